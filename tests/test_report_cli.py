"""``kvcanary report``: JSONL files written by the real Reporter (one per rank) are summarised per reason, rank, tag,
slot and request; injections are matched to violations within their own rank; bad lines (not JSON, cut off, not
a kvcanary record, a field missing, an unknown schema, not UTF-8) are reported as FILE:LINE with the line escaped,
skipped, and make the exit status 1. ``-`` (stdin), FIFOs and /dev/null are read as streams; a directory is refused by
name. On the real tensor-parallel fault run in shared/ the matcher agrees with the e2e driver's own."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from kvcanary.cli import matcher, summarize
from kvcanary.cli.main import main
from kvcanary.kernels import layout
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import Reporter, Violation
from kvcanary.runtime.faults import Injection
from kvcanary.settings import Mode

R = layout.FailReason
REPO = Path(__file__).resolve().parent.parent
TP2_FAULTS = REPO.parent / "shared" / "e2e" / "results" / "tp2-faults-2026-11-30.tgz"


def _violation(slot: int, step: int, bits: int, *, tag: LaunchTag = LaunchTag.VERIFY, request_row: int | None = None,
               writer_rid: str | None = None) -> Violation:
    row = [int(tag), slot, 3, 101, -1, 0x1234, 0x5678, int(bits)]
    return Violation.from_row(row, step=step, request_row=request_row, written_step=None if writer_rid is None else 1,
                              writer_rid=writer_rid)


def _write_rank0(path: Path) -> None:
    with Reporter(Mode.LOG, str(path), rank={"tp_rank": 0}) as rep:
        rep.record_injection(Injection("real_kv_flip", 10, (5,), "flip"))
        rep.report([_violation(5, 12, R.VERIFY_REAL_KV_HASH, request_row=2)])  # detected, latency 2
        rep.record_injection(Injection("token_swap", 20, (7, 8), "swap"))
        rep.report([_violation(8, 100, R.VERIFY_TOKEN, request_row=2)])  # detected within token_swap's 256
        rep.record_injection(Injection("position_skew", 30, (9,), "skew"))  # never reported: missed
        rep.report([_violation(50, 40, R.VERIFY_CHAIN_HASH, request_row=4)], lost=3)  # no injection: unexplained
        rep.report([_violation(5, 50, R.VERIFY_REAL_KV_HASH, tag=LaunchTag.SWEEP)])  # 40 forwards late
        rep.health_error("verify stalled", step=60, tags=[int(LaunchTag.VERIFY)])


def _write_rank1(path: Path) -> None:
    with Reporter(Mode.LOG, str(path), rank={"tp_rank": 1}) as rep:
        # the same slot and step as rank 0's injection: another rank's injection must not explain it
        rep.report([_violation(5, 12, R.VERIFY_REAL_KV_HASH | R.VERIFY_CHAIN_HASH, writer_rid="req-a"),
                    _violation(6, 14, R.WRITE_POSITION, tag=LaunchTag.WRITE, writer_rid="req-a")])


BAD_LINES = [
    (b"this is not json\n", "not JSON"),
    (b'{"foo": 1}\n', "not a kvcanary record (schema None)"),
    (b"[1, 2]\n", "not a kvcanary record (a JSON list"),
    (b'{"schema": "kvcanary.violation/1", "step": 1}\n', "kvcanary.violation/1: missing field 'tag'"),
    (b'{"schema": "kvcanary.lost/1", "count": "3", "step": 1, "rank": null}\n',
     "kvcanary.lost/1: field 'count' has a bad value '3'"),
    (b'{"schema": "kvcanary.violation/9"}\n', "unsupported kvcanary schema 'kvcanary.violation/9'"),
    (b'{"schema":"kvcanary.violation/1","step":77,"ta', "truncated line (no newline at the end of the file)"),
]


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    _write_rank0(tmp_path / "kvc-0.jsonl")
    _write_rank1(tmp_path / "kvc-1.jsonl")
    return tmp_path


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    return main(argv, out=out), out.getvalue()


def test_multi_rank_summary(reports: Path) -> None:
    code, text = _run(["report", "--json", str(reports / "kvc-*.jsonl")])
    assert code == 0, text
    s = json.loads(text)
    assert list(s["files"]) == [str(reports / "kvc-0.jsonl"), str(reports / "kvc-1.jsonl")]
    assert s["records"] == {"kvcanary.injection/1": 3, "kvcanary.violation/1": 6, "kvcanary.lost/1": 1,
                            "kvcanary.health/1": 1}
    assert s["violations"] == 6 and (s["first_step"], s["last_step"]) == (12, 100)
    assert s["by_reason"] == {"verify_real_kv_hash": 3, "verify_chain_hash": 2, "verify_token": 1, "write_position": 1}
    assert s["by_tag"] == {"verify": 4, "sweep": 1, "write": 1}
    assert s["by_rank"]["tp_rank=0"] == {"violations": 4, "first_step": 12, "last_step": 100, "lost": 3, "health": 1,
                                         "injections": 3}
    assert s["by_rank"]["tp_rank=1"] == {"violations": 2, "first_step": 12, "last_step": 14, "lost": 0, "health": 0,
                                         "injections": 0}
    assert s["top_slots"][0] == {"rank": "tp_rank=0", "slot": 5, "violations": 2}
    assert {"rank": "tp_rank=0", "request_row": 2, "violations": 2} in s["top_request_rows"]
    assert s["top_writer_rids"] == [{"rank": "tp_rank=1", "writer_rid": "req-a", "violations": 2}]
    assert s["lost"] == {"records": 1, "rows": 3}
    assert [h["message"] for h in s["health"]] == ["verify stalled"]
    inj = s["injections"]
    assert inj["classes"]["real_kv_flip"]["detected"] == 1 and inj["classes"]["real_kv_flip"]["latency_forwards"] == [2]
    assert inj["classes"]["token_swap"]["latency_forwards"] == [80]
    assert inj["classes"]["position_skew"] == {"injected": 1, "detected": 0, "latency_forwards": [], "reasons": {},
                                               "tags": {}}
    assert [m["fault"] for m in inj["missed"]] == ["position_skew"]
    # slot 50 (no injection) and rank 1's slots 5 and 6 (rank 0's injection is not theirs)
    assert inj["unexplained"] == 3 and inj["late"] == 1
    assert s["explanations"] == []  # faults and mixed reasons: no pattern pinned


def test_text_form(reports: Path) -> None:
    code, text = _run(["report", str(reports / "kvc-0.jsonl"), str(reports / "kvc-1.jsonl")])
    assert code == 0, text
    assert text.startswith("kvcanary report: 2 file(s), 11 records (6 violation, 1 lost, 1 health, 3 injection), "
                           "0 bad line(s)")
    assert "violations: 6, steps 12..100" in text
    assert "tp_rank=0 |          4 | 12..100 |         3 |      1 |          3" in text
    assert "lost: 3 violation rows the ring could not keep (1 lost records)" in text
    assert "step=60 tp_rank=0: verify stalled" in text
    assert "top 2 of 2 writers (writer_rid):" not in text and "top 1 of 1 writers (writer_rid):" in text
    assert "real_kv_flip  |        1 |        1 | 100 % | 2 " in text
    assert "injections without a detection: 1" in text and "missed: step=30 position_skew slots=[9]" in text


def test_bad_lines_are_reported_with_file_and_line_and_skipped(reports: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = reports / "kvc-1.jsonl"
    good = path.read_bytes()
    with open(path, "ab") as f:
        for raw, _ in BAD_LINES:
            f.write(raw)
    first = good.count(b"\n") + 1
    code, text = _run(["report", "--json", str(reports / "kvc-*.jsonl")])
    assert code == 1
    err = capsys.readouterr().err
    for n, (_, what) in enumerate(BAD_LINES):
        assert f"kvcanary report: {path}:{first + n}: {what}" in err, err
    s = json.loads(text)
    assert s["violations"] == 6  # every good record still counted
    assert [(b["line"], b["path"]) for b in s["bad_lines"]] == [(first + n, str(path)) for n in range(len(BAD_LINES))]
    code, text = _run(["report", str(path)])
    assert code == 1 and f"bad lines: {len(BAD_LINES)}" in text and "... and 2 more" in text


def test_a_file_of_other_json_is_not_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "other.jsonl"
    path.write_text('{"level": "info", "msg": "hello"}\n')
    code, text = _run(["report", str(path)])
    assert code == 1 and "0 records" in text
    assert f"{path}:1: not a kvcanary record" in capsys.readouterr().err


def test_missing_files(tmp_path: Path, reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["report", str(tmp_path / "nothing-*.jsonl")])[0] == 2
    assert "no report file to read" in capsys.readouterr().err
    code, _ = _run(["report", str(reports / "kvc-0.jsonl"), str(tmp_path / "gone.jsonl")])
    assert code == 1 and "gone.jsonl: no such file" in capsys.readouterr().err


def test_stdin_is_read_for_dash(reports: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = (reports / "kvc-0.jsonl").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code, text = _run(["report", "--json", "-", str(reports / "kvc-1.jsonl")])
    assert code == 0, text
    s = json.loads(text)
    assert s["files"] == {summarize.STDIN: 9, str(reports / "kvc-1.jsonl"): 2} and s["violations"] == 6


def test_a_fifo_and_dev_null_are_streams(reports: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    data = (reports / "kvc-0.jsonl").read_bytes()
    writer = threading.Thread(target=fifo.write_bytes, args=(data,))  # a shell's <(cat kvc-0.jsonl)
    writer.start()
    try:
        code, text = _run(["report", "--json", str(fifo)])
    finally:
        writer.join(timeout=10)
        if writer.is_alive():  # the report never opened the FIFO: open it here, or the writer blocks forever
            fifo.read_bytes()
            writer.join()
    assert code == 0 and json.loads(text)["files"] == {str(fifo): 9}
    code, text = _run(["report", os.devnull])  # an empty stream is an empty report, not an error
    assert code == 0 and f"{os.devnull}: 0 records (empty)" in text


def test_a_directory_is_refused_by_name(reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _run(["report", str(reports)])
    err = capsys.readouterr().err
    assert code == 2 and "no such file" not in err and text == ""  # nothing to summarise: no empty summary either
    assert f"kvcanary report: {reports}: is a directory; give the files or a glob like '{reports}/*.jsonl'\n" in err
    assert err.endswith("kvcanary report: no report file to read\n")


def test_binary_lines_are_escaped_never_raw(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kv.bin"
    path.write_bytes(b"\x7fELF\x1b[2J\xff\x00" * 40 + b"\n" + b"\x1b]0;title\x07 not json\n" + b'{"schema": "\xc3')
    code, text = _run(["report", str(path)])
    err = capsys.readouterr().err
    assert code == 1
    for out in (err, text):
        assert not any(c in out for c in "\x1b\x07\x00\ufffd"), out  # no control byte, no lossy replacement
    lines = [line for line in err.splitlines() if line.startswith(f"kvcanary report: {path}:")]
    assert lines[0].startswith(f"kvcanary report: {path}:1: not UTF-8 text: b'\\x7fELF\\x1b[2J\\xff\\x00")
    assert lines[0].endswith("'...") and len(lines[0]) < len(str(path)) + 140  # cut, not 400 bytes of escapes
    assert lines[1] == f"kvcanary report: {path}:2: not JSON: '\\x1b]0;title\\x07 not json'"
    # a character cut by the end of the file is a cut line, not a binary one
    assert lines[2] == f"kvcanary report: {path}:3: truncated line (no newline at the end of the file): " \
                       "b'{\"schema\": \"\\xc3'"


def test_records_without_rank_are_matched_within_their_file(tmp_path: Path) -> None:
    for n in (0, 1):
        with Reporter(Mode.LOG, str(tmp_path / f"r{n}.jsonl")) as rep:  # no rank: older single-process writers
            if n == 0:
                rep.record_injection(Injection("real_kv_flip", 1, (3,), "flip"))
            rep.report([_violation(3, 2, R.VERIFY_REAL_KV_HASH)])
    summary, unmatched = summarize.read_reports([str(tmp_path / "r*.jsonl")])
    assert not unmatched and summary.matches is not None
    assert summary.matches.classes["real_kv_flip"].detected == 1
    assert len(summary.matches.unexplained) == 1  # r1's violation: r0's injection is not its own
    assert set(summary.ranks) == {"(r0.jsonl)", "(r1.jsonl)"}


def test_matcher_rule_windows() -> None:
    inj = {"fault": "real_kv_flip", "step": 10, "slots": [4]}
    at = [{"step": s, "slot": 4, "reasons": ["verify_real_kv_hash"], "tag": "verify"} for s in (10, 18, 19)]
    res = matcher.match_injections([("r", inj)], [("r", v) for v in at])
    # step 10 is not after the injection (unexplained), 18 is the window's last forward, 19 is late
    assert (len(res.unexplained), res.classes["real_kv_flip"].latencies, res.late) == (1, [8], 1)
    wrong_reason = {"step": 11, "slot": 4, "reasons": ["verify_chain_hash"], "tag": "verify"}
    res = matcher.match_injections([("r", inj)], [("r", wrong_reason)])
    assert res.detected == 0 and res.unexplained == [] and res.late == 0 and len(res.missed) == 1


def test_matcher_judges_the_window_groups_line_by_its_full_group_twin() -> None:
    """An SWAKVPool's two groups (H200, 2026-12-02: a token swap in the full group, reported by both groups at the
    same step, row and position, the swa group under its own slot numbers): the swa line is an echo, not a false
    positive; a swa line with no full-group twin stays unexplained."""
    full = {"tp_rank": 0, "group": "full"}
    swa = {"tp_rank": 0, "group": "swa"}
    inj = {"fault": "token_swap", "step": 46, "slots": [11882, 11889], "rank": full}

    def vio(slot, rank, position=242, row=13):
        return {"step": 48, "slot": slot, "position": position, "request_row": row, "reasons": ["verify_token"],
                "tag": "verify", "rank": rank}

    rows = [vio(11882, full), vio(3250, swa), vio(3251, swa, position=243)]
    res = matcher.match_injections([(matcher.rank_key(inj), inj)], [(matcher.rank_key(v), v) for v in rows])
    assert res.classes["token_swap"].detected == 1 and res.echoes == 1
    assert [v["slot"] for v in res.unexplained] == [3251]


@pytest.mark.skipif(not TP2_FAULTS.is_file(), reason="needs shared/e2e/results next to the repository")
def test_real_tp2_fault_run_matches_the_e2e_drivers_matcher(tmp_path: Path) -> None:
    with tarfile.open(TP2_FAULTS) as tar:
        tar.extractall(tmp_path, filter="data")
    driver = json.loads((tmp_path / "e2e-tp" / "summary.json").read_text())["summary"]["faults"]
    summary, _ = summarize.read_reports([str(tmp_path / "e2e-tp" / "phase3-faults" / "kvc-*.jsonl")])
    assert not summary.bad_lines and summary.matches is not None
    m = summary.matches
    assert {k: c.injected for k, c in m.classes.items()} == driver["injections"]
    assert {k: c.detected for k, c in m.classes.items()} == driver["detected"]
    assert {k: dict(c.reasons) for k, c in m.classes.items()} == driver["reasons"]
    assert {k: dict(c.tags) for k, c in m.classes.items()} == driver["tags"]
    assert {k: sorted(c.latencies) for k, c in m.classes.items()} == {k: sorted(v) for k, v in
                                                                       driver["latency"].items()}
    assert (len(m.unexplained), m.late, len(m.missed)) == (driver["unexplained"], driver["late"], len(driver["missed"]))


def test_eagle_reports_pool_rank_keys_and_spec_lines(tmp_path) -> None:
    """EAGLE writes `pool` (a name) in its rank objects and `kvcanary.spec/1` counter lines: both are valid records
    (the first H200 EAGLE run's report was read as 100 % bad lines)."""
    import json

    from kvcanary.cli.summarize import read_reports, render

    rank = {"tp_rank": 0, "pool": "target"}
    rows = [
        {"schema": "kvcanary.spec/1", "step": 20, "pool": "target", "counters": {"drafts_written": 64}, "rank": rank},
        {"schema": "kvcanary.injection/1", "fault": "real_kv_flip", "step": 30, "slots": [7], "detail": "",
         "rank": rank},
        {"schema": "kvcanary.violation/1", "step": 31, "tag": "verify", "reasons": ["verify_real_kv_hash"], "slot": 7,
         "request_row": 2, "rank": rank},
        {"schema": "kvcanary.spec/1", "step": 40, "pool": "target", "counters": {"drafts_written": 128}, "rank": rank},
    ]
    path = tmp_path / "kvc-0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s, missing = read_reports([str(path)])
    assert not missing and not s.bad_lines and s.violations == 1
    assert s.speculative == {"tp_rank=0 pool=target": {"step": 40, "drafts_written": 128}}
    assert s.matches is not None and s.matches.classes["real_kv_flip"].detected == 1
    assert "speculative decoding" in render(s)


# Draft-pool rows of the H200 eagle-bug run (integration/results/sglang_e2e_h200_eagle.md, sglang 0.5.12, issue 26329):
# (slot, position, stored token = the token fed, expected token = the request's next token).
EAGLE_TAILS = [(1875, 1, 1257, 1884), (64, 7, 1455, 7), (388, 63, 777, 1007), (452, 127, 1876, 105)]
DRAFT = {"tp_rank": 0, "pool": "draft"}
TARGET = {"tp_rank": 0, "pool": "target"}


def _token_row(slot: int, position: int, stored: int, expected: int, *, tag: LaunchTag = LaunchTag.VERIFY,
               bits: int = R.VERIFY_TOKEN) -> list[int]:
    return [int(tag), slot, position, stored, expected, 0x1234, 0x1234, int(bits)]


def _write_eagle_report(path: Path, *, extra_rows: list[tuple[dict, list[int]]] = (), lost: int = 0,
                        injection: bool = False) -> None:
    """What the EAGLE draft being fed the wrong token leaves (draft-pool verify_token rows, the target pool clean),
    through the real Reporter, plus what a breaking case adds."""
    with Reporter(Mode.LOG, str(path), rank={"tp_rank": 0}) as rep:
        if injection:
            rep.record_injection(Injection("token_swap", 5, (999,), "swap"))
        for step, (slot, pos, stored, expected) in enumerate(EAGLE_TAILS, 10):
            rep.report([Violation.from_row(_token_row(slot, pos, stored, expected), step=step, rank=DRAFT,
                                           request_row=3)])
            rep.report([Violation.from_row(_token_row(slot, pos, stored, expected), step=step + 1, rank=DRAFT,
                                           request_row=3)])  # verified again the next forward: same slot
        for rank, row in extra_rows:
            rep.report([Violation.from_row(row, step=40, rank=rank)])
        if lost:
            rep.report([], lost=lost)


def test_an_eagle_draft_fed_the_wrong_token_is_explained(tmp_path: Path) -> None:
    path = tmp_path / "kvc-0.jsonl"
    _write_eagle_report(path)
    code, text = _run(["report", str(path)])
    assert code == 0, text
    assert text.splitlines()[-1] == summarize.EXPLANATION_LINES[summarize.EAGLE_DRAFT_WRONG_TOKEN]
    assert text.splitlines()[-1].startswith("explained: EAGLE draft fed the wrong token (")
    assert [line for line in text.splitlines() if line.startswith("explained:")] == [text.splitlines()[-1]]
    code, text = _run(["report", "--json", str(path)])
    assert code == 0, text
    assert json.loads(text)["explanations"] == [{
        "pattern": "eagle_draft_wrong_token", "line": summarize.EXPLANATION_LINES["eagle_draft_wrong_token"],
        "violations": 2 * len(EAGLE_TAILS), "slots": len(EAGLE_TAILS), "positions": [1, 7, 63, 127]}]
    # the page the line points to is there
    assert (REPO / "docs" / "upstream-bugs" / "README.md").is_file()


@pytest.mark.parametrize("breaker", [
    pytest.param(dict(extra_rows=[(TARGET, _token_row(70, 9, 5, 6))]), id="a-target-pool-violation"),
    pytest.param(dict(extra_rows=[(DRAFT, _token_row(71, 9, 5, 6, bits=R.VERIFY_TOKEN | R.VERIFY_CHAIN_HASH))]),
                 id="another-reason-beside-verify_token"),
    pytest.param(dict(extra_rows=[(DRAFT, _token_row(72, 9, 5, 9, bits=R.VERIFY_CHAIN_HASH))]),
                 id="another-reason-alone"),
    pytest.param(dict(extra_rows=[(DRAFT, _token_row(73, 9, 5, 9, tag=LaunchTag.WRITE, bits=R.WRITE_POSITION))]),
                 id="a-write-row"),
    pytest.param(dict(extra_rows=[(DRAFT, _token_row(74, 9, 5, 6, tag=LaunchTag.SWEEP))]), id="a-sweep-row"),
    pytest.param(dict(extra_rows=[(DRAFT, _token_row(75, 9, 5, -1))]), id="a-token-not-checked"),
    pytest.param(dict(extra_rows=[({"tp_rank": 0}, _token_row(76, 9, 5, 6))]), id="a-row-without-a-pool"),
    pytest.param(dict(lost=2), id="lost-rows"),
    pytest.param(dict(injection=True), id="an-injection"),
    pytest.param(dict(bad_line=True), id="a-bad-line"),
])
def test_a_report_that_breaks_the_pattern_stays_unexplained(tmp_path: Path, breaker: dict) -> None:
    """Each way out of the pattern, on top of a report that is explained without it: no line, no JSON entry."""
    breaker = dict(breaker)
    bad_line = breaker.pop("bad_line", False)
    base = tmp_path / "base.jsonl"
    _write_eagle_report(base)
    assert summarize.read_reports([str(base)])[0].explanations  # without the breaker: explained
    path = tmp_path / "kvc-0.jsonl"
    _write_eagle_report(path, **breaker)
    if bad_line:
        with open(path, "ab") as f:
            f.write(b'{"schema": "kvcanary.violation/1", "step": 50, "tag": "ver\n')
    s, _ = summarize.read_reports([str(path)])
    assert s.violations >= 2 * len(EAGLE_TAILS) and s.explanations == []
    code, text = _run(["report", str(path)])
    assert code == (1 if bad_line else 0), text
    assert not [line for line in text.splitlines() if line.startswith("explained:")], text  # ("unexplained:" is
    # the injection matcher's own word)
    assert json.loads(_run(["report", "--json", str(path)])[1])["explanations"] == []


def test_violations_on_slots_loaded_from_a_host_tier_are_counted_apart(tmp_path: Path) -> None:
    """A HiCache run's report says how many violations were on slots whose content came back from the host tier."""
    rows = [{"schema": "kvcanary.violation/1", "step": 5 + i, "tag": "verify", "reasons": ["verify_real_kv_hash"],
             "slot": 10 + i, "request_row": 1, "rank": {"tp_rank": 0}, **({"via": "host_tier"} if i < 2 else {})}
            for i in range(3)]
    path = tmp_path / "kv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, text = _run(["report", str(path)])
    assert code == 0
    assert re.search(r"slot content came via \| violations\n[-+]+\nhost_tier +\| +2\n", text), text
    code, text = _run(["report", "--json", str(path)])
    assert json.loads(text)["by_via"] == {"host_tier": 2}
