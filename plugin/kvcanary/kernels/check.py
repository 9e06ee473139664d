"""The fused per-forward check's wrapper: ``canary_check_step`` (csrc/canary_check.cuh: plan and verify every batch
row's prefix, store the write plan, snapshot the batch, count the forward, empty a drained ring) and ``CheckLaunch``,
the runtime's launch of it with everything but the batch arrays bound once. Reference: ``check_ref``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from kvcanary.kernels import call, layout
from kvcanary.kernels.batch import BatchView
from kvcanary.kernels.call import INT, OPTIONAL, REAL_KV, Arg, KernelSpec, RealKvLaunch, plan_args, prepare_real_kv
from kvcanary.kernels.plan import WritePlan
from kvcanary.kernels.real_kv import RealKvSource

logger = logging.getLogger(__name__)

# The export's order (one export, no attributed variant); ``canary_check_bind`` takes all but the per-forward ones,
# then the deferred write's two tensors, and its function the per-forward ones, then ``pending_write_tokens``
# (bound-only: the deferred write of issue 25, csrc/canary_check.cuh).
SPEC = KernelSpec(
    fn="canary_check_step", device="canary_buf",
    args=(
        Arg("state"), Arg("status_mirror", OPTIONAL), Arg("violation_meta", OPTIONAL),
        Arg("slot_attribution", OPTIONAL), Arg("canary_buf"),
        *plan_args("write_plan", WritePlan, skip=("verify_row_offsets",)),
        Arg("req_pool_indices"), Arg("prefix_lens"), Arg("extend_lens"),
        Arg("req_to_token"), Arg("swa_window_size", INT), Arg("full_to_swa_index_mapping", OPTIONAL),
        Arg("expected_tokens", OPTIONAL), Arg("expected_valid_lens_by_row", OPTIONAL),
        Arg("token_mail", OPTIONAL), Arg("token_mail_published", OPTIONAL),
        Arg("kv_token_id_vs_position_offset", INT),
        Arg("input_ids"), Arg("positions"), Arg("out_cache_loc"),
        Arg("input_ids_out"), Arg("positions_out"), Arg("out_cache_loc_out"), Arg("real_kv_sources", REAL_KV),
        Arg("real_kv_hash_mode", INT), Arg("check_tokens", INT),
        Arg("new_forward", INT), Arg("forward_step_value", INT),
        Arg("deferred_write_chain_assert", OPTIONAL, bound_only=True),
        Arg("deferred_write_row_serials", OPTIONAL, bound_only=True),
        Arg("pending_write_tokens", INT, bound_only=True),
    ),
    per_forward=("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc",
                 "new_forward", "forward_step_value", "pending_write_tokens"),
    bind_export="canary_check_bind",
)


def canary_check_step(
    *,
    state: torch.Tensor,
    canary_buf: torch.Tensor,
    write_plan: WritePlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    input_ids_out: torch.Tensor,
    positions_out: torch.Tensor,
    out_cache_loc_out: torch.Tensor,
    status_mirror: torch.Tensor | None = None,
    violation_meta: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    expected_tokens: torch.Tensor | None = None,
    expected_valid_lens_by_row: torch.Tensor | None = None,
    token_mail: torch.Tensor | None = None,
    token_mail_published: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
    new_forward: bool = True,
    forward_step_value: int = -1,
) -> None:
    """Everything before a forward in one launch (see csrc/canary_check.cuh): plan and verify (tag VERIFY) every
    batch row's prefix, store ``write_plan``, snapshot the batch's tokens, positions and slots, count the forward
    and empty a drained ring. Never synchronises; graph-capturable.

    ``state``: the manager's flat int64 buffer, header (``layout.STATE_*``) then the violation ring. Verify never
    overflows (no plan buffer), so nothing is skipped. ``req_pool_indices`` / ``prefix_lens`` / ``extend_lens``
    and the snapshot sources may be int32 or int64; ``*_out`` are int64 with at least ``input_ids.shape[0]``
    elements. ``expected_valid_lens_by_row`` (int64, one per req_to_token row) gives the token check's valid
    lengths; ``check_tokens`` compares them. ``new_forward``: set ``state[STATE_FORWARD]`` to
    ``forward_step_value`` (>= 0) or the counter + 1 (< 0: a captured launch, every replay counts one forward);
    else only read it. Rows carry the forward number in ``violation_meta`` and the slot's ``slot_attribution``.
    ``status_mirror``: int64 ``[layout.STATE_HEADER_FIELDS]`` host memory (pinned for a CUDA launch) that gets the
    finished header at the launch's end, written in place (no copy for the host to start; a read may be torn between
    two launches' headers). ``token_mail`` (int64 ``[layout.TOKEN_MAIL_FIELDS, capacity]``) and
    ``token_mail_published`` (int64 ``[1]``), host memory (pinned for a CUDA launch), with int32 ``expected_tokens``:
    before any entry is verified, the records published since ``state[STATE_TOKEN_MAIL_READ]`` whose step is at most
    this launch's are appended to the table in order, so this launch checks them
    (:class:`~kvcanary.runtime.token_table.TokenMail`).
    """
    if not isinstance(write_plan, WritePlan):  # (its fields are named in errors: not to be read from anything else)
        raise TypeError(f"canary_check_step: write_plan: expected WritePlan, got {type(write_plan).__name__}")
    SPEC.run(locals())


class CheckLaunch:
    """``canary_check_step`` with everything that stays fixed for a runtime's lifetime bound once.

    The fixed arguments are bound in C++ (``canary_check_bind``: the returned function owns them, so their storage
    lives as long as this object), and a forward passes only its batch arrays: tvm-ffi converts each tensor argument
    on every call, and a forward's host time is the product's cost. The bind validates the fixed arguments once, with
    the export's checks and errors (a bad one raises here, at binding); a call checks only the forward's arrays, as
    the export does, and a call that fails goes through the same naming as :func:`canary_check_step`, so errors
    still say which argument is wrong.

    Deferred write (issue 25): with ``deferred_write_chain_assert`` (the runtime write's
    ``enable_chain_position_assert``) and ``deferred_write_row_serials`` (its ``row_serials``, optional) bound, a call
    with ``pending_write_tokens`` n >= 0 also runs, inside the same launch and before anything it verifies, the write
    ``canary_write_step`` would run for the previous call's forward over the snapshot's first n tokens (tag WRITE, the
    header's WRITE counters, the forward counter before this call's): an eager forward then pays one launch instead
    of two. The launch's gate opener writes one request per thread, so it is meant for a decode (one token a request).
    -1: no write. A call whose batch is refused enqueues nothing, the write included (it stays pending).
    """

    def __init__(self, *, state: torch.Tensor, canary_buf: torch.Tensor, write_plan: WritePlan,
                 req_to_token: torch.Tensor, input_ids_out: torch.Tensor, positions_out: torch.Tensor,
                 out_cache_loc_out: torch.Tensor, status_mirror: torch.Tensor | None = None,
                 violation_meta: torch.Tensor | None = None,
                 slot_attribution: torch.Tensor | None = None, swa_window_size: int = 0,
                 full_to_swa_index_mapping: torch.Tensor | None = None, expected_tokens: torch.Tensor | None = None,
                 expected_valid_lens_by_row: torch.Tensor | None = None, token_mail: torch.Tensor | None = None,
                 token_mail_published: torch.Tensor | None = None, kv_token_id_vs_position_offset: int = 0,
                 real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
                 real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE, check_tokens: bool = False,
                 deferred_write_chain_assert: torch.Tensor | None = None,
                 deferred_write_row_serials: torch.Tensor | None = None) -> None:
        if not isinstance(write_plan, WritePlan):
            raise TypeError(f"canary_check_step: write_plan: expected WritePlan, got {type(write_plan).__name__}")
        self._fixed = dict(
            state=state, canary_buf=canary_buf, write_plan=write_plan, req_to_token=req_to_token,
            input_ids_out=input_ids_out, positions_out=positions_out, out_cache_loc_out=out_cache_loc_out,
            status_mirror=status_mirror, violation_meta=violation_meta, slot_attribution=slot_attribution,
            swa_window_size=swa_window_size,
            full_to_swa_index_mapping=full_to_swa_index_mapping, expected_tokens=expected_tokens,
            expected_valid_lens_by_row=expected_valid_lens_by_row, token_mail=token_mail,
            token_mail_published=token_mail_published,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            real_kv_sources=prepare_real_kv(real_kv_sources, canary_buf.device), real_kv_hash_mode=real_kv_hash_mode,
            check_tokens=check_tokens, deferred_write_chain_assert=deferred_write_chain_assert,
            deferred_write_row_serials=deferred_write_row_serials,
        )
        self._fn = SPEC.bind(self._fixed)
        # The bound tvm-ffi function itself, for a caller that counts every Python frame of a forward (an adapter's
        # eager hot path): ``bound(req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc,
        # new_forward, forward_step_value)`` with ints for the last two. It validates every array before it enqueues
        # anything, but its errors are tvm-ffi's, unnamed: a caller that gets one repeats the call through this object
        # (``__call__`` / ``of_batch``), whose error names the argument.
        self.bound = self._fn

    def __call__(self, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                 input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, *,
                 new_forward: bool = True, forward_step_value: int = -1, pending_write_tokens: int = -1) -> None:
        try:
            # req_pool_indices first: tvm-ffi takes the launch's stream from the call's first CUDA tensor (the bound
            # ones are not passed), so this must stay a per-forward device tensor (csrc/canary_check.cuh).
            self._fn(req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, int(new_forward),
                     int(forward_step_value), int(pending_write_tokens))
        except call.CALL_ERRORS as exc:
            self._raise(exc, req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc,
                        new_forward, forward_step_value, pending_write_tokens)

    def of_batch(self, batch: BatchView, new_forward: int, forward_step_value: int,
                 pending_write_tokens: int = -1) -> None:
        """The launch of one BatchView's six arrays: ``self(batch.req_pool_indices, ..., batch.out_cache_loc,
        new_forward=..., forward_step_value=..., pending_write_tokens=...)`` as one call (the per-forward path: a frame
        and a keyword call fewer). ``new_forward`` 0 or 1, ``forward_step_value`` and ``pending_write_tokens`` (-1:
        no deferred write) as ints (anything else is named like a failed ``__call__``)."""
        try:
            self._fn(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.input_ids, batch.positions,
                     batch.out_cache_loc, new_forward, forward_step_value, pending_write_tokens)
        except call.CALL_ERRORS as exc:
            self._raise(exc, batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.input_ids,
                        batch.positions, batch.out_cache_loc, new_forward, forward_step_value, pending_write_tokens)

    def _raise(self, exc: Exception, req_pool_indices: Any, prefix_lens: Any, extend_lens: Any, input_ids: Any,
               positions: Any, out_cache_loc: Any, new_forward: Any, forward_step_value: Any,
               pending_write_tokens: Any) -> NoReturn:
        """The named error of a failed launch, as :func:`canary_check_step` names it."""
        SPEC.reraise(exc, {**self._fixed, "req_pool_indices": req_pool_indices, "prefix_lens": prefix_lens,
                           "extend_lens": extend_lens, "input_ids": input_ids, "positions": positions,
                           "out_cache_loc": out_cache_loc, "new_forward": new_forward,
                           "forward_step_value": forward_step_value, "pending_write_tokens": pending_write_tokens})
