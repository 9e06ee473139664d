"""The sweep plan's commit kernel's wrapper: ``canary_sweep_plan_update`` (csrc/canary_sweep_plan.cuh), and the
metadata block it reads (:func:`sweep_plan_meta`). :class:`kvcanary.runtime.sweep_index.SweepIndex` calls the export
directly and this wrapper only to name a failure. Reference: ``sweep_plan_ref``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.call import Arg, KernelSpec

SPEC = KernelSpec(fn="canary_sweep_plan_update", device="verify_slot_indices",
                  args=(Arg("verify_slot_indices"), Arg("verify_prev_slot_indices"),
                        Arg("verify_expected_positions"), Arg("verify_num_valid"), Arg("new_slots"), Arg("meta")))


def sweep_plan_meta(spans: Iterable[tuple[int, int, int, int]], tombstones: Iterable[tuple[int, int]],
                    slots_base: int, num_valid: int) -> list[int]:
    """The metadata block of one launch as a list of int64 values (layout.SWEEP_PLAN_*): the header, each span's
    ``(start, length, first position, before)`` (``before``: the plan index of its first entry's predecessor, -1 for a
    chain head), each tombstone range's ``(start, length)``. The runtime packs the same values into a staging of its
    own (no list); tests and the reference build blocks here."""
    spans, tombstones = list(spans), list(tombstones)
    values = [0] * layout.SWEEP_PLAN_META_HEADER_FIELDS
    values[layout.SWEEP_PLAN_META_NUM_SPANS] = len(spans)
    values[layout.SWEEP_PLAN_META_NUM_TOMBSTONES] = len(tombstones)
    values[layout.SWEEP_PLAN_META_SLOTS_BASE] = slots_base
    values[layout.SWEEP_PLAN_META_NUM_VALID] = num_valid
    for span in spans:
        values += span
    for tombstone in tombstones:
        values += tombstone
    return values


def canary_sweep_plan_update(*, verify_slot_indices: torch.Tensor, verify_prev_slot_indices: torch.Tensor,
                             verify_expected_positions: torch.Tensor, verify_num_valid: torch.Tensor,
                             new_slots: torch.Tensor, meta: torch.Tensor) -> None:
    """Apply one sweep-plan commit (see csrc/canary_sweep_plan.cuh): for each span of ``meta`` its entries' slots
    (``new_slots[q - slots_base]``, or the padding slot where a tombstone range of ``meta`` covers them), positions and
    predecessor slots; the padding slot over every tombstone range; ``verify_num_valid``. Predecessors are read as the
    plan held them before this call's tombstones (a span's tombstoned predecessor still gives its slot), and from
    ``new_slots`` when appended in the same commit.

    The plan buffers are int64 ``[capacity]`` (``verify_num_valid`` int32 ``[1]``) on the build's device, ``new_slots``
    int64 on the same device (never read on the host), ``meta`` int64 host memory (:func:`sweep_plan_meta`'s layout;
    on CUDA pinned, read by the kernel in place: do not rewrite it before the launch has completed). The metadata is
    checked on the host first: a value outside its range raises a ``ValueError`` naming ``meta`` (and the span or
    range), and nothing is written. One launch, no copy, no allocation; never synchronises.
    """
    SPEC.run(locals())
