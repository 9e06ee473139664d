"""Pure-torch reference of the sweep plan's commit (contract: csrc/canary_sweep_plan.cuh), for differential tests.

``sweep_plan_ref.canary_sweep_plan_update`` takes the keyword arguments of ``sweep_plan.canary_sweep_plan_update`` and
applies the commit the way ``SweepIndex._write`` did before issue 25 moved it into one kernel, step by step and in
the same order: the new slots land in the plan (the ``cat``), the positions are written, the predecessors are gathered
from the plan *with the new slots in it* (a span's first entry's from its ``before``, the others from the entry
before), and only then are the tombstone ranges filled with the padding slot; last, the entry count. No checks: it is
given valid metadata only."""

from __future__ import annotations

import torch

from kvcanary.kernels import layout


def decode_meta(meta: torch.Tensor) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]], int, int]:
    """``(spans, tombstones, slots_base, num_valid)`` of a metadata block (layout.SWEEP_PLAN_*)."""
    values = meta.tolist()
    num_spans = values[layout.SWEEP_PLAN_META_NUM_SPANS]
    num_tombstones = values[layout.SWEEP_PLAN_META_NUM_TOMBSTONES]
    at = layout.SWEEP_PLAN_META_HEADER_FIELDS
    spans = [tuple(values[at + k * layout.SWEEP_PLAN_SPAN_FIELDS:at + (k + 1) * layout.SWEEP_PLAN_SPAN_FIELDS])
             for k in range(num_spans)]
    at += num_spans * layout.SWEEP_PLAN_SPAN_FIELDS
    tombstones = [tuple(values[at + k * layout.SWEEP_PLAN_TOMBSTONE_FIELDS:
                               at + (k + 1) * layout.SWEEP_PLAN_TOMBSTONE_FIELDS]) for k in range(num_tombstones)]
    return (spans, tombstones, values[layout.SWEEP_PLAN_META_SLOTS_BASE],  # type: ignore[return-value]
            values[layout.SWEEP_PLAN_META_NUM_VALID])


def canary_sweep_plan_update(*, verify_slot_indices: torch.Tensor, verify_prev_slot_indices: torch.Tensor,
                             verify_expected_positions: torch.Tensor, verify_num_valid: torch.Tensor,
                             new_slots: torch.Tensor, meta: torch.Tensor) -> None:
    spans, tombstones, base, num_valid = decode_meta(meta)
    slots = verify_slot_indices
    device = slots.device
    if spans:
        begin = spans[0][0]
        end = spans[-1][0] + spans[-1][1]
        slots[begin:end] = new_slots[begin - base:end - base]  # the cat
        positions = [first + i for _, n, first, _ in spans for i in range(n)]
        verify_expected_positions[begin:end] = torch.tensor(positions, dtype=torch.int64, device=device)
        # predecessors' plan indices, gathered from the plan with the commit's new slots in it (all of new_slots: a
        # commit split into launches has its earlier launches' entries there too): a span's first entry's is
        # `before` (-1: a chain head, which the torch commit read from a -1 kept in the plan's last entry), the
        # others the entry before
        with_new = slots.clone()
        with_new[base:base + new_slots.numel()] = new_slots
        index = [q for start, n, _, before in spans for q in (before, *range(start, start + n - 1))]
        index_t = torch.tensor(index, dtype=torch.int64, device=device)
        gathered = torch.index_select(with_new, 0, index_t.clamp(min=0))
        prev = torch.where(index_t < 0, torch.full_like(gathered, layout.CHAIN_HEAD_SLOT), gathered)
        verify_prev_slot_indices[begin:end] = prev
    for start, length in tombstones:  # the index_fill_, after every read
        slots[start:start + length] = layout.PADDING_SLOT
    verify_num_valid.fill_(num_valid)
