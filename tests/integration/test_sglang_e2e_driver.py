"""integration/sglang_e2e.py's own logic without sglang or a GPU: workload, report parsing, matching, budget, table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "integration" / "sglang_e2e.py"


@pytest.mark.parametrize("name", ["sglang_e2e.py", "e2e_core.py", "eagle_phases.py",  # the driver, what it split off
                                  "overhead_phases.py"])
def test_driver_imports_neither_kvcanary_nor_sglang_at_module_level(name) -> None:
    text = (DRIVER.parent / name).read_text()
    assert "import kvcanary" not in text and "from kvcanary" not in text
    top = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    assert not [ln for ln in top if "sglang" in ln], top


def test_expected_reasons_match_kvcanary(e2e) -> None:
    from kvcanary.runtime import faults

    for c in e2e.E2E_FAULTS:
        assert c in faults.FAULT_CLASSES
        assert tuple(e2e.EXPECTED_REASONS[c]) == tuple(faults.EXPECTED_REASONS[c])


def test_workload_shape(e2e) -> None:
    groups = e2e.make_workload(640, seed=0)
    st = e2e.workload_stats(groups, chunk=512)
    assert st["requests"] >= 600 and st["max_group"] <= 64
    assert st["prompt_len_min"] == 8 and st["prompt_len_max"] == 1500
    assert st["shared_prefix_requests"] > 300 and st["exact_repeats"] > 20
    assert st["longer_than_chunk"] > 50  # chunked prefill splits them
    assert e2e.make_workload(640, seed=0)[3][5].input_ids == groups[3][5].input_ids  # deterministic
    for r in (r for g in groups for r in g):
        assert all(3 <= t < 2048 for t in r.input_ids)


def _inj(fault, step, slots, rank=0):
    return {"schema": "kvcanary.injection/1", "fault": fault, "step": step, "slots": slots, "detail": "d",
            "rank": {"tp_rank": rank}}


def _vio(step, slot, reasons, tag="verify", rank=0):
    return {"schema": "kvcanary.violation/1", "step": step, "slot": slot, "reasons": reasons, "tag": tag,
            "rank": {"tp_rank": rank}}


def test_match_injections(e2e) -> None:
    rows = [
        _inj("req_to_token_redirect", 10, [5, 6, 7]),
        _vio(11, 5, ["verify_chain_hash", "verify_position"]), _vio(11, 7, ["verify_chain_hash"]),
        _inj("real_kv_flip", 20, [40]),
        _vio(19, 40, ["verify_real_kv_hash"]),  # before the injection: unexplained
        _inj("token_swap", 30, [50, 51]),
        _vio(40, 51, ["verify_token"]),  # within the token-swap window
        _inj("position_skew", 50, [60]),
        _vio(51, 60, ["verify_chain_hash"]),  # wrong reason: not a detection
        _vio(51, 99, ["verify_chain_hash"]),  # untouched slot
        _vio(70, 5, ["verify_chain_hash"]),  # touched, outside the window: late
        _inj("cached_idle_corruption", 80, [70], rank=1),
        _vio(81, 70, ["verify_real_kv_hash"], tag="sweep", rank=0),  # other rank: unexplained
        _inj("token_swap", 300, [90]), _vio(301, 90, ["verify_token"]),  # (the run goes on well past the others)
    ]
    m = e2e.match_injections(rows)
    assert dict(m.injections) == {"req_to_token_redirect": 1, "real_kv_flip": 1, "token_swap": 2,
                                  "position_skew": 1, "cached_idle_corruption": 1}
    assert dict(m.detected) == {"req_to_token_redirect": 1, "token_swap": 2} and not m.ended
    assert sorted((v["step"], v["slot"]) for v in m.unexplained) == [(19, 40), (51, 99), (81, 70)]
    assert m.late == 1
    assert {i["fault"] for i in m.missed} == {"real_kv_flip", "position_skew", "cached_idle_corruption"}
    assert m.latency["token_swap"] == [10, 1]
    ok, why = e2e.verdict_faults({"status": "OK"}, m, min_per_class=1)
    assert not ok and any("untouched" in w or "no injection" in w for w in why)


def test_the_window_groups_lines_are_judged_by_their_full_group_twin(e2e) -> None:
    """SWAKVPool (H200 phase 3 with the swa-lock fix, 2026-12-02: 243 'untouched' violations, each the swa group's
    line of a full-group detection under its own slot number): a ``group=swa`` violation with a full-group twin
    (step, row, position, reasons) is an echo; without one it is unexplained."""
    full, swa = {"tp_rank": 0, "group": "full"}, {"tp_rank": 0, "group": "swa"}
    inj = {**_inj("token_swap", 46, [11882, 11889]), "rank": full}

    def vio(slot, rank, position):
        return {**_vio(48, slot, ["verify_token"]), "rank": rank, "position": position, "request_row": 13}

    m = e2e.match_injections([inj, vio(11882, full, 242), vio(3250, swa, 242), vio(3251, swa, 243)])
    assert dict(m.detected) == {"token_swap": 1} and m.echoes == 1
    assert [v["slot"] for v in m.unexplained] == [3251]


def test_an_injection_the_run_ended_before_reading_is_not_judged(e2e) -> None:
    """H200 phase 22 (2026-12-02): a cached-idle corruption at the run's last forward, the next sweep 3 forwards
    away: set apart, neither detected nor missed; one just before the grace is missed as usual."""
    last = 1000
    rows = [_inj("real_kv_flip", 100, [1]), _vio(101, 1, ["verify_real_kv_hash"]),
            _inj("cached_idle_corruption", last - e2e.ENDED_GRACE, [2]),
            _inj("cached_idle_corruption", last, [3]), _inj("real_kv_flip", last - 2, [4]),
            _vio(last, 1, ["verify_real_kv_hash"])]
    m = e2e.match_injections(rows)
    assert [(i["fault"], i["step"]) for i in m.ended] == [("cached_idle_corruption", last), ("real_kv_flip", last - 2)]
    assert dict(m.injections) == {"real_kv_flip": 1, "cached_idle_corruption": 1}
    assert [i["step"] for i in m.missed] == [last - e2e.ENDED_GRACE]


def test_the_run_end_grace_counts_in_the_injections_own_pool(e2e) -> None:
    """EAGLE on pages of 16 (H200 2026-12-02): the draft pool counts more forwards (2080) than the target (1583); a
    cached-idle corruption at the target's last forward is set apart, not judged missed against the draft's steps."""
    target, draft = {"tp_rank": 0, "pool": "target"}, {"tp_rank": 0, "pool": "draft"}
    rows = [{**_inj("cached_idle_corruption", 1583, [3377]), "rank": target},
            {**_inj("real_kv_flip", 1500, [9]), "rank": target},
            {**_vio(1501, 9, ["verify_real_kv_hash"]), "rank": target},
            {**_vio(1583, 12, ["verify_real_kv_hash"]), "rank": target},
            {**_vio(2080, 40, ["verify_token"]), "rank": draft}]
    m = e2e.match_injections(rows)
    assert [(i["fault"], i["step"]) for i in m.ended] == [("cached_idle_corruption", 1583)] and not m.missed


def test_parse_stats_takes_the_last_line(e2e, core) -> None:
    log = ("x kvcanary stats: step=20 forwards=20 tokens_written=5 entries_verified=7 entries_swept=1 violations=0 "
           "lost=0\n[2026] kvcanary stats: step=40 forwards=40 tokens_written=9 entries_verified=1234567 "
           "entries_swept=3 violations=2 lost=1\n")
    assert core.parse_stats(log) == {"step": 40, "forwards": 40, "tokens_written": 9, "entries_verified": 1234567,
                                    "entries_swept": 3, "violations": 2, "lost": 1}
    assert core.parse_stats("nothing") is None


def test_parse_stats_reads_each_eagle_pool_at_its_own_last_step(e2e, core) -> None:
    """Regression (H200, EAGLE on pages of 16, 2026-12-02): the target and draft canaries count their own steps, and
    the summary took the log's last line, the draft's (13520 forwards, 7.9M entries), for the engine. Each pool is
    now read at its own last step: entries summed, forwards the target's."""
    def line(step, verified, pool):
        return (f"[t] kvcanary stats: step={step} forwards={step} tokens_written={step * 10} "
                f"entries_verified={verified} entries_swept=5 violations=0 lost=0 pool={pool}\n")
    log = (line(6000, 3_000_000, "target") + line(12000, 7_000_000, "draft") + line(6820, 3_945_870, "target")
           + line(13520, 7_864_605, "draft"))
    stats = core.parse_stats(log)
    assert stats["forwards"] == 6820 and stats["tokens_written"] == 68200
    assert stats["entries_verified"] == 3_945_870 + 7_864_605 and stats["entries_swept"] == 10
    by_pool = stats["by_pool"]
    assert by_pool["draft"]["forwards"] == 13520 and by_pool["target"]["entries_verified"] == 3_945_870


def test_manager_stats_line_names_its_pool_and_group(caplog) -> None:
    """The product side of the regression above: a manager whose rank names a pool or a group says so on its line."""
    import logging

    import torch

    from kvcanary.runtime.config import Config
    from kvcanary.runtime.manager import CanaryManager
    from kvcanary.settings import Mode

    manager = CanaryManager(Config(mode=Mode.LOG, stats_every=1), num_slots=16,
                            req_to_token=torch.zeros((2, 8), dtype=torch.int32), device="cpu", max_batch_size=2,
                            max_tokens_per_forward=8, rank={"tp_rank": 0, "pool": "draft", "group": "swa"})
    with caplog.at_level(logging.INFO, logger="kvcanary.runtime.health"):
        manager.step()
    assert any(r.getMessage().endswith("lost=0 pool=draft group=swa") for r in caplog.records)


def test_phase_env_and_engine_kwargs(e2e, eagle, tmp_path) -> None:
    base = {"PATH": "/bin", "KVCANARY_MODE": "raise", "KVCANARY_FAULT": "all", "KVCANARY_CUDA_ARCH": "9.0a"}
    env = e2e.phase_env(e2e.PHASES["3"], str(tmp_path), base)
    assert env["KVCANARY_MODE"] == "log" and env["KVCANARY_CUDA_ARCH"] == "9.0a" and env["PATH"] == "/bin"
    assert env["KVCANARY_FAULT"] == ",".join(e2e.E2E_FAULTS) and env["KVCANARY_VERIFY_TOKENS"] == "1"
    assert env["KVCANARY_REPORT"].endswith("kvc-{rank}.jsonl")
    assert "KVCANARY_FAULT" not in e2e.phase_env(e2e.PHASES["1"], str(tmp_path), base)
    args = e2e.parse_args(["--out", str(tmp_path)])
    for key, phase in e2e.PHASES.items():
        if eagle.is_eagle(phase):  # their own engine arguments: test_sglang_e2e_eagle.py (-_retract.py)
            continue
        kw = e2e.engine_kwargs(phase, "m", args)
        assert kw["disable_piecewise_cuda_graph"] is True
        assert kw["chunked_prefill_size"] < 1500 and kw["max_total_tokens"] < 368_000
        assert ("disable_cuda_graph" in kw) == (key == "1") and (kw.get("cuda_graph_max_bs") == 64) == (key != "1")


def test_budget_skips_and_partial_results(e2e, tmp_path) -> None:
    """A fake worker: phase 1 finishes, phase 2 is killed mid-way (partial result), the rest is skipped."""
    calls = []

    def runner(cmd, env, log_path, timeout):
        spec = json.load(open(cmd[-1]))
        calls.append((spec["phase"], spec["subs"], round(timeout)))
        out = spec["out"]
        if spec["phase"] == "1":
            json.dump({"status": "OK", "requests_sent": 640, "requests_ok": 640},
                      open(os.path.join(out, "result.json"), "w"))
            open(log_path, "w").write("kvcanary stats: step=9 forwards=9 tokens_written=1 entries_verified=2000000 "
                                      "entries_swept=5 violations=0 lost=0\n"
                                      "KV cache pool is full. Retract requests. \n")
            return 0
        json.dump({"status": "RUNNING", "requests_sent": 128, "requests_ok": 64},
                  open(os.path.join(out, "result.json"), "w"))
        return 124

    clock = iter([0, 0, 10, 10, 200, 200, 400, 400, 400, 400] + [600] * 20)
    real = e2e.time.monotonic
    e2e.time.monotonic = lambda: next(clock)
    try:
        args = e2e.parse_args(["--out", str(tmp_path), "--budget", "400", "--phases", "clean,2,3,4"])
        results = e2e.run_phases(args, runner=runner)
    finally:
        e2e.time.monotonic = real
    assert [c[0] for c in calls] == ["1", "2"]
    assert results["1"]["status"] == "OK" and results["2"]["status"] == "TIMEOUT"
    assert results["3"]["status"] == results["4off"]["status"] == results["4log"]["status"] == "SKIPPED"
    summary = e2e.build_summary(str(tmp_path), args.phase_list, results, 400, 400, {})
    rows = {s["phase"]: s for s in summary["phases"]}
    assert rows["1 clean"]["verdict"] == "PASS" and rows["1 clean"]["retractions"] == 1
    assert rows["2 graph"]["requests_sent"] == 128 and rows["2 graph"]["verdict"] == "FAIL"
    text = e2e.render(summary)
    assert "| 1 clean | OK |" in text and "RESULT: FAIL" in text


def test_dry_run_cli(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "| token_swap | 24 | 24 | 100 % |" in proc.stdout
    assert (tmp_path / "summary.md").read_text().strip().endswith("RESULT: PASS")
    assert json.loads((tmp_path / "summary.json").read_text())["summary"]["overhead"]["ratio"] == pytest.approx(0.975)
    # the dry run's host-time line carries the batch hook's share: the phase table and the overhead line show it
    assert "| 64.7 (batch-init 3.2) |" in proc.stdout
    assert "40.2 in the forward hooks (drain, health, stats) + 3.2 in the batch hook" in proc.stdout


def test_tp_size_and_fault_rank_reach_the_engine_and_the_fault_phase(e2e, tmp_path) -> None:
    import argparse

    args = argparse.Namespace(load_format="dummy", attention_backend="triton", mem_fraction=0.05, chunk=512, tp_size=2)
    faults_phase = e2e.PHASES["3"]
    assert e2e.engine_kwargs(faults_phase, "m", args)["tp_size"] == 2
    env = e2e.phase_env(faults_phase, str(tmp_path), base={}, fault_rank=1)
    assert env["KVCANARY_FAULT_RANK"] == "1" and env["KVCANARY_FAULT"]
    clean = e2e.phase_env(e2e.PHASES["1"], str(tmp_path), base={}, fault_rank=1)
    assert "KVCANARY_FAULT_RANK" not in clean  # only phases that inject get the filter


def test_host_time_line_of_the_adapter_parses(core, caplog) -> None:
    """The driver reads the adapter's own ``kvcanary host time:`` line (same text, no shared code)."""
    from kvcanary.runtime.config import Config
    from kvcanary.runtime.installation import HostTime, Installation

    inst = Installation(config=Config(stats_every=2), groups=[], to_views=lambda *a: [], req_to_token=None)
    inst.host_time = HostTime(eager_forwards=1, in_forward_ns=90_000)
    with caplog.at_level("INFO", logger="kvcanary.runtime.installation"):
        inst.account_batch_init(7_000)  # the batch hook (ForwardBatch.init_new), once per batch
        inst.account_batch_init(5_000)
        inst.account_forward(forward_ns=2_000_000, hook_ns=40_000)
        inst.account_forward(forward_ns=3_000_000, hook_ns=60_000)
    host = core.parse_host_time("\n".join(r.getMessage() for r in caplog.records))
    # canary = (hooks 100 + launches 90 + batch-init 12) µs over 2 forwards
    # the longest forward: the first, its hook half (40), launches (90) and both batch hooks before it (12)
    assert host == {"forwards": 2, "eager": 1, "canary_us": 101.0, "hooks_us": 50.0, "launch_us": 90.0,
                    "forward_us": 2500.0, "batch_init_us": 6.0, "max_forward_us": 142.0, "slow_forwards": 0}


def test_host_time_line_counts_slow_forwards_and_the_longest_since_the_last_line(core, caplog) -> None:
    """The tails (issue 28: an 8B engine's inter-token p99 rose while kvcanary's mean host time was 2-3 % of the
    wall): a forward's kvcanary host time is its hook half, the launches made since the previous forward was accounted
    and the batch-hook and host-tier time since then; forwards of >= 1 ms are counted since the start, the longest
    since the previous line."""
    from kvcanary.runtime.config import Config
    from kvcanary.runtime.installation import SLOW_FORWARD_NS, HostTime, Installation

    assert SLOW_FORWARD_NS == 1_000_000
    inst = Installation(config=Config(stats_every=2), groups=[], to_views=lambda *a: [], req_to_token=None)
    inst.host_time = HostTime()
    with caplog.at_level("INFO", logger="kvcanary.runtime.installation"):
        inst.account_batch_init(2_500_000)  # a slow batch hook: its forward's
        inst.host_time.in_forward_ns += 700_000  # that forward's launches
        inst.account_forward(forward_ns=4_000_000, hook_ns=300_000)  # 2.5 + 0.7 + 0.3 ms
        inst.account_forward(forward_ns=4_000_000, hook_ns=100_000)  # -> line 1
        inst.account_host_tier(800_000)  # outside forwards: counted with the next one, which reaches 1 ms exactly
        inst.account_forward(forward_ns=4_000_000, hook_ns=200_000)
        inst.account_forward(forward_ns=4_000_000, hook_ns=999_999)  # -> line 2; just under
    lines = [r.getMessage() for r in caplog.records if "host time" in r.getMessage()]
    first, second = (core.parse_host_time(x) for x in lines)
    assert (first["max_forward_us"], first["slow_forwards"]) == (3500.0, 1)
    assert (second["max_forward_us"], second["slow_forwards"]) == (1000.0, 2)  # the max restarted; the count did not


def test_host_time_lines_without_batch_init_still_parse(e2e, core) -> None:
    """Logs written before the batch hook was counted (no ``batch_init_us``) parse as before, with no such key; the
    summary shows the batch hook's share only when the line has it."""
    old = ("kvcanary host time: step=900 forwards=900 eager=3 canary_us_per_forward=70.0 hooks_us=30.0 "
           "launch_us_per_eager_forward=200.0 forward_us=900.0\n")
    new = old.replace("forward_us=900.0", "forward_us=900.0 piecewise=0 launch_us_per_piecewise_forward=0.0 "
                      "canary_us_per_piecewise_forward=0.0 batch_init_us=4.5")
    assert core.parse_host_time(old) == {"forwards": 900, "eager": 3, "canary_us": 70.0, "hooks_us": 30.0,
                                         "launch_us": 200.0, "forward_us": 900.0}
    assert core.parse_host_time(old + new)["batch_init_us"] == 4.5  # the last line wins
    assert "batch_init_us" not in core.parse_host_time(new + old)
    assert e2e._host_cell(core.parse_host_time(new)) == "70.0 (batch-init 4.5)"
    assert e2e._host_cell(core.parse_host_time(old)) == "70.0" and e2e._host_cell(None) == "-"


def test_host_time_line_with_sweep_counts_parses(e2e, core) -> None:
    """Since the sweep counts its walks and compactions, the line ends with them after ``sweep_us``; a line with
    ``sweep_us`` alone (the wheels between) still gives the sweep's share."""
    base = ("kvcanary host time: step=2160 forwards=2160 eager=425 canary_us_per_forward=257.2 hooks_us=140.1 "
            "launch_us_per_eager_forward=91.3 forward_us=1086.1 piecewise=0 launch_us_per_piecewise_forward=0.0 "
            "canary_us_per_piecewise_forward=0.0 batch_init_us=99.2 sweep_us=98.0")
    counted = core.parse_host_time(base + " sweeps=216 sweep_walks=1 sweep_compactions=24 sweep_event_us=1.4\n")
    assert (counted["sweep_us"], counted["sweeps"], counted["sweep_walks"], counted["sweep_compactions"],
            counted["sweep_event_us"]) == (98.0, 216, 1, 24, 1.4)
    assert e2e._host_cell(counted) == ("257.2 (batch-init 99.2, sweep 98.0, 216 sweeps: 1 walked, 24 compacted, "
                                       "tree events 1.4)")
    assert "sweep_event_us" not in core.parse_host_time(base + " sweeps=216 sweep_walks=1 sweep_compactions=24\n")
    assert e2e._host_cell(core.parse_host_time(base + "\n")) == "257.2 (batch-init 99.2, sweep 98.0)"


def test_overhead_ratio_comes_from_the_last_pair(e2e, overhead, tmp_path) -> None:
    """Phase 4 starts off, log, off, log: the first pair pays a fresh machine's compile-on-first-use (the H200 run
    measured off 4406 vs log 7060 tok/s in it), so the ratio is the last pair's; the first is shown beside it."""
    assert overhead.overhead_subs(2) == ["off-1", "log-1", "off", "log"] and overhead.overhead_subs(1) == ["off", "log"]
    ok = {"status": "OK", "requests_sent": 640, "requests_ok": 640, "workload_s": 5.0}
    results = {"4off-1": dict(ok, tokens_per_s=4406.0), "4log-1": dict(ok, tokens_per_s=7060.0),
               "4off": dict(ok, tokens_per_s=7000.0), "4log": dict(ok, tokens_per_s=6790.0)}
    summary = e2e.build_summary(str(tmp_path), ["4"], results, 100.0, 1.0, {})
    ov = summary["overhead"]
    assert ov["ratio"] == pytest.approx(0.97)
    assert ov["warmup_rounds"] == [{"round": 1, "off": 4406.0, "log": 7060.0, "ratio": pytest.approx(7060 / 4406)}]
    assert "warm-up pair 1" in e2e.render(summary)


def test_measured_forwards_excludes_the_warm_up(e2e, overhead) -> None:
    """Phase 4's per-forward time divides the measured workload's wall time by the forwards the canary counted
    after the worker's marker, not by every forward the Engine ran (its warm-up groups included)."""
    stats = ("kvcanary stats: step={0} forwards={0} tokens_written=1 entries_verified=1 entries_swept=0 "
             "violations=0 lost=0\n")
    engine, measured = overhead.ENGINE_MARKER, overhead.MEASURED_MARKER
    log = (engine + "off\n" + measured + "\n"
           + engine + "log\n" + stats.format(700) + stats.format(740) + measured + "\n"
           + stats.format(1500) + stats.format(2900) + engine + "off\n" + measured + "\n")
    assert overhead.measured_forwards(log) == 2900 - 740
    assert overhead.measured_forwards(log.replace(overhead.MEASURED_MARKER, "")) is None
    assert overhead.measured_forwards("no engines") is None


def test_a_log_faster_than_off_is_not_called_a_slowdown(e2e, tmp_path) -> None:
    ok = {"status": "OK", "requests_sent": 640, "requests_ok": 640, "workload_s": 4.0}
    results = {"4off": dict(ok, tokens_per_s=8435.6), "4log": dict(ok, tokens_per_s=8936.3)}
    text = e2e.render(e2e.build_summary(str(tmp_path), ["4"], results, 100.0, 1.0, {}))
    assert "no slowdown measurable: 5.94 % more tok/s" in text and "fewer" not in text


def test_overhead_eager_runs_phase_4_without_cuda_graphs(e2e, tmp_path) -> None:
    """--overhead-eager: the off/log Engines of phase 4 get disable_cuda_graph; without it they keep decode graphs."""
    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "4", "--overhead-eager"])
    kw = e2e.engine_kwargs(e2e.PHASES["4"], "m", args)
    assert kw.get("disable_cuda_graph") is True and "cuda_graph_max_bs" not in kw
    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "4"])
    kw = e2e.engine_kwargs(e2e.PHASES["4"], "m", args)
    assert "disable_cuda_graph" not in kw and kw["cuda_graph_max_bs"] == 64


def test_kvcanary_env_overrides_the_phase_settings(e2e, tmp_path) -> None:
    """--kvcanary-env: applied after the phase's own settings (phase 4 sets KVCANARY_REAL_KV=partial); the settings
    the driver sets per phase and Engine are refused by name, as is anything that is not KVCANARY_NAME=VALUE."""
    overrides = e2e.parse_kvcanary_env(["KVCANARY_REAL_KV=none", "KVCANARY_DRAIN_EVERY=16"])
    env = e2e.phase_env(e2e.PHASES["4"], str(tmp_path), base={}, overrides=overrides)
    assert env["KVCANARY_REAL_KV"] == "none" and env["KVCANARY_DRAIN_EVERY"] == "16"
    assert e2e.phase_env(e2e.PHASES["4"], str(tmp_path), base={})["KVCANARY_REAL_KV"] == "partial"
    for bad, why in (("KVCANARY_MODE=off", "set by the driver"), ("REAL_KV=none", "KVCANARY_NAME=VALUE"),
                     ("KVCANARY_REAL_KV", "KVCANARY_NAME=VALUE")):
        with pytest.raises(SystemExit, match=why):
            e2e.parse_kvcanary_env([bad])


def test_cpus_list_is_parsed_like_taskset_and_bad_parts_are_named(e2e) -> None:
    """--cpus: the ``taskset -c`` list form; a bad part is named in the error."""
    assert e2e.parse_cpu_list("0-3,8,10-11") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert e2e.parse_cpu_list("5") == frozenset({5})
    for bad in ("a-3", "4-2", "-1", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--cpus"):
            e2e.parse_cpu_list(bad)
    args = e2e.parse_args(["--cpus", "0-1"])
    assert args.cpus == frozenset({0, 1})


def test_pin_cpus_pins_this_process_and_says_what_it_set(e2e) -> None:
    """pin_cpus: the process's affinity becomes the list (children inherit it); the summary's form is returned;
    None leaves the affinity alone."""
    before = os.sched_getaffinity(0)
    one = min(before)
    try:
        assert e2e.pin_cpus(frozenset({one})) == str(one)
        assert os.sched_getaffinity(0) == {one}
        assert e2e.pin_cpus(None) is None and os.sched_getaffinity(0) == {one}
        with pytest.raises(SystemExit, match="--cpus"):
            e2e.pin_cpus(frozenset({1 << 20}))
    finally:
        os.sched_setaffinity(0, before)
