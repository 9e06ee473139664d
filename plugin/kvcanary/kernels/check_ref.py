"""Pure-torch reference of the fused per-forward check (contract: csrc/canary_check.cuh), for differential tests:
``check_ref.canary_check_step`` takes the keyword arguments of ``check.canary_check_step`` and composes the
drained-ring reuse (``reuse_drained_ring``), the token mail (``apply_token_mail``) and the plan and verify references,
in place on the given CPU tensors."""

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


def apply_token_mail(state: torch.Tensor, token_mail: torch.Tensor, token_mail_published: torch.Tensor,
                     expected_tokens: torch.Tensor, valid_lens_by_row: torch.Tensor, step: int) -> None:
    """The token mail of ``canary_check_step`` (contract: csrc/canary_check.cuh), in place: the records published
    since ``state[STATE_TOKEN_MAIL_READ]`` (nothing when the count is behind it or more than a ring ahead) are applied
    in order while their step is at most ``step``: token at (row, start), the row's valid length start + 1 (a record
    outside the table is skipped); the read cursor moves past the applied ones."""
    read, published = int(state[layout.STATE_TOKEN_MAIL_READ]), int(token_mail_published[0])
    capacity = int(token_mail.shape[1])  # (a column per field)
    if not read < published <= read + capacity:
        return
    rows, width = expected_tokens.shape
    at = read
    while at < published:
        row, start, token, record_step = token_mail[:, at % capacity].tolist()
        if record_step > step:
            break
        if 0 <= row < rows and 0 <= start < width:
            expected_tokens[row, start] = torch.tensor(token, dtype=torch.int64).to(torch.int32)  # the low 32 bits
            valid_lens_by_row[row] = start + 1
        at += 1
    state[layout.STATE_TOKEN_MAIL_READ] = at


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
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
    new_forward: bool = True,
    forward_step_value: int = -1,
) -> None:
    """Reference of ``check.canary_check_step`` (contract: csrc/canary_check.cuh): the drained-ring reuse first, the
    token mail, then the plan and verify references composed over a verify plan that cannot overflow, and the
    per-forward small ops."""
    i64 = torch.int64
    write_index = state[layout.STATE_WRITE_INDEX : layout.STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
    reuse_drained_ring(state, violation_meta)  # before this launch's appends: they follow the rows kept
    counter = int(state[layout.STATE_FORWARD])
    step = counter if not new_forward else (forward_step_value if forward_step_value >= 0 else counter + 1)
    if token_mail is not None and token_mail_published is not None and expected_tokens is not None \
            and expected_valid_lens_by_row is not None:  # (before any verify: this launch checks the appends)
        apply_token_mail(state, token_mail, token_mail_published, expected_tokens, expected_valid_lens_by_row, step)
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
