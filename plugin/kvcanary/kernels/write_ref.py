"""Pure-torch reference of the write kernel (SPEC §4.1; contract: csrc/canary_write.cuh), for differential tests:
``write_ref.canary_write_step`` takes the keyword arguments of ``write.canary_write_step`` (the seed ones) and
updates the given CPU tensors in place."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.hash_ref import Records, Sink, chain_head_hash, chain_step, real_kv_fingerprint, to_i64
from kvcanary.kernels.real_kv import RealKvSource

logger = logging.getLogger(__name__)


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
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
) -> None:
    records = Records(canary_buf)
    sink = Sink(violation_ring, violation_write_index, kernel_kind)
    offsets = write_offsets.tolist()
    seeds = write_seed_slot_indices.tolist()
    tokens, pos, locs = input_ids.tolist(), positions.tolist(), out_cache_loc.tolist()
    exp_tok = expected_input_tokens.tolist() if enable_write_input_assert else None
    exp_pos = expected_input_positions.tolist() if enable_write_input_assert else None
    chain_flag = int(enable_chain_position_assert[0]) != 0
    capacity, num_tokens = len(seeds), len(tokens)
    active = max(0, min(int(write_num_valid_reqs[0]), capacity))
    stored_total = 0
    for r in range(active):
        begin, end = offsets[r], offsets[r + 1]
        if begin >= end:
            continue
        if begin < 0 or end > num_tokens:
            sink.record(layout.SKIP_WRITE_SLOT, -1, -1, layout.NO_EXPECTED_TOKEN, r, begin if begin < 0 else end,
                        layout.REASON_SLOT_OUT_OF_RANGE)
            continue
        seed = seeds[r]
        running = chain_head_hash()
        prev_position = 0
        chain_assert = False
        if seed != layout.CHAIN_HEAD_SLOT:
            if 0 <= seed < records.num_slots:
                s_tok, s_pos, s_prev, _ = records.load(seed)
                running = chain_step(s_prev, s_tok, s_pos)
                prev_position = s_pos
                chain_assert = chain_flag
            else:
                sink.record(seed, -1, -1, layout.NO_EXPECTED_TOKEN, running, seed, layout.REASON_SLOT_OUT_OF_RANGE)
        for e in range(begin, end):
            slot = locs[e]
            if slot < 0:
                continue
            token, position = tokens[e], pos[e]
            if exp_tok is not None and exp_pos is not None:
                bits = (layout.REASON_WRITE_TOKEN if token != exp_tok[e] else 0) | (
                    layout.REASON_WRITE_POSITION if position != exp_pos[e] else 0
                )
                if bits:
                    sink.record(slot, position, token, exp_tok[e], running, exp_pos[e], bits)
            if chain_assert and position != prev_position + 1:
                sink.record(slot, position, token, token, running, prev_position + 1, layout.REASON_WRITE_POSITION)
            if slot >= records.num_slots:
                sink.record(slot, position, token, token, running, slot, layout.REASON_SLOT_OUT_OF_RANGE)
            else:
                fp = real_kv_fingerprint(real_kv_sources, real_kv_hash_mode, slot)
                records.store(slot, (token, position, running, fp))
                stored_total += 1
            running = chain_step(running, token, position)
            prev_position = position
    records.commit()
    sink.commit()
    kernel_run_counter[0] = to_i64(int(kernel_run_counter[0]) + 1)
    slot_run_counter[0] = to_i64(int(slot_run_counter[0]) + stored_total)
