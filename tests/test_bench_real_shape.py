"""benchmarks/bench_real_shape.py (kvcanary off vs on, Llama-3.1-8B shape) without sglang or a GPU: the dry run end
to end, the statistics helpers on known inputs, the stream timing, the host-time window on kvcanary's own lines,
an Engine that does not start in time, and the hand-written 8B config."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_real_shape.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_real_shape", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_dry_run_prints_the_tables_and_exits_0(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--pairs", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for name in ("decode-1", "decode-64", "decode-256", "prefill"):
        assert f"### {name}: " in out
    assert "3 off / 3 on Engines" in out
    for row in ("| output tokens/s |", "| TTFT p50 (ms) |", "| TTFT p99 (ms) |", "| ITL p50 (ms) |",
                "| ITL p99 (ms) |", "| kvcanary host µs per forward |", "| kvcanary host share of wall (%) |"):
        assert out.count(row) == 4, row
    assert "### Engines: start-up and status" in out and "every Engine ran" in out
    assert (tmp_path / "summary.md").read_text() in out
    engines = sorted(p.name for p in tmp_path.glob("engine-*"))
    assert engines == [f"engine-0{i}-{'off' if i % 2 == 0 else 'on'}" for i in range(6)]
    for name in engines:  # every Engine keeps its log tail
        assert (tmp_path / name / "log-tail.txt").read_text().strip()
    facts = json.loads((tmp_path / "summary.json").read_text())
    assert facts["ok"] and set(facts["verdicts"]) == {"decode-1", "decode-64", "decode-256", "prefill"}
    # a second call into the same folder adds Engines after the first six; --summarize renders both runs' Engines
    done = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--pairs", "1", "--traffic", "decode-64",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "engine-07-on" in done.stdout and "4 off / 4 on Engines" in done.stdout


def test_statistics_helpers_on_known_inputs(bench) -> None:
    assert bench.median([3.0, 1.0, 2.0]) == 2.0 and bench.median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert bench.median([]) is None
    assert bench.min_max([4.0, 1.5, 9.0]) == (1.5, 9.0) and bench.min_max([]) is None
    assert bench.ratio(99.0, 100.0) == pytest.approx(0.99)
    assert bench.ratio(None, 1.0) is None and bench.ratio(1.0, 0.0) is None
    xs = [float(i) for i in range(1, 101)]  # 1..100: numpy's linear percentiles
    assert bench.percentile(xs, 50) == pytest.approx(50.5)
    assert bench.percentile(xs, 99) == pytest.approx(99.01)
    assert bench.percentile(xs, 0) == 1.0 and bench.percentile(xs, 100) == 100.0
    assert bench.percentile([7.0], 99) == 7.0 and bench.percentile([], 50) is None
    assert bench.percentile([1.0, 3.0], 25) == pytest.approx(1.5)


def test_stream_timing_ttft_and_itl(bench) -> None:
    """TTFT from the submission to each request's first token; a chunk that carries 2 tokens after a 0.2 s gap
    counts as 2 ITLs of 0.1 s; a repeated chunk (no new token) counts nothing."""
    clock = iter([1.0, 1.5, 1.6, 1.8, 1.8, 2.0]).__next__
    chunks = [
        {"index": 0, "meta_info": {"completion_tokens": 1}},  # t=1.0: request 0's first token
        {"index": 1, "meta_info": {"completion_tokens": 1}},  # t=1.5
        {"index": 0, "meta_info": {"completion_tokens": 3}},  # t=1.6: 2 tokens after 0.6 s
        {"index": 1, "meta_info": {"completion_tokens": 2, "cached_tokens": 64}},  # t=1.8: 1 token after 0.3 s
        {"index": 1, "meta_info": {"completion_tokens": 2}},  # t=1.8: nothing new
    ]
    r = bench.time_stream(chunks, 2, 0.5, clock)
    assert r["ttft"] == pytest.approx([0.5, 1.0])
    assert r["itl"] == pytest.approx([0.3, 0.3, 0.3])
    assert r["tokens"] == [3, 2] and r["cached"] == 64 and r["wall"] == pytest.approx(1.5)
    t = bench.Traffic("t", 2, 1, (4, 4), 3)
    s = bench.shape_result(t, [r])
    assert s["requests_ok"] == 1 and s["output_tokens"] == 5 and s["tokens_per_s"] == pytest.approx(5 / 1.5, abs=0.1)
    assert s["ttft_p50_ms"] == pytest.approx(750.0) and s["itl_p99_ms"] == pytest.approx(300.0)
    assert s["ttft_ms"] == [500.0, 1000.0]  # every request's, for request-by-request comparisons


def test_host_window_reads_kvcanarys_own_lines(bench) -> None:
    """The shape's window runs from the last host-time line before its begin marker to the last before its end
    marker; the cumulative averages are differenced (lines from kvcanary's own HostTime)."""
    from kvcanary.runtime.installation import HostTime

    def line(forwards: int, canary_ns: int) -> str:
        return HostTime(forwards=forwards, eager_forwards=forwards, hook_ns=canary_ns,
                        forward_ns=forwards * 1_000_000).line(step=forwards)

    log = "\n".join([line(100, 100 * 50_000), bench.BEGIN + "decode-64", line(200, 100 * 50_000 + 100 * 30_000),
                     line(300, 100 * 50_000 + 200 * 30_000), bench.END + "decode-64", line(400, 10**9)])
    w = bench.host_window(log, "decode-64")  # (the lines round their averages to 0.1 µs)
    assert w["forwards"] == 200 and w["canary_us"] == pytest.approx(30.0, abs=0.1)
    assert w["forward_us"] == pytest.approx(1000)
    assert bench.host_window(log, "prefill") is None
    first = "\n".join([bench.BEGIN + "a", line(100, 100 * 20_000), bench.END + "a"])  # no line before: from 0
    assert bench.host_window(first, "a")["canary_us"] == pytest.approx(20.0)


def test_host_window_reads_the_tails(bench) -> None:
    """Slow forwards are differenced over the window (cumulative); the longest forward is the largest of the window's
    own lines (each covers the forwards since the previous one), so a slow forward after the end marker is not
    counted."""
    from kvcanary.runtime.installation import HostTime

    def line(forwards: int, slow: int, max_ns: int) -> str:
        return HostTime(forwards=forwards, hook_ns=forwards * 40_000, slow_forwards=slow,
                        max_forward_ns=max_ns).line(step=forwards)

    log = "\n".join([line(100, 3, 9_000_000), bench.BEGIN + "decode-1", line(200, 4, 1_500_000),
                     line(300, 6, 700_000), bench.END + "decode-1", line(400, 9, 20_000_000)])
    w = bench.host_window(log, "decode-1")
    assert (w["slow_forwards"], w["max_forward_ms"]) == (3, 1.5)
    assert w["batch_init_us"] == pytest.approx(0.0)
    old = log.replace(" max_forward_us=", " x=")  # lines from before issue 28: no tails
    assert bench.host_window(old, "decode-1")["slow_forwards"] is None
    assert bench.host_window(old, "decode-1")["max_forward_ms"] is None


def test_engine_that_does_not_start_is_ended_and_reported(bench, tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    worker = ("import json, sys, time; json.dump({'status': 'STARTING', 'mode': 'off', 'import_s': 0.1, "
              f"'shapes': {{}}}}, open({str(result)!r}, 'w')); time.sleep(60)")
    ran = bench.run_engine_worker([sys.executable, "-c", worker], {}, str(tmp_path / "worker.log"), str(result),
                                  start_timeout=1.0, timeout=30.0, poll=0.1)
    assert ran["killed"] == "start-up" and ran["rc"] == 124 and ran["worker_s"] < 20
    assert "(start-up)" in (tmp_path / "worker.log").read_text()


def test_startup_facts_from_sglang_lines(bench) -> None:
    log = ("server_args=ServerArgs(attention_backend='fa3', x=1)\nLoad weight end. elapsed=6.25 s, type=Llama\n"
           "Capture cuda graph bs [1, 2, 4, 8]\nCapture cuda graph end. Time elapsed: 12.50 s. mem usage=1 GB.\n"
           "Capture cuda graph num tokens [4, 8, 16]\nCapture piecewise CUDA graph end. Time elapsed: 30.00 s.\n")
    assert bench.startup_facts(log) == {"weights_s": 6.25, "decode_capture_s": 12.5, "decode_sizes": 4,
                                        "piecewise_capture_s": 30.0, "piecewise_sizes": 3, "attention_backend": "fa3"}
    assert bench.startup_facts("")["decode_capture_s"] is None


def test_config_is_the_llama_3_1_8b_shape(bench) -> None:
    cfg = json.loads((bench.MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")} == {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072}
    assert cfg["rope_theta"] == 500000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False


def test_workload_shapes(bench) -> None:
    for name, t in bench.TRAFFIC.items():
        rounds = bench.make_rounds(t, 0)
        assert len(rounds) == t.rounds and all(len(r) == t.concurrency for r in rounds), name
        assert all(t.prompt[0] <= len(p) <= t.prompt[1] and max(p) < bench.ID_LIMIT for r in rounds for p in r)
        assert rounds == bench.make_rounds(t, 0) and rounds != bench.make_rounds(t, 1)  # seeded
    pre = bench.TRAFFIC["prefill"]
    heads = {tuple(p[: pre.prefix_len]) for r in bench.make_rounds(pre, 0) for p in r}
    assert len(heads) <= pre.prefixes  # the prompts share prefixes (radix cache hits)
    assert [bench.TRAFFIC[n].concurrency for n in ("decode-1", "decode-64", "decode-256")] == [1, 64, 256]


def test_engines_log_at_info_so_the_tables_have_their_lines(bench) -> None:
    # The offline Engine defaults to log_level "error", which hides sglang's start-up lines and kvcanary's stats and
    # host-time lines; the first H200 run's tables came back without them.
    assert bench.engine_kwargs("m", {})["log_level"] == "info"
    assert bench.engine_kwargs("m", {"log_level": "warning"})["log_level"] == "warning"  # --engine-arg still wins


# -------------------------------------------------------------------------------------------- arms, tails, probe
def test_arm_parsing(bench) -> None:
    arms = bench.parse_arms(["nosweep:KVCANARY_SWEEP_INTERVAL=0", "lean:KVCANARY_VERIFY_TOKENS=0, KVCANARY_X=a=b"])
    assert arms == [bench.Arm("nosweep", {"KVCANARY_SWEEP_INTERVAL": "0"}),
                    bench.Arm("lean", {"KVCANARY_VERIFY_TOKENS": "0", "KVCANARY_X": "a=b"})]
    assert bench.parse_args([]).arms == []
    assert bench.parse_args(["--arm", "a:KVCANARY_Y=1"]).arms == [bench.Arm("a", {"KVCANARY_Y": "1"})]


@pytest.mark.parametrize(("items", "said"), [
    (["on:KVCANARY_SWEEP_INTERVAL=0"], "--arm: 'on' is a built-in Engine kind"),
    (["off:KVCANARY_SWEEP_INTERVAL=0"], "--arm: 'off' is a built-in Engine kind"),
    (["a:KVCANARY_X=1", "a:KVCANARY_Y=2"], "--arm: 'a' given twice"),
    (["a:SWEEP_INTERVAL=0"], "--arm a: expected KVCANARY_KEY=VALUE, got 'SWEEP_INTERVAL=0'"),
    (["a:KVCANARY_X"], "--arm a: expected KVCANARY_KEY=VALUE, got 'KVCANARY_X'"),
    (["a:KVCANARY_MODE=log"], "--arm a: KVCANARY_MODE is set per Engine by the bench"),
    (["nosweep"], "--arm: expected NAME:KVCANARY_KEY=VALUE"),
    (["a:"], "--arm: expected NAME:KVCANARY_KEY=VALUE"),
    ([":KVCANARY_X=1"], "--arm: name '' must be"),
    (["a/b:KVCANARY_X=1"], "--arm: name 'a/b' must be"),
])
def test_arm_errors_name_the_option(bench, items: list[str], said: str) -> None:
    with pytest.raises(SystemExit) as err:
        bench.parse_arms(items)
    assert str(err.value).startswith(said)


def test_engine_order_with_arms(bench) -> None:
    assert bench.engine_order("off", [], 2) == ["off", "on", "off", "on"]
    assert bench.engine_order("off", ["a", "b"], 2) == ["off", "on", "a", "b", "off", "on", "a", "b"]
    assert bench.engine_order("on", ["a"], 1) == ["on", "off", "a"]


def test_arms_get_their_settings_folders_and_the_probe(bench, tmp_path: Path) -> None:
    """Every Engine runs with its arm's settings over the on mode's, in its own engine-NN-ARM folder, with the loop
    probe plugin when asked; results record arm and settings; a skipped arm Engine too."""
    seen = []

    def runner(cmd, env, log_path, result_path, start_timeout, timeout):
        seen.append(env)
        return bench.dry_runner(cmd, env, log_path, result_path, start_timeout, timeout)

    args = bench.parse_args(["--pairs", "1", "--traffic", "ttft-1", "--arm", "nosweep:KVCANARY_SWEEP_INTERVAL=0",
                             "--loop-probe", "--out", str(tmp_path)])
    assert bench.run_parent(args, runner) == 0
    assert sorted(p.name for p in tmp_path.glob("engine-*")) == ["engine-00-off", "engine-01-on",
                                                                 "engine-02-nosweep"]
    assert [(e["KVCANARY_MODE"], e.get("KVCANARY_SWEEP_INTERVAL")) for e in seen] == [
        ("off", None), ("raise", "10"), ("raise", "0")]
    assert all(e["E2E_LOOP_PROBE"] == "1" and str(tmp_path) in e["PYTHONPATH"] for e in seen)
    assert (tmp_path / "engine-02-nosweep" / "loop-probe-plugin").is_dir()
    res = json.loads((tmp_path / "engine-02-nosweep" / "result.json").read_text())
    assert (res["arm"], res["env"], res["mode"]) == ("nosweep", {"KVCANARY_SWEEP_INTERVAL": "0"}, "on")
    assert set(res["shapes"]) == {"ttft-1"} and res["shapes"]["ttft-1"]["requests"] == 32
    md = (tmp_path / "summary.md").read_text()
    assert "### ttft-1 (nosweep): 1 concurrent, 32 round(s), prompts 96-160 tokens, 8 out" in md
    for arm in ("off", "on", "nosweep"):
        assert f"| ttft-1 ({arm}) | 1 | " in md  # the loop probe's row
    # no budget left for another round: the arm Engine is skipped like the others, with its arm recorded
    args = bench.parse_args(["--pairs", "1", "--arm", "b:KVCANARY_Z=1", "--engine-min-s", "1e9", "--out",
                             str(tmp_path / "skip")])
    bench.run_parent(args, runner)
    skipped = json.loads((tmp_path / "skip" / "engine-02-b" / "result.json").read_text())
    assert (skipped["status"], skipped["arm"], skipped["env"]) == ("SKIPPED", "b", {"KVCANARY_Z": "1"})


def _engine_dir(root: Path, name: str, result: dict) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps(result))
    (d / "worker.log").write_text("")


def test_summary_rows_per_arm_on_synthetic_folders(bench, tmp_path: Path) -> None:
    """One table per shape per arm against off; pairs are the k-th off with the k-th Engine of that arm; a folder
    from before --arm (no arm field) is its mode."""
    def shape(tps: float, ttft: float, itl_max: float, stalls: int) -> dict:
        return {"tokens_per_s": tps, "ttft_p50_ms": ttft, "itl_max_ms": itl_max, "itl_stalls": stalls}

    def result(arm: str | None, *shapes: dict) -> dict:
        r = {"status": "OK", "mode": "off" if arm == "off" else "on", "shapes": {"decode-1": shapes[0]}}
        return r | ({"arm": arm, "env": {"KVCANARY_SWEEP_INTERVAL": "0"} if arm == "nosweep" else {}} if arm else {})

    _engine_dir(tmp_path, "engine-00-off", result(None, shape(200.0, 20.0, 10.0, 2)))
    _engine_dir(tmp_path, "engine-01-on", result(None, shape(190.0, 30.0, 12.0, 6)))
    _engine_dir(tmp_path, "engine-02-nosweep", result("nosweep", shape(198.0, 21.0, 11.0, 3)))
    _engine_dir(tmp_path, "engine-03-off", result("off", shape(210.0, 22.0, 14.0, 4)))
    _engine_dir(tmp_path, "engine-04-on", result("on", shape(199.5, 34.0, 16.0, 10)))
    _engine_dir(tmp_path, "engine-05-nosweep", result("nosweep", shape(196.0, 23.0, 13.0, 5)))
    engines = bench.load_engines([str(tmp_path)])
    assert [(e["arm"], e["mode"]) for e in engines] == [("off", "off"), ("on", "on"), ("nosweep", "on")] * 2
    md, facts = bench.render(engines, [str(tmp_path)])
    assert "Arms (on with these settings on top): nosweep: KVCANARY_SWEEP_INTERVAL=0." in md
    assert set(facts["verdicts"]) == {"decode-1", "decode-1 (nosweep)"}
    on = md[md.index("### decode-1: "):md.index("### decode-1 (nosweep): ")]
    nosweep = md[md.index("### decode-1 (nosweep): "):md.index("### Engines")]
    assert "2 off / 2 on Engines" in on and "| metric | off | on | on/off | target | met |" in on
    assert "| output tokens/s | 205 (200–210) | 195 (190–200) | 0.950 | ≥ 0.99 | NOT met |" in on
    assert "| TTFT p50 (ms) | 21.00 (20.00–22.00) | 32.00 (30.00–34.00) | 1.524 | ≤ 1.02 | NOT met |" in on
    assert "| ITL max (ms) | 12.00 (10.00–14.00) | 14.00 (12.00–16.00) | 1.167 | | |" in on
    assert "| ITL stalls (> 2× the Engine's ITL p50) | 3 (2–4) | 8 (6–10) | 2.667 | | |" in on
    assert "Tokens/s on/off per pair: 0.950, 0.950." in on
    assert "| metric | off | nosweep | nosweep/off | target | met |" in nosweep
    assert "| output tokens/s | 205 (200–210) | 197 (196–198) | 0.961 | ≥ 0.99 | NOT met |" in nosweep
    assert "| ITL stalls (> 2× the Engine's ITL p50) | 3 (2–4) | 4 (3–5) | 1.333 | | |" in nosweep
    assert "Tokens/s nosweep/off per pair: 0.990, 0.933." in nosweep
    assert "| 2 | nosweep | OK |" in md and "Loop probe" not in md  # start-up rows by arm; no probe, no table


def test_ttft_1_only_when_asked(bench) -> None:
    assert bench.TRAFFIC["ttft-1"] == bench.Traffic("ttft-1", 1, 32, (96, 160), 8)
    assert bench.parse_args([]).traffic == ["decode-1", "decode-64", "decode-256", "prefill"]
    assert bench.parse_args(["--traffic", "ttft-1,decode-1"]).traffic == ["ttft-1", "decode-1"]


def test_itl_tails_from_known_samples(bench) -> None:
    itl = [0.010] * 9 + [0.025, 0.019, 0.030]  # p50 10 ms: 25 and 30 ms are stalls (> 20 ms), 19 ms is not
    assert bench.itl_tails(itl) == {"itl_max_ms": 30.0, "itl_stalls": 2}
    assert bench.itl_tails([]) == {"itl_max_ms": None, "itl_stalls": 0}
    t = bench.Traffic("t", 1, 1, (4, 4), 13)
    s = bench.shape_result(t, [{"ttft": [0.02], "itl": itl, "tokens": [13], "cached": 0, "wall": 0.2}])
    assert (s["itl_max_ms"], s["itl_stalls"], s["ttft_ms"]) == (30.0, 2, [20.0])


def test_probe_windows_per_shape(bench) -> None:
    """Each shape's window: from the last probe line before its WINDOW_START to the last by its WINDOW_END, in the
    log up to the next shape's begin marker; a shape without a window of its own is left out."""
    import loop_probe

    def line(t: float, iters: int, loop_ns: int, decode_ns: int = 0, decode_n: int = 0) -> str:
        c = dict.fromkeys(loop_probe.FIELDS, 0) | {"iters": iters, "loop_ns": loop_ns, "gpu_decode_ns": decode_ns,
                                                    "gpu_decode_n": decode_n}
        return f"[e2e-probe] t={t:.3f} pid=7 " + " ".join(f"{k}={v}" for k, v in c.items())

    log = "\n".join([
        line(100.0, 25, 25_000_000, 1_000_000, 10),  # warm-up
        bench.BEGIN + "a", loop_probe.WINDOW_START + "101.000", line(102.0, 75, 75_000_000, 6_000_000, 60),
        loop_probe.WINDOW_END + "103.000", bench.END + "a",
        bench.BEGIN + "b", loop_probe.WINDOW_START + "104.000", line(105.0, 175, 375_000_000, 16_000_000, 80),
        loop_probe.WINDOW_END + "106.000", bench.END + "b",
        bench.BEGIN + "c", bench.END + "c",  # no window: not a's or b's again
        line(200.0, 1000, 10**12)]) + "\n"
    w = bench.probe_windows(log)
    assert set(w) == {"a", "b"}
    assert (w["a"]["iters"], w["a"]["loop_us"], w["a"]["gpu_decode_us"]) == (50, 1000.0, 100.0)
    assert (w["b"]["iters"], w["b"]["loop_us"], w["b"]["gpu_decode_us"]) == (100, 3000.0, 500.0)
    assert bench.probe_windows(log.replace(loop_probe.WINDOW_START, "x")) == {}
