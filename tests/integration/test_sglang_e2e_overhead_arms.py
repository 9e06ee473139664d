"""integration/sglang_e2e.py --overhead-arms A,B (phase 4 with two arms other than off/log, e.g. issue 26's protect
vs log) without sglang or a GPU: the Engines and their settings, the rows and ratio, the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "integration" / "sglang_e2e.py"

STATS = ("kvcanary stats: step={0} forwards={0} tokens_written=1 entries_verified=2000000 entries_swept=5 "
         "violations=0 lost=0\n")


def test_default_arms_are_off_and_log_as_before(e2e, overhead, tmp_path) -> None:
    """No --overhead-arms: the same Engines, result keys, report folders, marker lines and summary keys as before
    the option existed."""
    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "4"])
    assert args.overhead_arms == overhead.DEFAULT_OVERHEAD_ARMS == ("off", "log")
    subs = overhead.overhead_subs
    assert subs(2) == subs(2, args.overhead_arms) == ["off-1", "log-1", "off", "log"]
    assert overhead.overhead_subs(3) == ["off-1", "log-1", "off-2", "log-2", "off", "log"]
    for sub, mode in (("off-1", "off"), ("log-1", "log"), ("off", "off"), ("log", "log")):
        env = overhead.overhead_engine_env(sub, "/r/" + sub)
        assert env == {"KVCANARY_MODE": mode, "KVCANARY_REPORT": f"/r/{sub}/kvc-{{rank}}.jsonl"}
        assert overhead.overhead_engine_marker(sub) == "[e2e-worker] overhead engine: KVCANARY_MODE=" + mode
    results = e2e.dry_run_reports(args, e2e.make_workload(64, seed=0))
    assert list(results) == ["4off", "4log"]
    summary = e2e.build_summary(args.out, ["4"], results, 100.0, 1.0, {}, overhead_arms=args.overhead_arms)
    assert [r["phase"] for r in summary["phases"]] == ["4 overhead-off", "4 overhead-log"]
    ov = summary["overhead"]
    assert "arms" not in ov and ov["ratio"] == pytest.approx(0.975)
    assert set(ov) == {"off", "log", "host", "ratio", "ms_per_forward_delta", "warmup_rounds", "pairs", "probe"}
    text = e2e.render(summary)
    assert "| off | 1000.0 |" in text and "| log | 975.0 |" in text and "| log/off | 0.9750 (" in text
    assert "where the canary's time goes (log)" in text and "overhead-arms" not in text
    # inferred from the results' keys when not given (--summarize)
    assert overhead.overhead_arms_in(results) == ("off", "log")
    assert overhead.overhead_arms_in({"1": {}}) == ("off", "log")


def test_arm_engine_env_sets_mode_and_hold_per_engine(e2e, overhead) -> None:
    """The settings the worker sets (and restores) per Engine: the arm's mode, its report folder, and for the
    protect arms the hold (protect-hold: 1, protect: 0, so neither inherits the other's)."""
    want = {"log-1": ("log", None), "protect-1": ("protect", "0"), "raise": ("raise", None),
            "protect": ("protect", "0"), "protect-hold-2": ("protect", "1"), "protect-hold": ("protect", "1"),
            "off": ("off", None)}
    for sub, (mode, hold) in want.items():
        env = overhead.overhead_engine_env(sub, "/d")
        assert env["KVCANARY_MODE"] == mode and env.get("KVCANARY_PROTECT_HOLD") == hold, sub
        assert env["KVCANARY_REPORT"] == "/d/kvc-{rank}.jsonl"
        assert overhead.engine_sections(overhead.overhead_engine_marker(sub) + "\nx\n") == \
            [(overhead.overhead_arm(sub), overhead.overhead_engine_marker(sub)[len(overhead.ENGINE_MARKER):] + "\nx\n")]
    assert overhead.overhead_engine_marker("protect-hold") == \
        "[e2e-worker] overhead engine: KVCANARY_MODE=protect KVCANARY_PROTECT_HOLD=1 arm=protect-hold"
    for bad in ("protect-hold-x", "logx", "", "hold-1"):
        with pytest.raises(ValueError):
            overhead.overhead_arm(bad)


def test_worker_sets_and_restores_each_engines_settings(e2e, overhead, tmp_path, monkeypatch) -> None:
    """worker_main: each Engine starts under its arm's settings; after it the worker's own come back (also
    KVCANARY_PROTECT_HOLD, set for the protect Engines only)."""
    monkeypatch.setenv("KVCANARY_MODE", "log")
    monkeypatch.setenv("KVCANARY_REPORT", "/w/kvc-{rank}.jsonl")
    monkeypatch.delenv("KVCANARY_PROTECT_HOLD", raising=False)
    seen = []

    def fake_run_engine(Engine, spec, groups, res, res_path):
        seen.append({k: os.environ.get(k) for k in ("KVCANARY_MODE", "KVCANARY_REPORT", "KVCANARY_PROTECT_HOLD")})
        res["status"] = "OK"

    monkeypatch.setattr(e2e, "run_engine", fake_run_engine)
    monkeypatch.setattr(e2e, "phase_workload", lambda spec: [])
    sglang_entry = type(sys)("sglang.srt.entrypoints.engine")  # (no sglang import: a found module is taken as is)
    sglang_entry.Engine = object
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", sglang_entry)
    subs = overhead.overhead_subs(2, ("log", "protect-hold"))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "subs": subs}))
    assert e2e.worker_main(str(spec)) == 0
    assert [(s["KVCANARY_MODE"], s["KVCANARY_PROTECT_HOLD"]) for s in seen] == \
        [("log", None), ("protect", "1"), ("log", None), ("protect", "1")]
    assert [s["KVCANARY_REPORT"] for s in seen] == [str(tmp_path / sub / "kvc-{rank}.jsonl") for sub in subs]
    assert os.environ["KVCANARY_MODE"] == "log" and os.environ["KVCANARY_REPORT"] == "/w/kvc-{rank}.jsonl"
    assert "KVCANARY_PROTECT_HOLD" not in os.environ
    assert all(json.loads((tmp_path / f"result-{sub}.json").read_text())["status"] == "OK" for sub in subs)


def _dry_run(arms: str, *extra: str, out) -> str:
    """The driver's phase 4 dry run with ``--overhead-arms arms``: its stdout (it must exit 0)."""
    proc = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--phases", "4", "--overhead-arms", arms, *extra,
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_log_vs_protect_dry_run_names_rows_by_arm_with_the_ratio(tmp_path) -> None:
    """The brief's command: rows, table labels, ratio and summary keys name log and protect, never off."""
    out = _dry_run("log,protect", "--overhead-rounds", "3", out=tmp_path)
    assert "overhead-arms: log,protect" in out
    assert "| 4 overhead-log | OK |" in out and "| 4 overhead-protect | OK |" in out
    assert "\n| log | 1000.0 |" in out and "\n| protect | 975.0 |" in out
    assert "| protect/log | 0.9750 (2.50 % fewer tok/s) |" in out
    assert "where the canary's time goes (protect)" in out
    assert "off" not in out.split("| overhead |", 1)[1].replace("(", " ").split()  # no "off" label anywhere
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert list(saved["results"]) == ["4log", "4protect"]
    ov = saved["summary"]["overhead"]
    assert ov["arms"] == ["log", "protect"] and ov["ratio"] == pytest.approx(0.975)
    assert ov["protect"]["forwards"] == ov["log"]["forwards"] == 1200
    assert sorted(p.name for p in (tmp_path / "phase4-overhead").iterdir()) == ["log", "protect"]


def test_piecewise_and_eager_combine_with_the_arms(e2e, tmp_path) -> None:
    """--piecewise --overhead-eager with protect-hold vs log: every pair's B/A ratio, median and range; each
    kvcanary Engine must show piecewise prefill; the Engines run eagerly."""
    out = tmp_path / "o"
    text = _dry_run("log,protect-hold", "--piecewise", "--overhead-eager", out=out)
    assert ("| warm-up pair 1 (first Engines on this machine), protect-hold/log | "
            "0.9850 (protect-hold 985.0 vs log 1000.0 tok/s)") in text
    assert "overhead, protect-hold/log tok/s over 3 pairs: median 1.0050, min 0.9850, max 1.0250" in text
    assert "per log Engine: [240, 240, 240], per protect-hold Engine: [240, 240, 240]" in text
    saved = json.loads((out / "summary.json").read_text())
    assert list(saved["results"]) == ["4log-1", "4protect-hold-1", "4log-2", "4protect-hold-2", "4log",
                                      "4protect-hold"]
    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "4", "--overhead-eager", "--overhead-arms",
                           "log,protect-hold"])
    assert e2e.engine_kwargs(e2e.PHASES["4"], "m", args).get("disable_cuda_graph") is True
    e2e.parse_args(["--out", str(tmp_path)])  # (PHASES["4"] back to decode graphs for the other tests)


def test_two_kvcanary_arms_each_read_their_own_engines(e2e, overhead, tmp_path) -> None:
    """In one shared worker log, a row's stats and measured forwards are its own arm's Engines', not the other's
    (with off as one arm nothing is left out, as before); a protect Engine without piecewise prefill fails."""
    pdir = tmp_path / "phase4-overhead"
    pdir.mkdir()
    log = ""
    for sub, (warm, end) in zip(overhead.overhead_subs(2, ("log", "protect")),
                                [(100, 400), (110, 500), (700, 1000), (800, 1300)], strict=True):
        log += overhead.overhead_engine_marker(sub) + "\n" + STATS.format(warm) + overhead.MEASURED_MARKER + "\n"
        log += STATS.format(end)
    (pdir / "worker.log").write_text(log)
    ok = {"status": "OK", "requests_sent": 640, "requests_ok": 640, "workload_s": 6.0}
    results = {"4log-1": dict(ok, tokens_per_s=5000.0), "4protect-1": dict(ok, tokens_per_s=4500.0),
               "4log": dict(ok, tokens_per_s=6000.0), "4protect": dict(ok, tokens_per_s=5700.0)}
    assert overhead.overhead_arms_in(results) == ("log", "protect")
    summary = e2e.build_summary(str(tmp_path), ["4"], results, 100.0, 1.0, {})  # arms read from the keys
    rows = {r["phase"]: r for r in summary["phases"]}
    assert rows["4 overhead-log"]["forwards"] == 1000 and rows["4 overhead-protect"]["forwards"] == 1300
    ov = summary["overhead"]
    assert ov["log"]["forwards"] == 300 and ov["protect"]["forwards"] == 500  # measured: after the marker
    assert ov["ratio"] == pytest.approx(0.95) and ov["warmup_rounds"][0]["ratio"] == pytest.approx(0.9)
    assert ov["pairs"]["median"] == pytest.approx(0.925) and summary["pass"]
    # a violation in the measured arm's report fails it (clean workload: no violation, every request ok)
    (pdir / "protect").mkdir()
    (pdir / "protect" / "kvc-0.jsonl").write_text(json.dumps({"schema": e2e.VIOLATION_SCHEMA}) + "\n")
    bad = e2e.build_summary(str(tmp_path), ["4"], results, 100.0, 1.0, {})
    assert {r["phase"]: r["verdict"] for r in bad["phases"]} == {"4 overhead-log": "PASS",
                                                                 "4 overhead-protect": "FAIL"}
    # --piecewise: the protect Engines must have served prefill from the piecewise runner too
    pw = {k: dict(v, piecewise=True) for k, v in results.items()}
    (pdir / "protect" / "kvc-0.jsonl").unlink()
    failed = e2e.build_summary(str(tmp_path), ["4"], pw, 100.0, 1.0, {})
    why = {r["phase"]: r["why"] for r in failed["phases"]}
    assert any("a protect Engine served no prefill forward" in w for w in why["4 overhead-protect"])
    assert any("2 log/protect pair(s) measured, < 3" in w for w in why["4 overhead-protect"])


@pytest.mark.parametrize("value", ["log,log", "log", "off,log,protect", "log,protectx", "off,hold", ",", ""])
def test_bad_arms_are_refused_naming_the_option(e2e, tmp_path, value) -> None:
    with pytest.raises(SystemExit, match=r"--overhead-arms: .*off, log, raise, protect, protect-hold"):
        e2e.parse_args(["--out", str(tmp_path), "--overhead-arms", value])


def test_bad_arms_exit_from_the_command_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--phases", "4", "--overhead-arms", "log,foo",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--overhead-arms" in proc.stderr and "protect-hold" in proc.stderr


def test_protect_arms_refuse_a_global_hold_setting(e2e, tmp_path) -> None:
    """The protect arms set KVCANARY_PROTECT_HOLD per Engine: a --kvcanary-env for every Engine is refused."""
    with pytest.raises(SystemExit, match="--overhead-arms.*KVCANARY_PROTECT_HOLD"):
        e2e.parse_args(["--out", str(tmp_path), "--overhead-arms", "log,protect", "--kvcanary-env",
                        "KVCANARY_PROTECT_HOLD=1"])
    args = e2e.parse_args(["--out", str(tmp_path), "--overhead-arms", "Log, Raise"])  # case and spaces forgiven
    assert args.overhead_arms == ("log", "raise")


def test_run_phases_starts_the_arms_engines_and_retries_arm_b_alone(e2e, tmp_path) -> None:
    """run_phases with a fake worker: one worker starts log-1, protect-1, log, protect (--overhead-split: one
    each); when B's Engine fails in the shared worker, B alone is started again (as log was before)."""
    calls = []

    def runner(cmd, env, log_path, timeout):
        spec = json.load(open(cmd[-1]))
        calls.append(spec["subs"])
        for sub in spec["subs"]:
            status = "ERROR" if sub == "protect" and len(calls) == 1 else "OK"
            json.dump({"status": status}, open(os.path.join(spec["out"], f"result-{sub}.json"), "w"))
        return 0

    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "4", "--overhead-arms", "log,protect"])
    results = e2e.run_phases(args, runner=runner)
    assert calls == [["log-1", "protect-1", "log", "protect"], ["protect"]]
    assert list(results) == ["4log-1", "4protect-1", "4log", "4protect"] and results["4protect"]["status"] == "OK"
    calls.clear()
    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "4", "--overhead-arms", "log,protect-hold",
                           "--overhead-split", "--overhead-rounds", "1"])
    e2e.run_phases(args, runner=runner)
    assert calls == [["log"], ["protect-hold"]]
