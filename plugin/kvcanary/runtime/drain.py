"""The violation drain (SPEC §5): device status and violation rows to the host without a sync, and their reports.

The status mirror (kvcanary+). Every check launch ends by writing the finished state header to host memory
(:meth:`kvcanary.runtime.device_state.DeviceState.mirrored_header`; pinned on CUDA, written by the kernel in place).
Most drains find nothing new, and on the ``drain_every`` cadence the drain first reads the mirror: when its ring index,
epoch and lost-at-reset count equal what the last status read saw, no row can be waiting, and the mirror's counters
feed the stats and the health check with no copy, no event and no driver call (a status copy's start and read cost
~100 µs of the engine's host time per drain period from its cold caches; the mirror's read ~30). Anything else
moved, or a copy is in flight: the status copy runs as below. What the mirror cannot see yet is seen by a later
drain: a write's or a sweep's rows show in it from the next check launch on, a launch still running on the GPU from
when it finishes. Rows are only ever read and labelled from the ordered copies below. Protect mode keeps the status
copy on every drain (``use_mirror=False``): its detection window (:mod:`kvcanary.runtime.protect`) counts on a copy
ordered after the drain's own step.

Two :class:`kvcanary.runtime.pump.PinnedChannel` copies carry everything: the **status** copy (the state header: ring
index, overflows, counters, forward counter; plus the next few ring rows and their metadata) taken after step T
is read at step T+1 on CUDA (at step T when already done), at once on the CPU; a burst larger than the peek is
fetched by the **rows** copy, read one step later. With ``drain_every = N`` one status copy per N steps starts on the
step before every N-th and is read on that step when it is ready at once (CPU, idle GPU), else on the N-th
(:meth:`ViolationDrain.on_step`).

Ring epochs. The kernels only append to the ring. Once the host has read every row up to index ``I`` it
acknowledges ``I`` in the ring's epoch (:meth:`kvcanary.runtime.device_state.DeviceState.acknowledge_ring`); the next
forward's check launch reuses the ring and increments the epoch in the header: the rows appended since ``I`` move
to the front, in order (so a violation found again on every forward never keeps the ring from emptying), or, after
an overflow, the rows past ``I`` that were never stored are counted in the header's lost-at-reset field. The host
sees the new epoch in the next status copy and adds the acknowledged rows to its running total (at most one reuse
per acknowledgement; an acknowledgement of an emptied epoch is ignored). Rows a burst could not keep (index beyond
the capacity) are reported as lost.

Which forward found a violation (kvcanary+). Every row's metadata holds the device forward counter its launch
read (see :mod:`kvcanary.runtime.device_state`). Every status copy carries the counter too, and the host labels rows
with ``counter - (snapshot counter - snapshot step)``: a drift that nothing anchored (e.g. a graph captured after
``mark_init_finished``) is corrected from the next snapshot on. The writer serial of the slot becomes a request
id through the writer table (``writer_rid``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.tags import NUM_LAUNCH_TAGS, LaunchTag, is_write
from kvcanary.report.record import VIA_HOST_TIER, Violation
from kvcanary.report.reporter import Reporter
from kvcanary.runtime.device_state import STATE_HEADER, STATUS_COPY_MAX_META, DeviceState, StatusCopy, parse_header
from kvcanary.runtime.pump import PinnedChannel
from kvcanary.runtime.writers import loaded_from_host_tier

logger = logging.getLogger(__name__)

ROW_PEEK = 32  # ring rows copied with every status snapshot: the usual few violations need no second copy
MAX_STATUS_ROWS = 1024  # the status copy is the state prefix up to the peeked rows; past this, no peek
_META = layout.VIOLATION_META_FIELDS


class StatusChannel(PinnedChannel):
    """The status copy's channel (a :class:`~kvcanary.runtime.device_state.StatusCopy`, usually one copy): its header
    can be read alone. Most status reads find no new ring row, and converting the peeked rows to Python ints (hundreds
    of values) was most of a read's host time; they are converted only when a read uses them (:meth:`peeked_rows`,
    after :meth:`take_header`)."""

    def __init__(self, numel: int, device: torch.device) -> None:
        super().__init__(numel, torch.int64, device)
        self._header_views: dict[int, torch.Tensor] = {}  # by the header's offset (a slice is a torch op: built once)

    def start_status(self, copy: StatusCopy, *, step: int, first: int, peek_end: int) -> None:
        """Start ``copy``, which peeks ring rows ``first..peek_end``, taken after step ``step``."""
        self.start(*copy.sources, step=step, first=first, peek_end=peek_end, state_at=copy.state_at,
                   meta_at=copy.meta_at)

    def take_header(self) -> list[int]:
        """The copied state header (call once ``ready()``); frees the channel. The peeked rows stay readable with
        :meth:`peeked_rows` until the next ``start``."""
        self.busy = False
        at = self.meta["state_at"]
        view = self._header_views.get(at)
        if view is None:
            if len(self._header_views) >= 64:
                self._header_views.clear()
            view = self._header_views[at] = self.host[at : at + STATE_HEADER]
        return view.tolist()

    def peeked_rows(self, count: int) -> tuple[list[int], list[int]]:
        """The first ``count`` peeked ring rows and their metadata rows, each flat (of the last copy, once ready)."""
        meta = self.meta
        rows_at = meta["state_at"] + STATE_HEADER + meta["first"] * layout.VIOLATION_FIELDS
        meta_at = meta["meta_at"]
        return (self.host[rows_at : rows_at + count * layout.VIOLATION_FIELDS].tolist(),
                self.host[meta_at : meta_at + count * _META].tolist())


@dataclass
class CanaryStats:
    """Host view of the device counters (as of the last drained snapshot)."""

    forwards: int = 0
    kernel_runs: tuple[int, ...] = (0,) * NUM_LAUNCH_TAGS
    slot_runs: tuple[int, ...] = (0,) * NUM_LAUNCH_TAGS
    violations_seen: int = 0  # every violation the device counted, kept or lost, over the manager's life
    sweeps: int = 0


# (host step, kernel_runs per tag) of every status read: the manager's health check
CountersObserver = Callable[[int, tuple[int, ...]], None]


class ViolationDrain:
    """Drains ``state``'s status and ring and reports what they hold.

    Args:
        state: the device state it reads (only through its drain API).
        drain_every: the status cadence in steps (1: every step).
        reporter: where violations and lost counts go (raise mode raises from :meth:`on_step` / :meth:`drain`).
        rank: attached to every violation.
        writer_id: writer serial -> request id (``None``: unknown).
        stats: updated from every status read (``sweeps`` excepted: not a device counter).
        on_counters: called with (host step, kernel_runs) after every status read.

    Public state: ``violations`` (every violation reported so far), ``acknowledged_index`` (the ring index last
    acknowledged and not yet seen emptied, or None: the next forward need not try to empty the ring) and
    ``status_reads`` (status copies read so far).
    """

    def __init__(self, state: DeviceState, *, drain_every: int, reporter: Reporter, rank: dict[str, int] | None,
                 writer_id: Callable[[int], str | None], stats: CanaryStats, on_counters: CountersObserver,
                 use_mirror: bool = True) -> None:
        self._state = state
        self._drain_every = drain_every
        # (drain_every 1 asks for a status copy after every forward: the mirror would only delay what it shows)
        self._use_mirror = use_mirror and drain_every > 1
        self._reporter = reporter
        self._rank = rank
        self._writer_id = writer_id
        self._stats = stats
        self._on_counters = on_counters
        self._capacity = capacity = state.ring_capacity
        # (both copy on the forward's stream, behind its kernels: kvcanary.runtime.pump says why not on a side stream)
        status_rows = min(capacity, MAX_STATUS_ROWS)
        carried_meta = max(ROW_PEEK * _META, min(capacity * _META, STATUS_COPY_MAX_META))  # (see status_copy)
        self._status_channel = StatusChannel(STATE_HEADER + status_rows * layout.VIOLATION_FIELDS + carried_meta,
                                             state.device)
        self._rows_channel = PinnedChannel(capacity * (layout.VIOLATION_FIELDS + _META), torch.int64, state.device)
        self.violations: list[Violation] = []
        self.acknowledged_index: int | None = None
        self.status_reads = 0
        self.mirror_reads = 0  # drains the status mirror answered (no copy)
        self._rows_requested = 0  # ring rows already asked for (all rows below this are in flight or read)
        self._lost_reported = 0
        self._epoch = 0
        self._index_base = 0  # violations counted in ring epochs already emptied
        self._lost_at_reset = 0  # the header's count of rows ring resets dropped, as last read
        self._last_index = 0
        # host step = device forward counter - _step_offset (as of the last drained snapshot)
        self._step_offset = 0
        # The step count at which on_step next has work (the cadence, or every step while a rows copy is in
        # flight): the steps before it cost the caller one integer compare (see :meth:`on_step`).
        self.next_due = 1
        # Bumped before every status or rows read: whatever this drain updates (stats, violations, the reporter's
        # totals) can only have changed when it moved (kvcanary.report.metrics need not look otherwise).
        self.reads = 0

    @property
    def uses_mirror(self) -> bool:
        """Whether the cadence's drains read the status mirror first (not in protect mode, not with drain_every 1)."""
        return self._use_mirror

    @property
    def busy(self) -> bool:
        """Whether a copy is still in flight."""
        return self._rows_channel.busy or self._status_channel.busy

    def on_step(self, steps: int) -> list[Violation]:
        """The drain of the step that made the step count ``steps``, on the ``drain_every`` cadence (a burst of rows
        in flight is read every step). Returns the violations reported now.

        A step before ``next_due`` has nothing to do here: a caller may skip the call after comparing the two."""
        if steps < self.next_due:
            return []
        every = self._drain_every
        if every > 1 and not self._rows_channel.busy:
            phase = steps % every
            if phase == every - 1:  # (a stale snapshot still unread, e.g. after a flush, is read first)
                if self._use_mirror and not self._status_channel.busy and self._read_mirror(steps):
                    return []  # nothing moved: no copy this period
                return self.drain(steps, restart=True)  # starts the snapshot the next step reads
            return self.drain(steps, restart=False) if phase == 0 else self._schedule(steps)
        return self.drain(steps)

    def drain(self, steps: int, restart: bool = True) -> list[Violation]:
        """Read whatever copies are ready; ``restart``: start the next status copy at once (at most one per call).
        ``steps``: the host step count now.

        The second pass reads what the first started when it is ready at once (CPU, idle GPU): the status snapshot
        is then read on the step that took it, and a rows copy a status read started is read with it. It starts no
        second status copy: nothing ran on the device since the first, so a second snapshot could only repeat what
        the first read said (same rows, same counters) one step later, at the price of a copy start (tens of µs of
        host time on a GPU) and a read."""
        reported: list[Violation] = []
        started = False
        try:
            for _ in range(2):
                if self._rows_channel.ready():
                    reported += self._read_rows()
                if self._status_channel.ready():
                    reported += self._read_status(steps)
                if restart and not started and not self._status_channel.busy:
                    self._start_status(steps)
                    started = True
        finally:  # (raise mode raises from a read: the cadence must still move on)
            self._schedule(steps)
        return reported

    def _schedule(self, steps: int) -> list[Violation]:
        """Set ``next_due`` after a drain at step count ``steps``: the next step while a rows copy is in flight (or
        ``drain_every`` is 1); while a status copy is in flight, the next step of the cadence (phase
        ``drain_every - 1`` or 0, where it is read); else the next step of phase ``drain_every - 1`` (a snapshot
        read on the step that took it leaves nothing for phase 0). Returns ``[]``."""
        every = self._drain_every
        if every <= 1 or self._rows_channel.busy:
            self.next_due = steps + 1
        else:
            phase = steps % every
            if phase < every - 1:
                self.next_due = steps + every - 1 - phase
            else:
                self.next_due = steps + (1 if self._status_channel.busy else every)
        return []

    def flush(self, steps: int) -> list[Violation]:
        """Synchronise and drain everything (shutdown / tests only: this blocks)."""
        self._state.synchronize()
        reported: list[Violation] = []
        for _ in range(3):
            reported += self.drain(steps)
            if not self.busy:
                break
            self._state.synchronize()
        return reported

    def _read_mirror(self, steps: int) -> bool:
        """Whether the status mirror shows nothing the last status read did not see (no new row, no ring reuse, no
        lost row); if so its counters are taken, as a status read would take them, and the cadence moves on. A
        mirror older than the last status read (its launch count behind: the GPU has not finished a launch the copy
        already saw) answers nothing new either, and feeds nothing."""
        header = parse_header(self._state.mirrored_header())
        if (header.write_index != self._last_index or header.ring_epoch != self._epoch
                or header.lost_at_reset != self._lost_at_reset):
            return False
        stats = self._stats
        if header.kernel_runs[LaunchTag.VERIFY] >= stats.kernel_runs[LaunchTag.VERIFY]:
            self.mirror_reads += 1
            self.reads += 1
            stats.kernel_runs, stats.slot_runs = header.kernel_runs, header.slot_runs
            stats.forwards = steps
            self._on_counters(steps, header.kernel_runs)
        self._schedule(steps)
        return True

    # ------------------------------------------------------------------------------------------ copies
    def _start_status(self, steps: int) -> None:
        """One copy of the state prefix: the header and the ring up to the next ROW_PEEK unread rows, plus those
        rows' metadata (none once more than MAX_STATUS_ROWS rows were read: then rows come by the rows channel, one
        step later)."""
        first = self._rows_requested
        peek_end = min(first + ROW_PEEK, self._capacity)
        if peek_end > MAX_STATUS_ROWS:
            peek_end = first = 0
        self._status_channel.start_status(self._state.status_copy(first, peek_end), step=steps, first=first,
                                          peek_end=peek_end)

    def _read_status(self, steps: int) -> list[Violation]:
        self.status_reads += 1
        self.reads += 1
        channel = self._status_channel
        step, first, peek_end = channel.step, channel.meta["first"], channel.meta["peek_end"]
        header = parse_header(channel.take_header())  # the rows it peeked are converted below, only when read
        fields = layout.VIOLATION_FIELDS
        index = header.write_index
        # The snapshot was taken after forward `step` (stream order), when the device counter read
        # header.forward: forwards the host never stepped (warm-up, capture) are the difference.
        self._step_offset = header.forward - step
        reported: list[Violation] = []
        if header.ring_epoch != self._epoch:  # the device reused the ring after our acknowledgement
            reported += self._new_epoch(header, step)
        self._last_index = index
        stats = self._stats
        stats.kernel_runs, stats.slot_runs = header.kernel_runs, header.slot_runs
        stats.violations_seen = self._index_base + index
        stats.forwards = steps
        capacity = self._capacity
        kept = min(index, capacity) if index >= 0 else capacity  # a wrapped int32 index: the ring is full
        lost_total = max(0, index - capacity) if index >= 0 else 0
        if not self._rows_channel.busy and kept > self._rows_requested:
            have = min(kept, peek_end)
            peeked: list[list[int]] = []
            metas: list[list[int]] = []
            if first == self._rows_requested and have > first:
                # (nothing started the channel since take_header)
                peek, peek_meta = channel.peeked_rows(have - first)
                peeked = [peek[i * fields : (i + 1) * fields] for i in range(have - first)]
                metas = [peek_meta[i * _META : (i + 1) * _META] for i in range(have - first)]
                self._rows_requested = have  # before reporting: raise mode must not see these rows again
            if kept > self._rows_requested:  # more rows than the peek carried: fetch them (read next step)
                self._rows_channel.start(*self._state.ring_segments(self._rows_requested, kept),
                                         step=step, lost=lost_total, offset=self._step_offset)
                self._rows_requested = kept
            if peeked:
                reported += self._report_rows(peeked, metas, step, self._step_offset, lost_total)
        elif not self._rows_channel.busy and lost_total > self._lost_reported:
            reported += self._report_rows([], [], step, self._step_offset, lost_total)
        self._acknowledge_drained_rows()
        self._on_counters(steps, header.kernel_runs)
        return reported

    def _new_epoch(self, header, step: int) -> list[Violation]:
        """The device reused the ring after an acknowledgement (at most one reuse per acknowledgement;
        csrc/canary_check.cuh), the one at ``header.reused_at`` (this drain may have acknowledged a later index of
        the old epoch since, too late for that launch): the rows appended since moved to the front, in order, so the
        ones this drain already read past that index are the new epoch's first rows; or, when the reuse dropped the
        rows past it (never stored: the ring had overflowed), they are lost, less those already reported lost.
        Reports the newly lost rows; returns no violation."""
        acked = header.reused_at
        dropped = header.lost_at_reset - self._lost_at_reset
        self._lost_at_reset = header.lost_at_reset
        read_past = max(0, self._rows_requested - acked)  # rows of the old epoch past the acknowledgement, read
        lost_past = max(0, self._lost_reported - max(0, acked - self._capacity))  # ... reported lost
        self._index_base += acked + dropped
        self._epoch = header.ring_epoch
        self._rows_requested = 0 if dropped else read_past
        self._lost_reported = 0
        self.acknowledged_index = None
        newly_lost = dropped - lost_past
        if newly_lost <= 0:
            return []
        self._reporter.report([], lost=newly_lost, step=step)
        return []

    def _read_rows(self) -> list[Violation]:
        self.reads += 1
        channel = self._rows_channel
        step, lost_total, offset = channel.step, channel.meta["lost"], channel.meta["offset"]
        flat, flat_meta = channel.take_segments()
        fields = layout.VIOLATION_FIELDS
        rows = [flat[i : i + fields] for i in range(0, len(flat), fields)]
        metas = [flat_meta[i : i + _META] for i in range(0, len(flat_meta), _META)]
        reported = self._report_rows(rows, metas, step, offset, lost_total)
        self._acknowledge_drained_rows()
        return reported

    # ------------------------------------------------------------------------------------------ acknowledgement
    def _acknowledge_drained_rows(self) -> None:
        """Acknowledge every row up to the last seen index once all of them were read or counted lost (so the next
        forward may empty the ring); once per index."""
        index = self._last_index
        if index <= 0 or self._rows_channel.busy or index == self.acknowledged_index:
            return
        capacity = self._capacity
        if self._rows_requested < min(index, capacity) or self._lost_reported < max(0, index - capacity):
            return
        self._state.acknowledge_ring(index, self._epoch)
        self.acknowledged_index = index

    # ------------------------------------------------------------------------------------------ reports
    def _violation(self, row: list[int], meta: list[int], snapshot_step: int, offset: int) -> Violation:
        """A ring row and its metadata row as a Violation: device forward counter values become host steps."""
        unknown = layout.META_UNKNOWN
        found = meta[layout.VIOLATION_META_COL_STEP]
        request_row = meta[layout.VIOLATION_META_COL_REQUEST_ROW]
        written = meta[layout.VIOLATION_META_COL_WRITTEN_STEP]
        written_step = written - offset if written != unknown and written - offset > 0 else None  # <= 0: warm-up
        serial = meta[layout.VIOLATION_META_COL_WRITER_SERIAL]
        return Violation.from_row(
            row,
            step=found - offset if found != unknown else snapshot_step,
            rank=self._rank,
            request_row=None if request_row == unknown else request_row,
            written_step=written_step,
            writer_rid=self._writer_id(serial),
            # (a write row's slot attribution is the content being overwritten: where that came from says nothing
            # about the token or position being written)
            via=VIA_HOST_TIER if loaded_from_host_tier(serial) and not is_write(row[layout.VIOLATION_COL_KERNEL_KIND])
            else None,
        )

    def _report_rows(self, rows: list[list[int]], metas: list[list[int]], step: int, offset: int,
                     lost_total: int) -> list[Violation]:
        """Record and report rows already marked as read (so a raise never repeats them)."""
        lost = max(0, lost_total - self._lost_reported)
        self._lost_reported = max(self._lost_reported, lost_total)
        violations = [self._violation(r, m, step, offset) for r, m in zip(rows, metas, strict=True)]
        self.violations.extend(violations)
        try:
            self._reporter.report(violations, lost=lost, step=step)
        finally:
            self._acknowledge_drained_rows()
        return violations
