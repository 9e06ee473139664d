"""The write kernel's wrapper: ``canary_write_step`` (SPEC §4.1; csrc/canary_write.cuh) and ``WriteLaunch``, the
runtime's per-forward write with everything but the token count bound once. Reference: ``write_ref``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcanary.kernels import call, layout
from kvcanary.kernels.call import INT, OPTIONAL, REAL_KV, Arg, KernelSpec, RealKvLaunch, prepare_real_kv
from kvcanary.kernels.plan import WritePlan
from kvcanary.kernels.real_kv import RealKvSource

logger = logging.getLogger(__name__)

# The export's order: the seed export is ``canary_write_step(...)``, the attributed one appends the kvcanary+
# tensors, and ``canary_write_bind`` takes all but the three per-forward token arrays.
SPEC = KernelSpec(
    fn="canary_write_step", device="canary_buf",
    args=(
        Arg("canary_buf"), Arg("write_offsets"), Arg("write_seed_slot_indices"), Arg("write_num_valid_reqs"),
        Arg("input_ids"), Arg("positions"), Arg("out_cache_loc"),
        Arg("kernel_kind", INT), Arg("enable_write_input_assert", INT),
        Arg("expected_input_tokens", OPTIONAL), Arg("expected_input_positions", OPTIONAL),
        Arg("violation_ring"), Arg("violation_write_index"), Arg("slot_run_counter"), Arg("kernel_run_counter"),
        Arg("enable_chain_position_assert"), Arg("real_kv_sources", REAL_KV), Arg("real_kv_hash_mode", INT),
        Arg("violation_meta", OPTIONAL, True), Arg("forward_step", OPTIONAL, True),
        Arg("write_request_rows", OPTIONAL, True), Arg("slot_attribution", OPTIONAL, True),
        Arg("row_serials", OPTIONAL, True),
    ),
    per_forward=("input_ids", "positions", "out_cache_loc"),
    bind_export="canary_write_bind",
)


def canary_write_step(
    *,
    canary_buf: torch.Tensor,
    write_offsets: torch.Tensor,
    write_seed_slot_indices: torch.Tensor,
    write_num_valid_reqs: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    kernel_kind: int,
    enable_write_input_assert: bool,
    expected_input_tokens: torch.Tensor | None,
    expected_input_positions: torch.Tensor | None,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    slot_run_counter: torch.Tensor,
    kernel_run_counter: torch.Tensor,
    enable_chain_position_assert: torch.Tensor,
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    violation_meta: torch.Tensor | None = None,
    forward_step: torch.Tensor | None = None,
    write_request_rows: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
    row_serials: torch.Tensor | None = None,
) -> None:
    """Store the shadow records of the slots one forward filled (SPEC §4.1; see csrc/canary_write.cuh).

    Runs on ``canary_buf.device`` (CPU build or CUDA build, on torch's current stream) and never
    synchronises. Violations go to ``violation_ring``; counters are bumped on the device.

    kvcanary+ (all optional): ``violation_meta`` int64 [R, VIOLATION_META_FIELDS] gets one metadata row per
    ring row (``forward_step``'s value, the request's row from ``write_request_rows`` int64 [cap], the slot's
    previous attribution); ``slot_attribution`` int64 [num_slots, SLOT_ATTRIBUTION_FIELDS] gets
    (``forward_step``'s value, ``row_serials[row]``) for every record stored. Records, rows and counters are
    bit-exact with the seed call.
    """
    SPEC.run(locals())


class WriteLaunch:
    """``canary_write_step`` of a runtime with every argument but its token count bound once.

    The fixed arguments are bound in C++ (``canary_write_bind``: the returned function owns them), and the write
    reads the first ``n`` tokens of the runtime's own snapshot buffers, so a forward passes only the three ``[:n]``
    slices, made once per ``n`` (at most ``max_cached`` counts are kept; a decode loop uses one or a few). The bind
    validates the fixed arguments once, with the export's checks and errors (a bad one raises here, at binding); a
    call checks only the three slices, as the export does, and its failures are named like
    :func:`canary_write_step`'s.
    """

    def __init__(self, *, canary_buf: torch.Tensor, write_plan: WritePlan, input_ids: torch.Tensor,
                 positions: torch.Tensor, out_cache_loc: torch.Tensor, kernel_kind: int,
                 violation_ring: torch.Tensor, violation_write_index: torch.Tensor, slot_run_counter: torch.Tensor,
                 kernel_run_counter: torch.Tensor, enable_chain_position_assert: torch.Tensor,
                 real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
                 real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE, violation_meta: torch.Tensor | None = None,
                 forward_step: torch.Tensor | None = None, slot_attribution: torch.Tensor | None = None,
                 row_serials: torch.Tensor | None = None, max_cached: int = 256) -> None:
        self._kwargs: dict[str, Any] = dict(
            canary_buf=canary_buf, **write_plan.kernel_args(), kernel_kind=kernel_kind,
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
            violation_ring=violation_ring, violation_write_index=violation_write_index,
            slot_run_counter=slot_run_counter, kernel_run_counter=kernel_run_counter,
            enable_chain_position_assert=enable_chain_position_assert,
            real_kv_sources=prepare_real_kv(real_kv_sources, canary_buf.device), real_kv_hash_mode=real_kv_hash_mode,
            violation_meta=violation_meta, forward_step=forward_step, slot_attribution=slot_attribution,
            row_serials=row_serials,
        )
        self._kwargs.setdefault("write_request_rows", None)
        self._buffers = (input_ids, positions, out_cache_loc)
        self._fn = SPEC.bind(self._kwargs)
        # The bound tvm-ffi function and its arguments per token count, for a caller that counts every Python frame
        # of a forward (an adapter's eager hot path): ``bound(*arguments[n])``, with ``arguments_of(n)`` for a count
        # not cached yet. Its errors are tvm-ffi's, unnamed: a caller that gets one repeats the call through this
        # object (``self(n)``), whose error names the argument.
        self.bound = self._fn
        # n -> the snapshot buffers' first n tokens (input_ids, positions, out_cache_loc), sliced once per count:
        # slicing costs host time per forward; at most ``max_cached`` counts are kept (a decode loop uses one or a few)
        self.arguments: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._max_cached = max_cached

    def arguments_of(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The write's arguments for ``n`` tokens, cached in :attr:`arguments`."""
        ids, pos, loc = self._buffers
        if len(self.arguments) >= self._max_cached:
            self.arguments.clear()
        slices = self.arguments[n] = (ids[:n], pos[:n], loc[:n])
        return slices

    def __call__(self, n: int) -> None:
        slices = self.arguments.get(n)
        try:
            # input_ids first: tvm-ffi takes the launch's stream from the call's first CUDA tensor (the bound ones
            # are not passed), so the snapshot slices must stay the call's device tensors (csrc/canary_write.cuh).
            self._fn(*(slices if slices is not None else self.arguments_of(n)))
        except call.CALL_ERRORS as exc:
            ids, pos, loc = self._buffers
            args: Mapping[str, Any] = {**self._kwargs, "input_ids": ids[:n], "positions": pos[:n],
                                       "out_cache_loc": loc[:n]}
            SPEC.reraise(exc, args)
