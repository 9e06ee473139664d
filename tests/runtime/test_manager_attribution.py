"""CanaryManager (CPU): every violation names the forward that found it, the request row, and who last wrote the
slot; the int32 token table; the stats cadence; BatchView errors; the health window in steps (issue 11).

Forward k is the one after which ``step()`` has been called k times. With ``KVCANARY_DRAIN_EVERY=8`` the host
reads violations only every 8 steps, yet each row keeps the number of the forward whose launch found it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.report import CanaryHealthError
from kvcanary.runtime import writers
from kvcanary.runtime.config import Config
from kvcanary.runtime.health import STATS_PREFIX
from kvcanary.runtime.manager import CanaryManager
from kvcanary.settings import Mode

NUM_SLOTS = 128
KV_BYTES = 32


def t64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class Harness:
    """A hand-driven engine: each forward names, per req_to_token row, the (position, token, slot) it writes."""

    def __init__(self, mode: Mode = Mode.LOG, **config: object) -> None:
        self.req_to_token = torch.zeros((6, 64), dtype=torch.int32)
        self.kv = torch.zeros((NUM_SLOTS, KV_BYTES), dtype=torch.uint8)
        self.lengths: dict[int, int] = {}
        cfg = Config(mode=mode, **{"drain_every": 8, "stats_every": 0, **config})  # type: ignore[arg-type]
        self.mgr = CanaryManager(cfg, num_slots=NUM_SLOTS, req_to_token=self.req_to_token, device="cpu",
                                 max_batch_size=4, max_tokens_per_forward=64,
                                 real_kv_sources=[RealKvSource(self.kv, 1, KV_BYTES, KV_BYTES)])
        self.next_slot = 1

    def batch(self, writes: dict[int, list[tuple[int, int, int]]], positions_skew: int = 0) -> BatchView:
        ids, pos, locs, rows, prefixes, extends = [], [], [], [], [], []
        for row, entries in writes.items():
            rows.append(row)
            prefixes.append(entries[0][0])
            extends.append(len(entries))
            for p, token, slot in entries:
                ids.append(token)
                pos.append(p + positions_skew)
                locs.append(slot)
        kind = ForwardKind.DECODE if all(e == 1 for e in extends) else ForwardKind.EXTEND
        return BatchView(kind, t64(ids), t64(pos), t64(locs), t64(rows), t64(prefixes), t64(extends))

    def forward(self, writes: dict[int, list[tuple[int, int, int]]], *, step: bool = True,
                positions_skew: int = 0) -> None:
        for row, entries in writes.items():
            for p, _, slot in entries:
                self.req_to_token[row, p] = slot
        batch = self.batch(writes, positions_skew)
        self.mgr.before_forward(batch)
        for row, entries in writes.items():
            for p, token, slot in entries:
                self.kv[slot] = (token * 7 + p) % 251
            self.lengths[row] = max(self.lengths.get(row, 0), entries[-1][0] + 1)
        self.mgr.after_forward(batch)
        if step:
            self.mgr.step()

    def new_entries(self, row: int, count: int) -> list[tuple[int, int, int]]:
        start = self.lengths.get(row, 0)
        out = []
        for p in range(start, start + count):
            out.append((p, 100 * row + p, self.next_slot))
            self.next_slot += 1
        return out

    def decode(self, rows: list[int], *, step: bool = True) -> None:
        self.forward({row: self.new_entries(row, 1) for row in rows}, step=step)

    @property
    def steps(self) -> int:
        return self.mgr.steps


def verify_rows(h: Harness) -> list:
    return [v for v in h.mgr.violations if v.tag_name == "verify"]


# ---------------------------------------------------------------------------------------------- step


@pytest.mark.parametrize("drain_every", [1, 8])
def test_step_is_the_forward_that_found_it(drain_every: int) -> None:
    """A K byte flipped before forward 6 and repaired after forward 9: rows say 6, 7, 8, 9 whatever the drain."""
    h = Harness(drain_every=drain_every)
    h.mgr.mark_init_finished()
    h.forward({1: h.new_entries(1, 4), 2: h.new_entries(2, 4)})  # forward 1
    for _ in range(4):
        h.decode([1, 2])  # forwards 2..5
    victim = int(h.req_to_token[1, 2])
    h.kv[victim, 0] ^= 0xFF
    reported_after: list[int] = []
    for k in range(6, 10):
        h.decode([1, 2])
        if verify_rows(h) and not reported_after:
            reported_after.append(k)
    h.kv[victim, 0] ^= 0xFF
    for _ in range(10, 17):
        h.decode([1, 2])
    h.mgr.flush()
    assert [(v.step, v.slot, v.reasons) for v in verify_rows(h)] == [
        (k, victim, ("verify_real_kv_hash",)) for k in (6, 7, 8, 9)
    ]
    if drain_every == 8:  # reported later (step 7 or 8), labelled with the forward that found it
        assert reported_after in ([7], [8], [9]), reported_after


def test_forwards_the_host_never_steps_shift_nothing() -> None:
    """CUDA-graph warm-up runs call before_forward/after_forward without step(): eager planning sets the counter
    to the forward's number instead of adding to it, so they cannot push later labels ahead."""
    h = Harness()
    h.forward({1: h.new_entries(1, 3)})  # forward 1
    for _ in range(3):  # warm-up runs: no step()
        h.forward({1: [(3, 999, 60)]}, step=False)
    h.req_to_token[1, 3] = 0
    h.lengths[1] = 3
    for _ in range(9):
        h.decode([1])  # forwards 2..10 (the drain at 7/8 maps the counter)
    victim = int(h.req_to_token[1, 1])
    h.kv[victim, 3] ^= 1
    h.decode([1])  # forward 11 finds it
    h.kv[victim, 3] ^= 1
    for _ in range(6):
        h.decode([1])
    h.mgr.flush()
    assert [v.step for v in verify_rows(h)] == [11]
    assert h.steps == 17


@pytest.mark.parametrize("when", ["before_step", "after_step"])
def test_rewrites_of_a_forward_do_not_shift_later_steps(when: str) -> None:
    """An adapter re-planning a forward (the sglang fault injector rewrites token-swapped rows): before step() a
    plain before_forward is harmless (the counter is set, not incremented); after step() it passes
    new_forward=False."""
    h = Harness(drain_every=1)
    h.forward({1: h.new_entries(1, 3)})  # forward 1
    entries = h.new_entries(1, 1)
    h.forward({1: entries}, step=False)  # forward 2
    rewrite = h.batch({1: entries})
    if when == "after_step":
        h.mgr.step()
    h.mgr.before_forward(rewrite, new_forward=when == "before_step")
    h.mgr.before_forward(rewrite, new_forward=when == "before_step")
    h.mgr.after_forward(rewrite)
    if when == "before_step":
        h.mgr.step()
    victim = int(h.req_to_token[1, 0])
    h.kv[victim, 0] ^= 1
    h.decode([1])  # forward 3
    h.mgr.flush()
    assert [v.step for v in verify_rows(h)] == [3]


def test_write_rows_say_their_forward_and_request_row() -> None:
    """A position skew on row 3 in forward 5 (chain-position assert armed): the write row says step 5, row 3."""
    h = Harness()
    h.mgr.mark_init_finished()
    h.forward({2: h.new_entries(2, 3), 3: h.new_entries(3, 3)})  # forward 1
    for _ in range(3):
        h.decode([2, 3])  # forwards 2..4
    h.forward({3: h.new_entries(3, 1)}, positions_skew=1)  # forward 5
    for _ in range(3):
        h.decode([2])
    h.mgr.flush()
    writes = [v for v in h.mgr.violations if v.tag_name == "write"]
    assert [(v.step, v.request_row, v.reasons) for v in writes] == [(5, 3, ("write_position",))]


def test_sweep_rows_say_the_step_that_swept_and_who_wrote_the_slot() -> None:
    h = Harness(sweep_interval=5)
    h.mgr.assign_requests([1, 2], ["req-one", "req-two"])
    h.forward({1: h.new_entries(1, 4)})  # forward 1 writes row 1 (then row 1 leaves the batch)
    slots = [int(s) for s in h.req_to_token[1, :4]]
    h.mgr.set_sweep_source(lambda: (slots, [-1, *slots[:-1]], list(range(4))))
    h.forward({2: h.new_entries(2, 2)})  # forward 2
    h.kv[slots[2], 9] ^= 4
    for _ in range(3, 12):
        h.decode([2])  # forwards 3..11: sweeps at steps 5 and 10
    h.mgr.flush()
    swept = [v for v in h.mgr.violations if v.tag_name == "sweep"]
    assert [(v.step, v.slot, v.request_row, v.written_step, v.writer_rid) for v in swept] == [
        (5, slots[2], None, 1, "req-one"), (10, slots[2], None, 1, "req-one")
    ]


# ---------------------------------------------------------------------------------------------- rows and writers


def test_verify_rows_name_the_request_row_and_the_writer_after_a_slot_reuse() -> None:
    """Stale reuse: row 1's slot at position 2 is handed to row 3's new request, which writes it in forward 3;
    row 1's next verify reports the slot with request_row=1, written_step=3 and the new writer's id."""
    h = Harness(drain_every=8)
    h.mgr.mark_init_finished()
    h.mgr.assign_requests([1, 2], ["rid-A", "rid-B"])
    h.forward({1: h.new_entries(1, 4), 2: h.new_entries(2, 2)})  # forward 1
    h.decode([1, 2])  # forward 2
    stale = int(h.req_to_token[1, 2])
    h.mgr.assign_requests([3], ["rid-C"])
    h.forward({3: [(0, 777, stale)]})  # forward 3: row 3's request overwrites row 1's slot
    h.decode([1])  # forward 4: row 1's verify sees it
    h.mgr.flush()
    rows = verify_rows(h)
    assert rows, "stale reuse not detected"
    first = rows[0]
    assert (first.step, first.slot, first.request_row) == (4, stale, 1)
    assert (first.written_step, first.writer_rid) == (3, "rid-C")
    assert "verify_position" in first.reasons
    clean_writer = [v for v in rows if v.slot != stale]  # the successor's chain check: written by row 1 itself
    assert all(v.writer_rid == "rid-A" and v.request_row == 1 for v in clean_writer)


def test_assign_requests_gives_a_new_serial_only_when_the_request_changes() -> None:
    h = Harness()
    mgr = h.mgr
    mgr.assign_requests([1, 2], ["a", "b"])
    first = mgr.row_serials.tolist()
    mgr.assign_requests([1, 2], ["a", "b"])  # same requests: nothing changes
    assert mgr.row_serials.tolist() == first
    mgr.assign_requests([2], ["c"])
    serials = mgr.row_serials.tolist()
    assert serials[1] == first[1] and serials[2] not in (first[1], first[2]) and serials[2] > 0
    assert mgr.writer_id(serials[2]) == "c" and mgr.writer_id(first[2]) == "b"
    with pytest.raises(ValueError, match="row 9"):
        mgr.assign_requests([9], ["x"])


def test_a_refused_assign_leaves_the_device_serials_in_step_with_the_table() -> None:
    """A call with a bad row assigned the rows before it on the host but uploaded nothing, so the same request
    later counted as unchanged and its row kept no serial on the device (its violations named no writer)."""
    h = Harness()
    mgr = h.mgr
    with pytest.raises(ValueError, match="row 9"):
        mgr.assign_requests([1, 9], ["a", "x"])
    mgr.assign_requests([1], ["a"])
    serial = int(mgr.row_serials[1])
    assert serial > 0 and mgr.writer_id(serial) == "a"


def test_writer_ids_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writers, "MAX_WRITER_IDS", 2)
    h = Harness()
    h.mgr.assign_requests([1], ["one"])
    s1 = int(h.mgr.row_serials[1])
    h.mgr.assign_requests([2, 3], ["two", "three"])
    assert h.mgr.writer_id(s1) is None  # the oldest dropped
    assert h.mgr.writer_id(int(h.mgr.row_serials[3])) == "three"


def test_rows_without_a_known_writer_say_none() -> None:
    """No assign_requests: verify rows still carry request_row and written_step; writer_rid is None."""
    h = Harness(drain_every=1)
    h.forward({4: h.new_entries(4, 3)})
    h.kv[int(h.req_to_token[4, 0]), 0] ^= 1
    h.decode([4])
    h.mgr.flush()
    (v,) = verify_rows(h)
    assert (v.step, v.request_row, v.written_step, v.writer_rid) == (2, 4, 1, None)


# ---------------------------------------------------------------------------------------------- token table


def test_expected_token_table_is_int32_and_checks_tokens() -> None:
    h = Harness(drain_every=1, verify_tokens=True)
    assert h.mgr.expected_tokens is not None and h.mgr.expected_tokens.dtype == torch.int32
    entries = h.new_entries(1, 3)
    h.mgr.set_expected_tokens(1, [tok for _, tok, _ in entries])
    h.forward({1: entries})
    h.mgr.update_expected_tokens([(1, 1, [12345])])  # the engine now expects another token at position 1
    h.decode([1])
    h.mgr.flush()
    (v,) = verify_rows(h)
    assert v.reasons == ("verify_token",) and v.expected_token == 12345 and v.position == 1


# ---------------------------------------------------------------------------------------------- stats, health


def test_stats_line_holds_its_cadence_with_drain_8(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(drain_every=8, stats_every=4)
    h.forward({1: h.new_entries(1, 2)})
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        for _ in range(15):
            h.decode([1])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(STATS_PREFIX)]
    assert [int(line.split("step=")[1].split()[0]) for line in lines] == [4, 8, 12, 16]
    written = [int(line.split("tokens_written=")[1].split()[0]) for line in lines]
    assert written == sorted(written) and written[-1] > 0  # the last drained counters


def test_health_window_counts_steps_when_draining_every_8() -> None:
    """health_window=10 with drain 8: a stalled path is caught within the window plus three drains (a baseline
    read after the stall, then a check at least 10 steps later, on a drain step), not after 10 drains (80 steps)."""
    h = Harness(mode=Mode.RAISE, drain_every=8, health_window=10)
    for _ in range(40):
        h.decode([1])  # healthy
    with pytest.raises(CanaryHealthError):
        for _ in range(10 + 3 * 8):
            h.mgr.step()  # no forwards: verify/write counters stand still


# ---------------------------------------------------------------------------------------------- BatchView


@pytest.mark.parametrize(
    ("change", "exc", "pattern"),
    [
        ({"input_ids": torch.tensor([5], dtype=torch.int16)}, TypeError,
         r"^BatchView: input_ids: expected dtype int64 or int32, got torch.int16"),
        ({"req_pool_indices": torch.tensor([1.0])}, TypeError, r"^BatchView: req_pool_indices: "),
        ({"kind": "decode"}, TypeError, r"^BatchView: kind: expected ForwardKind, got str"),
        ({"positions": torch.zeros(0, dtype=torch.int64)}, ValueError, r"^BatchView: positions: expected 1 entries"),
        ({"extend_lens": torch.ones(2, dtype=torch.int64)}, ValueError, r"^BatchView: extend_lens: expected 1 entries"),
        ({"out_cache_loc": [3]}, TypeError, r"^BatchView: out_cache_loc: expected torch.Tensor, got list"),
        ({"prefix_lens": torch.zeros((1, 1), dtype=torch.int64)}, ValueError, r"^BatchView: prefix_lens: expected a 1"),
    ],
)
def test_batch_view_errors_name_the_field(change: dict, exc: type[Exception], pattern: str) -> None:
    h = Harness()
    good = h.batch({1: [(0, 5, 1)]})
    bad = BatchView(**{**good.__dict__, **change})
    with pytest.raises(exc, match=pattern):
        h.mgr.before_forward(bad)
    with pytest.raises(exc, match=pattern):
        h.mgr.after_forward(bad)
    with pytest.raises(TypeError, match="^CanaryManager: batch: expected BatchView"):
        h.mgr.before_forward(object())  # type: ignore[arg-type]


def test_a_batch_the_launch_accepts_is_not_checked_again_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check launch validates the batch's tensors itself before it enqueues anything: a well-formed batch
    costs no Python-side check (``well_formed`` / ``validate``), in before_forward or in the after_forward of the
    same batch."""
    h = Harness()
    calls: list[str] = []
    well_formed, validate = BatchView.well_formed, BatchView.validate
    monkeypatch.setattr(BatchView, "well_formed", lambda self: calls.append("well_formed") or well_formed(self))
    monkeypatch.setattr(BatchView, "validate", lambda self: calls.append("validate") or validate(self))
    h.forward({1: h.new_entries(1, 3)})
    h.decode([1])
    assert calls == [] and h.steps == 2


@pytest.mark.parametrize(
    "change",
    [{"input_ids": torch.tensor([5], dtype=torch.int16)}, {"positions": torch.zeros(0, dtype=torch.int64)},
     {"prefix_lens": torch.zeros((1, 1), dtype=torch.int64)}, {"kind": "decode"}],
)
def test_a_malformed_batch_launches_nothing(change: dict) -> None:
    """The launch refuses a malformed batch before it enqueues anything: the forward counter and the launch counts
    stand still, and the error is the one naming the BatchView field."""
    h = Harness()
    h.forward({1: h.new_entries(1, 3)})
    before = h.mgr.device_state.state.clone()
    good = h.batch({1: h.new_entries(1, 1)})
    with pytest.raises((TypeError, ValueError), match="^BatchView: "):
        h.mgr.before_forward(BatchView(**{**good.__dict__, **change}))
    assert torch.equal(h.mgr.device_state.state, before)


def test_a_burst_beyond_the_status_peek_keeps_its_metadata() -> None:
    """50 rows in one forward: 32 come with the status snapshot, the rest through the rows channel one step later;
    every row still names forward 3 and its request row."""
    h = Harness(drain_every=8, ring_capacity=100)
    h.forward({1: h.new_entries(1, 25), 2: h.new_entries(2, 25)})  # forward 1
    h.decode([1, 2])  # forward 2
    victims = {int(h.req_to_token[row, p]): row for row in (1, 2) for p in range(25)}
    for slot in victims:
        h.kv[slot, 2] ^= 0x20
    h.decode([1, 2])  # forward 3 finds all 50
    for slot in victims:
        h.kv[slot, 2] ^= 0x20
    for _ in range(12):
        h.decode([1, 2])
    h.mgr.flush()
    rows = verify_rows(h)
    assert sorted(v.slot for v in rows) == sorted(victims)
    assert {v.step for v in rows} == {3}
    assert all(v.request_row == victims[v.slot] and v.written_step == 1 for v in rows)
