"""kvcanary.report: violation records, the log line, the JSONL report and the Reporter's modes."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvcanary.kernels import layout
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import (
    HEALTH_SCHEMA,
    INJECTION_SCHEMA,
    LOG_KEYS,
    LOG_LINE_RE,
    LOG_PREFIX,
    LOST_SCHEMA,
    VIA_HOST_TIER,
    VIOLATION_SCHEMA,
    CanaryHealthError,
    CanaryViolationError,
    Reporter,
    Violation,
    from_hex64,
    hex64,
    parse_log_line,
)
from kvcanary.settings import Mode

NEG_HASH = -0x1234_5678_9ABC_DEF0  # a negative int64, as the ring stores hashes >= 2^63
NEG_HASH_HEX = "0xedcba98765432110"

R = layout.FailReason


def verify_row() -> list[int]:
    bits = int(R.VERIFY_CHAIN_HASH | R.VERIFY_POSITION)
    return [int(LaunchTag.VERIFY), 17, 3, 101, -1, NEG_HASH, 0x0BADC0FFEE000001, bits]


def write_row() -> list[int]:
    # write rows: column 5 is the running hash, column 6 the expected position
    return [int(LaunchTag.WRITE), 40, 9, 555, 556, 0x1A2B3C4D5E6F7081, 8, int(R.WRITE_TOKEN | R.WRITE_POSITION)]


def sweep_row() -> list[int]:
    return [int(LaunchTag.SWEEP), 5, 0, 7, -1, 0x11, NEG_HASH, int(R.VERIFY_REAL_KV_HASH)]


def out_of_range_row() -> list[int]:
    # verify row for slot >= num_slots: (slot, expected position, -1, expected token, 0, slot)
    return [int(LaunchTag.VERIFY), 9999, 4, -1, 12, 0, 9999, int(R.SLOT_OUT_OF_RANGE)]


def make(row: list[int], step: int = 12, request_row: int | None = 5, rank: dict[str, int] | None = None) -> Violation:
    return Violation.from_row(row, step=step, request_row=request_row, rank=rank)


# -- Violation ---------------------------------------------------------------------------------------------


def test_from_row_maps_every_column() -> None:
    row = verify_row()
    v = make(row)
    assert (v.kernel_kind, v.slot, v.position, v.stored_token, v.expected_token) == (0, 17, 3, 101, -1)
    assert v.stored_chain_hash == NEG_HASH
    assert v.expected_aux == 0x0BADC0FFEE000001
    assert v.fail_reason_bits == 3
    assert (v.step, v.request_row, v.rank) == (12, 5, None)
    assert v.reasons == ("verify_chain_hash", "verify_position")
    assert v.tag_name == "verify"
    assert not v.is_write
    assert make(write_row()).is_write
    assert make([7, 0, 0, 0, 0, 0, 0, 1]).tag_name == "tag7"
    with pytest.raises(ValueError, match="8 columns"):
        Violation.from_row(row[:7], step=0)


def test_hex_of_negative_hashes() -> None:
    assert hex64(NEG_HASH) == NEG_HASH_HEX
    assert hex64(-1) == "0xffffffffffffffff"
    assert hex64(0) == "0x0000000000000000"
    assert hex64(1 << 63) == "0x8000000000000000"
    assert from_hex64(NEG_HASH_HEX) == NEG_HASH
    assert from_hex64("0xffffffffffffffff") == -1


def test_log_line_verify_row_exact() -> None:
    line = make(verify_row()).log_line()
    assert line == (
        "kvcanary violation: step=12 tag=verify reasons=verify_chain_hash+verify_position slot=17 position=3 "
        f"stored_token=101 expected_token=-1 stored_chain_hash={NEG_HASH_HEX} expected_aux=0x0badc0ffee000001 "
        "request_row=5 written_step=- writer_rid=-"
    )


def test_log_line_write_row_has_decimal_expected_position() -> None:
    fields = parse_log_line(make(write_row(), request_row=None).log_line())
    assert fields["tag"] == "write"
    assert fields["reasons"] == "write_token+write_position"
    assert fields["stored_chain_hash"] == "0x1a2b3c4d5e6f7081"
    assert fields["expected_aux"] == "8"
    assert fields["request_row"] == "-"


def test_log_line_sweep_row_has_hex_expected_hash() -> None:
    fields = parse_log_line(make(sweep_row()).log_line())
    assert fields["tag"] == "sweep"
    assert fields["reasons"] == "verify_real_kv_hash"
    assert fields["expected_aux"] == NEG_HASH_HEX
    assert fields["stored_chain_hash"] == "0x0000000000000011"


def test_log_line_out_of_range_row_has_decimal_index() -> None:
    v = make(out_of_range_row())
    fields = parse_log_line(v.log_line())
    assert fields["reasons"] == "slot_out_of_range"
    assert fields["expected_aux"] == "9999"
    assert fields["slot"] == "9999"
    assert v.expected_aux_kind == "index"
    # an out-of-range prev on a verify row: the other failures plus the bit, expected_aux = prev (may be < -1)
    v2 = make([0, 3, 1, 2, -1, 77, -5, int(R.VERIFY_POSITION | R.SLOT_OUT_OF_RANGE)])
    assert parse_log_line(v2.log_line())["expected_aux"] == "-5"


def test_log_line_rank_keys_follow() -> None:
    line = make(verify_row(), rank={"tp_rank": 1, "pp_rank": 0}).log_line()
    assert line.endswith("request_row=5 written_step=- writer_rid=- tp_rank=1 pp_rank=0")
    fields = parse_log_line(line)
    assert fields["tp_rank"] == "1" and fields["pp_rank"] == "0"


def test_rank_keys_validated() -> None:
    with pytest.raises(ValueError, match="rank key"):
        make(verify_row(), rank={"tp rank": 0})
    with pytest.raises(ValueError, match="rank key"):
        make(verify_row(), rank={"slot": 0})


UNKNOWN_TAG_ROW = [9, -1, -1, -1, -1, -1, -1, 1 << 12]


@pytest.mark.parametrize("row", [verify_row(), write_row(), sweep_row(), out_of_range_row(), UNKNOWN_TAG_ROW])
@pytest.mark.parametrize("rank", [None, {"tp_rank": 3}])
@pytest.mark.parametrize("request_row", [None, 0, 42])
@pytest.mark.parametrize("via", [None, VIA_HOST_TIER])
def test_log_line_round_trip(row: list[int], rank: dict[str, int] | None, request_row: int | None,
                             via: str | None) -> None:
    v = make(row, step=99, request_row=request_row, rank=rank)
    v = dataclasses.replace(v, written_step=None if request_row is None else 97, writer_rid=None if rank else "a1b2",
                            via=via)
    line = v.log_line()
    assert "\n" not in line
    assert line.startswith(LOG_PREFIX + " ")
    assert LOG_LINE_RE.search(line)
    fields = parse_log_line(line)
    assert list(fields)[:12] == [
        "step", "tag", "reasons", "slot", "position", "stored_token", "expected_token",
        "stored_chain_hash", "expected_aux", "request_row", "written_step", "writer_rid",
    ]  # fmt: skip
    keys = LOG_KEYS if via is not None else tuple(k for k in LOG_KEYS if k != "via")  # via: only when set
    assert tuple(fields)[: len(keys)] == keys
    assert ("via" in fields) == (via is not None)
    assert all(" " not in value for value in fields.values())
    assert Violation.from_log_fields(fields) == v
    assert Violation.from_log_fields(fields).to_json(now=0.0)["via"] == via


def test_via_is_checked() -> None:
    with pytest.raises(ValueError, match="via"):
        dataclasses.replace(make(verify_row()), via="disk")


OLD_LINE = (  # a line as v1 printed it before writer attribution: no written_step / writer_rid keys
    "kvcanary violation: step=12 tag=verify reasons=verify_chain_hash+verify_position slot=17 position=3 "
    f"stored_token=101 expected_token=-1 stored_chain_hash={NEG_HASH_HEX} expected_aux=0x0badc0ffee000001 "
    "request_row=5 tp_rank=1"
)


def test_old_lines_without_writer_keys_still_parse() -> None:
    fields = parse_log_line(OLD_LINE)
    assert "written_step" not in fields and fields["tp_rank"] == "1"
    v = Violation.from_log_fields(fields)
    assert v == make(verify_row(), rank={"tp_rank": 1})
    assert (v.written_step, v.writer_rid, v.rank) == (None, None, {"tp_rank": 1})
    # the new form of the same record carries the keys, in order, before the rank keys
    new = dataclasses.replace(v, written_step=11, writer_rid="9f8e7d6c5b4a")
    assert new.log_line() == OLD_LINE.replace(
        "request_row=5 tp_rank=1", "request_row=5 written_step=11 writer_rid=9f8e7d6c5b4a tp_rank=1"
    )
    assert Violation.from_log_fields(parse_log_line(new.log_line())) == new
    with pytest.raises(ValueError, match="missing request_row"):
        Violation.from_log_fields(parse_log_line(OLD_LINE.replace(" request_row=5", "")))


def test_writer_fields_from_row_and_json() -> None:
    v = Violation.from_row(verify_row(), step=30, request_row=2, written_step=28, writer_rid="0123abcd-ef")
    assert (v.written_step, v.writer_rid) == (28, "0123abcd-ef")
    obj = v.to_json(now=1.0)
    assert (obj["written_step"], obj["writer_rid"]) == (28, "0123abcd-ef")
    assert list(obj).index("writer_rid") == list(obj).index("request_row") + 2
    fields = parse_log_line(v.log_line())
    assert (fields["written_step"], fields["writer_rid"]) == ("28", "0123abcd-ef")
    # an empty rid carries nothing: None, printed "-"
    assert Violation.from_row(verify_row(), step=1, writer_rid="").writer_rid is None
    with pytest.raises(ValueError, match="writer_rid"):
        Violation.from_row(verify_row(), step=1, writer_rid=123)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "rid",
    [
        "f47ac10b-58cc-4372-a567-0e02b2c3d479",
        "deadbeef" * 4,
        "has space",
        "tab\there\nnewline",
        "key=value",
        "100%",
        "%41",
        "-",
        "--",
        "ü-rid-١٠",
        "a+b,c:d/e@f~g",
        " ",
    ],
)
def test_writer_rid_never_breaks_the_line(rid: str) -> None:
    v = Violation.from_row(verify_row(), step=3, written_step=1, writer_rid=rid, rank={"tp_rank": 0})
    line = v.log_line()
    value = line.split(" writer_rid=", 1)[1].split(" ")[0]
    assert value and not any(c.isspace() or c == "=" for c in value) and value.isascii() and value != "-"
    assert line.endswith(f"writer_rid={value} tp_rank=0")
    fields = parse_log_line(f"INFO prefix: {line}")
    assert Violation.from_log_fields(fields).writer_rid == rid
    if all(c.isalnum() and c.isascii() or c == "-" for c in rid) and rid.strip("-"):
        assert value == rid  # hex and uuid rids are printed as they are


def test_parse_log_line_accepts_logging_prefix_and_rejects_other_lines() -> None:
    line = make(verify_row()).log_line()
    assert parse_log_line(f"2025-01-01 WARNING kvcanary.report: {line}\n") == parse_log_line(line)
    with pytest.raises(ValueError):
        parse_log_line("kvcanary stats: step=1 forwards=1")
    with pytest.raises(ValueError):
        parse_log_line("kvcanary violation: step=1 tag=verify garbage")


def test_to_json_schema() -> None:
    v = make(verify_row(), rank={"tp_rank": 2})
    obj = v.to_json(now=1700000000.5)
    assert obj == {
        "schema": VIOLATION_SCHEMA,
        "step": 12,
        "tag": "verify",
        "kernel_kind": 0,
        "reasons": ["verify_chain_hash", "verify_position"],
        "fail_reason_bits": 3,
        "slot": 17,
        "position": 3,
        "stored_token": 101,
        "expected_token": -1,
        "stored_chain_hash": NEG_HASH_HEX,
        "expected_aux": 0x0BADC0FFEE000001,
        "expected_aux_hex": "0x0badc0ffee000001",
        "expected_aux_kind": "hash",
        "request_row": 5,
        "written_step": None,
        "writer_rid": None,
        "via": None,
        "rank": {"tp_rank": 2},
        "time": 1700000000.5,
    }
    w = make(write_row(), request_row=None).to_json()
    assert w["expected_aux"] == 8 and w["expected_aux_kind"] == "position" and w["request_row"] is None
    assert w["rank"] is None and isinstance(w["time"], float)
    assert json.loads(json.dumps(w)) == w


# -- Reporter ----------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_log_mode_logs_one_warning_per_violation_and_writes_jsonl(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sub" / "dir" / "report.jsonl"
    batch = [make(verify_row()), make(write_row()), make(sweep_row())]
    with caplog.at_level(logging.WARNING, logger="kvcanary.report.reporter"):
        with Reporter(Mode.LOG, str(path)) as reporter:
            reporter.report(batch)
            # written already, before close
            assert len(read_jsonl(path)) == 3
            assert reporter.total_reported == 3 and reporter.total_lost == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [v.log_line() for v in batch]
    rows = read_jsonl(path)
    assert [r["schema"] for r in rows] == [VIOLATION_SCHEMA] * 3
    assert [r["tag"] for r in rows] == ["verify", "write", "sweep"]
    assert rows[0]["stored_chain_hash"] == NEG_HASH_HEX


def test_reporter_appends_to_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"schema":"older"}\n')
    with Reporter("log", str(path), logger=logging.getLogger("test.quiet")) as reporter:
        reporter.report([make(verify_row())])
    rows = read_jsonl(path)
    assert [r["schema"] for r in rows] == ["older", VIOLATION_SCHEMA]


def test_raise_mode_writes_before_raising_with_all_violations(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "r.jsonl"
    batch = [make(verify_row(), step=s) for s in range(8)]
    reporter = Reporter(Mode.RAISE, str(path))
    try:
        with caplog.at_level(logging.WARNING, logger="kvcanary.report.reporter"):
            reporter.report(batch, lost=3)
    except CanaryViolationError as exc:
        rows = read_jsonl(path)  # read inside the except block: no close() has happened
        assert [r["step"] for r in rows if r["schema"] == VIOLATION_SCHEMA] == list(range(8))
        assert [r for r in rows if r["schema"] == LOST_SCHEMA][0]["count"] == 3
        assert exc.violations == batch
        assert exc.lost == 3
        message = str(exc)
        assert message.startswith("8 kvcanary violations")
        assert "+3 lost" in message
        assert message.count(LOG_PREFIX) == 5 and "... and 3 more" in message
        assert batch[0].log_line() in message
        assert len([r for r in caplog.records if r.getMessage().startswith(LOG_PREFIX)]) == 8
    else:
        pytest.fail("raise mode did not raise")
    finally:
        reporter.close()
    assert reporter.total_reported == 8 and reporter.total_lost == 3


def test_raise_mode_single_violation_message() -> None:
    with pytest.raises(CanaryViolationError, match=r"^1 kvcanary violation: ") as info:
        Reporter(Mode.RAISE, logger=logging.getLogger("test.quiet")).report([make(out_of_range_row())])
    assert len(info.value.violations) == 1


def test_empty_batch_is_a_no_op(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with Reporter(Mode.RAISE, str(path)) as reporter:
        reporter.report([])
        reporter.report([], lost=0)
    assert path.read_text() == ""


def test_lost_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "r.jsonl"
    with caplog.at_level(logging.WARNING, logger="kvcanary.report.reporter"):
        with Reporter(Mode.LOG, str(path), rank={"tp_rank": 1}) as reporter:
            reporter.report([make(verify_row(), step=4)], lost=10)
            reporter.report([], lost=5, step=6)
            assert reporter.total_lost == 15 and reporter.total_reported == 1
    rows = read_jsonl(path)
    lost = [r for r in rows if r["schema"] == LOST_SCHEMA]
    assert [(r["count"], r["step"], r["rank"]) for r in lost] == [(10, 4, {"tp_rank": 1}), (5, 6, {"tp_rank": 1})]
    assert rows[0]["rank"] == {"tp_rank": 1}  # the reporter's rank fills in violations without one
    lost_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcanary lost:")]
    assert len(lost_lines) == 2
    assert "step=4 count=10" in lost_lines[0] and "step=6 count=5" in lost_lines[1]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_off_mode_does_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "r.jsonl"
    with caplog.at_level(logging.DEBUG):
        reporter = Reporter(Mode.OFF, str(path))
        reporter.report([make(verify_row())], lost=3)
        reporter.health_error("stalled")
        reporter.close()
    assert not path.exists()
    assert not caplog.records
    assert reporter.total_reported == 0


def test_close_is_idempotent_and_a_late_report_reopens(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    reporter = Reporter(Mode.LOG, str(path), logger=logging.getLogger("test.quiet"))
    assert path.exists() and not reporter.closed  # opened eagerly: a bad path fails at install time
    reporter.close()
    reporter.close()
    assert reporter.closed
    reporter.report([make(verify_row())])  # e.g. a last drain after atexit: not lost
    reporter.close()
    assert len(read_jsonl(path)) == 1


def test_bad_report_path_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"^KVCANARY_REPORT: .* is not a directory"):
        Reporter(Mode.LOG, str(blocker / "r.jsonl"))


def test_health_error_log_mode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "r.jsonl"
    with caplog.at_level(logging.WARNING, logger="kvcanary.report.reporter"):
        with Reporter(Mode.LOG, str(path)) as reporter:
            reporter.health_error("verify did not run", step=200, tags=[LaunchTag.VERIFY])
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["kvcanary health: verify did not run"]
    (row,) = read_jsonl(path)
    assert row["schema"] == HEALTH_SCHEMA
    assert (row["message"], row["step"], row["tags"]) == ("verify did not run", 200, ["verify"])


def test_health_error_raise_mode_writes_first(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with Reporter(Mode.RAISE, str(path)) as reporter:
        with pytest.raises(CanaryHealthError, match="sweep stalled"):
            reporter.health_error("sweep stalled", step=5, tags=[2])
        assert read_jsonl(path)[0]["tags"] == ["sweep"]
        assert reporter.total_health_errors == 1


@pytest.mark.parametrize("mode", [Mode.LOG, Mode.RAISE])
def test_record_injection_writes_one_line_and_never_raises(tmp_path: Path, mode: Mode) -> None:
    from kvcanary.runtime.faults import Injection

    path = tmp_path / "r.jsonl"
    inj = Injection("req_to_token_redirect", 41, (7, 9, 12), "req_to_token[3, 5]: 9 -> 7")
    with Reporter(mode, str(path), rank={"tp_rank": 1}) as reporter:
        record = reporter.record_injection(inj)
        reporter.report([make(verify_row(), step=42)] if mode is Mode.LOG else [])
        assert reporter.total_injections == 1
    rows = read_jsonl(path)
    assert rows[0] == record
    assert rows[0]["schema"] == INJECTION_SCHEMA
    assert {k: rows[0][k] for k in ("fault", "step", "slots", "detail", "rank")} == {
        "fault": "req_to_token_redirect", "step": 41, "slots": [7, 9, 12], "detail": "req_to_token[3, 5]: 9 -> 7",
        "rank": {"tp_rank": 1},
    }
    assert isinstance(rows[0]["time"], float)
    assert [r["schema"] for r in rows[1:]] == ([VIOLATION_SCHEMA] if mode is Mode.LOG else [])


def test_record_injection_off_mode_and_no_path(tmp_path: Path) -> None:
    from kvcanary.runtime.faults import Injection

    inj = Injection("token_swap", None, (), "input_ids[0] 1 <-> input_ids[1] 2")
    assert Reporter(Mode.OFF, str(tmp_path / "off.jsonl")).record_injection(inj) is None
    assert not (tmp_path / "off.jsonl").exists()
    reporter = Reporter(Mode.LOG)  # no report path: counted, nothing written
    assert reporter.record_injection(inj)["step"] is None and reporter.total_injections == 1


def _append_worker(path: str, rank: int, barrier: Any) -> None:
    reporter = Reporter(Mode.LOG, path, logger=logging.getLogger("test.quiet"), rank={"tp_rank": rank})
    barrier.wait()
    for batch in range(10):
        reporter.report([make(verify_row(), step=batch * 50 + i, request_row=rank) for i in range(50)])
    reporter.close()
    os._exit(0)


def test_two_processes_append_to_one_file_without_interleaving(tmp_path: Path) -> None:
    logging.getLogger("test.quiet").propagate = False
    path = str(tmp_path / "shared.jsonl")
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_append_worker, args=(path, rank, barrier)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 1000
    rows = [json.loads(line) for line in lines]  # every line intact
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == {"tp_rank": rank}]
        assert [r["step"] for r in mine] == list(range(500))
        assert all(r["request_row"] == rank for r in mine)


def test_log_line_regex_is_module_level() -> None:
    assert isinstance(LOG_LINE_RE, re.Pattern)
