"""A failing report sink: log mode keeps serving (logged once then rate-limited, counted, retried, dropped);
raise mode raises the original OSError after logging; a bad KVCANARY_REPORT fails at construction, named."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from one_request import OneRequest

from kvcanary.kernels import layout
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import (
    HEALTH_SCHEMA,
    INJECTION_SCHEMA,
    LOG_PREFIX,
    SINK_LOG_PREFIX,
    VIOLATION_SCHEMA,
    CanaryViolationError,
    Reporter,
    Violation,
)
from kvcanary.runtime.faults import Injection
from kvcanary.settings import Mode

R = layout.FailReason
LOGGER = "kvcanary.report.reporter"


def row(slot: int = 17) -> list[int]:
    return [int(LaunchTag.VERIFY), slot, 3, 101, -1, 0x55, 0x66, int(R.VERIFY_CHAIN_HASH)]


def violation(step: int, slot: int = 17) -> Violation:
    return Violation.from_row(row(slot), step=step)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sink_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(SINK_LOG_PREFIX) and r.levelno == logging.ERROR
    ]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- a CanaryManager on CPU: serving goes on ---------------------------------------------------------------


def test_log_mode_manager_keeps_serving_with_report_on_dev_full(caplog: pytest.LogCaptureFixture) -> None:
    eng = OneRequest(Mode.LOG, "/dev/full")  # accepted at start-up: a device, writable; every write fails ENOSPC
    eng.forward(4)
    eng.kv[2, 0] ^= 0xFF  # corrupt a live slot: every later forward finds it
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        found = []
        for _ in range(5):
            found += eng.forward(1)  # must not raise
    assert found and all(v.reasons == ("verify_real_kv_hash",) for v in found)
    rep = eng.mgr.reporter
    assert rep.total_reported == len(found)
    assert rep.total_sink_errors == len(found) and rep.total_lines_dropped == len(found)
    errors = sink_errors(caplog)
    assert len(errors) == 1, errors  # once, then rate-limited
    assert "/dev/full" in errors[0] and "ENOSPC" in errors[0] and "keeps serving" in errors[0]
    assert any(r.getMessage().startswith(LOG_PREFIX) for r in caplog.records)  # the WARNING line still went out
    eng.mgr.close()


def test_raise_mode_manager_raises_the_sink_oserror(caplog: pytest.LogCaptureFixture) -> None:
    eng = OneRequest(Mode.RAISE, "/dev/full")
    eng.forward(4)
    eng.kv[2, 0] ^= 0xFF
    with caplog.at_level(logging.WARNING, logger="kvcanary"), pytest.raises(OSError) as info:
        eng.forward(1)
    assert info.value.errno == errno.ENOSPC and not isinstance(info.value, CanaryViolationError)
    assert len(sink_errors(caplog)) == 1  # logged before raising
    assert any(r.getMessage().startswith(LOG_PREFIX) for r in caplog.records)
    assert eng.mgr.reporter.total_sink_errors == 1 and eng.mgr.reporter.total_lines_dropped == 1
    eng.mgr.reporter.close()


# -- the Reporter's policy ---------------------------------------------------------------------------------


def test_dev_full_rate_limited_with_counts(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rep = Reporter(Mode.LOG, "/dev/full", repeat_window=0, clock=clock, sink_error_interval_s=60)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rep.report([violation(1), violation(1, slot=18)])  # 2 lines dropped, 1 ERROR line
        clock.now += 30
        rep.report([violation(2)], lost=4)  # violation + lost line: 2 more dropped, silent
        rep.health_error("verify stalled", step=3, tags=[0])  # 1 more, silent; health ERROR line still logged
        rep.record_injection(Injection("real_kv_flip", 3, (5,), "flip"))  # 1 more, silent, no raise
        clock.now += 31  # 61 s after the first message
        rep.report([violation(4)])
    errors = sink_errors(caplog)
    assert len(errors) == 2, errors
    assert "2 line(s) dropped" in errors[0]
    assert "still fails" in errors[1] and "4 error(s) and 5 line(s) dropped since the last message" in errors[1]
    assert "(7 line(s) in all)" in errors[1]
    assert (rep.total_sink_errors, rep.total_lines_dropped) == (5, 7)
    assert rep.total_reported == 4 and rep.total_lost == 4 and rep.total_health_errors == 1
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcanary health:")]
    assert len([r for r in caplog.records if r.getMessage().startswith(LOG_PREFIX)]) == 4
    rep.close()


@pytest.mark.parametrize("what", ["violation", "health", "injection"])
def test_raise_mode_raises_the_original_oserror(what: str, caplog: pytest.LogCaptureFixture) -> None:
    rep = Reporter(Mode.RAISE, "/dev/full")
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(OSError) as info:
        if what == "violation":
            rep.report([violation(1)])
        elif what == "health":
            rep.health_error("write stalled", step=9, tags=[1])
        else:
            rep.record_injection(Injection("token_swap", 2, (), "swap"))
    assert type(info.value) is OSError and info.value.errno == errno.ENOSPC
    assert len(sink_errors(caplog)) == 1
    if what == "health":  # the health message is not lost with the JSON line
        assert any(r.getMessage() == "kvcanary health: write stalled" for r in caplog.records)
    assert rep.total_sink_errors == 1 and rep.total_lines_dropped == 1
    rep.close()


def test_directory_removed_after_start_then_restored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "logs"
    path = directory / "kv.jsonl"
    clock = FakeClock()
    rep = Reporter(Mode.LOG, str(path), repeat_window=0, clock=clock)
    rep.report([violation(1)])
    assert len(read_jsonl(path)) == 1
    shutil.rmtree(directory)  # the open file is unlinked with it: writes there would vanish
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        rep.report([violation(2)])  # noticed (stat), reopen fails: the directory is not recreated
        rep.report([violation(3)])
        assert not directory.exists()
        assert (rep.total_sink_errors, rep.total_lines_dropped) == (2, 2)
        directory.mkdir()  # the operator brings it back: the next report writes again
        rep.report([violation(4)])
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [4] and rows[0]["schema"] == VIOLATION_SCHEMA
    errors = sink_errors(caplog)
    assert len(errors) == 1 and "ENOENT" in errors[0]
    recovered = [r.getMessage() for r in caplog.records if "is written again" in r.getMessage()]
    assert len(recovered) == 1 and "2 line(s) dropped in all" in recovered[0]
    rep.close()


def test_file_removed_or_rotated_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    with Reporter(Mode.LOG, str(path), repeat_window=0) as rep:
        rep.report([violation(1)])
        path.unlink()
        rep.report([violation(2)])  # a new file at the path, not the unlinked inode
        assert [r["step"] for r in read_jsonl(path)] == [2]
        path.rename(tmp_path / "kv.jsonl.1")  # rotation
        rep.report([violation(3)])
        assert [r["step"] for r in read_jsonl(path)] == [3]
        assert [r["step"] for r in read_jsonl(tmp_path / "kv.jsonl.1")] == [2]
        assert rep.total_sink_errors == 0


def _open_fds_for(path: Path) -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == str(path):
                fds.append(int(name))
        except OSError:
            pass
    return fds


def test_descriptor_closed_behind_our_back_is_reopened_once(tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    with Reporter(Mode.LOG, str(path), repeat_window=0) as rep:
        (fd,) = _open_fds_for(path)
        os.close(fd)  # EBADF on the next write
        rep.report([violation(1)])
        assert [r["step"] for r in read_jsonl(path)] == [1]
        assert rep.total_sink_errors == 0


def test_fake_fd_errors_are_retried_on_the_next_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "kv.jsonl"
    rep = Reporter(Mode.LOG, str(path), repeat_window=0)
    real_write = os.write
    state = {"fail": 2}

    def flaky_write(fd: int, data: bytes) -> int:
        if state["fail"] > 0:
            state["fail"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real_write(fd, data)

    monkeypatch.setattr("kvcanary.report.sink.os.write", flaky_write)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rep.report([violation(1), violation(1, slot=2), violation(1, slot=3)])  # first line fails: batch dropped
        rep.report([violation(2)])  # fails again
        rep.report([violation(3)])  # retried: works
    assert [r["step"] for r in read_jsonl(path)] == [3]
    assert (rep.total_sink_errors, rep.total_lines_dropped) == (2, 4)
    assert len(sink_errors(caplog)) == 1 and "EIO" in sink_errors(caplog)[0]
    rep.close()


def test_a_torn_line_does_not_corrupt_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kv.jsonl"
    rep = Reporter(Mode.LOG, str(path), repeat_window=0)
    real_write = os.write
    state = {"calls": 0}

    def half_then_enospc(fd: int, data: bytes) -> int:
        state["calls"] += 1
        if state["calls"] == 1:
            return real_write(fd, data[:10])  # a short write ...
        if state["calls"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk is full
        return real_write(fd, data)

    monkeypatch.setattr("kvcanary.report.sink.os.write", half_then_enospc)
    rep.report([violation(1)])
    rep.report([violation(2)])
    lines = path.read_text().split("\n")
    assert len(lines[0]) == 10  # the torn line, on its own
    assert json.loads(lines[1])["step"] == 2 and lines[2] == ""
    assert rep.total_lines_dropped == 1
    rep.close()


def test_health_and_injection_lines_survive_a_good_sink(tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    with Reporter(Mode.LOG, str(path)) as rep:
        rep.health_error("stalled", step=1, tags=[0])
        rep.record_injection(Injection("real_kv_flip", 1, (3,), "flip"))
    assert [r["schema"] for r in read_jsonl(path)] == [HEALTH_SCHEMA, INJECTION_SCHEMA]


# -- a bad KVCANARY_REPORT at start-up ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "proc", "under_file", "sys"])
def test_bad_report_path_fails_at_construction_naming_the_variable(tmp_path: Path, kind: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    path = {
        "directory": str(tmp_path),
        "proc": "/proc/kvcanary.jsonl",
        "under_file": str(blocker / "r.jsonl"),
        "sys": "/sys/kvcanary.jsonl",
    }[kind]
    for mode in (Mode.LOG, Mode.RAISE):
        with pytest.raises(ValueError, match=r"^KVCANARY_REPORT: "):
            Reporter(mode, path)
        with pytest.raises(ValueError, match=r"^KVCANARY_REPORT: "):
            OneRequest(mode, path)


def test_open_failure_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("kvcanary.report.sink.os.open", refuse)
    with pytest.raises(ValueError, match=r"^KVCANARY_REPORT: cannot open .* Read-only file system") as info:
        Reporter(Mode.LOG, str(tmp_path / "r.jsonl"))
    assert isinstance(info.value.__cause__, OSError)


def test_relative_path_stays_where_it_was_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with Reporter(Mode.LOG, "kv.jsonl", repeat_window=0) as rep:
        monkeypatch.chdir(tmp_path / "b")  # a relative path must not now name b/kv.jsonl
        rep.report([violation(1)])
    assert [r["step"] for r in read_jsonl(tmp_path / "a" / "kv.jsonl")] == [1]
    assert not (tmp_path / "b" / "kv.jsonl").exists()


def test_off_and_raise_ignore_the_repeat_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_LOG_REPEAT_WINDOW", "not a number")
    assert Reporter(Mode.OFF).repeat_window == 0 and Reporter(Mode.RAISE).repeat_window == 0
    with pytest.raises(ValueError, match="^KVCANARY_LOG_REPEAT_WINDOW: "):
        Reporter(Mode.LOG)
