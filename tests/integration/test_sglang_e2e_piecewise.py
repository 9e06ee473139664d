"""integration/sglang_e2e.py --piecewise (sglang's default prefill graphs) without sglang or a GPU: Engine arguments,
time limits, the piecewise counts read from the worker logs, the verdicts and the overhead pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "integration" / "sglang_e2e.py"

CAPTURE = "Capture piecewise CUDA graph end. Time elapsed: 18.7 s. mem usage=0.10 GB. avail mem=120.00 GB.\n"
STATS = ("kvcanary stats: step=900 forwards=900 tokens_written=300000 entries_verified=2000000 entries_swept=5000 "
         "violations=0 lost=0\n")


def host_line(piecewise: int, forwards: int = 900) -> str:
    return (f"kvcanary host time: step={forwards} forwards={forwards} eager=3 canary_us_per_forward=70.0 "
            f"hooks_us=30.0 launch_us_per_eager_forward=200.0 forward_us=900.0 piecewise={piecewise} "
            f"launch_us_per_piecewise_forward=150.5 canary_us_per_piecewise_forward=190.25\n")


def test_piecewise_leaves_sglangs_default_in_place(e2e, overhead, eagle, tmp_path) -> None:
    plain = e2e.parse_args(["--out", str(tmp_path)])
    pw = e2e.parse_args(["--out", str(tmp_path), "--piecewise"])
    for phase in e2e.PHASES.values():
        if eagle.is_eagle(phase):  # piecewise graphs stay off there: test_sglang_e2e_eagle.py
            continue
        assert e2e.engine_kwargs(phase, "m", plain)["disable_piecewise_cuda_graph"] is True
        kw = e2e.engine_kwargs(phase, "m", pw)
        assert "disable_piecewise_cuda_graph" not in kw  # left out, as a user leaves it: sglang's default (on)
        assert kw["chunked_prefill_size"] == 512 and kw["max_total_tokens"] == phase.max_total_tokens
    assert plain.overhead_rounds == 2 and pw.overhead_rounds == overhead.PIECEWISE_OVERHEAD_ROUNDS == 3
    assert e2e.parse_args(["--out", str(tmp_path), "--piecewise", "--overhead-rounds", "4"]).overhead_rounds == 4


def test_time_limits_add_the_piecewise_start_per_engine(e2e, overhead, tmp_path) -> None:
    plain = e2e.parse_args(["--out", str(tmp_path)])
    pw = e2e.parse_args(["--out", str(tmp_path), "--piecewise"])
    p2, p4 = e2e.PHASES["2"], e2e.PHASES["4"]
    assert overhead.phase_limits(p2, plain, 1, 1) == (p2.cap_s, p2.min_s)  # unchanged without --piecewise
    assert overhead.phase_limits(p4, plain, 4, 4) == (p4.cap_s, p4.min_s)
    assert overhead.phase_limits(p4, plain, 1, 4) == (p4.cap_s, p4.min_s / 4)  # --overhead-split: one Engine each
    extra = overhead.PIECEWISE_START_S
    assert overhead.phase_limits(p2, pw, 1, 1) == (p2.cap_s + extra, p2.min_s + extra)
    cap, least = overhead.phase_limits(p4, pw, 6, 6)  # 3 pairs in one worker
    assert cap == p4.cap_s * 6 / 4 + 6 * extra and least == p4.min_s + extra


def test_parse_piecewise_and_capture_seconds(e2e, core) -> None:
    log = CAPTURE + STATS + host_line(10, 400) + STATS + host_line(57)
    assert core.parse_piecewise(log) == {"forwards": 900, "piecewise": 57, "launch_us": 150.5, "canary_us": 190.25}
    assert core.parse_host_time(log)["forwards"] == 900  # the older fields still parse on the longer line
    assert core.parse_piecewise(STATS) is None
    assert core.piecewise_capture_seconds(CAPTURE * 2) == [18.7, 18.7]


def _phase_dir(tmp_path, key: str) -> Path:
    d = tmp_path / f"phase{key}-{__import__('sglang_e2e_driver').PHASES[key].name}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.mark.parametrize("log,verdict,why", [
    (CAPTURE + STATS + host_line(57), "PASS", None),
    (CAPTURE + STATS + host_line(0), "FAIL", "no prefill forward served by the piecewise runner"),
    (STATS + host_line(57), "FAIL", "no piecewise CUDA graph was built"),
], ids=["served", "none-served", "not-built"])
def test_a_piecewise_phase_passes_only_when_the_runner_served_prefill(e2e, tmp_path, log, verdict, why) -> None:
    (_phase_dir(tmp_path, "2") / "worker.log").write_text(log)
    res = {"2": {"status": "OK", "requests_sent": 640, "requests_ok": 640, "piecewise": True}}
    summary = e2e.build_summary(str(tmp_path), ["2"], res, 100.0, 1.0, {})
    row = summary["phases"][0]
    assert row["verdict"] == verdict, row["why"]
    assert (why is None and not row["why"]) or any(why in w for w in row["why"])
    text = e2e.render(summary)
    assert "| 2 graph | " + ("57" if "57" in log else "0") + " | 900 | 190.2 (150.5) |" in text
    # without --piecewise the same log is not judged on it
    res["2"]["piecewise"] = False
    assert e2e.build_summary(str(tmp_path), ["2"], res, 100.0, 1.0, {})["phases"][0]["verdict"] == "PASS"


def _overhead_log(served: list[int]) -> str:
    text = ""
    for n in served:
        for mode in ("off", "log"):
            text += e2e_marker() + mode + "\n" + CAPTURE + "[e2e-worker] measured workload starts\n"
            text += (STATS + host_line(n)) if mode == "log" else ""
    return text


def e2e_marker() -> str:
    return sys.modules["overhead_phases"].ENGINE_MARKER  # (integration/overhead_phases.py, as the driver imports it)


def _overhead_results(tps_pairs: list[tuple[float, float]], piecewise: bool = True) -> dict:
    ok = {"status": "OK", "requests_sent": 640, "requests_ok": 640, "workload_s": 4.0, "piecewise": piecewise}
    results = {}
    for i, (off, log) in enumerate(tps_pairs, start=1):
        suffix = "" if i == len(tps_pairs) else f"-{i}"
        results["4off" + suffix] = dict(ok, tokens_per_s=off)
        results["4log" + suffix] = dict(ok, tokens_per_s=log)
    return results


def test_overhead_pairs_median_and_range(e2e, tmp_path) -> None:
    (_phase_dir(tmp_path, "4") / "worker.log").write_text(_overhead_log([300, 310, 305]))
    results = _overhead_results([(8000.0, 7600.0), (8000.0, 8400.0), (8000.0, 7920.0)])
    summary = e2e.build_summary(str(tmp_path), ["4"], results, 100.0, 1.0, {})
    pairs = summary["overhead"]["pairs"]
    assert pairs["ratios"] == pytest.approx([0.95, 1.05, 0.99])
    assert (pairs["median"], pairs["min"], pairs["max"]) == pytest.approx((0.99, 0.95, 1.05))
    assert summary["overhead"]["pcg_engines"]["built"] == 6 == summary["overhead"]["pcg_engines"]["engines"]
    assert summary["overhead"]["piecewise_per_log_engine"] == [300, 310, 305]
    assert summary["pass"], [r["why"] for r in summary["phases"]]
    text = e2e.render(summary)
    assert "over 3 pairs: median 0.9900, min 0.9500, max 1.0500" in text
    assert "piecewise graphs built by 6 of 6 Engines" in text


@pytest.mark.parametrize("served,pairs,why", [
    ([300, 0, 305], 3, "a log Engine served no prefill forward from the piecewise runner"),
    ([300, 310], 2, "2 off/log pair(s) measured, < 3"),
], ids=["log-engine-not-served", "too-few-pairs"])
def test_overhead_with_piecewise_fails_without_its_evidence(e2e, tmp_path, served, pairs, why) -> None:
    (_phase_dir(tmp_path, "4") / "worker.log").write_text(_overhead_log(served))
    results = _overhead_results([(8000.0, 7900.0)] * pairs)
    summary = e2e.build_summary(str(tmp_path), ["4"], results, 100.0, 1.0, {})
    assert not summary["pass"]
    log_row = next(r for r in summary["phases"] if r["phase"] == "4 overhead-log")
    assert log_row["verdict"] == "FAIL" and any(why in w for w in log_row["why"]), log_row["why"]
    # the same numbers without --piecewise: judged as before (the last pair's ratio exists)
    assert e2e.build_summary(str(tmp_path), ["4"], _overhead_results([(8000.0, 7900.0)] * pairs, False),
                             100.0, 1.0, {})["pass"]


def test_run_phases_with_piecewise_reaches_the_worker_spec(e2e, overhead, tmp_path) -> None:
    specs = []

    def runner(cmd, env, log_path, timeout):
        spec = json.load(open(cmd[-1]))
        specs.append((spec, timeout))
        for sub in spec["subs"]:
            json.dump({"status": "OK", "requests_sent": 1, "requests_ok": 1},
                      open(os.path.join(spec["out"], f"result{sub and '-' + sub}.json"), "w"))
        return 0

    args = e2e.parse_args(["--out", str(tmp_path), "--piecewise", "--phases", "2,4", "--budget", "5000"])
    results = e2e.run_phases(args, runner=runner)
    assert [s["phase"] for s, _ in specs] == ["2", "4"]
    assert specs[1][0]["subs"] == ["off-1", "log-1", "off-2", "log-2", "off", "log"]
    for spec, _ in specs:
        assert "disable_piecewise_cuda_graph" not in spec["engine"]
    assert specs[0][1] == e2e.PHASES["2"].cap_s + overhead.PIECEWISE_START_S
    assert specs[1][1] == overhead.phase_limits(e2e.PHASES["4"], args, 6, 6)[0]
    assert all(r["piecewise"] for r in results.values())


def test_dry_run_cli_with_piecewise(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--piecewise", "--phases", "2,3,4", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout
    assert "| 2 graph | 240 | 1200 | 146.7 (106.5) | 21.4 |" in proc.stdout
    assert "over 3 pairs: median" in proc.stdout


def test_the_adapters_host_time_line_parses_with_its_piecewise_count(e2e, core, caplog) -> None:
    """The driver reads kvcanary's own ``kvcanary host time:`` line (same text, no shared code)."""
    from kvcanary.runtime.config import Config
    from kvcanary.runtime.installation import HostTime, Installation

    inst = Installation(config=Config(stats_every=2), groups=[], to_views=lambda *a: [], req_to_token=None)
    inst.host_time = HostTime(eager_forwards=1, in_forward_ns=250_000, piecewise_launch_ns=160_000)
    with caplog.at_level("INFO", logger="kvcanary.runtime.installation"):
        inst._piecewise_now = True  # what the model.forward wrapper sets when a piecewise replay served the forward
        inst.account_forward(forward_ns=2_000_000, hook_ns=40_000)
        inst.account_forward(forward_ns=3_000_000, hook_ns=60_000)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert core.parse_piecewise(text) == {"forwards": 2, "piecewise": 1, "launch_us": 160.0, "canary_us": 200.0}
    assert core.parse_host_time(text) == {"forwards": 2, "eager": 1, "canary_us": 175.0, "hooks_us": 50.0,
                                          "launch_us": 90.0, "forward_us": 2500.0, "batch_init_us": 0.0,
                                              "max_forward_us": 290.0, "slow_forwards": 0}


def test_no_piecewise_table_for_phases_that_ran_without_piecewise_graphs(e2e, overhead) -> None:
    """A phase without --piecewise still parses piecewise=0 from its host-time lines: the piecewise table (headed
    'piecewise CUDA graphs on') is for phases that asked for the graphs or were served by them."""
    off = {"phase": "2 graph", "piecewise": {"piecewise": 0, "forwards": 2160, "canary_us": 0.0, "launch_us": 0.0}}
    assert overhead.render_piecewise({"phases": [off]}) == []
    served = {**off, "phase": "2 graph", "piecewise": {**off["piecewise"], "piecewise": 5}}
    asked = {**off, "phase": "3 faults", "piecewise_requested": True}
    lines = overhead.render_piecewise({"phases": [off, served, asked]})
    assert [line.split(" |")[0] for line in lines if line.startswith("| 2 ") or line.startswith("| 3 ")] == [
        "| 2 graph", "| 3 faults"]
