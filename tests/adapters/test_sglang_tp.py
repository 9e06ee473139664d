"""Tensor parallelism on CPU: a REAL sglang 0.5.12 ModelRunner with tp_size=2 (two processes, gloo), kvcanary
installed in each rank through its entry point.

Each rank (``sgl_tp_worker.py``) runs the same seeded schedule (extend, chunked extend, radix prefix hits,
decode) for FORWARDS forwards: both ranks must see 0 violations and advance their own counters. Then rank 1
alone flips one K byte of a live slot in its own KV shard: rank 1 reports it (``tp_rank=1`` in the log line,
the JSONL row and the file name from ``KVCANARY_REPORT=.../kv-{rank}.jsonl``), rank 0 stays clean.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import sgl_engine  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE.parent.parent / "plugin"
TP_SIZE = 2
FORWARDS = 120
FAULT_RANK = 1
TIMEOUT_S = 420

pytestmark = pytest.mark.slow  # two sglang processes (~30-60 s on 2 cores)


def _child_env(tmp_path: Path, report: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    paths = [str(PLUGIN_DIR)]
    if not any(ep.name == "kvcanary" for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")):
        # a source checkout: kvcanary's entry point as pip would install it (dist-info on the children's path)
        ep_dir = tmp_path / "ep"
        dist = ep_dir / "kvcanary_src-0.0.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcanary-src\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nkvcanary = kvcanary.sglang:register\n")
        paths.insert(0, str(ep_dir))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    cpus = max(os.cpu_count() or 1, 1)
    env.update({
        "KVCANARY_MODE": "log",  # a raise on rank 1 would leave rank 0 waiting in a collective
        "KVCANARY_REPORT": report,
        "KVCANARY_VERIFY_TOKENS": "1",
        "KVCANARY_SWEEP_INTERVAL": "5",
        "KVCANARY_STATS_EVERY": "0",
        "KVCANARY_LOG_REPEAT_WINDOW": "0",  # every row logged: the fault test counts each rank's lines
        "SGLANG_PLUGINS": "kvcanary",
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        # sglang on CPU asserts tp_size <= NUMA nodes unless each rank's cores are named (init_threads_binding)
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % cpus) for r in range(TP_SIZE)),
        "OMP_NUM_THREADS": "1",
    })
    return env


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tp2")
    model_dir = sgl_engine.write_model_dir(tmp_path / "tiny-llama")
    out = tmp_path / "out"
    out.mkdir()
    env = _child_env(tmp_path, str(out / "kv-{rank}.jsonl"))
    port = sgl_engine.free_port()
    procs, logs = [], []
    for rank in range(TP_SIZE):
        log = open(tmp_path / f"worker-{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "sgl_tp_worker.py"), str(rank), str(TP_SIZE), str(port), str(model_dir),
             str(out), str(FORWARDS), str(FAULT_RANK)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
        ))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = []
    for rank, log in enumerate(logs):
        log.seek(0)
        tails.append(f"--- rank {rank} (rc={procs[rank].returncode}) ---\n" + "".join(log.readlines()[-40:]))
        log.close()
    if any(p.returncode != 0 for p in procs):
        pytest.fail("a tp=2 worker failed:\n" + "\n".join(tails))
    results = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(TP_SIZE)]
    return out, results


def _violation_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line is whole JSON
    return [r for r in rows if r["schema"] == "kvcanary.violation/1"]


def test_tp2_each_rank_installs_with_its_rank(tp2_run) -> None:
    out, results = tp2_run
    for rank, r in enumerate(results):
        assert r["runner_attrs"]["tp_rank"] == rank and r["runner_attrs"]["tp_size"] == TP_SIZE
        assert r["manager_rank"] == {"tp_rank": rank}
        assert r["runner_ranks"] == [{"tp_rank": rank}, rank]
        assert r["report_path"] == str(out / f"kv-{rank}.jsonl")
        installed = [ln for ln in r["log_lines"] if ln.startswith("kvcanary: installed on")]
        assert len(installed) == 1 and f"tp_rank={rank}" in installed[0], installed


def test_tp2_real_kv_sources_are_the_ranks_own_shards(tp2_run) -> None:
    _, results = tp2_run
    for r in results:
        pool = r["pool"]
        # this rank's pool holds its share of the KV heads (2 KV heads / tp 2 = 1 head per rank)
        assert pool["head_num"] == pool["total_kv_heads"] // TP_SIZE == 1
        k, v = pool["k"], pool["v"]
        expected = [k[0], v[0], k[-1], v[-1]]  # KVCANARY_REAL_KV_LAYERS default 0,-1: K and V of each
        assert r["sources"] == expected
        assert all(s["shape"][1] == pool["head_num"] for s in r["sources"])


def test_tp2_clean_phase_zero_violations_counters_advance_on_both_ranks(tp2_run) -> None:
    _, results = tp2_run
    for r in results:
        c = r["clean"]
        assert c["forwards"] == c["steps"] == FORWARDS
        assert c["modes"] == ["DECODE", "EXTEND"] and c["cached_tokens"] > 0 and c["finished"] > 0
        assert c["violations"] == 0
        assert c["verify_runs"] == c["write_runs"] == FORWARDS
        assert c["sweep_runs"] == FORWARDS // 5
        assert c["slots_written"] > 0 and c["slots_verified"] > 0
    # the ranks ran the same schedule on their own shards: their own counters advanced identically
    keys = ("forwards", "verify_runs", "write_runs", "sweep_runs", "slots_written", "slots_verified")
    per_rank = [{k: r["clean"][k] for k in keys} for r in results]
    assert all(counters == per_rank[0] for counters in per_rank), per_rank


def test_tp2_fault_on_rank1_is_reported_by_rank1_only(tp2_run, capsys) -> None:
    out, results = tp2_run
    clean_rank, faulty = results[1 - FAULT_RANK], results[FAULT_RANK]
    # rank 0: no injection, no violation, still checking every forward, empty report file
    assert clean_rank["fault"]["injected"] is None
    assert clean_rank["fault"]["reported"] == 0 and clean_rank["fault"]["violations"] == []
    assert clean_rank["fault"]["verify_runs"] > clean_rank["clean"]["verify_runs"]
    assert not [ln for ln in clean_rank["log_lines"] if ln.startswith("kvcanary violation:")]
    assert not _violation_rows(out / f"kv-{1 - FAULT_RANK}.jsonl")
    # rank 1: the flipped slot, reason verify_real_kv_hash, tp_rank=1 in the record, the log line and the file
    f = faulty["fault"]
    assert f["injected"] and f["reported"] == len(f["violations"]) >= 1
    assert {v["slot"] for v in f["violations"]} == {f["slot"]}
    assert all(v["reasons"] == ["verify_real_kv_hash"] for v in f["violations"])
    assert all(v["rank"] == {"tp_rank": FAULT_RANK} for v in f["violations"])
    logged = [ln for ln in faulty["log_lines"] if ln.startswith("kvcanary violation:")]
    assert len(logged) == f["reported"] and all(ln.endswith(f" tp_rank={FAULT_RANK}") for ln in logged)
    rows = _violation_rows(out / f"kv-{FAULT_RANK}.jsonl")
    assert len(rows) == f["reported"]
    assert all(row["rank"] == {"tp_rank": FAULT_RANK} and row["slot"] == f["slot"]
               and row["reasons"] == ["verify_real_kv_hash"] for row in rows)
    with capsys.disabled():
        for rank, r in enumerate(results):
            fault = {k: r["fault"][k] for k in ("injected", "reported", "verify_runs")}
            print(f"\ntp=2 rank {rank}: clean {r['clean']} fault {fault}")
        print(f"tp=2 fault line: {logged[0]}")


def test_install_on_a_real_runner_uses_its_ranks_for_rows_and_report_file(tmp_path, monkeypatch) -> None:
    """A real single-process runner whose rank attributes say "tp rank 1 of 2, pipeline stage 1 of 2":
    install() tags its manager and names its report file with the combined index (1 * 2 + 1 = 3)."""
    import hooks_state

    from kvcanary.sglang import hooks, ranks, v0_5_12

    hooks_state.clear_kvcanary_env(monkeypatch)
    monkeypatch.setenv("KVCANARY_MODE", "log")
    monkeypatch.setenv("KVCANARY_REPORT", str(tmp_path / "kv-{rank}.jsonl"))
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)  # a plain runner: kvcanary is installed by hand below
    sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"))
    mr = sgl_engine.build_runner(sa, nccl_port=sgl_engine.free_port())
    try:
        assert hooks.installation_of(mr) is None
        assert ranks.runner_ranks(mr) == ({"tp_rank": 0}, 0)  # the real attributes of a tp=1 runner
        mr.tp_rank, mr.tp_size, mr.pp_rank, mr.pp_size = 1, 2, 1, 2
        inst = hooks.hooks_for(v0_5_12).install(mr)
        assert [g.manager.rank for g in inst.groups] == [{"tp_rank": 1, "pp_rank": 1}]
        assert inst.manager.reporter.report_path == str(tmp_path / "kv-3.jsonl")
        assert inst.manager.reporter.rank == {"tp_rank": 1, "pp_rank": 1}
        assert (tmp_path / "kv-3.jsonl").exists()
        inst.close()
    finally:
        hooks_state.restore(state)
        sgl_engine.destroy_distributed()
