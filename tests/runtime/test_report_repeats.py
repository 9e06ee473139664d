"""Log-mode repeat suppression: one line per key per window with a repeat count, summaries for keys that stop,
a bounded key table, every row kept in the JSONL, raise mode unchanged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvcanary.kernels import layout
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import (
    LOG_PREFIX,
    REPEAT_LOG_PREFIX,
    CanaryViolationError,
    Reporter,
    Violation,
    parse_log_line,
    parse_repeat_line,
)
from kvcanary.report.repeats import RepeatFilter
from kvcanary.settings import Mode

R = layout.FailReason
LOGGER = "kvcanary.report.reporter"


def violation(step: int, slot: int = 17, token: int = 101, rank: dict[str, int] | None = None) -> Violation:
    row = [int(LaunchTag.VERIFY), slot, 3, token, -1, 0x55, 0x66, int(R.VERIFY_REAL_KV_HASH)]
    return Violation.from_row(row, step=step, request_row=1, rank=rank)


def messages(caplog: pytest.LogCaptureFixture, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def test_one_slot_every_forward_logs_once_per_window_with_repeats(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "r.jsonl"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with Reporter(Mode.LOG, str(path), repeat_window=10, rank={"tp_rank": 0}) as rep:
            steps = list(range(1, 26))
            for i in range(0, len(steps), 8):
                rep.report([violation(s) for s in steps[i : i + 8]])
            assert rep.total_reported == 25 and rep.total_log_lines_suppressed == 22
    lines = messages(caplog, LOG_PREFIX + " ")
    assert [parse_log_line(m)["step"] for m in lines] == ["1", "11", "21"]
    assert "repeats" not in parse_log_line(lines[0])
    assert [parse_log_line(m).get("repeats") for m in lines[1:]] == ["9", "9"]
    assert lines[1].endswith("tp_rank=0 repeats=9")  # after the rank keys
    assert Violation.from_log_fields(parse_log_line(lines[1])) == violation(11, rank={"tp_rank": 0})
    # the 4 rows after step 21 stopped inside the window: one summary at close
    (summary,) = messages(caplog, REPEAT_LOG_PREFIX)
    fields = parse_repeat_line(summary)
    assert fields == {
        "tag": "verify", "reasons": "verify_real_kv_hash", "slot": "17", "position": "3", "count": "4",
        "first_step": "22", "last_step": "25", "tp_rank": "0",
    }  # fmt: skip
    with pytest.raises(ValueError):
        parse_log_line(summary)  # a summary is not a violation line
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == steps  # every row in the JSONL


def test_summary_when_a_later_report_passes_the_window(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rep = Reporter(Mode.LOG, repeat_window=5)
        rep.report([violation(1), violation(2), violation(3)])  # slot 17: logged, then 2 suppressed
        assert not messages(caplog, REPEAT_LOG_PREFIX)
        rep.report([violation(4, slot=30)])  # another slot, window of slot 17 not over (1 + 5 > 4)
        assert not messages(caplog, REPEAT_LOG_PREFIX)
        rep.report([violation(6, slot=30)])  # step 6 >= 1 + 5: slot 17's count is reported now
        (summary,) = messages(caplog, REPEAT_LOG_PREFIX)
        assert summary.endswith("slot=17 position=3 count=2 first_step=2 last_step=3")
        rep.report([violation(7)])  # slot 17 again after its summary: a fresh line without repeats
        rep.close()
    lines = [parse_log_line(m) for m in messages(caplog, LOG_PREFIX + " ")]
    assert [(f["slot"], f["step"], f.get("repeats")) for f in lines] == [
        ("17", "1", None), ("30", "4", None), ("17", "7", None),
    ]  # fmt: skip
    # slot 30 step 6 was suppressed (1 row); reported at close
    assert messages(caplog, REPEAT_LOG_PREFIX)[-1].endswith("slot=30 position=3 count=1 first_step=6 last_step=6")


def test_different_values_are_different_keys(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rep = Reporter(Mode.LOG, repeat_window=1000)
        rep.report([violation(1), violation(2, token=7), violation(3, slot=18), violation(4)])
    assert [parse_log_line(m)["step"] for m in messages(caplog, LOG_PREFIX + " ")] == ["1", "2", "3"]


def test_window_zero_logs_every_row(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rep = Reporter(Mode.LOG, repeat_window=0)
        rep.report([violation(s) for s in range(50)])
        rep.close()
    assert len(messages(caplog, LOG_PREFIX + " ")) == 50
    assert not messages(caplog, REPEAT_LOG_PREFIX)
    assert rep.total_log_lines_suppressed == 0


def test_window_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Reporter(Mode.LOG).repeat_window == 1000
    monkeypatch.setenv("KVCANARY_LOG_REPEAT_WINDOW", "25")
    assert Reporter(Mode.LOG).repeat_window == 25
    assert Reporter(Mode.LOG, repeat_window=3).repeat_window == 3
    monkeypatch.setenv("KVCANARY_LOG_REPEAT_WINDOW", "1_000")
    with pytest.raises(ValueError, match="^KVCANARY_LOG_REPEAT_WINDOW: expected an integer >= 0"):
        Reporter(Mode.LOG)


def test_raise_mode_is_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    rep = Reporter(Mode.RAISE, repeat_window=1000)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step in (1, 2):
            with pytest.raises(CanaryViolationError) as info:
                rep.report([violation(step)])
            assert [v.step for v in info.value.violations] == [step]
        rep.close()
    assert len(messages(caplog, LOG_PREFIX + " ")) == 2 and not messages(caplog, REPEAT_LOG_PREFIX)
    assert "repeats=" not in caplog.text


def test_key_table_is_bounded_and_evicted_counts_are_not_lost() -> None:
    f = RepeatFilter(100, max_keys=4)
    assert f.admit(violation(1, slot=1)) == 0
    assert f.admit(violation(2, slot=1)) is None  # suppressed
    for slot in range(2, 12):  # 10 more keys: slot 1 is evicted (least recently seen)
        assert f.admit(violation(3, slot=slot)) == 0
    assert len(f) == 4
    (summary,) = f.expired()
    assert (summary.violation.slot, summary.count, summary.first_step, summary.last_step) == (1, 1, 2, 2)
    assert f.admit(violation(4, slot=1)) == 0  # forgotten: logged as new


def test_filter_validates_its_window() -> None:
    with pytest.raises(ValueError, match="window"):
        RepeatFilter(-1)
    with pytest.raises(ValueError, match="window"):
        RepeatFilter(True)  # type: ignore[arg-type]


def test_manager_in_log_mode_floods_no_more(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corrupted live slot found by every forward: 30 rows in the JSONL, 3 lines (window 10) + 1 summary."""
    from one_request import OneRequest

    # the manager builds its Reporter from the mode and the path; the window comes from the environment
    monkeypatch.setenv("KVCANARY_LOG_REPEAT_WINDOW", "10")
    path = tmp_path / "r.jsonl"
    eng = OneRequest(Mode.LOG, str(path), log_repeat_window=10)
    assert eng.mgr.reporter.repeat_window == 10
    eng.forward(4)
    eng.kv[2, 0] ^= 0xFF
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for _ in range(30):
            eng.forward(1)
        eng.mgr.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 30 and {r["slot"] for r in rows} == {2}
    lines = messages(caplog, LOG_PREFIX + " ")
    assert len(lines) == 3, lines
    assert [parse_log_line(m).get("repeats") for m in lines] == [None, "9", "9"]
    (summary,) = messages(caplog, REPEAT_LOG_PREFIX)
    assert parse_repeat_line(summary)["count"] == "9"


def test_the_managers_reporter_takes_the_window_from_its_config() -> None:
    """A Config built in code (not from the environment) sets the window of the Reporter the manager builds."""
    import torch

    from kvcanary.runtime.config import Config
    from kvcanary.runtime.manager import CanaryManager
    from kvcanary.settings import Mode

    def manager(mode: Mode, window: int) -> CanaryManager:
        return CanaryManager(Config(mode=mode, log_repeat_window=window, stats_every=0), num_slots=8,
                             req_to_token=torch.zeros((2, 4), dtype=torch.int32), device="cpu", max_batch_size=2,
                             max_tokens_per_forward=8)

    assert manager(Mode.LOG, 7).reporter.repeat_window == 7
    assert manager(Mode.LOG, 0).reporter.repeat_window == 0
    assert manager(Mode.RAISE, 7).reporter.repeat_window == 0  # raise mode never suppresses
