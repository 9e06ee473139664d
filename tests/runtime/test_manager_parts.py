"""The manager's parts on their own (CPU): the state header, the drain's epoch / acknowledgement protocol driven by
hand-written device state, the writer table, the sweep cadence and the token table. The manager-level tests
(test_manager.py, test_manager_attribution.py) stay the contract; these pin each part's public API."""

from __future__ import annotations

import pytest
import torch

from kvcanary.kernels import check_ref, layout
from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.tags import NUM_LAUNCH_TAGS, LaunchTag
from kvcanary.report import Reporter
from kvcanary.runtime import writers
from kvcanary.runtime.config import Config
from kvcanary.runtime.device_state import (
    STATE_FORWARD,
    STATE_HEADER,
    STATE_KERNEL_RUNS,
    STATE_RING_EPOCH,
    STATE_WRITE_INDEX,
    DeviceState,
    parse_header,
)
from kvcanary.runtime.drain import ROW_PEEK, CanaryStats, ViolationDrain
from kvcanary.runtime.manager import CanaryManager
from kvcanary.runtime.sweep import Sweeper
from kvcanary.runtime.token_table import TokenTable
from kvcanary.runtime.writers import WriterTable
from kvcanary.settings import Mode

CPU = torch.device("cpu")


def device_state(ring_capacity: int = 8) -> DeviceState:
    return DeviceState(
        num_slots=64, req_to_token=torch.zeros((4, 16), dtype=torch.int32), device=CPU, max_batch_size=4,
        max_tokens_per_forward=16, ring_capacity=ring_capacity, real_kv_sources=(),
        real_kv_mode=layout.REAL_KV_HASH_MODE_NONE, swa_window_size=0, kv_token_id_vs_position_offset=0,
        full_to_swa_index_mapping=None, token_table=None,
    )


# ---------------------------------------------------------------------------------------------- state header


def test_parse_header_reads_the_int32_write_index_from_the_low_half() -> None:
    values = list(range(100, 100 + STATE_HEADER))
    values[STATE_WRITE_INDEX] = (7 << 32) | 0xFFFFFFFF  # high half: not the index's; low half: int32 -1
    header = parse_header(values)
    assert header.write_index == -1
    values[STATE_WRITE_INDEX] = (3 << 32) | 5
    header = parse_header(values)
    assert header.write_index == 5
    assert header.kernel_runs == tuple(values[STATE_KERNEL_RUNS : STATE_KERNEL_RUNS + NUM_LAUNCH_TAGS])
    assert (header.ring_epoch, header.forward) == (values[STATE_RING_EPOCH], values[STATE_FORWARD])


def test_state_views_share_the_flat_buffer() -> None:
    state = device_state()
    state.violation_write_index.fill_(3)
    state.kernel_run_counters[LaunchTag.WRITE] = 9
    state.violation_ring[1, 0] = 42
    header = parse_header(state.state.tolist())
    assert (header.write_index, header.kernel_runs[LaunchTag.WRITE]) == (3, 9)
    state.violation_meta[1, 0] = 77
    copy = state.status_copy(0, 2)
    (flat,) = copy.sources  # one copy: the metadata table sits right before the state
    assert flat.numel() == copy.state_at + STATE_HEADER + 2 * layout.VIOLATION_FIELDS
    assert int(flat[copy.state_at + STATE_HEADER + layout.VIOLATION_FIELDS]) == 42
    assert int(flat[copy.meta_at + layout.VIOLATION_META_FIELDS]) == 77


# ---------------------------------------------------------------------------------------------- drain


class HandDrain:
    """A ViolationDrain over a CPU DeviceState whose ring the test writes by hand (as the kernels would)."""

    def __init__(self, ring_capacity: int = 8, drain_every: int = 1, *, use_mirror: bool = False) -> None:
        """``use_mirror``: the drain reads the status mirror first (the runtime's default); the mirror then shows
        the hand-written state only after :meth:`publish` (what a check launch's end does)."""
        self.state = device_state(ring_capacity)
        self.reporter = Reporter(Mode.LOG)
        self.stats = CanaryStats()
        self.counters: list[tuple[int, tuple[int, ...]]] = []
        self.drain = ViolationDrain(self.state, drain_every=drain_every, reporter=self.reporter, rank=None,
                                    writer_id={7: "rid-7"}.get, stats=self.stats,
                                    on_counters=lambda step, runs: self.counters.append((step, runs)),
                                    use_mirror=use_mirror)
        self.index = 0

    def append(self, slot: int, *, found_at: int, serial: int = 0) -> None:
        """One verify row for ``slot``, found by the launch that read forward counter ``found_at``, at the device's
        write index (a check launch may have reused the ring since)."""
        i = self.index = int(self.state.violation_write_index[0])
        if i < self.state.ring_capacity:
            row = [0] * layout.VIOLATION_FIELDS
            row[layout.VIOLATION_COL_KERNEL_KIND] = int(LaunchTag.VERIFY)
            row[layout.VIOLATION_COL_SLOT] = slot
            row[layout.VIOLATION_COL_FAIL_REASON_BITS] = int(layout.FailReason.VERIFY_CHAIN_HASH)
            self.state.violation_ring[i] = torch.tensor(row)
            meta = [found_at, 1, layout.META_UNKNOWN, serial]
            self.state.violation_meta[i] = torch.tensor(meta)
        self.index += 1
        self.state.violation_write_index.fill_(self.index)

    def publish(self) -> None:
        """The status mirror gets the header as it is now (a check launch's last block)."""
        self.state.status_mirror.copy_(self.state.state[: layout.STATE_HEADER_FIELDS])

    def empty_ring(self) -> None:
        """What the next forward's check launch does after an acknowledgement (nothing appended since): index back
        to 0, one more epoch (the reference's drained-ring reuse, csrc/canary_check.cuh)."""
        epoch = int(self.state.state[STATE_RING_EPOCH])
        check_ref.reuse_drained_ring(self.state.state, self.state.violation_meta)
        assert int(self.state.state[STATE_RING_EPOCH]) == epoch + 1, "no acknowledgement to reuse the ring with"
        self.index = 0


def test_drain_reports_rows_once_with_host_steps_and_writer_ids() -> None:
    h = HandDrain()
    h.state.forward_counter.fill_(12)  # the device counter ran 2 ahead of the host (warm-up forwards)
    h.append(5, found_at=11, serial=7)
    h.append(6, found_at=12)
    got = h.drain.drain(steps=10)
    assert [(v.slot, v.step, v.writer_rid) for v in got] == [(5, 9, "rid-7"), (6, 10, None)]
    assert h.drain.drain(steps=10) == [] and len(h.drain.violations) == 2  # never twice
    assert h.drain.acknowledged_index == 2 and h.stats.violations_seen == 2
    assert h.counters and h.counters[-1][0] == 10 and h.drain.status_reads >= 2


def test_drain_epochs_keep_a_lifetime_count_across_ring_reuse() -> None:
    h = HandDrain(ring_capacity=4)
    for k in range(3):  # three bursts of 3 rows, each in a ring the device emptied after the acknowledgement
        for j in range(3):
            h.append(10 * k + j, found_at=k + 1)
        h.drain.drain(steps=k + 1)
        assert h.drain.acknowledged_index == 3
        h.empty_ring()
        h.drain.drain(steps=k + 1)  # sees the new epoch: the acknowledged rows join the running total
        assert h.drain.acknowledged_index is None
    assert [v.slot for v in h.drain.violations] == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    assert h.stats.violations_seen == 9 and h.reporter.total_lost == 0


def test_drain_counts_rows_beyond_the_ring_as_lost_and_acknowledges_only_then() -> None:
    h = HandDrain(ring_capacity=4)
    for j in range(6):
        h.append(j, found_at=1)
    h.drain.drain(steps=1)
    assert [v.slot for v in h.drain.violations] == [0, 1, 2, 3]
    assert h.reporter.total_lost == 2 and h.stats.violations_seen == 6
    assert h.drain.acknowledged_index == 6


def test_drain_fetches_a_burst_beyond_the_peek_through_the_rows_copy() -> None:
    h = HandDrain(ring_capacity=ROW_PEEK + 10)
    for j in range(ROW_PEEK + 5):
        h.append(j, found_at=1)
    first = h.drain.drain(steps=1)
    assert len(first) == ROW_PEEK  # the status copy's peek; the rest is in flight on the rows copy
    h.drain.flush(steps=1)
    assert [v.slot for v in h.drain.violations] == list(range(ROW_PEEK + 5))
    assert h.drain.acknowledged_index == ROW_PEEK + 5


class CopyLog:
    """Counts the status copies a HandDrain starts and the steps that read one; ``ready_next_step``: a copy is
    ready one step after it started (a GPU still running the forward), not at once (the CPU, an idle GPU)."""

    def __init__(self, h: HandDrain, *, ready_next_step: bool = False) -> None:
        self.step = 0
        self.starts: list[int] = []
        self.reads: list[int] = []
        self._started_at = 0
        channel = h.drain._status_channel  # noqa: SLF001 - the test counts the copies of the drain's own channel
        start, ready = channel.start, channel.ready

        def counted_start(*args, **kwargs):
            self.starts.append(self.step)
            self._started_at = self.step
            return start(*args, **kwargs)

        def delayed_ready() -> bool:
            return ready() and not (ready_next_step and self._started_at == self.step)

        channel.start = counted_start  # type: ignore[method-assign]
        channel.ready = delayed_ready  # type: ignore[method-assign]
        self.h = h

    def run(self, steps: range) -> None:
        for step in steps:
            self.step = step
            before = self.h.drain.status_reads
            self.h.drain.on_step(step)
            self.reads += [step] * (self.h.drain.status_reads - before)


@pytest.mark.parametrize("every", [1, 4])
def test_drain_cadence_starts_one_status_copy_per_period_and_reads_it_at_once_when_ready(every: int) -> None:
    """CPU (an idle GPU alike): the copy started on the last step of a period is ready at once and read on that
    step; no second copy follows it (it would read the same device state again one step later)."""
    log = CopyLog(HandDrain(drain_every=every))
    log.run(range(1, 13))
    expected = list(range(1, 13)) if every == 1 else [3, 7, 11]
    assert log.starts == expected and log.reads == expected


@pytest.mark.parametrize("every", [1, 4])
def test_drain_cadence_reads_a_copy_that_is_not_ready_at_once_on_the_next_step(every: int) -> None:
    """A busy GPU: the copy started on the last step of a period is read on the next one (phase 0), still one copy
    per period; with ``drain_every`` 1, each step reads the previous step's copy and starts the next."""
    log = CopyLog(HandDrain(drain_every=every), ready_next_step=True)
    log.run(range(1, 13))
    assert log.starts == (list(range(1, 13)) if every == 1 else [3, 7, 11])
    assert log.reads == (list(range(2, 13)) if every == 1 else [4, 8, 12])


def test_drain_cadence_reports_each_violation_at_the_first_read_after_it() -> None:
    """One copy per period loses nothing and delays nothing: a row the device appended before step ``s`` is
    reported on the first step >= s of phase ``drain_every - 1``."""
    h = HandDrain(ring_capacity=32, drain_every=4)
    log = CopyLog(h)
    reported_at: dict[int, int] = {}
    for step in range(1, 13):
        h.append(step, found_at=step)
        log.run(range(step, step + 1))
        for v in h.drain.violations:
            reported_at.setdefault(v.slot, step)
    assert reported_at == {s: s + (3 - s % 4) % 4 for s in range(1, 12)}


def _launch(h: HandDrain, *, rows: tuple[int, ...] = (), step: int = 0, publish: bool = True) -> None:
    """Forward ``step``'s check launch by hand: the forward counter, its rows, kernel_runs[VERIFY] + 1, and
    (``publish``) the status mirror at its end."""
    h.state.forward_counter.fill_(step)
    for slot in rows:
        h.append(slot, found_at=step)
    h.state.kernel_run_counters[LaunchTag.VERIFY] += 1
    if publish:
        h.publish()


def test_drain_with_the_mirror_copies_nothing_while_nothing_moves() -> None:
    """The cadence's drains read the status mirror: no new row, so no status copy at all (each costs ~100 µs of the
    engine's host time per period), and the mirror's counters feed the stats and the health check as a status read
    would, on the same steps."""
    h = HandDrain(drain_every=4, use_mirror=True)
    log = CopyLog(h)
    for step in range(1, 13):
        _launch(h, step=step)
        log.run(range(step, step + 1))
    assert log.starts == [] and h.drain.status_reads == 0 and h.drain.mirror_reads == 3
    assert [(step, runs[LaunchTag.VERIFY]) for step, runs in h.counters] == [(3, 3), (7, 7), (11, 11)]
    assert h.stats.kernel_runs[LaunchTag.VERIFY] == 11 and h.drain.reads == 3  # (metrics are fed when reads move)


def test_drain_with_the_mirror_reports_a_published_row_when_the_status_copy_would() -> None:
    """A row the mirror shows starts the status copy on the same step the cadence would have (ready at once on the
    CPU: read on that step), so reporting is not delayed; quiet periods copy nothing."""
    h = HandDrain(ring_capacity=32, drain_every=4, use_mirror=True)
    log = CopyLog(h)
    reported_at: dict[int, int] = {}
    for step in range(1, 13):
        _launch(h, rows=(step,) if step in (2, 9) else (), step=step)
        log.run(range(step, step + 1))
        for v in h.drain.violations:
            reported_at.setdefault(v.slot, step)
    assert reported_at == {2: 3, 9: 11}
    assert log.starts == [3, 11] and h.drain.mirror_reads == 1


def test_drain_with_the_mirror_sees_unpublished_rows_from_the_next_check_launch_on() -> None:
    """Rows a later launch appended (a write, a sweep) are in the mirror only once a check launch publishes it: the
    drain reports them at the first cadence step after that, never loses them, and labels them with the forward
    their launch read."""
    h = HandDrain(ring_capacity=32, drain_every=4, use_mirror=True)
    for step in range(1, 4):
        _launch(h, step=step)
    h.append(40, found_at=3)  # the write after forward 3 (no check launch publishes it yet)
    assert h.drain.on_step(3) == [] and h.drain.violations == []
    for step in range(4, 8):
        _launch(h, step=step)  # forward 4's check publishes the row
        h.drain.on_step(step)
    assert [(v.slot, v.step) for v in h.drain.violations] == [(40, 3)]


def test_drain_with_the_mirror_follows_a_ring_reuse() -> None:
    """After the host's acknowledgement a check launch empties the ring (a new epoch, index 0): the mirror differs
    from the last status read, so one status copy takes the new epoch; then quiet periods copy nothing again."""
    h = HandDrain(ring_capacity=8, drain_every=4, use_mirror=True)
    log = CopyLog(h)
    _launch(h, rows=(5,), step=1)
    log.run(range(3, 4))
    assert [v.slot for v in h.drain.violations] == [5] and h.drain.acknowledged_index == 1
    h.empty_ring()  # the next check launch: reuse, then its end publishes
    _launch(h, step=4)
    log.run(range(4, 16))
    assert log.starts == [3, 7] and h.drain.acknowledged_index is None
    assert h.stats.violations_seen == 1 and h.reporter.total_lost == 0


def test_drain_with_the_mirror_ignores_a_mirror_older_than_the_last_status_read() -> None:
    """The GPU has not finished a launch the last status copy already saw: that mirror shows nothing new, and its
    older counters must not move the stats (or the health check's baseline) backwards."""
    h = HandDrain(ring_capacity=8, drain_every=4, use_mirror=True)
    _launch(h, rows=(5,), step=1)
    h.drain.on_step(3)  # a status read: kernel_runs[VERIFY] 1
    h.state.status_mirror[layout.STATE_KERNEL_RUNS + LaunchTag.VERIFY] = 0  # an older launch's mirror
    observed = len(h.counters)
    h.drain.on_step(7)
    assert h.stats.kernel_runs[LaunchTag.VERIFY] == 1 and len(h.counters) == observed
    assert h.drain.next_due == 11  # the cadence moves on all the same


def test_protect_and_drain_every_one_keep_a_status_copy_per_drain() -> None:
    """Protect mode's detection window counts on a copy ordered after the drain's step; ``drain_every`` 1 asks for
    a copy after every forward: neither reads the mirror."""
    config = Config(mode=Mode.PROTECT, drain_every=4)
    manager = CanaryManager(config, num_slots=64, req_to_token=torch.zeros((4, 16), dtype=torch.int32), device=CPU,
                            max_batch_size=4, max_tokens_per_forward=16)
    assert not manager.violation_drain.uses_mirror
    assert not HandDrain(drain_every=1, use_mirror=True).drain.uses_mirror
    assert HandDrain(drain_every=4, use_mirror=True).drain.uses_mirror


@pytest.mark.parametrize("every", [1, 4])
def test_drain_next_due_is_the_next_step_with_work(every: int) -> None:
    """``next_due`` (what the manager compares before calling on_step) is the next cadence step, or the next step
    while a rows copy is in flight; a step before it would have done nothing."""
    h = HandDrain(ring_capacity=ROW_PEEK + 10, drain_every=every)
    skipped_quiet = []
    for step in range(1, 14):
        if step == 5:
            for j in range(ROW_PEEK + 5):  # a burst beyond the peek: the rows copy follows the status read
                h.append(j, found_at=step)
        due = step >= h.drain.next_due
        before = (h.drain.status_reads, h.drain.reads, h.drain.busy, len(h.drain.violations))
        h.drain.on_step(step)
        after = (h.drain.status_reads, h.drain.reads, h.drain.busy, len(h.drain.violations))
        if not due:
            skipped_quiet.append(before == after)
        assert h.drain.next_due > step
        if every > 1:  # the next step (rows in flight, or phase 0 next), else the next phase every - 1
            assert h.drain.next_due == step + 1 or h.drain.next_due % every == every - 1
    assert all(skipped_quiet) and (every == 1) == (not skipped_quiet)
    assert [v.slot for v in h.drain.violations] == list(range(ROW_PEEK + 5))
    assert h.drain.reads >= h.drain.status_reads > 0


def test_status_read_converts_the_peeked_rows_only_when_there_are_new_ones() -> None:
    h = HandDrain()
    channel = h.drain._status_channel  # noqa: SLF001 - the test counts the conversions of its copy
    converted = []
    peeked_rows = channel.peeked_rows
    channel.peeked_rows = lambda n: converted.append(1) or peeked_rows(n)  # type: ignore[method-assign]
    h.drain.drain(steps=1)
    assert converted == [] and h.drain.status_reads >= 1  # a clean read: the header alone
    h.append(5, found_at=2)
    got = h.drain.drain(steps=2)
    assert [v.slot for v in got] == [5] and converted == [1]


def test_status_copy_is_one_copy_while_the_metadata_it_carries_is_small() -> None:
    """A copy start is ~10 us of host time on a GPU host: the status copy is one copy (metadata rows first.., the
    header, the peeked ring rows: adjacent in memory) unless the metadata after the first peeked row is large."""
    from kvcanary.runtime.device_state import STATUS_COPY_MAX_META

    assert len(device_state(1024).status_copy(0, ROW_PEEK).sources) == 1  # the default ring
    big = device_state(4096)
    assert len(big.status_copy(0, ROW_PEEK).sources) == 2
    first = 4096 - STATUS_COPY_MAX_META // layout.VIOLATION_META_FIELDS
    assert len(big.status_copy(first, first + ROW_PEEK).sources) == 1


@pytest.mark.parametrize("capacity", [8, 2100])
def test_drain_reports_rows_and_metadata_through_one_or_two_copy_status_layouts(capacity: int) -> None:
    """Ring 2100: the status copy starts as two copies (8400 metadata elements after row 0) and becomes one once
    the rows read pass row 52; every row keeps its own metadata (step, writer) either way."""
    h = HandDrain(ring_capacity=capacity)
    h.state.forward_counter.fill_(1000)  # the device counter equals the host's steps: rows keep their found_at
    expected = []
    for burst in range(3):
        for j in range(min(40, capacity - 1) if burst == 0 else 3):
            slot = 100 * burst + j
            h.append(slot, found_at=slot + 1, serial=7 if j % 2 else 0)
            expected.append((slot, slot + 1, "rid-7" if j % 2 else None))
        h.drain.flush(steps=1000)
        if capacity == 8 and burst == 0:
            h.empty_ring()
            h.drain.flush(steps=1000)
    got = [(v.slot, v.step, v.writer_rid) for v in h.drain.violations]
    assert got == expected and h.reporter.total_lost == 0


def test_manager_step_calls_the_drain_only_when_due() -> None:
    from one_request import OneRequest

    eng = OneRequest(Mode.LOG, drain_every=8)
    drain = eng.mgr.violation_drain
    called = []
    on_step = drain.on_step
    drain.on_step = lambda steps: called.append(steps) or on_step(steps)  # type: ignore[method-assign]
    for _ in range(17):
        eng.forward(1)
    # the first step, then each period's last step (on the CPU its copy is read at once: nothing left for phase 0)
    assert called == [1, 7, 15]
    assert eng.mgr.stats.forwards == 15


def test_acknowledged_ring_is_reused_by_the_next_forward() -> None:
    """The device half of the protocol: after the host's acknowledgement the check launch reuses the ring, keeping
    the rows appended since (moved to the front, in order), and the host reads every row exactly once. Before
    2026-12-02 the ring was emptied only when nothing had been appended since, and a violation found again on every
    forward kept it from ever emptying (the H200's phase 15 lost 1,643 rows)."""
    h = HandDrain()
    h.append(5, found_at=0)
    h.drain.drain(steps=0)
    assert h.drain.acknowledged_index == 1
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = BatchView(ForwardKind.DECODE, t([1]), t([0]), t([1]), t([1]), t([0]), t([1]))
    h.append(6, found_at=0)  # appended after the acknowledgement: kept, as the new epoch's row 0
    h.state.check_batch(batch, 1, 1)
    header = parse_header(h.state.state.tolist())
    assert (header.write_index, header.ring_epoch, header.lost_at_reset) == (1, 1, 0)
    assert int(h.state.violation_ring[0, layout.VIOLATION_COL_SLOT]) == 6
    for steps in (1, 2):  # the new epoch's status, then its row
        h.drain.drain(steps=steps)
    assert [v.slot for v in h.drain.violations] == [5, 6]
    assert h.drain.acknowledged_index == 1 and h.reporter.total_lost == 0
    h.state.check_batch(batch, 1, 3)
    header = parse_header(h.state.state.tolist())
    assert (header.write_index, header.ring_epoch, header.forward) == (0, 2, 3)


def test_a_violation_repeated_on_every_forward_never_fills_the_ring() -> None:
    """A corrupted slot a running request reads on every forward appends a row per forward: with the drain
    reading every few forwards, the ring keeps being reused and nothing is lost, far past its capacity."""
    h = HandDrain()
    capacity = h.state.ring_capacity
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = BatchView(ForwardKind.DECODE, t([1]), t([0]), t([1]), t([1]), t([0]), t([1]))
    forwards = 3 * capacity
    for step in range(1, forwards + 1):
        h.state.check_batch(batch, 1, step)  # the reuse, at the launch's start
        if step % 3 == 0:  # the host reads (and acknowledges) a snapshot ...
            h.drain.drain(steps=step)
        h.append(7, found_at=step)  # ... and the device finds the slot again before the next check sees the ack
    h.drain.flush(forwards)
    assert h.reporter.total_lost == 0
    assert len(h.drain.violations) == forwards and {v.slot for v in h.drain.violations} == {7}


@pytest.mark.parametrize("seen_before_reuse", [False, True])
def test_rows_past_an_overflowed_ring_are_counted_lost_once(seen_before_reuse: bool) -> None:
    """After an overflow the host reads every stored row, counts the rest lost and acknowledges the index; the next
    check launch empties the ring and counts the rows appended since (never stored) in the header, and the host
    reports exactly those it had not already reported lost: every row appended is read or counted lost, once."""
    h = HandDrain(ring_capacity=8)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = BatchView(ForwardKind.DECODE, t([1]), t([0]), t([1]), t([1]), t([0]), t([1]))
    for _ in range(10):
        h.append(5, found_at=0)
    h.drain.drain(steps=0)  # 8 rows read, 2 lost, index 10 acknowledged
    assert (len(h.drain.violations), h.reporter.total_lost, h.drain.acknowledged_index) == (8, 2, 10)
    for _ in range(3):
        h.append(6, found_at=0)  # never stored
        if seen_before_reuse:
            h.drain.drain(steps=0)  # a later snapshot of the same epoch: reported lost already
    h.state.check_batch(batch, 1, 1)
    header = parse_header(h.state.state.tolist())
    # (seen: the host counted them lost and acknowledged the later index, so the launch drops nothing it did not)
    assert (header.write_index, header.ring_epoch, header.lost_at_reset) == (0, 1, 0 if seen_before_reuse else 3)
    h.append(7, found_at=1)
    for steps in (1, 2):
        h.drain.drain(steps=steps)
    assert h.reporter.total_lost == 5  # 2 + 3: every row appended past the capacity, once
    assert [v.slot for v in h.drain.violations] == [5] * 8 + [7]
    assert h.stats.violations_seen == 14


def test_a_snapshot_older_than_the_reuse_counts_no_row_twice() -> None:
    """The GPU's order: the host acknowledges index 10 (of an overflowed 8-row ring), the device appends 2 more
    rows (never stored), the next check launch reuses the ring with that acknowledgement (2 rows counted in the
    header), and only then does the host read a snapshot taken before the launch (index 12: it reports the 2 lost
    and acknowledges 12 in the old epoch, which the device ignores). The new epoch's status must not report those 2
    again."""
    h = HandDrain(ring_capacity=8)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = BatchView(ForwardKind.DECODE, t([1]), t([0]), t([1]), t([1]), t([0]), t([1]))
    for _ in range(10):
        h.append(5, found_at=0)
    h.drain.drain(steps=0)
    assert (h.reporter.total_lost, h.drain.acknowledged_index) == (2, 10)
    for _ in range(2):
        h.append(6, found_at=0)
    before = h.state.state.clone()  # the snapshot the host reads late
    h.state.check_batch(batch, 1, 1)
    after = h.state.state.clone()
    assert parse_header(after.tolist()).lost_at_reset == 2
    h.state.state.copy_(before)
    h.drain.drain(steps=1)  # reads the old epoch at index 12: 2 more lost, acknowledges 12 (stale by now)
    assert (h.reporter.total_lost, h.drain.acknowledged_index) == (4, 12)
    h.state.state.copy_(after)  # (the device's state: the stale acknowledgement changed nothing there)
    for steps in (2, 3):
        h.drain.drain(steps=steps)
    assert h.reporter.total_lost == 4 and h.stats.violations_seen == 12
    assert len(h.drain.violations) == 8


# ---------------------------------------------------------------------------------------------- writers


def test_writer_table_hands_out_serials_per_new_request(monkeypatch: pytest.MonkeyPatch) -> None:
    table = WriterTable(rows=4)
    assert table.assign([1, 2], ["a", "b"]) == ([1, 2], [1, 2])
    assert table.assign([1, 2], ["a", "b"]) == ([], [])  # same requests: nothing to upload
    assert table.assign([2], [99]) == ([2], [3])
    assert (table.writer_id(3), table.writer_id(2), table.writer_id(0), table.writer_id(-1)) == ("99", "b", None, None)
    with pytest.raises(ValueError, match=r"^CanaryManager.assign_requests: row 4 outside \[0, 4\)$"):
        table.assign([4], ["x"])
    monkeypatch.setattr(writers, "MAX_WRITER_IDS", 2)
    table.assign([3], ["c"])
    assert table.writer_id(1) is None and table.writer_id(4) == "c"  # the oldest dropped


# ---------------------------------------------------------------------------------------------- sweep


def test_sweeper_cadence_and_arguments() -> None:
    sweeper = Sweeper(device_state(), interval=3)
    assert not any(sweeper.due(s) for s in range(1, 10))  # no source
    sweeper.source = lambda: ([], [], [])
    assert [s for s in range(1, 10) if sweeper.due(s)] == [3, 6, 9]
    assert not Sweeper(device_state(), interval=0).due(0)
    with pytest.raises(ValueError, match="lengths differ: 2/1/2"):
        sweeper.run([1, 2], [-1], [0, 1])


def test_sweeper_copies_new_entries_and_reuses_its_plan_for_the_very_same_tensors() -> None:
    """The very tensors of the last sweep are not copied again (a source hands them back while its cache has not
    changed); other tensors or lists are, and the plan's count follows them. The plan never expects tokens."""
    state = device_state()
    seen: list[tuple[list[int], list[int], list[int], int, int, list[int]]] = []

    def launched(plan) -> None:
        n = int(plan.verify_num_valid)
        seen.append((plan.verify_slot_indices[:n].tolist(), plan.verify_prev_slot_indices[:n].tolist(),
                     plan.verify_expected_positions[:n].tolist(), n, int(plan.verify_enable),
                     plan.verify_expected_tokens[:n].tolist()))

    state.sweep = launched
    sweeper = Sweeper(state, interval=1)
    slots, prevs, positions = torch.tensor([5, 6, 7]), torch.tensor([-1, 5, 6]), torch.arange(3)
    sweeper.run(slots, prevs, positions)
    slots[0] = 9  # (a source never does this: here it shows whether the second sweep copied again)
    sweeper.run(slots, prevs, positions)
    sweeper.run(slots.clone(), prevs, positions)
    sweeper.run([3], [-1], [0])
    sweeper.run(slots, prevs, positions)  # the plan holds [3] now: copied again
    none = [layout.NO_EXPECTED_TOKEN] * 3
    assert seen == [([5, 6, 7], [-1, 5, 6], [0, 1, 2], 3, 1, none), ([5, 6, 7], [-1, 5, 6], [0, 1, 2], 3, 1, none),
                    ([9, 6, 7], [-1, 5, 6], [0, 1, 2], 3, 1, none), ([3], [-1], [0], 1, 1, none[:1]),
                    ([9, 6, 7], [-1, 5, 6], [0, 1, 2], 3, 1, none)]


# ---------------------------------------------------------------------------------------------- token table


def test_token_table_long_rows_and_scatters_leave_the_same_table() -> None:
    long = list(range(1, 42))  # one update of 41 tokens, or two of 20 and 21
    whole, pieces = TokenTable(3, 64, CPU), TokenTable(3, 64, CPU)
    whole.update([(1, 0, long)])
    pieces.update([(1, 0, long[:20])])
    pieces.update([(1, 20, long[20:])])
    assert torch.equal(whole.expected_tokens, pieces.expected_tokens)
    assert int(whole.valid_lens_by_row[1]) == int(pieces.valid_lens_by_row[1]) == len(long)
    assert int(whole.expected_tokens[2, 0]) == layout.NO_EXPECTED_TOKEN
    whole.update([(2, 62, [7, 8, 9])])  # clipped at the width
    assert whole.expected_tokens[2, 62:].tolist() == [7, 8] and int(whole.valid_lens_by_row[2]) == 64
    with pytest.raises(ValueError, match="start -1 < 0"):
        whole.update([(1, -1, [1])])


# ---------------------------------------------------------------------------------------------- batch view


def test_batch_view_stays_a_frozen_dataclass_with_its_own_constructor() -> None:
    import dataclasses

    ids, rows = torch.tensor([5, 6]), torch.tensor([1], dtype=torch.int32)
    by_position = BatchView(ForwardKind.DECODE, ids, ids, ids, rows, rows, rows)
    by_name = BatchView(kind=ForwardKind.DECODE, input_ids=ids, positions=ids, out_cache_loc=ids,
                        req_pool_indices=rows, prefix_lens=rows, extend_lens=rows)
    for v in (by_position, by_name):
        assert (v.kind, v.input_ids, v.req_pool_indices, v.extend_lens) == (ForwardKind.DECODE, ids, rows, rows)
        assert (v.batch_size, v.num_tokens) == (1, 2) and v.well_formed()
        with pytest.raises(dataclasses.FrozenInstanceError):
            v.kind = ForwardKind.EXTEND  # type: ignore[misc]
    replaced = dataclasses.replace(by_name, kind=ForwardKind.EXTEND)
    assert replaced.kind is ForwardKind.EXTEND and replaced.positions is ids
    assert [f.name for f in dataclasses.fields(BatchView)] == [
        "kind", "input_ids", "positions", "out_cache_loc", "req_pool_indices", "prefix_lens", "extend_lens"]
    with pytest.raises(TypeError):
        BatchView(ForwardKind.DECODE, ids, ids, ids, rows, rows)  # type: ignore[call-arg]
