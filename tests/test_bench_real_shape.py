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
