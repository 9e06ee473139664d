"""An incremental sweep plan: the prefix cache's entries kept on the device as the cache changes (issue 25).

Why. A sweep verifies every (slot, predecessor, position) the prefix cache holds. Gathering them by walking the
cache costs host time in proportion to its nodes (~1-2 ms per sweep of a few hundred nodes on the H200 host), and a
serving engine's cache changes between nearly every two sweeps (requests finish and are inserted, the pool
evicts), so a walk-per-sweep source pays that walk almost every time. :class:`SweepIndex` instead follows the
cache's changes as they happen and turns them into 2 device operations at the next sweep (a ``cat`` and one kernel
launch), whatever the size of the cache and of the change:

* **Spans.** The cache tells the index about *spans*: a run of slots at consecutive positions, owned by a key (a
  cache node), continuing the chain of another span (``after``: the span whose last slot precedes its first) or
  starting one (``after`` None: the first slot's predecessor is -1 and its position 0). A span's first position is
  its ``after`` span's end position. Each span held by the index occupies a contiguous range of the plan.
* **Appends** (:meth:`SweepIndex.append`): new spans get the plan's tail at once (host only: their ranges, and
  their entries' positions and predecessors as per-span segments); their entries are written at the next
  :meth:`SweepIndex.commit`.
* **Removals** (:meth:`SweepIndex.remove`) become *tombstones*: the span's range is set to the padding slot (0), which
  the verify kernel skips, at the next :meth:`SweepIndex.commit`. The verify kernel's entry counter counts the plan's
  entries, tombstones included, so the sweep subtracts them again (:class:`kvcanary.runtime.sweep.SweepPlan`'s
  ``skipped``): "entries swept" stays the number of cached entries checked.
* **Splits** (:meth:`SweepIndex.split`): a span cut in two keeps its entries where they are; only the host ranges
  change (a split keeps every slot, predecessor and position).
* **Commit** (:meth:`SweepIndex.commit`): the appended spans' slot tensors joined by one ``cat`` (they stay device
  tensors, never read on the host), and one launch of ``canary_sweep_plan_update``
  (csrc/canary_sweep_plan.cuh) that writes every new entry's slot, position and predecessor slot, sets the
  tombstones to the padding slot and writes the entry count. What it reads of the change is a small int64 block
  the host packs (per span: plan start, length, first position, the plan index of its first slot's predecessor or
  -1; per tombstone: start, length) into a staging of a pinned ring reused across commits (on CUDA the kernel reads
  it in place; an event every :data:`~kvcanary.runtime.staging.EVENT_EVERY` launches says when a staging may
  be rewritten: :class:`kvcanary.runtime.staging.StagingRing`). A commit of more than :data:`MAX_SPANS` spans
  or :data:`MAX_TOMBSTONES` tombstone ranges takes several launches. The results are bit-identical to the torch
  commit this replaced (issue 25: an upload, a ``cumsum`` or ``repeat_interleave``, ``cat``, ``copy_``,
  ``index_select``, ``index_fill_`` and the count's fill, ~27 torch calls of host time per commit on the H200 with
  the stream wrapper; ``kvcanary.kernels.sweep_plan_ref`` keeps it as the reference): a predecessor removed in the
  same commit is read as the slot it held, and a chain head's predecessor is -1 (the plan buffer still keeps a -1
  in its last entry, outside the verified range, which that commit read for it).
* **Compaction** (:meth:`SweepIndex.compact`): tombstones are dropped by gathering the live ranges, which the index
  knows, into a second plan buffer (one expansion, three ``index_select``): no walk of the cache. Wanted when
  tombstones are at least half the plan (:meth:`SweepIndex.wants_compaction`). A serving engine's pool turns its
  whole size over every few sweeps (``benchmarks/bench_sweep_churn.py``, a 12288-slot pool: a compaction every 4-9
  sweeps at a sweep every 10 forwards), so compaction is frequent; it used to be a walk of the cache and a rebuild
  of the plan from every node.

The index never reads a slot on the host (no device sync). It does not know streams: its caller runs the device
operations (:meth:`SweepIndex.commit`, :meth:`SweepIndex.compact`) on the stream that verifies the plan, ordered after
the stream that produces the slot tensors it hands over and keeping those alive until they have run
(:func:`kvcanary.runtime.streams.update_after_producer`), and reserves capacity first (:meth:`SweepIndex.reserve`,
which also allocates the compaction's buffer when one is wanted).
"""

from __future__ import annotations

import array
import struct
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.jit import load_module
from kvcanary.kernels.plan import VerifyPlan
from kvcanary.kernels.sweep_plan import canary_sweep_plan_update
from kvcanary.runtime.staging import EVENT_EVERY, StagingEvent, StagingRing, device_events
from kvcanary.runtime.sweep import MIN_SWEEP_PLAN, SweepPlan, allocate_sweep_plan

# Tombstones below this many entries never ask for a compaction: verifying a few thousand padding entries costs the
# device nothing measurable, a rebuild costs a walk of the cache.
MIN_COMPACTION_ENTRIES = 4096


class Span(NamedTuple):
    """A run of slots at consecutive positions that a cache node owns (a tuple: the incremental sweep builds a few
    per sweep, a rebuild one per cache node).

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


# Stagings of commit metadata on CUDA (pinned, SWEEP_PLAN_META_VALUES int64 each: 6 KiB), reused in turn; one event
# is recorded per EVENT_EVERY launches (kvcanary.runtime.staging: the same ring as the token check's uploads). A
# staging is rewritten RING_SIZE launches later, by when the device has long run the (microsecond) launch that read it
# unless it is that many commits behind (then the host waits on the event, never overwriting what it still reads).
RING_SIZE = 16
# Spans and tombstone ranges per launch (the metadata block's bound, csrc/canary_sweep_plan.cuh). A commit with more
# is SPLIT into several launches, never sent to a torch path: the spans in chunks of MAX_SPANS, in plan order, every
# chunk before any tombstone (a chunk reads predecessors from the plan, which no tombstone of this commit may have
# padded yet); the tombstones with the last chunk of spans, and any left over in launches of their own after it.
MAX_SPANS = layout.SWEEP_PLAN_MAX_SPANS
MAX_TOMBSTONES = layout.SWEEP_PLAN_MAX_TOMBSTONES
# Expansions of at most this many entries (a compaction's live entries) upload their differences and scan them on the
# device (2 operations, a 64 KiB host buffer at most); larger ones upload their segments and expand them with
# repeat_interleave (~5 operations).
SCAN_ENTRIES = 8192
_ONES = array.array("q", [1]) * SCAN_ENTRIES


_pack_into = struct.pack_into


def _ones(n: int) -> array.array:
    """A fresh int64 host array of ``n`` ones (one memory copy)."""
    return _ONES[:n]


class SweepIndex:
    """The sweep plan of a prefix cache, kept up to date span by span (see the module docstring)."""

    def __init__(self, device: torch.device | str, *,
                 event_factory: Callable[[], StagingEvent] | None = None) -> None:
        self.device = torch.device(device)
        self._plan: VerifyPlan | None = None
        self._spare: VerifyPlan | None = None  # the compaction's target (same capacity), swapped with the plan
        self._ranges: dict[Hashable, tuple[int, int, int]] = {}  # key -> (plan start, length, first position)
        self._used = 0  # plan entries in use, tombstones included (and appended ones not written yet)
        self._dead = 0  # tombstoned entries among them
        # not yet set to the padding slot: (start, length) per range, flat (the metadata block's layout)
        self._tombstones: list[int] = []
        # appended, not written yet: their slot tensors, and per span (plan start, length, first position, plan
        # index of its first slot's predecessor, -1: a chain head) from _written on, flat (the metadata's layout)
        self._parts: list[torch.Tensor] = []
        self._appended: list[int] = []
        self._written = 0  # plan entries written (the appended ones start here)
        self._planned: SweepPlan | None = None  # what the last commit handed out (None: changed since)
        self.compactions = 0
        self.launches = 0  # canary_sweep_plan_update launches (benchmarks count them as device operations)
        # The commit's metadata stagings (see RING_SIZE; on the CPU the launch has read its staging when it returns:
        # one staging, no events, unless tests inject theirs) and the export, bound once.
        event_factory, stream = device_events(self.device, event_factory)
        self._staging = StagingRing(RING_SIZE if event_factory is not None else 1, pinned=self.device.type == "cuda",
                                    event_factory=event_factory, event_every=EVENT_EVERY, launch_stream=stream,
                                    min_values=layout.SWEEP_PLAN_META_VALUES)
        self._launch = load_module("cuda" if self.device.type == "cuda" else "cpu").canary_sweep_plan_update
        self._no_slots = torch.zeros(0, dtype=torch.int64, device=self.device)  # new_slots of a commit without appends

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
        """Whether there is device work for :meth:`commit` (entries to write, tombstones to set, or a plan not
        handed out yet)."""
        return self._planned is None or bool(self._tombstones) or bool(self._appended)

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
        self._tombstones += start, length
        self._dead += length
        self._planned = None

    def clear(self) -> None:
        """Forget every span (the cache was emptied); the plan is empty after the next :meth:`commit`."""
        self._ranges.clear()
        self._tombstones.clear()
        self._parts.clear()
        self._appended.clear()
        self._used = self._dead = self._written = 0
        self._planned = None

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more entries now, and for the compaction's buffer when one is wanted (call outside
        the producer stream: see the module docstring)."""
        needed = self._used + extra + 1  # (+1: the -1 in the buffer's last entry, a chain head's predecessor)
        plan = self._plan
        if plan is None or plan.capacity < needed:
            capacity = max(needed, 2 * (plan.capacity if plan is not None else 0), MIN_SWEEP_PLAN)
            grown = self._allocate(capacity)
            n = self._written
            if plan is not None and n:
                grown.verify_slot_indices[:n].copy_(plan.verify_slot_indices[:n])
                grown.verify_prev_slot_indices[:n].copy_(plan.verify_prev_slot_indices[:n])
                grown.verify_expected_positions[:n].copy_(plan.verify_expected_positions[:n])
            self._plan, self._spare = grown, None
            self._planned = None
        if self._spare is None and self.wants_compaction():
            self._spare = self._allocate(self._plan.capacity)

    def _allocate(self, capacity: int) -> VerifyPlan:
        plan = allocate_sweep_plan(capacity, self.device)
        plan.verify_slot_indices[capacity - 1:].fill_(-1)  # (never verified: a plan holds fewer entries)
        return plan

    # ------------------------------------------------------------------------------------------ changes
    def append(self, spans: Sequence[Span]) -> None:
        """Add ``spans`` at the plan's tail (host only: written by the next :meth:`commit`); each ``after`` is held
        already or earlier in ``spans``. Raises :class:`UnplacedSpan` (nothing changed) when one is neither, and
        ``ValueError`` for a key held already or an empty span."""
        ranges = self._ranges
        batch: dict[Hashable, tuple[int, int, int]] = {}
        appended: list[int] = []
        start = self._used
        for key, slots, after in spans:
            if key in ranges or key in batch:
                raise ValueError("SweepIndex.append: a key already owns a span")
            n = slots.numel()
            if n == 0:
                raise ValueError("SweepIndex.append: an empty span")
            if after is None:
                before, first_position = -1, 0
            else:
                found = batch.get(after) or ranges.get(after)
                if found is None:
                    raise UnplacedSpan(after)
                a_start, a_length, a_position = found
                before, first_position = a_start + a_length - 1, a_position + a_length
            batch[key] = (start, n, first_position)
            appended += start, n, first_position, before
            start += n
        ranges.update(batch)
        self._appended += appended
        self._parts += [span.slots if span.slots.dtype is torch.int64 else span.slots.to(torch.int64)
                        for span in spans]
        self._used = start
        self._planned = None

    def compact(self) -> None:
        """Drop the tombstones now: the live ranges gathered into the compaction's buffer (device operations: call
        where :meth:`commit` is called; appends not committed yet are committed first)."""
        if self._appended:
            self.commit()
        ranges, live = self._ranges, self._used - self._dead
        self.reserve(0)
        if self._spare is None or self._spare.capacity != self._plan.capacity:
            self._spare = self._allocate(self._plan.capacity)
        plan, target = self._plan, self._spare
        offsets, lengths, at = [], [], 0
        for key, (start, length, first) in ranges.items():
            ranges[key] = (at, length, first)
            offsets.append(start - at)
            lengths.append(length)
            at += length
        if live:
            index = self._expand(offsets, lengths, live)
            for name in ("verify_slot_indices", "verify_prev_slot_indices", "verify_expected_positions"):
                torch.index_select(getattr(plan, name), 0, index, out=getattr(target, name)[:live])
        self._plan, self._spare = target, plan
        self._used = self._written = live
        self._dead = 0
        self._tombstones.clear()
        self._planned = None
        self.compactions += 1

    def prime(self) -> None:
        """The device operations of a compaction, once, at start-up, on scratch results: the plan allocated
        (:meth:`reserve`), both ways :meth:`_expand` builds a gather index (a scan of up to :data:`SCAN_ENTRIES`
        entries, segments beyond it) and the gather itself. Why: torch loads a kernel's code on its first launch, and in
        the H200 engine the first compaction, the first use of those kernels in the process, cost one forward ~13 ms of
        host time (2026-12-03; every later compaction ~0.1 ms). The index's entries are not touched."""
        self.reserve(0)
        source = self._plan.verify_slot_indices
        for total in (1, SCAN_ENTRIES + 1):
            # segments of one entry each, offset back to entry 0: every index entry is 0, inside any plan
            index = self._expand([-i for i in range(total)], [1] * total, total)
            torch.index_select(source, 0, index, out=torch.empty(total, dtype=torch.int64, device=self.device))

    def _expand(self, offsets: list[int], lengths: list[int], total: int) -> torch.Tensor:
        """``[offsets[s] + i for each segment s, i in range(total)]`` on the device, from one upload.

        Up to :data:`SCAN_ENTRIES` entries the upload is the entries' differences (1 inside a segment, the jump at a
        segment's first entry; built on the host by memory copies) and one ``cumsum`` on the device expands them: 2
        device operations. Beyond, the upload is the segments (2 ints each) and ``repeat_interleave`` + ``arange``
        + ``add_`` expand them (~5 operations on a GPU, but no host buffer of the expansion's size)."""
        if total <= SCAN_ENTRIES:
            deltas = _ones(total) if total <= len(_ONES) else array.array("q", [1]) * total
            at, last = 0, 0  # (the value before the first entry: 0, so its delta is its value)
            for offset, length in zip(offsets, lengths, strict=True):
                if length:
                    deltas[at] = offset + at - last
                    at += length
                    last = offset + at - 1
            host = torch.frombuffer(deltas, dtype=torch.int64) if total else torch.zeros(0, dtype=torch.int64)
            if self.device.type != "cpu":  # (pageable: staged before the call returns, as torch.tensor's below)
                host = host.to(self.device, non_blocking=True)
            return torch.cumsum(host, 0)
        meta = torch.tensor(offsets + lengths, dtype=torch.int64)
        if self.device.type != "cpu":
            meta = meta.to(self.device, non_blocking=True)
        seg_offsets, seg_lengths = meta[:len(offsets)], meta[len(offsets):]
        index = torch.repeat_interleave(seg_offsets, seg_lengths, output_size=total)
        return index.add_(torch.arange(total, dtype=torch.int64, device=self.device))

    def commit(self) -> SweepPlan:
        """Write the appended entries, set the pending tombstones and the entry count on the device; the plan to
        sweep (the same object while nothing changed: no device work then). Device work: the ``cat`` of the appended
        spans' slot tensors (none without appends), and one ``canary_sweep_plan_update`` launch (more only for
        a commit of over :data:`MAX_SPANS` spans or :data:`MAX_TOMBSTONES` tombstone ranges)."""
        planned = self._planned
        if planned is not None and not self._tombstones and not self._appended:
            return planned
        self.reserve(0)
        plan = self._plan
        parts = self._parts
        # One cat, also of a single span: the kernel reads one contiguous tensor the index owns (a span's own may be a
        # strided view), and the adapter's stream test sees every node value the commit reads go through it.
        new_slots = torch.cat(parts) if parts else self._no_slots
        self._write(plan, new_slots, self._appended, self._tombstones)
        self._tombstones.clear()
        self._appended.clear()
        parts.clear()
        self._written = self._used
        planned = self._planned = SweepPlan(plan, self._dead)
        return planned

    def _write(self, plan: VerifyPlan, new_slots: torch.Tensor, appended: list[int], tombstones: list[int]) -> None:
        """The pending changes by ``canary_sweep_plan_update`` (csrc/canary_sweep_plan.cuh): per launch, its
        metadata packed into the ring's next staging (the header, the spans, the tombstone ranges), one call, and the
        staging handed back to the ring (which records an event after every EVENT_EVERY-th launch). A commit over
        the block's bound takes several launches in the order of :data:`MAX_SPANS`' comment."""
        span_values = MAX_SPANS * layout.SWEEP_PLAN_SPAN_FIELDS
        tombstone_values = MAX_TOMBSTONES * layout.SWEEP_PLAN_TOMBSTONE_FIELDS
        base, used = self._written, self._used
        s = t = 0
        while True:
            spans = appended[s:s + span_values]
            s += len(spans)
            # tombstones only with (or after) the last chunk of spans
            ranges = tombstones[t:t + tombstone_values] if s == len(appended) else []
            t += len(ranges)
            values = layout.SWEEP_PLAN_META_HEADER_FIELDS + len(spans) + len(ranges)
            staging = self._staging.acquire(values)
            _pack_into(f"{values}q", staging.view, 0, len(spans) // layout.SWEEP_PLAN_SPAN_FIELDS,
                       len(ranges) // layout.SWEEP_PLAN_TOMBSTONE_FIELDS, base, used, *spans, *ranges)
            try:
                self._launch(plan.verify_slot_indices, plan.verify_prev_slot_indices, plan.verify_expected_positions,
                             plan.verify_num_valid, new_slots, staging.buffer)
            except Exception:
                # Refused before anything was written (the export checks every argument and the metadata first): the
                # keyword wrapper names the argument (or re-raises).
                canary_sweep_plan_update(verify_slot_indices=plan.verify_slot_indices,
                                         verify_prev_slot_indices=plan.verify_prev_slot_indices,
                                         verify_expected_positions=plan.verify_expected_positions,
                                         verify_num_valid=plan.verify_num_valid, new_slots=new_slots,
                                         meta=staging.buffer)
                raise
            self._staging.launched(staging)  # (after the launch that reads the staging)
            self.launches += 1
            if s == len(appended) and t == len(tombstones):
                return


__all__ = ["MAX_SPANS", "MAX_TOMBSTONES", "MIN_COMPACTION_ENTRIES", "RING_SIZE", "SCAN_ENTRIES", "Span", "SweepIndex",
           "UnplacedSpan"]
