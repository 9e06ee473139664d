"""Pure-torch reference of the plan kernel (SPEC §4.3; contract: csrc/canary_plan.cuh), for differential tests:
``plan_step_ref.canary_plan_step`` takes the keyword arguments of ``plan_step.canary_plan_step`` (the forward counter
aside) and fills the given CPU plans in place."""

from __future__ import annotations

import logging

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.plan import VerifyPlan, WritePlan

logger = logging.getLogger(__name__)


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
    out_cache_loc: torch.Tensor | None = None,
) -> None:
    """Reference of ``plan_step.canary_plan_step`` (contract: csrc/canary_plan.cuh), with the padding rows of
    ``out_cache_loc`` (a row that writes and whose first new token is on the padding slot)."""
    rps, prefixes, extends = req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()
    locs = out_cache_loc.tolist() if out_cache_loc is not None else None
    table = req_to_token.tolist()
    req_rows = len(table)
    max_ctx = int(req_to_token.shape[1])
    lut = full_to_swa_index_mapping.tolist() if full_to_swa_index_mapping is not None else None
    exp = expected_tokens.tolist() if expected_tokens is not None else None
    valid = expected_tokens_valid_lens.tolist() if expected_tokens_valid_lens is not None else None
    err = layout.encode_plan_index_error

    def translate(value: int) -> int:
        if lut is None or value < 0:
            return value
        return lut[value] if value < len(lut) else err(value)

    def expected(r: int, rp: int, pos: int) -> int:
        if exp is None or not 0 <= rp < len(exp):
            return layout.NO_EXPECTED_TOKEN
        index = pos + kv_token_id_vs_position_offset
        if index < 0 or index >= valid[r] or index >= len(exp[rp]):
            return layout.NO_EXPECTED_TOKEN
        return exp[rp][index]

    bs = len(rps)
    cap = write_plan.capacity
    offsets, seeds, row_offsets, request_rows = [0], [], [0], []
    entries: list[tuple[int, int, int, int]] = []  # slot, prev, token, position
    entry_rows: list[int] = []  # rp of each entry's batch row
    for r in range(cap):
        seed, write_count, row_entries = layout.CHAIN_HEAD_SLOT, 0, []
        rp = rps[r] if r < bs else layout.PADDING_REQ_POOL_ROW
        if rp != layout.PADDING_REQ_POOL_ROW:
            prefix, extend = prefixes[r], extends[r]
            start = offsets[-1]  # where the row's tokens start: padding rows before it took none
            padding = locs is not None and extend > 0 and start < len(locs) and locs[start] == layout.PADDING_SLOT
            write_count = 0 if padding else max(extend, 0)
            if not 0 <= rp < req_rows:
                row_entries.append((err(rp), layout.UNKNOWN_PREV_SLOT, -1, layout.NO_EXPECTED_POSITION))
            else:
                bad_prefix = prefix < 0 or prefix > max_ctx
                end = min(max(prefix, 0), max_ctx)
                window_start = max(0, end - swa_window_size) if swa_window_size > 0 else 0
                for pos in range(end if padding else window_start, end):  # a padding row: no window entries
                    prev = translate(table[rp][pos - 1]) if pos > 0 else layout.CHAIN_HEAD_SLOT
                    row_entries.append((translate(table[rp][pos]), prev, expected(r, rp, pos), pos))
                if bad_prefix:
                    row_entries.append((err(prefix), layout.UNKNOWN_PREV_SLOT, -1, layout.NO_EXPECTED_POSITION))
                if extend < 0:
                    row_entries.append((err(extend), layout.UNKNOWN_PREV_SLOT, -1, layout.NO_EXPECTED_POSITION))
                if not padding and not bad_prefix and prefix > 0 and extend > 0:
                    seed = translate(table[rp][prefix - 1])
        seeds.append(seed)
        request_rows.append(rp)
        offsets.append(offsets[-1] + write_count)
        entries.extend(row_entries)
        entry_rows.extend([rp] * len(row_entries))
        row_offsets.append(len(entries))
    write_plan.write_offsets.copy_(torch.tensor(offsets, dtype=torch.int64))
    write_plan.write_seed_slot_indices.copy_(torch.tensor(seeds, dtype=torch.int64))
    write_plan.verify_row_offsets.copy_(torch.tensor(row_offsets, dtype=torch.int64))
    write_plan.write_num_valid_reqs[0] = bs
    if write_plan.write_request_rows is not None:
        write_plan.write_request_rows.copy_(torch.tensor(request_rows, dtype=torch.int64))
    vcap = verify_plan.capacity
    overflow = len(entries) > vcap
    verify_plan.verify_num_valid[0] = vcap if overflow else len(entries)
    verify_plan.verify_enable[0] = 0 if overflow else 1
    if overflow:
        return
    for e, (slot, prev, token, position) in enumerate(entries):
        verify_plan.verify_slot_indices[e] = slot
        verify_plan.verify_prev_slot_indices[e] = prev
        verify_plan.verify_expected_tokens[e] = token
        verify_plan.verify_expected_positions[e] = position
        if verify_plan.verify_request_rows is not None:
            verify_plan.verify_request_rows[e] = entry_rows[e]
