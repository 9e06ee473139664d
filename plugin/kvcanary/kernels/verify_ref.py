"""Pure-torch reference of the verify kernel (SPEC §4.2; contract: csrc/canary_verify.cuh), for differential tests:
``verify_ref.canary_verify_step`` takes the keyword arguments of ``verify.canary_verify_step`` and updates the given
CPU tensors in place."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.hash_ref import Records, Sink, chain_head_hash, chain_step, real_kv_fingerprint, to_i64
from kvcanary.kernels.real_kv import RealKvSource

logger = logging.getLogger(__name__)


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
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
    violation_meta: torch.Tensor | None = None,
    forward_step: torch.Tensor | None = None,
    verify_request_rows: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
) -> None:
    """Reference of ``verify.canary_verify_step`` (contract: csrc/canary_verify.cuh), metadata arguments included."""
    records = Records(canary_buf)
    unknown = layout.META_UNKNOWN
    sink = Sink(violation_ring, violation_write_index, kernel_kind, violation_meta,
                 int(forward_step[0]) if forward_step is not None else unknown)
    request_rows = verify_request_rows.tolist() if verify_request_rows is not None else None
    attribution = slot_attribution.tolist() if slot_attribution is not None else None
    slots, prevs = verify_slot_indices.tolist(), verify_prev_slot_indices.tolist()
    exp_tok, exp_pos = verify_expected_tokens.tolist(), verify_expected_positions.tolist()
    enabled = int(verify_enable[0]) != 0
    active = max(0, min(int(verify_num_valid[0]), len(slots))) if enabled else 0
    for e in range(active):
        slot = slots[e]
        if slot == layout.PADDING_SLOT:
            continue
        reported_token = exp_tok[e] if check_tokens else layout.NO_EXPECTED_TOKEN
        request_row = request_rows[e] if request_rows is not None else unknown
        if slot < 0 or slot >= records.num_slots:
            sink.record(slot, exp_pos[e], -1, reported_token, 0, slot, layout.REASON_SLOT_OUT_OF_RANGE,
                        meta=(request_row, unknown, unknown))
            continue
        token, position, prev_hash, kv_hash = records.load(slot)
        prev = prevs[e]
        bits = 0
        expected_aux = prev_hash
        if prev == layout.CHAIN_HEAD_SLOT:
            expected_aux = to_i64(chain_head_hash())
        elif layout.UNKNOWN_PREV_SLOT < prev < records.num_slots:
            p_tok, p_pos, p_prev, _ = records.load(prev)
            expected_aux = to_i64(chain_step(p_prev, p_tok, p_pos))
        elif prev != layout.UNKNOWN_PREV_SLOT:
            bits |= layout.REASON_SLOT_OUT_OF_RANGE
            expected_aux = prev
        if (prev == layout.CHAIN_HEAD_SLOT or layout.UNKNOWN_PREV_SLOT < prev < records.num_slots) and (
            prev_hash != expected_aux
        ):
            bits |= layout.REASON_VERIFY_CHAIN_HASH
        if check_tokens and exp_tok[e] != layout.NO_EXPECTED_TOKEN and token != exp_tok[e]:
            bits |= layout.REASON_VERIFY_TOKEN
        if position != exp_pos[e]:
            bits |= layout.REASON_VERIFY_POSITION
        if kv_hash != to_i64(real_kv_fingerprint(real_kv_sources, real_kv_hash_mode, slot)):
            bits |= layout.REASON_VERIFY_REAL_KV_HASH
        if bits:
            written = tuple(attribution[slot]) if attribution is not None else (unknown, unknown)
            sink.record(slot, position, token, reported_token, prev_hash, expected_aux, bits,
                        meta=(request_row, *written))
    sink.commit()
    kernel_run_counter[0] = to_i64(int(kernel_run_counter[0]) + 1)
    slot_run_counter[0] = to_i64(int(slot_run_counter[0]) + active)
