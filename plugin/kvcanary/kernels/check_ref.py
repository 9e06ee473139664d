"""Pure-torch reference of the fused per-forward check (contract: csrc/canary_check.cuh), for differential tests:
``check_ref.canary_check_step`` takes the keyword arguments of ``check.canary_check_step`` and composes the
drained-ring reuse (``reuse_drained_ring``) and the plan and verify references, in place on the given CPU tensors."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.plan_step_ref import canary_plan_step
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.kernels.verify_ref import canary_verify_step

logger = logging.getLogger(__name__)


def reuse_drained_ring(state: torch.Tensor, violation_meta: torch.Tensor | None = None) -> None:
    """The drained-ring reuse at the start of ``canary_check_step`` (contract: csrc/canary_check.cuh), in place on
    ``state`` (the header, then the ring) and ``violation_meta``: with the host's acknowledgement (epoch E, index D) of
    the ring's current epoch, the rows appended since D move to the front (when they fit below D and the ring did not
    overflow), or, when every stored row was read and the rows past D were never stored (D >= capacity), they are
    counted in ``STATE_RING_LOST_AT_RESET``; either way the epoch advances and the acknowledgement is consumed."""
    drained_to = int(state[layout.STATE_DRAINED_TO])
    if drained_to <= 0:
        return
    shift = layout.DRAINED_TO_EPOCH_SHIFT
    acked = drained_to & ((1 << shift) - 1)
    if acked <= 0 or drained_to >> shift != int(state[layout.STATE_RING_EPOCH]):
        return  # nothing read, or read in an epoch already emptied
    write_index = state[layout.STATE_WRITE_INDEX : layout.STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
    index = int(write_index[0])
    capacity = (int(state.shape[0]) - layout.STATE_HEADER_FIELDS) // layout.VIOLATION_FIELDS
    kept, lost = 0, 0
    if acked <= index <= capacity and index - acked <= acked:
        kept = index - acked
        ring = state[layout.STATE_HEADER_FIELDS :].view(-1, layout.VIOLATION_FIELDS)
        ring[:kept] = ring[acked:index].clone()
        if violation_meta is not None:
            violation_meta[:kept] = violation_meta[acked:index].clone()
    elif index > capacity and acked >= capacity and index >= acked:
        lost = index - acked
    else:
        return  # an overlapping move, unread stored rows past D, or a wrapped index: the host acknowledges again
    write_index[0] = kept
    state[layout.STATE_RING_EPOCH] += 1
    state[layout.STATE_DRAINED_TO] = -1
    state[layout.STATE_RING_LOST_AT_RESET] += lost
    state[layout.STATE_RING_REUSED_AT] = acked


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
    kv_token_id_vs_position_offset: int = 0,
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
    new_forward: bool = True,
    forward_step_value: int = -1,
) -> None:
    """Reference of ``check.canary_check_step`` (contract: csrc/canary_check.cuh): the drained-ring reuse first, then
    the plan and verify references composed over a verify plan that cannot overflow, and the per-forward small ops."""
    i64 = torch.int64
    write_index = state[layout.STATE_WRITE_INDEX : layout.STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
    reuse_drained_ring(state, violation_meta)  # before this launch's appends: they follow the rows kept
    n = int(input_ids.shape[0])
    for src, dst in ((input_ids, input_ids_out), (positions, positions_out), (out_cache_loc, out_cache_loc_out)):
        dst[:n] = src.to(i64)
    rps = req_pool_indices.to(i64)
    valid = None
    if expected_valid_lens_by_row is not None:
        valid = expected_valid_lens_by_row[rps.clamp(0, int(expected_valid_lens_by_row.shape[0]) - 1)]
    bs = int(rps.shape[0])
    scratch = WritePlan.allocate(write_plan.capacity, "cpu")
    verify_plan = VerifyPlan.allocate(bs * (int(req_to_token.shape[1]) + 2), "cpu")  # every entry a row can plan
    canary_plan_step(
        write_plan=scratch, verify_plan=verify_plan, req_pool_indices=rps, prefix_lens=prefix_lens.to(i64),
        extend_lens=extend_lens.to(i64), req_to_token=req_to_token, swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping, expected_tokens=expected_tokens,
        expected_tokens_valid_lens=valid, kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        out_cache_loc=out_cache_loc,
    )
    write_plan.write_offsets.copy_(scratch.write_offsets)
    write_plan.write_seed_slot_indices.copy_(scratch.write_seed_slot_indices)
    write_plan.write_num_valid_reqs.copy_(scratch.write_num_valid_reqs)
    if write_plan.write_request_rows is not None and scratch.write_request_rows is not None:
        write_plan.write_request_rows.copy_(scratch.write_request_rows)
    counter = int(state[layout.STATE_FORWARD])
    step = counter if not new_forward else (forward_step_value if forward_step_value >= 0 else counter + 1)
    tag = layout.LAUNCH_TAG_VERIFY
    canary_verify_step(
        canary_buf=canary_buf,
        verify_slot_indices=verify_plan.verify_slot_indices,
        verify_expected_tokens=verify_plan.verify_expected_tokens,
        verify_expected_positions=verify_plan.verify_expected_positions,
        verify_prev_slot_indices=verify_plan.verify_prev_slot_indices,
        verify_num_valid=verify_plan.verify_num_valid,
        verify_enable=verify_plan.verify_enable,
        kernel_kind=tag,
        violation_ring=state[layout.STATE_HEADER_FIELDS :].view(-1, layout.VIOLATION_FIELDS),
        violation_write_index=write_index,
        slot_run_counter=state[layout.STATE_SLOT_RUNS + tag : layout.STATE_SLOT_RUNS + tag + 1],
        kernel_run_counter=state[layout.STATE_KERNEL_RUNS + tag : layout.STATE_KERNEL_RUNS + tag + 1],
        real_kv_sources=real_kv_sources,
        real_kv_hash_mode=real_kv_hash_mode,
        check_tokens=check_tokens,
        violation_meta=violation_meta,
        forward_step=torch.tensor([step], dtype=i64),
        verify_request_rows=verify_plan.verify_request_rows,
        slot_attribution=slot_attribution,
    )
    if new_forward:
        state[layout.STATE_FORWARD] = step
    if status_mirror is not None:  # the finished header, as the launch's last block publishes it
        status_mirror.copy_(state[: layout.STATE_HEADER_FIELDS])
