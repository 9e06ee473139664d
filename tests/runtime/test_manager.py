"""CanaryManager on CPU: a hand-driven sequence of forwards, detection, raise mode, sweep, health."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.kernels import layout
from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import CanaryHealthError, CanaryViolationError
from kvcanary.runtime.config import Config
from kvcanary.runtime.manager import CanaryManager
from kvcanary.settings import Mode

NUM_SLOTS = 128


class TinyEngine:
    """Two requests in req_to_token rows 1 and 2; slots handed out in order; KV = f(token, position)."""

    def __init__(self, mode: Mode = Mode.RAISE, token_mail: bool = False, **config: object) -> None:
        self.req_to_token = torch.zeros((4, 32), dtype=torch.int32)
        self.kv = torch.zeros((NUM_SLOTS, 32), dtype=torch.uint8)
        self.next_slot = 1
        self.lengths = {1: 0, 2: 0}
        self.tokens: dict[int, list[int]] = {1: [], 2: []}
        # drain every step unless a test asks otherwise: these tests pin what each step reports
        cfg = Config(mode=mode, **{"drain_every": 1, **config})  # type: ignore[arg-type]
        self.mgr = CanaryManager(
            cfg,
            num_slots=NUM_SLOTS,
            req_to_token=self.req_to_token,
            device="cpu",
            max_batch_size=4,
            max_tokens_per_forward=64,
            real_kv_sources=[RealKvSource(self.kv, 1, 32, 32)],
            token_mail=token_mail,
        )

    def forward(self, rows: list[int], counts: list[int]) -> None:
        ids, pos, locs, prefixes = [], [], [], []
        for row, count in zip(rows, counts, strict=True):
            prefixes.append(self.lengths[row])
            for _ in range(count):
                p = self.lengths[row]
                slot = self.next_slot
                self.next_slot += 1
                self.req_to_token[row, p] = slot
                token = 100 * row + p
                ids.append(token)
                pos.append(p)
                locs.append(slot)
                self.lengths[row] += 1
                self.tokens[row].append(token)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        batch = BatchView(
            kind=ForwardKind.EXTEND if max(counts) > 1 else ForwardKind.DECODE,
            input_ids=t(ids), positions=t(pos), out_cache_loc=t(locs),
            req_pool_indices=t(rows), prefix_lens=t(prefixes), extend_lens=t(counts),
        )
        batch.validate()
        self.mgr.before_forward(batch)
        for token, p, slot in zip(ids, pos, locs, strict=True):  # the "model" writes KV
            self.kv[slot] = torch.full((32,), (token * 7 + p) % 251, dtype=torch.uint8)
        self.mgr.after_forward(batch)
        self.mgr.step()


def test_clean_prefill_and_decode() -> None:
    eng = TinyEngine()
    eng.mgr.mark_init_finished()
    eng.forward([1, 2], [5, 3])
    for _ in range(6):
        eng.forward([1, 2], [1, 1])
    eng.mgr.flush()
    assert eng.mgr.violations == []
    runs = eng.mgr.stats.kernel_runs
    assert runs[0] == 7 and runs[1] == 7  # verify and write once per forward
    assert eng.mgr.stats.slot_runs[1] == 8 + 12  # tokens written
    assert eng.mgr.stats.slot_runs[0] == sum(5 + 3 + 2 * k for k in range(6)) + 0  # prefix entries verified


def test_redirect_is_reported_in_log_mode(caplog: pytest.LogCaptureFixture) -> None:
    eng = TinyEngine(mode=Mode.LOG)
    eng.forward([1, 2], [4, 4])
    eng.req_to_token[1, 2] = eng.req_to_token[2, 2]  # point row 1 position 2 at row 2's slot
    with caplog.at_level(logging.WARNING):
        eng.forward([1, 2], [1, 1])
        eng.mgr.flush()
    assert eng.mgr.violations, "redirect not detected"
    reasons = {r for v in eng.mgr.violations for r in v.reasons}
    assert "verify_chain_hash" in reasons
    assert any("kvcanary violation:" in rec.getMessage() for rec in caplog.records)


def test_raise_mode_raises_with_all_violations() -> None:
    eng = TinyEngine(mode=Mode.RAISE)
    eng.forward([1], [4])
    eng.kv[int(eng.req_to_token[1, 1]), 0] ^= 0xFF  # flip a KV byte of a live slot
    with pytest.raises(CanaryViolationError) as info:
        eng.forward([1], [1])
        eng.mgr.flush()
    assert [v.reasons for v in info.value.violations] == [("verify_real_kv_hash",)]


def test_sweep_checks_cached_slots() -> None:
    eng = TinyEngine(mode=Mode.LOG, sweep_interval=2)
    eng.forward([1], [4])
    slots = [int(s) for s in eng.req_to_token[1, :4]]
    eng.mgr.set_sweep_source(lambda: (slots, [-1, *slots[:-1]], list(range(4))))
    eng.kv[slots[3], 5] ^= 1
    eng.forward([2], [2])
    eng.forward([2], [1])
    eng.mgr.flush()
    swept = [v for v in eng.mgr.violations if v.tag_name == "sweep"]
    assert [(v.slot, v.reasons) for v in swept] == [(slots[3], ("verify_real_kv_hash",))]


def test_health_raises_when_a_launch_stops_running() -> None:
    eng = TinyEngine(mode=Mode.RAISE, health_window=3)
    eng.forward([1], [2])
    with pytest.raises(CanaryHealthError):
        for _ in range(8):  # steps without forwards: verify/write counters stand still
            eng.mgr.step()


def test_verify_has_no_capacity_to_overflow() -> None:
    """Σ prefix far beyond the pool (rows sharing a cached prefix): every entry is verified, none skipped (the fused
    check launch has no plan buffer; a capacity once disabled verify for such a forward)."""
    slots, rows_n, ctx = 32, 9, 12
    req = torch.zeros((rows_n, ctx), dtype=torch.int32)
    mgr = CanaryManager(Config(mode=Mode.LOG), num_slots=slots, req_to_token=req, device="cpu", max_batch_size=8,
                        max_tokens_per_forward=16)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    prompt = list(range(1, 11))  # one cached prefix of 10 slots, shared by 8 rows
    req[1, :10] = torch.tensor(prompt, dtype=torch.int32)
    first = BatchView(ForwardKind.EXTEND, t([5] * 10), t(list(range(10))), t(prompt), t([1]), t([0]), t([10]))
    mgr.before_forward(first)
    mgr.after_forward(first)
    mgr.step()
    for row in range(1, 9):
        req[row, :10] = torch.tensor(prompt, dtype=torch.int32)
        req[row, 10] = 10 + row  # one new slot each
    rows = t(list(range(1, 9)))
    batch = BatchView(ForwardKind.DECODE, t([5] * 8), t([10] * 8), t([10 + r for r in range(1, 9)]), rows,
                      t([10] * 8), t([1] * 8))
    mgr.before_forward(batch)  # 80 entries, verify capacity would have been 3 x 32 slots before: now unbounded
    mgr.after_forward(batch)
    mgr.step()
    mgr.flush()
    assert mgr.stats.slot_runs[LaunchTag.VERIFY] == 80
    assert mgr.violations == []


def test_batch_beyond_capacity_is_refused() -> None:
    """Too many tokens or rows: the manager's error names the capacity, and nothing is launched (the check launch
    refuses the batch before it enqueues anything; the manager names what it exceeds)."""
    eng = TinyEngine()
    eng.forward([1], [2])
    eng.mgr.step()
    eng.mgr.flush()
    runs = eng.mgr.kernel_run_counters.tolist()
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    big = BatchView(ForwardKind.EXTEND, t([1] * 80), t(list(range(80))), t([1] * 80), t([1]), t([0]), t([80]))
    with pytest.raises(ValueError, match=r"^CanaryManager: batch has 80 tokens, more than max_tokens_per_forward=64$"):
        eng.mgr.before_forward(big)
    wide = BatchView(ForwardKind.DECODE, t([1] * 5), t([2] * 5), t([9] * 5), t([1] * 5), t([2] * 5), t([1] * 5))
    with pytest.raises(ValueError, match=r"^CanaryManager: batch has 5 rows, more than max_batch_size=4$"):
        eng.mgr.before_forward(wide)
    with pytest.raises(ValueError, match=r"max_tokens_per_forward=64$"):
        eng.mgr.after_forward(big)
    assert eng.mgr.kernel_run_counters.tolist() == runs
    eng.forward([1], [1])  # the manager still serves
    eng.mgr.step()
    eng.mgr.flush()
    assert eng.mgr.violations == []


def test_plan_index_error_reported_as_out_of_range() -> None:
    eng = TinyEngine(mode=Mode.LOG)
    eng.forward([1], [2])
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    bad = BatchView(ForwardKind.DECODE, t([5]), t([2]), t([40]), t([7]), t([2]), t([1]))  # rp 7 > rows
    eng.mgr.before_forward(bad)
    eng.mgr.after_forward(bad)
    eng.mgr.step()
    eng.mgr.flush()
    oob = [v for v in eng.mgr.violations if "slot_out_of_range" in v.reasons]
    assert len(oob) == 1 and layout.decode_plan_index_error(oob[0].slot) == 7


def test_ring_overflow_keeps_the_first_rows_and_counts_the_rest() -> None:
    eng = TinyEngine(mode=Mode.LOG, ring_capacity=20)
    eng.forward([1, 2], [15, 15])
    for row in (1, 2):
        for p in range(15):
            eng.kv[int(eng.req_to_token[row, p]), 3] ^= 0x10  # 30 corrupt slots, verified twice below
    eng.forward([1, 2], [1, 1])
    eng.forward([1, 2], [1, 1])
    eng.mgr.flush()
    # each verify finds 30 corrupt slots: the ring keeps the first 20 of each forward's rows,
    # counts the other 10 as lost, and is emptied for reuse once the host has read it
    assert len(eng.mgr.violations) == 40
    assert eng.mgr.reporter.total_lost == 20
    assert {v.reasons for v in eng.mgr.violations} == {("verify_real_kv_hash",)}


def test_ring_is_reused_once_drained() -> None:
    """A small ring keeps reporting violation after violation: the drained ring is emptied and reused."""
    eng = TinyEngine(mode=Mode.LOG, ring_capacity=4)
    eng.forward([1, 2], [12, 12])
    victims = [int(eng.req_to_token[1 + (i % 2), i % 12]) for i in range(10)]
    for slot in victims:
        eng.kv[slot, 7] ^= 0x40  # one corrupt slot at a time
        eng.forward([1, 2], [1, 1])  # verify finds it
        eng.kv[slot, 7] ^= 0x40  # repaired
        eng.forward([1, 2], [1, 1])
    eng.mgr.flush()
    assert [v.slot for v in eng.mgr.violations] == victims
    assert eng.mgr.reporter.total_lost == 0
    assert eng.mgr.stats.violations_seen == len(victims)  # a lifetime count, across ring reuses


def test_burst_larger_than_the_status_peek_arrives_complete() -> None:
    eng = TinyEngine(mode=Mode.LOG, ring_capacity=100)
    eng.forward([1, 2], [25, 25])
    slots = sorted(int(eng.req_to_token[row, p]) for row in (1, 2) for p in range(25))
    for slot in slots:
        eng.kv[slot, 1] ^= 0x01  # 50 violations in one verify: more than the 32 rows a status copy peeks at
    eng.forward([1, 2], [1, 1])
    eng.mgr.flush()
    assert sorted(v.slot for v in eng.mgr.violations) == slots
    assert eng.mgr.reporter.total_lost == 0


def test_raise_mode_reports_each_violation_once() -> None:
    """After a CanaryViolationError the engine may go on (e.g. a test harness): the same rows never raise twice."""
    eng = TinyEngine(mode=Mode.RAISE)
    eng.forward([1], [4])
    slot = int(eng.req_to_token[1, 1])
    eng.kv[slot, 0] ^= 0xFF
    with pytest.raises(CanaryViolationError):
        eng.forward([1], [1])
    eng.kv[slot, 0] ^= 0xFF  # repaired
    eng.forward([1], [1])  # must not raise the old rows again
    eng.mgr.flush()
    assert [v.slot for v in eng.mgr.violations] == [slot]


def test_drain_every_reports_within_that_many_forwards_and_reads_nothing_in_between() -> None:
    """KVCANARY_DRAIN_EVERY=4: the host touches the device status only on steps 3 and 4 of every 4 (snapshot, read
    at once when ready, else on step 4), so a violation found by any forward is reported by the next 4th step, and
    other steps cost nothing."""
    eng = TinyEngine(mode=Mode.LOG, drain_every=4)
    eng.mgr.mark_init_finished()
    eng.forward([1], [4])  # step 1
    drain = eng.mgr.violation_drain
    reads: list[int] = []  # the steps whose step() read a status snapshot

    def forward() -> None:
        before = drain.status_reads
        eng.forward([1], [1])
        reads.extend([eng.mgr.steps] * (drain.status_reads - before))

    eng.kv[int(eng.req_to_token[1, 1]), 0] ^= 0xFF
    forward()  # step 2: verify finds the flip
    assert eng.mgr.violations == [] and reads == []
    forward()  # step 3: snapshot (the CPU copy is immediate, so it is read at once)
    forward()  # step 4: nothing left to read
    assert {v.reasons for v in eng.mgr.violations} == {("verify_real_kv_hash",)}
    for _ in range(4):
        forward()
    assert reads and set(reads) <= {3, 4, 7, 8}, reads


def test_drain_every_copies_nothing_while_the_status_mirror_shows_no_new_row() -> None:
    """The check launches publish the header to the status mirror: a clean run's drains read it and start no status
    copy (its counters still feed stats and health); a violation starts the copy on the cadence step after the
    launch that found it."""
    eng = TinyEngine(mode=Mode.LOG, drain_every=4)
    eng.mgr.mark_init_finished()
    eng.forward([1, 2], [4, 4])
    for _ in range(7):
        eng.forward([1, 2], [1, 1])
    drain = eng.mgr.violation_drain
    assert drain.status_reads == 0 and drain.mirror_reads == 2 and eng.mgr.violations == []
    # the mirror of forward 7's check: 7 check launches, and the writes of forwards 1..6
    assert eng.mgr.stats.kernel_runs[LaunchTag.VERIFY] == 7 and eng.mgr.stats.kernel_runs[LaunchTag.WRITE] == 6
    eng.kv[int(eng.req_to_token[1, 1]), 0] ^= 0xFF
    eng.forward([1, 2], [1, 1])  # step 9: verify finds the flip
    assert eng.mgr.violations == []
    eng.forward([1, 2], [1, 1])  # step 10
    eng.forward([1, 2], [1, 1])  # step 11: the mirror shows the row: one status copy, read at once on the CPU
    # (every verify of row 1 finds the flipped slot again)
    assert [(v.step, v.reasons) for v in eng.mgr.violations] == [(s, ("verify_real_kv_hash",)) for s in (9, 10, 11)]
    assert drain.status_reads == 1
    eng.mgr.flush()
    assert eng.mgr.stats.kernel_runs[LaunchTag.WRITE] == 11, "a flush reads the state itself"


def test_drain_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="drain_every"):
        Config(drain_every=0)
    with pytest.raises(ValueError, match="KVCANARY_DRAIN_EVERY"):
        Config.from_env({"KVCANARY_DRAIN_EVERY": "0"})
    assert Config.from_env({"KVCANARY_DRAIN_EVERY": "1"}).drain_every == 1
    assert Config().drain_every == 8


def test_update_expected_tokens_appends_like_a_full_upload() -> None:
    """The incremental token-table upload (what a serving loop sends per forward) leaves the same table as
    uploading every row in full, and bounds rows, starts and the table width."""
    full, inc = TinyEngine(verify_tokens=True), TinyEngine(verify_tokens=True)
    a, b = [11, 12, 13, 14], [21, 22]
    full.mgr.set_expected_tokens(1, a + [15, 16])
    full.mgr.set_expected_tokens(2, b + [23])
    inc.mgr.update_expected_tokens([(1, 0, a), (2, 0, b)])
    inc.mgr.update_expected_tokens([(1, 4, [15]), (2, 2, [23])])
    inc.mgr.update_expected_tokens([(1, 5, [16])])
    assert torch.equal(full.mgr.expected_tokens, inc.mgr.expected_tokens)
    assert full.mgr.token_table is not None and inc.mgr.token_table is not None
    assert torch.equal(full.mgr.token_table.valid_lens_by_row, inc.mgr.token_table.valid_lens_by_row)
    width = inc.mgr.expected_tokens.shape[1]
    inc.mgr.update_expected_tokens([(3, width - 1, [7, 8, 9])])  # clipped at the width
    assert inc.mgr.expected_tokens[3, width - 1] == 7 and int(inc.mgr.token_table.valid_lens_by_row[3]) == width
    with pytest.raises(ValueError, match="row 99"):
        inc.mgr.update_expected_tokens([(99, 0, [1])])
    with pytest.raises(ValueError, match="start -1"):
        inc.mgr.update_expected_tokens([(1, -1, [1])])
    with pytest.raises(RuntimeError, match="verify_tokens"):
        TinyEngine().mgr.update_expected_tokens([(1, 0, [1])])


def test_sweep_takes_tensors_and_checks_them() -> None:
    """A sweep source may hand over int64 tensors (slots on the KV device, no host copy): same result as lists;
    a wrong dtype is refused by name."""
    eng = TinyEngine(mode=Mode.LOG, sweep_interval=1)
    eng.forward([1], [4])
    slots = eng.req_to_token[1, :4].to(torch.int64)
    prevs = torch.cat([torch.tensor([-1]), slots[:-1]])
    eng.mgr.set_sweep_source(lambda: (slots, prevs, torch.arange(4)))
    eng.kv[int(slots[2]), 1] ^= 1
    eng.forward([2], [1])
    eng.mgr.flush()
    swept = [v for v in eng.mgr.violations if v.tag_name == "sweep"]
    assert {(v.slot, v.reasons) for v in swept} == {(int(slots[2]), ("verify_real_kv_hash",))}
    with pytest.raises(ValueError, match="positions: expected a 1-D int64 tensor"):
        eng.mgr.sweep(slots, prevs, torch.arange(4, dtype=torch.int32))


def test_a_source_that_hands_back_the_same_tensors_is_still_verified_every_sweep() -> None:
    """A source hands back the very tensors of its previous call while its cache is unchanged (the sweep then
    re-launches verify on the plan it holds, no copy): a slot corrupted after the first sweep is still found by the
    next, and no sweep before or after the corruption reports anything else."""
    eng = TinyEngine(mode=Mode.LOG, sweep_interval=2)
    eng.forward([1], [4])
    slots = eng.req_to_token[1, :4].to(torch.int64)
    entries = (slots, torch.cat([torch.tensor([-1]), slots[:-1]]), torch.arange(4))
    eng.mgr.set_sweep_source(lambda: entries)
    for _ in range(4):
        eng.forward([2], [1])  # two clean sweeps of the same tensors
    eng.mgr.flush()
    assert eng.mgr.violations == [] and eng.mgr.stats.sweeps == 2
    eng.kv[int(slots[1]), 3] ^= 1
    eng.forward([2], [1])
    eng.forward([2], [1])  # the third sweep
    eng.mgr.flush()
    swept = [v for v in eng.mgr.violations if v.tag_name == "sweep"]
    assert [(v.slot, v.reasons) for v in swept] == [(int(slots[1]), ("verify_real_kv_hash",))]
    assert eng.mgr.stats.slot_runs[LaunchTag.SWEEP] == 3 * 4


def test_int32_batch_arrays_give_the_same_records_and_checks_as_int64() -> None:
    """sglang hands extend_prefix_lens / extend_seq_lens as int32: a BatchView takes int32 or int64 per field, and the
    runtime records and checks exactly the same either way (no conversion per forward)."""
    results = []
    for dtype in (torch.int64, torch.int32):
        req = torch.zeros((3, 16), dtype=torch.int32)
        req[1, :6] = torch.arange(1, 7, dtype=torch.int32)
        mgr = CanaryManager(Config(mode=Mode.LOG), num_slots=32, req_to_token=req, device="cpu", max_batch_size=2,
                            max_tokens_per_forward=16)
        t = lambda v, d=dtype: torch.tensor(v, dtype=d)  # noqa: E731
        for prefix, extend in ((0, 4), (4, 2)):  # a prefill chunk, then the rest on a cached prefix
            ids = [7 + p for p in range(prefix, prefix + extend)]
            batch = BatchView(ForwardKind.EXTEND, t(ids), t(list(range(prefix, prefix + extend))),
                              t(list(range(prefix + 1, prefix + extend + 1))), t([1]), t([prefix]), t([extend]))
            mgr.before_forward(batch)
            mgr.after_forward(batch)
            mgr.step()
        mgr.flush()
        results.append((mgr.canary_buf.clone(), mgr.stats.slot_runs, len(mgr.violations)))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1:] == results[1][1:]
    assert results[0][1][LaunchTag.VERIFY] == 4 and results[0][2] == 0


def test_a_sweep_source_is_primed_when_it_is_set() -> None:
    """With sweeps on, ``set_sweep_source`` asks the source once (the first sweep's one-off work, at start-up) and
    drops the answer: nothing is verified, launched or counted until the first sweep asks again. With sweeps off
    the source is not asked."""
    eng = TinyEngine(mode=Mode.LOG, sweep_interval=2)
    eng.forward([1], [4])
    slots = [int(s) for s in eng.req_to_token[1, :4]]
    calls = []
    eng.mgr.set_sweep_source(lambda: calls.append(len(calls)) or (slots, [-1, *slots[:-1]], list(range(4))))
    assert calls == [0]
    eng.mgr.flush()
    assert eng.mgr.stats.sweeps == 0 and eng.mgr.stats.kernel_runs[LaunchTag.SWEEP] == 0
    eng.forward([2], [1])  # the second forward: the first sweep
    eng.mgr.flush()
    assert calls == [0, 1] and eng.mgr.stats.sweeps == 1 and eng.mgr.stats.slot_runs[LaunchTag.SWEEP] == 4
    off = TinyEngine(mode=Mode.LOG, sweep_interval=0)
    off.mgr.set_sweep_source(lambda: calls.append("off"))
    assert calls == [0, 1]


# ---------------------------------------------------------------------------------------------- the token mail


def _mail_engine(mode: Mode = Mode.RAISE) -> TinyEngine:
    """A TinyEngine with the token check, its prompts (3 tokens in rows 1 and 2) uploaded and written, the mail open."""
    eng = TinyEngine(mode, token_mail=True, verify_tokens=True)
    assert eng.mgr.token_table is not None and eng.mgr.token_table.mail is not None
    eng.mgr.update_expected_tokens([(1, 0, [100, 101, 102]), (2, 0, [200, 201, 202])])  # prompts: a launch each
    eng.forward([1, 2], [3, 3])
    return eng


def _mail_read(mgr: CanaryManager) -> int:
    return int(mgr.device_state.state[layout.STATE_TOKEN_MAIL_READ])


def test_the_token_mail_takes_a_decode_batch_and_the_next_check_applies_it() -> None:
    """A decode batch's appends (one token per row) go into the mail, no launch: the table is unchanged until the next
    forward's check launch applies them at its end, then the read cursor (and its mirror) moves past them."""
    eng = _mail_engine()
    table = eng.mgr.token_table
    assert table is not None and table.mail is not None and table.mail.is_open
    eng.mgr.update_expected_tokens([(1, 3, [103]), (2, 3, [203])])
    assert table.mail.posted == 1 and table.mail.written == 2
    assert int(table.valid_lens_by_row[1]) == 3 and int(eng.mgr.expected_tokens[1, 3]) == layout.NO_EXPECTED_TOKEN
    eng.forward([1, 2], [1, 1])
    assert eng.mgr.expected_tokens[1, :4].tolist() == [100, 101, 102, 103]
    assert eng.mgr.expected_tokens[2, :4].tolist() == [200, 201, 202, 203]
    assert table.valid_lens_by_row[1:3].tolist() == [4, 4]
    assert _mail_read(eng.mgr) == 2
    assert eng.mgr.device_state.mirrored_values[layout.STATE_TOKEN_MAIL_READ] == 2
    for _ in range(3):  # the appended positions verified from here on: clean
        eng.mgr.update_expected_tokens([(1, eng.lengths[1], [100 + eng.lengths[1]]),
                                        (2, eng.lengths[2], [200 + eng.lengths[2]])])
        eng.forward([1, 2], [1, 1])
    eng.mgr.flush()
    assert eng.mgr.violations == [] and table.mail.posted == 4


def test_a_wrong_token_posted_by_mail_is_found() -> None:
    """The mail's tokens are what the check compares: a request whose expected token differs from the one the forward
    was fed is reported at the position, once the mail has reached the table (the next forward's verify)."""
    eng = _mail_engine(Mode.LOG)
    eng.mgr.update_expected_tokens([(1, 3, [999]), (2, 3, [203])])  # the engine feeds 103 at row 1, position 3
    eng.forward([1, 2], [1, 1])
    eng.mgr.update_expected_tokens([(1, 4, [104]), (2, 4, [204])])
    eng.forward([1, 2], [1, 1])
    eng.mgr.flush()
    found = [(v.slot, v.position, v.reasons) for v in eng.mgr.violations]
    assert found and all(position == 3 and "verify_token" in reasons for _, position, reasons in found), found


def test_mail_records_for_a_later_forward_wait_for_its_check() -> None:
    """A record applies from the forward it was posted for: a host running ahead of the device leaves its records
    for the launches of their own forwards (the step tag), never an earlier one."""
    eng = _mail_engine()
    table = eng.mgr.token_table
    assert table is not None

    class Ahead:  # the forward two steps on
        steps = eng.mgr.steps + 1

    rows, width = eng.mgr.expected_tokens.shape
    table.mail.open(eng.mgr.device_state.mirrored_values, Ahead, rows, width)
    eng.mgr.update_expected_tokens([(1, 3, [103])])
    eng.forward([1], [1])  # step s + 1: the record is for s + 2
    assert int(eng.mgr.expected_tokens[1, 3]) == layout.NO_EXPECTED_TOKEN and _mail_read(eng.mgr) == 0
    eng.forward([2], [1])  # step s + 2
    assert int(eng.mgr.expected_tokens[1, 3]) == 103 and _mail_read(eng.mgr) == 1


@pytest.mark.parametrize("published", [-1, 1 + 4096 + 1])
def test_a_published_count_behind_the_cursor_or_past_a_ring_applies_nothing(published: int) -> None:
    eng = _mail_engine()
    table = eng.mgr.token_table
    assert table is not None
    eng.mgr.update_expected_tokens([(1, 3, [103])])
    table.mail.published[0] = published
    eng.forward([1], [1])
    assert _mail_read(eng.mgr) == 0 and int(eng.mgr.expected_tokens[1, 3]) == layout.NO_EXPECTED_TOKEN


def test_without_the_token_mail_a_decode_batch_is_launched() -> None:
    eng = TinyEngine(verify_tokens=True)  # (the default: no mail)
    table = eng.mgr.token_table
    assert table is not None and table.mail is None
    eng.mgr.update_expected_tokens([(1, 0, [100])])
    eng.mgr.update_expected_tokens([(1, 1, [101])])  # (applied by its own launch: visible at once)
    assert eng.mgr.expected_tokens[1, :2].tolist() == [100, 101]
    with pytest.raises(ValueError, match="token_mail: needs the token check"):
        TinyEngine(token_mail=True)


def test_the_forward_that_applies_the_mail_checks_its_tokens() -> None:
    """The mail is applied before the launch verifies anything: a posted token for a position already written (an
    overlap scheduler's decode uploads the token its previous forward fed) is checked by the very next forward, as
    it was when the batch's appends had a launch of their own (issue 25: applied at the launch's end instead, the
    H200 fault phase found token swaps one forward late, 24 of 86)."""
    eng = _mail_engine(Mode.LOG)
    eng.mgr.update_expected_tokens([(1, 2, [555])])  # position 2 of row 1 holds 102
    eng.forward([1, 2], [1, 1])
    eng.mgr.flush()
    assert [(v.position, v.step) for v in eng.mgr.violations] == [(2, eng.mgr.steps)]
