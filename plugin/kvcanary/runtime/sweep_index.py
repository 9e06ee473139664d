"""An incremental sweep plan: the prefix cache's entries kept on the device as the cache changes (issue 25).

Why. A sweep verifies every (slot, predecessor, position) the prefix cache holds. Gathering them by walking the
cache costs host time in proportion to its nodes (~1-2 ms per sweep of a few hundred nodes on the H200 host), and a
serving engine's cache changes between nearly every two sweeps (requests finish and are inserted, the pool
evicts), so a walk-per-sweep source pays that walk almost every time. :class:`SweepIndex` instead follows the
cache's changes as they happen and turns them into a few device operations at the next sweep, whatever the size of
the cache:

* **Spans.** The cache tells the index about *spans*: a run of slots at consecutive positions, owned by a key (a
  cache node), continuing the chain of another span (``after``: the span whose last slot precedes its first) or
  starting one (``after`` None: the first slot's predecessor is -1 and its position 0). A span's first position is
  its ``after`` span's end position. Each span held by the index occupies a contiguous range of the plan.
* **Appends** (:meth:`SweepIndex.append`): new spans are gathered into the plan's tail by one batch of ~10 device
  operations (one cat of their slot tensors; the positions and the predecessor of each span's first slot come from
  host facts uploaded at once), whatever their number.
* **Removals** (:meth:`SweepIndex.remove`) become *tombstones*: the span's range is set to the padding slot (0), which
  the verify kernel skips, at the next :meth:`SweepIndex.commit`. The verify kernel's entry counter counts the plan's
  entries, tombstones included, so the sweep subtracts them again (:class:`kvcanary.runtime.sweep.SweepPlan`'s
  ``skipped``): "entries swept" stays the number of cached entries checked.
* **Splits** (:meth:`SweepIndex.split`): a span cut in two keeps its entries where they are; only the host ranges
  change (a split keeps every slot, predecessor and position).
* **Compaction.** Tombstones are dropped by rebuilding the plan from scratch (the caller walks its cache once,
  calls :meth:`SweepIndex.clear` and appends every span again) when they are at least half the plan
  (:meth:`SweepIndex.wants_compaction`).

The index never reads a slot on the host (no device sync). It does not know streams: its caller runs the device
operations where the slot tensors it hands over are produced
(:func:`kvcanary.runtime.streams.update_on_producer_stream`) and reserves capacity first (:meth:`SweepIndex.reserve`),
outside that stream.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.plan import VerifyPlan
from kvcanary.runtime.sweep import MIN_SWEEP_PLAN, SweepPlan, allocate_sweep_plan

# Tombstones below this many entries never ask for a compaction: verifying a few thousand padding entries costs the
# device nothing measurable, a rebuild costs a walk of the cache.
MIN_COMPACTION_ENTRIES = 4096


@dataclass(frozen=True)
class Span:
    """A run of slots at consecutive positions that a cache node owns.

    Attributes:
        key: the owner (hashable; one span per key).
        slots: 1-D integer tensor of the slots, on the plan's device (never read on the host).
        after: key of the span whose last slot comes right before ``slots[0]`` (held by the index, or earlier in
            the same :meth:`SweepIndex.append` call), or None: ``slots[0]`` starts a chain (position 0).
    """

    key: Hashable
    slots: torch.Tensor
    after: Hashable | None = None


class UnplacedSpan(KeyError):
    """A span's ``after`` is neither held by the index nor earlier in the same append (the caller rebuilds)."""


class SweepIndex:
    """The sweep plan of a prefix cache, kept up to date span by span (see the module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._plan: VerifyPlan | None = None
        self._ranges: dict[Hashable, tuple[int, int, int]] = {}  # key -> (plan start, length, first position)
        self._used = 0  # plan entries in use, tombstones included
        self._dead = 0  # tombstoned entries among them
        self._tombstones: list[tuple[int, int]] = []  # (start, length) not yet set to the padding slot
        self._planned: SweepPlan | None = None  # what the last commit handed out (None: changed since)
        self._head: torch.Tensor | None = None  # [-1] on the device: the predecessor of a chain head

    # ------------------------------------------------------------------------------------------ host facts
    def __len__(self) -> int:
        """Live entries (plan entries that are not tombstones)."""
        return self._used - self._dead

    def __contains__(self, key: Hashable) -> bool:
        return key in self._ranges

    @property
    def tombstones(self) -> int:
        return self._dead

    def wants_compaction(self) -> bool:
        """Whether tombstones are at least half the plan (and more than :data:`MIN_COMPACTION_ENTRIES`)."""
        return self._dead >= MIN_COMPACTION_ENTRIES and 2 * self._dead >= self._used

    def dirty(self) -> bool:
        """Whether there is device work for :meth:`commit` (tombstones to set, or a plan not handed out yet)."""
        return self._planned is None or bool(self._tombstones)

    # ------------------------------------------------------------------------------------------ host-only changes
    def split(self, key: Hashable, head: Hashable, head_length: int) -> None:
        """The span ``key`` was cut after ``head_length`` slots: ``head`` now owns the first part, ``key`` the rest.
        Host only (every entry keeps its slot, predecessor and position)."""
        start, length, first = self._ranges[key]
        if not 0 < head_length < length:
            raise ValueError(f"SweepIndex.split: head_length {head_length} not inside a span of {length}")
        if head in self._ranges:
            raise ValueError("SweepIndex.split: the head key already owns a span")
        self._ranges[head] = (start, head_length, first)
        self._ranges[key] = (start + head_length, length - head_length, first + head_length)

    def remove(self, key: Hashable) -> None:
        """The span ``key`` left the cache: its entries become tombstones at the next :meth:`commit`."""
        start, length, _ = self._ranges.pop(key)
        self._tombstones.append((start, length))
        self._dead += length
        self._planned = None

    def clear(self) -> None:
        """Forget every span (the cache was emptied); the plan is empty after the next :meth:`commit`."""
        self._ranges.clear()
        self._tombstones.clear()
        self._used = self._dead = 0
        self._planned = None

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more entries now (call outside the producer stream: see the module docstring)."""
        needed = self._used + extra
        plan = self._plan
        if plan is not None and plan.capacity >= needed:
            return
        capacity = max(needed, 2 * (plan.capacity if plan is not None else 0), MIN_SWEEP_PLAN)
        grown = allocate_sweep_plan(capacity, self.device)
        if plan is not None and self._used:
            n = self._used
            grown.verify_slot_indices[:n].copy_(plan.verify_slot_indices[:n])
            grown.verify_prev_slot_indices[:n].copy_(plan.verify_prev_slot_indices[:n])
            grown.verify_expected_positions[:n].copy_(plan.verify_expected_positions[:n])
        self._plan = grown
        self._planned = None

    # ------------------------------------------------------------------------------------------ device changes
    def append(self, spans: Sequence[Span]) -> None:
        """Add ``spans`` at the plan's tail (~10 device operations, whatever their number); each ``after`` is held
        already or earlier in ``spans``. Raises :class:`UnplacedSpan` (nothing changed) when one is neither, and
        ``ValueError`` for a key held already or an empty span."""
        if not spans:
            return
        ranges = self._ranges
        batch: dict[Hashable, tuple[int, int, int]] = {}  # key -> (first entry in this batch, length, first position)
        externals: list[torch.Tensor] = []  # last slots of held spans that batch spans continue
        external_index: dict[Hashable, int] = {}
        firsts: list[int] = []
        befores: list[int] = []  # per span: index in [-1, *externals, *batch slots] of its first slot's predecessor
        offsets: list[int] = []  # per span: first position - first entry
        lengths: list[int] = []
        parts: list[torch.Tensor] = []
        total = 0
        for span in spans:
            key, slots, after = span.key, span.slots, span.after
            if key in ranges or key in batch:
                raise ValueError("SweepIndex.append: a key already owns a span")
            n = slots.numel()
            if n == 0:
                raise ValueError("SweepIndex.append: an empty span")
            if after is None:
                before, first_position = 0, 0
            elif after in batch:
                a_first, a_length, a_position = batch[after]
                before, first_position = -(a_first + a_length), a_position + a_length  # (resolved below)
            elif after in ranges:
                a_start, a_length, a_position = ranges[after]
                j = external_index.get(after)
                if j is None:
                    j = external_index[after] = len(externals)
                    externals.append(a_start + a_length - 1)  # (a plan index; its slot is read on the device)
                before, first_position = 1 + j, a_position + a_length
            else:
                raise UnplacedSpan(after)
            batch[key] = (total, n, first_position)
            firsts.append(total)
            befores.append(before)
            offsets.append(first_position - total)
            lengths.append(n)
            parts.append(slots if slots.dtype is torch.int64 else slots.to(torch.int64))
            total += n
        head = 1 + len(externals)  # [-1, *externals, *batch slots]: batch entry i is at head + i
        befores = [b if b >= 0 else head - b - 1 for b in befores]  # in-batch: the after span's last entry

        self.reserve(total)  # (normally done by the caller, outside the producer stream)
        plan = self._plan
        start = self._used
        device = self.device
        if self._head is None:
            self._head = torch.full((1,), -1, dtype=torch.int64, device=device)
        # one upload of the host facts (and of the plan indices of the held spans' last slots, read on the device)
        meta = torch.tensor(firsts + befores + offsets + lengths + externals, dtype=torch.int64)
        if device.type != "cpu":
            meta = meta.to(device, non_blocking=True)
        sources = [self._head]
        if externals:
            sources.append(plan.verify_slot_indices.index_select(0, meta[4 * len(firsts):]))
        headed = torch.cat(sources + parts)
        span_firsts, span_befores, span_offsets, span_lengths = meta[:4 * len(firsts)].split(len(firsts))
        index = torch.arange(total, dtype=torch.int64, device=device)
        end = start + total
        torch.add(torch.repeat_interleave(span_offsets, span_lengths, output_size=total), index,
                  out=plan.verify_expected_positions[start:end])
        index += head - 1  # [-1, *externals, *batch slots][index[i]]: the slot before entry i, but at a span's first
        index[span_firsts] = span_befores
        torch.index_select(headed, 0, index, out=plan.verify_prev_slot_indices[start:end])
        plan.verify_slot_indices[start:end].copy_(headed[head:])
        for key, (first, n, position) in batch.items():
            ranges[key] = (start + first, n, position)
        self._used = end
        self._planned = None

    def commit(self) -> SweepPlan:
        """Set the pending tombstones and the entry count on the device; the plan to sweep (the same object while
        nothing changed: no device work then)."""
        planned = self._planned
        if planned is not None and not self._tombstones:
            return planned
        if self._plan is None:
            self.reserve(0)
        plan = self._plan
        tombstones = self._tombstones
        if tombstones:
            if len(tombstones) <= 2:
                for start, length in tombstones:
                    plan.verify_slot_indices[start:start + length].fill_(layout.PADDING_SLOT)
            else:
                total = sum(length for _, length in tombstones)
                offsets, lengths, first = [], [], 0
                for start, length in tombstones:
                    offsets.append(start - first)
                    lengths.append(length)
                    first += length
                meta = torch.tensor(offsets + lengths, dtype=torch.int64)
                if self.device.type != "cpu":
                    meta = meta.to(self.device, non_blocking=True)
                range_offsets, range_lengths = meta.split(len(offsets))
                index = torch.arange(total, dtype=torch.int64, device=self.device)
                index += torch.repeat_interleave(range_offsets, range_lengths, output_size=total)
                plan.verify_slot_indices.index_fill_(0, index, layout.PADDING_SLOT)
            tombstones.clear()
        plan.verify_num_valid.fill_(self._used)
        planned = self._planned = SweepPlan(plan, self._dead)
        return planned


__all__ = ["MIN_COMPACTION_ENTRIES", "Span", "SweepIndex", "UnplacedSpan"]
