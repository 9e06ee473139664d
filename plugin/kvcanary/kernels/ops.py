"""Typed wrappers of the kernels: keyword-only, dispatching on ``canary_buf.device``.

Argument checks live in C++ (one layer for the CPU build, the CUDA build and direct tvm-ffi calls);
this module turns ``real_kv_sources`` into the fixed four-buffer ABI and forwards. What C++ cannot name
(``None`` where a tensor is required, a Python list, a meta tensor, a non-integer flag: tvm-ffi or torch
fail before the C++ checks run, with a positional or C++-stack message) is named here, on the failure
path only: a call runs first, and only when it raises are the arguments inspected, so a valid call pays
nothing for the check (the per-forward host cost matters) and an invalid one gets a ``TypeError`` /
``ValueError`` that starts with ``"<fn>: <argument>: "``, like the C++ errors.

The kvcanary+ arguments (violation metadata, request rows, writer attribution, forward counter) are
optional: without them a call goes to the seed-ABI export (``canary_write_step`` …), with any of them to
the ``*_attributed`` export, which takes the same arguments followed by the new ones.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.batch import BatchView
from kvcanary.kernels.jit import load_module
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.real_kv import RealKvSource

__all__ = [
    "CheckLaunch", "RealKvLaunch", "WriteLaunch", "canary_check_step", "canary_plan_step", "canary_token_update",
    "canary_verify_step", "canary_write_step", "load_module", "prepare_real_kv", "real_kv_launch_args",
    "canary_row_serial_update",
]

_unused_source_cache: dict[torch.device, torch.Tensor] = {}


def _backend_of(device: torch.device) -> str:
    if device.type in ("cpu", "cuda"):
        return device.type
    raise ValueError(f"kvcanary: canary_buf: device {device} is not supported (cpu or cuda)")


def _unused_source(device: torch.device) -> torch.Tensor:
    """A tiny aligned uint8 [1, 16] tensor standing in for unused ABI source slots (never read)."""
    t = _unused_source_cache.get(device)
    if t is None:
        t = torch.zeros((1, layout.REAL_KV_ALIGN_BYTES), dtype=torch.uint8, device=device)
        _unused_source_cache[device] = t
    return t


@dataclass(frozen=True)
class RealKvLaunch:
    """``real_kv_sources`` in the kernels' fixed four-buffer ABI, built once and reused for every launch.

    Building it costs a dozen small tensor writes (~50 us of host time); a manager prepares it once, so a
    forward's launches pay nothing. Holds the sources, so their buffers stay alive as long as it does.
    """

    sources: tuple[RealKvSource, ...]
    buffers: tuple[torch.Tensor, ...]  # MAX_REAL_KV_SOURCES byte tensors (unused slots: a tiny dummy)
    params: torch.Tensor  # CPU int32 [MAX_REAL_KV_SOURCES, REAL_KV_PARAM_FIELDS]
    num_sources: int


def prepare_real_kv(real_kv_sources: Sequence[RealKvSource] | RealKvLaunch, device: torch.device) -> RealKvLaunch:
    """Check ``real_kv_sources`` and lay them out for the kernels (a ``RealKvLaunch`` passes through)."""
    if isinstance(real_kv_sources, RealKvLaunch):
        return real_kv_sources
    sources = tuple(real_kv_sources)
    if len(sources) > layout.MAX_REAL_KV_SOURCES:
        raise ValueError(
            f"kvcanary: real_kv_sources: at most {layout.MAX_REAL_KV_SOURCES} sources, got {len(sources)}"
        )
    for i, src in enumerate(sources):
        if not isinstance(src, RealKvSource):
            raise TypeError(f"kvcanary: real_kv_sources[{i}]: expected RealKvSource, got {type(src).__name__}")
    rows = []
    for i in range(layout.MAX_REAL_KV_SOURCES):
        row = [0] * layout.REAL_KV_PARAM_FIELDS
        if i < len(sources):
            row[layout.REAL_KV_PARAM_PAGE_SIZE] = sources[i].page_size
            row[layout.REAL_KV_PARAM_BYTES_PER_TOKEN] = sources[i].num_bytes_per_token
            row[layout.REAL_KV_PARAM_READ_BYTES] = sources[i].read_bytes
        rows.append(row)
    buffers = tuple(src.kv_bytes for src in sources) + (_unused_source(device),) * (
        layout.MAX_REAL_KV_SOURCES - len(sources))
    return RealKvLaunch(sources, buffers, torch.tensor(rows, dtype=torch.int32), len(sources))


def real_kv_launch_args(
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch, device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """(four byte tensors, CPU int32 [4, 3] param table, num_sources) for the raw ABI."""
    launch = prepare_real_kv(real_kv_sources, device)
    return list(launch.buffers), launch.params, launch.num_sources


# Exceptions a call with an argument tvm-ffi or torch cannot take raises before the C++ checks name it:
# TypeError (tvm-ffi's positional "Mismatched type on argument #5"), RuntimeError / BufferError (torch's DLPack
# export of a meta tensor, with a C++ stack), AttributeError (``.device`` of a non-tensor).
_CALL_ERRORS = (TypeError, ValueError, RuntimeError, AttributeError, BufferError)


def _named_error(fn: str, tensors: Mapping[str, tuple[Any, bool]], ints: Mapping[str, Any],
                 real_kv_sources: Any = ()) -> Exception | None:
    """The first argument Python can name as wrong, as the exception to raise (None: nothing found).

    ``tensors``: name -> (value, optional); ``ints``: name -> value.
    """
    for name, (value, optional) in tensors.items():
        if value is None:
            if optional:
                continue
            return TypeError(f"{fn}: {name}: expected a torch.Tensor, got None")
        if not isinstance(value, torch.Tensor):
            return TypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(value).__name__}")
        if value.device.type not in ("cpu", "cuda"):
            return ValueError(
                f"{fn}: {name}: expected a cpu or cuda tensor, got a tensor on device {value.device}"
                + (" (a meta tensor has no data)" if value.device.type == "meta" else "")
            )
    for name, value in ints.items():
        try:
            operator.index(value)
        except TypeError:
            return TypeError(f"{fn}: {name}: expected an int, got {type(value).__name__}")
    if not isinstance(real_kv_sources, (RealKvLaunch, Sequence)) or isinstance(real_kv_sources, (str, bytes)):
        return TypeError(
            f"{fn}: real_kv_sources: expected a sequence of RealKvSource or a RealKvLaunch, "
            f"got {type(real_kv_sources).__name__}"
        )
    return None


def _reraise_named(exc: Exception, fn: str, tensors: Mapping[str, tuple[Any, bool]], ints: Mapping[str, Any],
                   real_kv_sources: Any = ()) -> NoReturn:
    """Raise the named error for a failed call, or ``exc`` itself when no argument is to blame in Python."""
    named = _named_error(fn, tensors, ints, real_kv_sources)
    if named is None:
        raise exc
    raise named from None


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
    kwargs = {k: v for k, v in locals().items() if k in _WRITE_ARGS}
    try:
        name, args = _write_call(**kwargs)
        getattr(load_module(_backend_of(canary_buf.device)), name)(*args)
    except _CALL_ERRORS as exc:
        _raise_write_error(exc, **kwargs)


_WRITE_ARGS = (
    "canary_buf", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs", "input_ids", "positions",
    "out_cache_loc", "kernel_kind", "enable_write_input_assert", "expected_input_tokens", "expected_input_positions",
    "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter", "enable_chain_position_assert",
    "real_kv_sources", "real_kv_hash_mode", "violation_meta", "forward_step", "write_request_rows",
    "slot_attribution", "row_serials",
)


def _write_parts(*, canary_buf, write_offsets, write_seed_slot_indices, write_num_valid_reqs, kernel_kind,
                 enable_write_input_assert, expected_input_tokens, expected_input_positions, violation_ring,
                 violation_write_index, slot_run_counter, kernel_run_counter, enable_chain_position_assert,
                 real_kv_sources, real_kv_hash_mode, violation_meta, forward_step, write_request_rows, slot_attribution,
                 row_serials) -> tuple[tuple, tuple, tuple]:
    """The write's arguments that stay fixed across forwards, as the three runs around and after the per-forward ones
    (the one place their order is written): the seed export is ``fn(*head, input_ids, positions, out_cache_loc,
    *tail)``, the attributed one appends ``*attributed``, and ``canary_write_bind(*head, *tail, *attributed)``."""
    bufs, params, num_sources = real_kv_launch_args(real_kv_sources, canary_buf.device)
    head = (canary_buf, write_offsets, write_seed_slot_indices, write_num_valid_reqs)
    tail = (int(kernel_kind), int(enable_write_input_assert), expected_input_tokens, expected_input_positions,
            violation_ring, violation_write_index, slot_run_counter, kernel_run_counter, enable_chain_position_assert,
            *bufs, params, num_sources, int(real_kv_hash_mode))
    attributed = (violation_meta, forward_step, write_request_rows, slot_attribution, row_serials)
    return head, tail, attributed


def _write_call(*, input_ids, positions, out_cache_loc, **fixed) -> tuple[str, tuple]:
    """(export name, positional arguments) of one write: the seed export, or the attributed one when any kvcanary+
    argument is given."""
    head, tail, attributed = _write_parts(**fixed)
    args = (*head, input_ids, positions, out_cache_loc, *tail)
    if all(a is None for a in attributed):
        return "canary_write_step", args
    return "canary_write_step_attributed", (*args, *attributed)


_WRITE_PER_FORWARD = ("input_ids", "positions", "out_cache_loc")


def _write_error_args(*, canary_buf, write_offsets, write_seed_slot_indices, write_num_valid_reqs, input_ids,
                      positions, out_cache_loc, kernel_kind, enable_write_input_assert, expected_input_tokens,
                      expected_input_positions, violation_ring, violation_write_index, slot_run_counter,
                      kernel_run_counter, enable_chain_position_assert, real_kv_sources, real_kv_hash_mode,
                      violation_meta, forward_step, write_request_rows, slot_attribution,
                      row_serials) -> tuple[dict[str, tuple[Any, bool]], dict[str, Any]]:
    """(tensors, ints) that name a failed canary_write_step's arguments (see ``_reraise_named``), in the export's
    order."""
    tensors = {
        "canary_buf": (canary_buf, False),
        "write_offsets": (write_offsets, False),
        "write_seed_slot_indices": (write_seed_slot_indices, False),
        "write_num_valid_reqs": (write_num_valid_reqs, False),
        "input_ids": (input_ids, False),
        "positions": (positions, False),
        "out_cache_loc": (out_cache_loc, False),
        "expected_input_tokens": (expected_input_tokens, True),
        "expected_input_positions": (expected_input_positions, True),
        "violation_ring": (violation_ring, False),
        "violation_write_index": (violation_write_index, False),
        "slot_run_counter": (slot_run_counter, False),
        "kernel_run_counter": (kernel_run_counter, False),
        "enable_chain_position_assert": (enable_chain_position_assert, False),
        "violation_meta": (violation_meta, True),
        "forward_step": (forward_step, True),
        "write_request_rows": (write_request_rows, True),
        "slot_attribution": (slot_attribution, True),
        "row_serials": (row_serials, True),
    }
    ints = {"kernel_kind": kernel_kind, "enable_write_input_assert": enable_write_input_assert,
            "real_kv_hash_mode": real_kv_hash_mode}
    return tensors, ints


def _raise_write_error(exc: Exception, **args: Any) -> NoReturn:
    """The named error of a failed canary_write_step call (or ``exc`` when Python cannot name an argument); ``args``:
    every keyword argument of :func:`canary_write_step`."""
    _reraise_named(exc, "canary_write_step", *_write_error_args(**args), args["real_kv_sources"])


def _raise_bind_error(exc: Exception, fn: str, error_args: Callable[..., tuple[dict, dict]],
                      fixed: Mapping[str, Any], per_forward: Sequence[str]) -> NoReturn:
    """The named error of a failed bind of ``fn`` (``canary_check_bind`` / ``canary_write_bind``): ``fixed`` holds
    every argument but the ``per_forward`` ones, named as a call of ``fn`` with them would name them (``error_args``:
    the call's ``(tensors, ints)`` naming tables)."""
    tensors, ints = error_args(**fixed, **dict.fromkeys(per_forward))
    _reraise_named(exc, fn, _without(tensors, per_forward), _without(ints, per_forward), fixed["real_kv_sources"])


def _without(named: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``named`` less the entries called ``names``, in order."""
    return {k: v for k, v in named.items() if k not in names}


def canary_verify_step(
    *,
    canary_buf: torch.Tensor,
    verify_slot_indices: torch.Tensor,
    verify_expected_tokens: torch.Tensor,
    verify_expected_positions: torch.Tensor,
    verify_prev_slot_indices: torch.Tensor,
    verify_num_valid: torch.Tensor,
    verify_enable: torch.Tensor,
    kernel_kind: int,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    slot_run_counter: torch.Tensor,
    kernel_run_counter: torch.Tensor,
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
    violation_meta: torch.Tensor | None = None,
    forward_step: torch.Tensor | None = None,
    verify_request_rows: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
) -> None:
    """Check the records of planned prefix entries (SPEC §4.2; see csrc/canary_verify.cuh).

    Never modifies ``canary_buf``; runs on its device without synchronising.

    kvcanary+ (all optional): ``violation_meta`` int64 [R, VIOLATION_META_FIELDS] gets one metadata row per
    ring row: ``forward_step``'s value, the entry's row from ``verify_request_rows`` int64 [cap] and the
    failing slot's ``slot_attribution`` row (read for failing entries only).
    """
    try:
        module: Any = load_module(_backend_of(canary_buf.device))
        bufs, params, num_sources = real_kv_launch_args(real_kv_sources, canary_buf.device)
        args = (
            canary_buf,
            verify_slot_indices,
            verify_expected_tokens,
            verify_expected_positions,
            verify_prev_slot_indices,
            verify_num_valid,
            verify_enable,
            int(kernel_kind),
            violation_ring,
            violation_write_index,
            slot_run_counter,
            kernel_run_counter,
            *bufs,
            params,
            num_sources,
            int(real_kv_hash_mode),
            int(check_tokens),
        )
        if violation_meta is None and forward_step is None and verify_request_rows is None and slot_attribution is None:
            module.canary_verify_step(*args)
        else:
            module.canary_verify_step_attributed(*args, violation_meta, forward_step, verify_request_rows,
                                                 slot_attribution)
    except _CALL_ERRORS as exc:
        _reraise_named(
            exc, "canary_verify_step",
            {
                "canary_buf": (canary_buf, False),
                "verify_slot_indices": (verify_slot_indices, False),
                "verify_expected_tokens": (verify_expected_tokens, False),
                "verify_expected_positions": (verify_expected_positions, False),
                "verify_prev_slot_indices": (verify_prev_slot_indices, False),
                "verify_num_valid": (verify_num_valid, False),
                "verify_enable": (verify_enable, False),
                "violation_ring": (violation_ring, False),
                "violation_write_index": (violation_write_index, False),
                "slot_run_counter": (slot_run_counter, False),
                "kernel_run_counter": (kernel_run_counter, False),
                "violation_meta": (violation_meta, True),
                "forward_step": (forward_step, True),
                "verify_request_rows": (verify_request_rows, True),
                "slot_attribution": (slot_attribution, True),
            },
            {"kernel_kind": kernel_kind, "real_kv_hash_mode": real_kv_hash_mode, "check_tokens": check_tokens},
            real_kv_sources,
        )


def _plan_tensors(name: str, plan: Any, cls: type) -> dict[str, tuple[Any, bool]]:
    """``<name>.<field>`` -> (value, optional) for a plan's tensors (the kvcanary+ fields may be None)."""
    return {f"{name}.{f.name}": (getattr(plan, f.name), f.default is None) for f in fields(cls)}


def canary_plan_step(
    *,
    write_plan: WritePlan,
    verify_plan: VerifyPlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    expected_tokens: torch.Tensor | None = None,
    expected_tokens_valid_lens: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    forward_counter: torch.Tensor | None = None,
    forward_step_value: int = -1,
    out_cache_loc: torch.Tensor | None = None,
) -> None:
    """Fill ``write_plan`` and ``verify_plan`` for one forward (SPEC §4.3; see csrc/canary_plan.cuh).

    Runs on the plans' device without synchronising; the amount of work lives in the plans' device
    scalars, so the launch is CUDA-graph capturable. An overflowing verify plan is disabled
    (``verify_enable == 0``), which the caller drains and reports. ``expected_tokens`` may be int32 (like
    ``req_to_token``) or int64.

    kvcanary+: the plans' ``write_request_rows`` / ``verify_request_rows`` (when allocated) get each batch
    row's and each entry's req_to_token row. ``forward_counter`` (int64 [1], optional) becomes the number of the
    forward this plan starts: ``forward_step_value`` when it is >= 0, else the counter + 1 (what a launch
    captured in a CUDA graph needs: every replay counts one forward). ``out_cache_loc`` (the forward's slots,
    int32 or int64, optional): a row that writes and whose first new token is on the padding slot is a padding row
    (no window entries, no write, no seed), as ``canary_check_step`` plans it.
    """
    try:
        if not isinstance(write_plan, WritePlan):
            raise TypeError(f"canary_plan_step: write_plan: expected WritePlan, got {type(write_plan).__name__}")
        if not isinstance(verify_plan, VerifyPlan):
            raise TypeError(f"canary_plan_step: verify_plan: expected VerifyPlan, got {type(verify_plan).__name__}")
        module: Any = load_module(_backend_of(write_plan.write_offsets.device))
        args = (
            write_plan.write_offsets,
            write_plan.write_seed_slot_indices,
            write_plan.write_num_valid_reqs,
            write_plan.verify_row_offsets,
            verify_plan.verify_slot_indices,
            verify_plan.verify_expected_tokens,
            verify_plan.verify_expected_positions,
            verify_plan.verify_prev_slot_indices,
            verify_plan.verify_num_valid,
            verify_plan.verify_enable,
            req_pool_indices,
            prefix_lens,
            extend_lens,
            req_to_token,
            int(swa_window_size),
            full_to_swa_index_mapping,
            expected_tokens,
            expected_tokens_valid_lens,
            int(kv_token_id_vs_position_offset),
        )
        write_rows, verify_rows = write_plan.write_request_rows, verify_plan.verify_request_rows
        if write_rows is None and verify_rows is None and forward_counter is None and out_cache_loc is None:
            module.canary_plan_step(*args)
        else:
            module.canary_plan_step_attributed(*args, write_rows, verify_rows, forward_counter,
                                               int(forward_step_value), out_cache_loc)
    except _CALL_ERRORS as exc:
        if not isinstance(write_plan, WritePlan) or not isinstance(verify_plan, VerifyPlan):
            raise
        _reraise_named(
            exc, "canary_plan_step",
            {
                **_plan_tensors("write_plan", write_plan, WritePlan),
                **_plan_tensors("verify_plan", verify_plan, VerifyPlan),
                "req_pool_indices": (req_pool_indices, False),
                "prefix_lens": (prefix_lens, False),
                "extend_lens": (extend_lens, False),
                "req_to_token": (req_to_token, False),
                "full_to_swa_index_mapping": (full_to_swa_index_mapping, True),
                "expected_tokens": (expected_tokens, True),
                "expected_tokens_valid_lens": (expected_tokens_valid_lens, True),
                "forward_counter": (forward_counter, True),
                "out_cache_loc": (out_cache_loc, True),
            },
            {"swa_window_size": swa_window_size, "kv_token_id_vs_position_offset": kv_token_id_vs_position_offset,
             "forward_step_value": forward_step_value},
        )


def canary_token_update(
    *,
    expected_tokens: torch.Tensor,
    valid_lens_by_row: torch.Tensor,
    staging: torch.Tensor,
    num_updates: int,
    staged_len: int,
) -> None:
    """Apply ``num_updates`` expected-token updates staged in ``staging[:staged_len]`` (see csrc/canary_tokens.cuh).

    ``staging`` (int64, laid out as :data:`~kvcanary.kernels.layout.TOKEN_UPDATE_FIELDS` field-major header runs,
    then the tokens) is host memory: on CUDA it must be pinned, and the kernel reads it in place, so the caller must
    not rewrite it before the launch has completed (record an event after this call). ``expected_tokens`` int32
    [rows, width] and ``valid_lens_by_row`` int64 [rows] are updated in batch order (a later update of a row wins).
    One launch, no copy, no allocation; never synchronises.
    """
    try:
        load_module(_backend_of(expected_tokens.device)).canary_token_update(
            expected_tokens, valid_lens_by_row, staging, operator.index(num_updates), operator.index(staged_len))
    except _CALL_ERRORS as exc:
        _reraise_named(
            exc, "canary_token_update",
            {"expected_tokens": (expected_tokens, False), "valid_lens_by_row": (valid_lens_by_row, False),
             "staging": (staging, False)},
            {"num_updates": num_updates, "staged_len": staged_len},
        )


def canary_token_append(
    *,
    expected_tokens: torch.Tensor,
    valid_lens_by_row: torch.Tensor,
    staging: torch.Tensor,
    num_updates: int,
) -> None:
    """Append one token to each of ``num_updates`` rows, staged in ``staging`` (see csrc/canary_tokens.cuh): update
    ``u`` writes its token at position ``start`` of its row and makes the row's valid length ``start + 1``.

    ``staging`` (int64, :data:`~kvcanary.kernels.layout.TOKEN_APPEND_FIELDS` runs of ``num_updates`` values: rows,
    starts, tokens) is host memory as for :func:`canary_token_update` (pinned on CUDA, read in place: record an event
    after this call before rewriting it). A start must lie inside the table (clip through :func:`canary_token_update`).
    Updates apply in batch order (a later update of a row wins). One launch, no copy, no allocation; never
    synchronises.
    """
    try:
        load_module(_backend_of(expected_tokens.device)).canary_token_append(
            expected_tokens, valid_lens_by_row, staging, operator.index(num_updates))
    except _CALL_ERRORS as exc:
        _reraise_named(
            exc, "canary_token_append",
            {"expected_tokens": (expected_tokens, False), "valid_lens_by_row": (valid_lens_by_row, False),
             "staging": (staging, False)},
            {"num_updates": num_updates},
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
    violation_meta: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    expected_tokens: torch.Tensor | None = None,
    expected_valid_lens_by_row: torch.Tensor | None = None,
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
    """
    try:
        if not isinstance(write_plan, WritePlan):
            raise TypeError(f"canary_check_step: write_plan: expected WritePlan, got {type(write_plan).__name__}")
        module: Any = load_module(_backend_of(canary_buf.device))
        head, mid, tail = _check_parts(
            state=state, violation_meta=violation_meta, slot_attribution=slot_attribution, canary_buf=canary_buf,
            write_plan=write_plan, req_to_token=req_to_token, swa_window_size=swa_window_size,
            full_to_swa_index_mapping=full_to_swa_index_mapping, expected_tokens=expected_tokens,
            expected_valid_lens_by_row=expected_valid_lens_by_row,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, input_ids_out=input_ids_out,
            positions_out=positions_out, out_cache_loc_out=out_cache_loc_out, real_kv_sources=real_kv_sources,
            real_kv_hash_mode=real_kv_hash_mode, check_tokens=check_tokens,
        )
        module.canary_check_step(*head, req_pool_indices, prefix_lens, extend_lens, *mid, input_ids, positions,
                                 out_cache_loc, *tail, int(new_forward), int(forward_step_value))
    except _CALL_ERRORS as exc:
        if not isinstance(write_plan, WritePlan):
            raise
        _raise_check_error(exc, **{k: v for k, v in locals().items() if k in _CHECK_ARGS})


def _check_parts(*, state, violation_meta, slot_attribution, canary_buf, write_plan, req_to_token, swa_window_size,
                 full_to_swa_index_mapping, expected_tokens, expected_valid_lens_by_row,
                 kv_token_id_vs_position_offset, input_ids_out, positions_out, out_cache_loc_out, real_kv_sources,
                 real_kv_hash_mode, check_tokens) -> tuple[tuple, tuple, tuple]:
    """The export's arguments that stay fixed across forwards, as the three runs around the per-forward ones (the one
    place their order is written): a call is ``fn(*head, req_pool_indices, prefix_lens, extend_lens, *mid,
    input_ids, positions, out_cache_loc, *tail, new_forward, forward_step_value)``, a bind
    ``canary_check_bind(*head, *mid, *tail)``."""
    launch = prepare_real_kv(real_kv_sources, canary_buf.device)
    head = (state, violation_meta, slot_attribution, canary_buf, write_plan.write_offsets,
            write_plan.write_seed_slot_indices, write_plan.write_num_valid_reqs, write_plan.write_request_rows)
    mid = (req_to_token, int(swa_window_size), full_to_swa_index_mapping, expected_tokens, expected_valid_lens_by_row,
           int(kv_token_id_vs_position_offset))
    tail = (input_ids_out, positions_out, out_cache_loc_out, *launch.buffers, launch.params, launch.num_sources,
            int(real_kv_hash_mode), int(check_tokens))
    return head, mid, tail


_CHECK_ARGS = (
    "state", "canary_buf", "write_plan", "req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids",
    "positions", "out_cache_loc", "input_ids_out", "positions_out", "out_cache_loc_out", "violation_meta",
    "slot_attribution", "swa_window_size", "full_to_swa_index_mapping", "expected_tokens", "expected_valid_lens_by_row",
    "kv_token_id_vs_position_offset", "real_kv_sources", "real_kv_hash_mode", "check_tokens", "new_forward",
    "forward_step_value",
)
_CHECK_PER_FORWARD = (
    "req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc", "new_forward",
    "forward_step_value",
)


def _check_error_args(*, state, canary_buf, write_plan, req_pool_indices, prefix_lens, extend_lens, req_to_token,
                      input_ids, positions, out_cache_loc, input_ids_out, positions_out, out_cache_loc_out,
                      violation_meta, slot_attribution, swa_window_size, full_to_swa_index_mapping, expected_tokens,
                      expected_valid_lens_by_row, kv_token_id_vs_position_offset, real_kv_sources, real_kv_hash_mode,
                      check_tokens, new_forward,
                      forward_step_value) -> tuple[dict[str, tuple[Any, bool]], dict[str, Any]]:
    """(tensors, ints) that name a failed canary_check_step's arguments (see ``_reraise_named``), in the export's
    order."""
    tensors = {
        "state": (state, False),
        "violation_meta": (violation_meta, True),
        "slot_attribution": (slot_attribution, True),
        "canary_buf": (canary_buf, False),
        **{k: v for k, v in _plan_tensors("write_plan", write_plan, WritePlan).items()
           if k != "write_plan.verify_row_offsets"},
        "req_pool_indices": (req_pool_indices, False),
        "prefix_lens": (prefix_lens, False),
        "extend_lens": (extend_lens, False),
        "req_to_token": (req_to_token, False),
        "full_to_swa_index_mapping": (full_to_swa_index_mapping, True),
        "expected_tokens": (expected_tokens, True),
        "expected_valid_lens_by_row": (expected_valid_lens_by_row, True),
        "input_ids": (input_ids, False),
        "positions": (positions, False),
        "out_cache_loc": (out_cache_loc, False),
        "input_ids_out": (input_ids_out, False),
        "positions_out": (positions_out, False),
        "out_cache_loc_out": (out_cache_loc_out, False),
    }
    ints = {"swa_window_size": swa_window_size, "kv_token_id_vs_position_offset": kv_token_id_vs_position_offset,
            "real_kv_hash_mode": real_kv_hash_mode, "check_tokens": check_tokens, "new_forward": new_forward,
            "forward_step_value": forward_step_value}
    return tensors, ints


def _raise_check_error(exc: Exception, **args: Any) -> NoReturn:
    """The named error of a failed canary_check_step call (or ``exc`` when Python cannot name an argument); ``args``:
    every keyword argument of :func:`canary_check_step`."""
    _reraise_named(exc, "canary_check_step", *_check_error_args(**args), args["real_kv_sources"])


class CheckLaunch:
    """``canary_check_step`` with everything that stays fixed for a runtime's lifetime bound once.

    The fixed arguments are bound in C++ (``canary_check_bind``: the returned function owns them, so their storage
    lives as long as this object), and a forward passes only its batch arrays: tvm-ffi converts each tensor argument
    on every call, and a forward's host time is the product's cost. The bound call runs the same C++ wrapper, so its
    checks are the export's; a call that fails goes through the same naming as :func:`canary_check_step`, so errors
    still say which argument is wrong (a fixed argument tvm-ffi cannot take at all is named here, at binding).
    """

    def __init__(self, *, state: torch.Tensor, canary_buf: torch.Tensor, write_plan: WritePlan,
                 req_to_token: torch.Tensor, input_ids_out: torch.Tensor, positions_out: torch.Tensor,
                 out_cache_loc_out: torch.Tensor, violation_meta: torch.Tensor | None = None,
                 slot_attribution: torch.Tensor | None = None, swa_window_size: int = 0,
                 full_to_swa_index_mapping: torch.Tensor | None = None, expected_tokens: torch.Tensor | None = None,
                 expected_valid_lens_by_row: torch.Tensor | None = None, kv_token_id_vs_position_offset: int = 0,
                 real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
                 real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE, check_tokens: bool = False) -> None:
        if not isinstance(write_plan, WritePlan):
            raise TypeError(f"canary_check_step: write_plan: expected WritePlan, got {type(write_plan).__name__}")
        self._fixed = dict(
            state=state, canary_buf=canary_buf, write_plan=write_plan, req_to_token=req_to_token,
            input_ids_out=input_ids_out, positions_out=positions_out, out_cache_loc_out=out_cache_loc_out,
            violation_meta=violation_meta, slot_attribution=slot_attribution, swa_window_size=swa_window_size,
            full_to_swa_index_mapping=full_to_swa_index_mapping, expected_tokens=expected_tokens,
            expected_valid_lens_by_row=expected_valid_lens_by_row,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            real_kv_sources=prepare_real_kv(real_kv_sources, canary_buf.device), real_kv_hash_mode=real_kv_hash_mode,
            check_tokens=check_tokens,
        )
        module: Any = load_module(_backend_of(canary_buf.device))
        try:
            head, mid, tail = _check_parts(**self._fixed)
            self._fn = module.canary_check_bind(*head, *mid, *tail)
        except _CALL_ERRORS as exc:
            _raise_bind_error(exc, "canary_check_step", _check_error_args, self._fixed, _CHECK_PER_FORWARD)

    def __call__(self, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                 input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, *,
                 new_forward: bool = True, forward_step_value: int = -1) -> None:
        try:
            # req_pool_indices first: tvm-ffi takes the launch's stream from the call's first CUDA tensor (the bound
            # ones are not passed), so this must stay a per-forward device tensor (csrc/canary_check.cuh).
            self._fn(req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, int(new_forward),
                     int(forward_step_value))
        except _CALL_ERRORS as exc:
            self._raise(exc, req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc,
                        new_forward, forward_step_value)

    def of_batch(self, batch: BatchView, new_forward: int, forward_step_value: int) -> None:
        """The launch of one BatchView's six arrays: ``self(batch.req_pool_indices, ..., batch.out_cache_loc,
        new_forward=..., forward_step_value=...)`` as one call (the per-forward path: a frame and a keyword call
        fewer). ``new_forward`` 0 or 1 and ``forward_step_value`` as ints (anything else is named like a failed
        ``__call__``)."""
        try:
            self._fn(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.input_ids, batch.positions,
                     batch.out_cache_loc, new_forward, forward_step_value)
        except _CALL_ERRORS as exc:
            self._raise(exc, batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.input_ids,
                        batch.positions, batch.out_cache_loc, new_forward, forward_step_value)

    def _raise(self, exc: Exception, req_pool_indices: Any, prefix_lens: Any, extend_lens: Any, input_ids: Any,
               positions: Any, out_cache_loc: Any, new_forward: Any, forward_step_value: Any) -> NoReturn:
        """The named error of a failed launch (see :func:`_raise_check_error`)."""
        _raise_check_error(exc, **self._fixed, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
                           extend_lens=extend_lens, input_ids=input_ids, positions=positions,
                           out_cache_loc=out_cache_loc, new_forward=new_forward,
                           forward_step_value=forward_step_value)


class WriteLaunch:
    """``canary_write_step`` of a runtime with every argument but its token count bound once.

    The fixed arguments are bound in C++ (``canary_write_bind``: the returned function owns them), and the write
    reads the first ``n`` tokens of the runtime's own snapshot buffers, so a forward passes only the three ``[:n]``
    slices, made once per ``n`` (at most ``max_cached`` counts are kept; a decode loop uses one or a few). The bound
    call runs the same C++ wrapper, so its checks are the export's; failures are named like
    :func:`canary_write_step`'s (a fixed argument tvm-ffi cannot take at all is named here, at binding).
    """

    def __init__(self, *, canary_buf: torch.Tensor, write_plan: WritePlan, input_ids: torch.Tensor,
                 positions: torch.Tensor, out_cache_loc: torch.Tensor, kernel_kind: int,
                 violation_ring: torch.Tensor, violation_write_index: torch.Tensor, slot_run_counter: torch.Tensor,
                 kernel_run_counter: torch.Tensor, enable_chain_position_assert: torch.Tensor,
                 real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
                 real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE, violation_meta: torch.Tensor | None = None,
                 forward_step: torch.Tensor | None = None, slot_attribution: torch.Tensor | None = None,
                 row_serials: torch.Tensor | None = None, max_cached: int = 256) -> None:
        self._kwargs = dict(
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
        module: Any = load_module(_backend_of(canary_buf.device))
        try:
            head, tail, attributed = _write_parts(**self._kwargs)
            self._fn = module.canary_write_bind(*head, *tail, *attributed)
        except _CALL_ERRORS as exc:
            _raise_bind_error(exc, "canary_write_step", _write_error_args, self._kwargs, _WRITE_PER_FORWARD)
        self._by_count: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._max_cached = max_cached

    def _slices(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The snapshot buffers' first ``n`` tokens (cached per ``n``: slicing costs host time per forward)."""
        ids, pos, loc = self._buffers
        if len(self._by_count) >= self._max_cached:
            self._by_count.clear()
        slices = self._by_count[n] = (ids[:n], pos[:n], loc[:n])
        return slices

    def __call__(self, n: int) -> None:
        slices = self._by_count.get(n)
        try:
            # input_ids first: tvm-ffi takes the launch's stream from the call's first CUDA tensor (the bound ones
            # are not passed), so the snapshot slices must stay the call's device tensors (csrc/canary_write.cuh).
            self._fn(*(slices if slices is not None else self._slices(n)))
        except _CALL_ERRORS as exc:
            ids, pos, loc = self._buffers
            _raise_write_error(exc, **self._kwargs, input_ids=ids[:n], positions=pos[:n], out_cache_loc=loc[:n])


def canary_row_serial_update(*, row_serials: torch.Tensor, staging: torch.Tensor, num_updates: int) -> None:
    """``row_serials[rows[u]] = serials[u]`` for the ``num_updates`` updates staged in ``staging`` (see
    csrc/canary_row_serials.cuh): the rows ``staging[:num_updates]``, then the serials
    ``staging[num_updates:2 * num_updates]``, int64.

    ``staging`` is host memory: on CUDA it must be pinned, and the kernel reads it in place, so the caller must not
    rewrite it before the launch has completed (record an event after this call). ``row_serials`` int64 [rows] is
    updated in batch order (a row repeated in one call gets its later serial, on CUDA too). Every row is checked on
    the host first: a row outside ``row_serials`` raises a ``ValueError`` naming the update, and nothing is written.
    One launch, no copy, no allocation; never synchronises.
    """
    try:
        load_module(_backend_of(row_serials.device)).canary_row_serial_update(
            row_serials, staging, operator.index(num_updates))
    except _CALL_ERRORS as exc:
        _reraise_named(
            exc, "canary_row_serial_update",
            {"row_serials": (row_serials, False), "staging": (staging, False)},
            {"num_updates": num_updates},
        )
