"""benchmarks/bench_forward_path.py (the engine's per-forward call sequence through the sglang adapter, on CPU) and
the host-time accounting it checks: every host cost the canary adds is in ``kvcanary host time``, the batch hook
(``ForwardBatch.init_new``) included."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_forward_path.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_forward_path", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the stand-in pool classes are named by module path (pools.PoolClasses)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_host_time_line_counts_the_batch_hook() -> None:
    from kvcanary.runtime.installation import HostTime

    host = HostTime(forwards=4, eager_forwards=4, hook_ns=200_000, in_forward_ns=400_000, batch_inits=4,
                    batch_init_ns=100_000, forward_ns=4_000_000)
    line = host.line(step=4)
    assert "canary_us_per_forward=175.0 hooks_us=50.0 launch_us_per_eager_forward=100.0" in line
    # after the older fields (older parsers match the line's prefix), only the tails
    assert line.endswith(" batch_init_us=25.0 max_forward_us=0.0 slow_forwards=0")


def test_the_batch_hook_is_accounted_even_when_it_raises(bench, monkeypatch) -> None:
    """after_forward_batch_init adds its host time to the Installation's HostTime, once per batch (decode batches
    too), and keeps the time of a call that fails: in log mode kvcanary then stops on the runner and the batch goes
    on; in raise mode the error stands."""
    import torch

    from kvcanary.sglang.hooks import AdapterHooks, installation_of

    for key in bench._ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("KVCANARY_MODE", "log")
    monkeypatch.setenv("KVCANARY_VERIFY_TOKENS", "1")
    case = bench.Case("mixed", "none", True, 0)
    work = bench.Workload(case, 4, torch.device("cpu"))
    runner = bench.StandInRunner(work.rows, work.context, work.slots, torch.device("cpu"))
    hooks = AdapterHooks(bench.bench_version())
    hooks.after_init_memory_pool(None, runner)
    inst = installation_of(runner)
    assert inst.host_time.batch_inits == 0
    wb, fb = work.next_batch()
    assert hooks.after_forward_batch_init(fb, bench.ForwardBatch, wb, runner) is fb
    assert inst.host_time.batch_inits == 1 and inst.host_time.batch_init_ns > 0
    decode = bench.WorkerBatch(bench.ForwardMode.DECODE, [work.decode_reqs[r] for r in work.decode_rows])
    hooks.after_forward_batch_init(fb, bench.ForwardBatch, decode, runner)
    assert inst.host_time.batch_inits == 2
    bad = bench.WorkerBatch(bench.ForwardMode.EXTEND, [bench.Req("x", work.rows + 5, [1, 2], [])])
    assert hooks.after_forward_batch_init(fb, bench.ForwardBatch, bad, runner) is fb
    assert inst.host_time.batch_inits == 3 and inst.stopped is not None and "outside" in inst.stopped
    inst.close()

    monkeypatch.setenv("KVCANARY_MODE", "raise")
    runner = bench.StandInRunner(work.rows, work.context, work.slots, torch.device("cpu"))
    hooks.after_init_memory_pool(None, runner)
    inst = installation_of(runner)
    with pytest.raises(ValueError, match="outside"):
        hooks.after_forward_batch_init(fb, bench.ForwardBatch, bad, runner)
    assert inst.host_time.batch_inits == 1 and inst.stopped is None
    inst.close()


@pytest.mark.parametrize("case", ["decode bs64 PARTIAL + tokens", "mixed bs64 PARTIAL + tokens + sweep 10"])
def test_bench_and_host_time_measure_the_same_forwards(bench, tmp_path, case) -> None:
    """The benchmark times each hook from outside; HostTime's intervals nest inside those, so per round HostTime is
    at most the benchmark in every column, and it misses little (a missing piece, such as the batch hook before it
    was counted, shows as a low ratio: with the token check that hook is most of the cost)."""
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--forwards", "4", "--rounds", "2", "--cases", case, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kernels"] == "null" and [c["case"] for c in data["cases"]] == [case]
    result = data["cases"][0]
    for rnd in result["rounds"]:
        assert rnd["host_time_forwards"] == 4
        for key in ("hooks", "launches", "batch_init", "total"):
            assert rnd["host_time"][key] <= rnd["bench"][key] + 1e-6, (key, rnd)
        assert rnd["host_time"]["batch_init"] > 0
        assert rnd["host_time"]["total"] >= 0.5 * rnd["bench"]["total"], rnd
    pieces = result["pieces_us"]
    for name in ("step", "kernels"):
        assert pieces.get(name, 0) > 0, name
    # the tokens' way out of the batch hook: a decode batch's read and posted to the token mail by the host
    # extension's one C call (no Python columns), a prefill's (the mixed batch) columns through the table's upload
    if case.startswith("decode"):
        assert pieces.get("token decode post (C)", 0) > 0, pieces
        assert "expected_token_updates" not in pieces and "token table upload" not in pieces, pieces
    else:  # (a batch that can bring new requests is not offered to the C call)
        assert pieces.get("expected_token_updates", 0) > 0 and pieces.get("token table upload", 0) > 0, pieces
        assert "token decode post (C)" not in pieces, pieces
    # the wrapper's eager hot path launches every timed forward: no BatchView, no before_forward / after_forward
    assert not {"BatchConverter", "before_forward", "after_forward"} & set(pieces), pieces
    assert ("assign_requests" in pieces) == case.startswith("mixed")  # new requests: extend rows only
    assert ("sweep (in step)" in pieces) == ("sweep" in case)
    assert "| " + case + " |" in data["markdown"]
    # kvcanary's Python calls per forward (the cold-cache cost's driver): the batch hook, the forward hook, the
    # wrapper and the managers' calls at least; a decode forward with the token check made 31 on 2026-12-02 (41 before
    # that session's cuts), a mixed one with the sweep 62 (72; its extend rows take the token check's full path); with
    # the eager hot path, the written-out forward hook and the batch hook's request read skipped: 13 and 48
    # (2026-12-03); a decode batch read by the host extension's one C call (no columns function): 10 (2026-12-04)
    calls = result["python_calls_per_forward"]
    assert (8 <= calls <= 16) if case.startswith("decode") else (30 < calls <= 52), calls


def test_the_stand_in_model_keeps_its_time_without_module_setattr(bench, monkeypatch) -> None:
    """The stand-in model's own clock costs the canary's columns nothing: no ``nn.Module.__setattr__`` (~3.5 µs of
    isinstance checks, after the model's clock stopped, counted as launches) per forward."""
    import torch

    model = bench.StandInModel()
    calls = []
    setattr_ = torch.nn.Module.__setattr__
    monkeypatch.setattr(torch.nn.Module, "__setattr__", lambda self, k, v: (calls.append(k), setattr_(self, k, v)))
    ids = torch.zeros(2, dtype=torch.int64)
    for _ in range(3):
        assert model.forward(ids, ids, None) is ids
    assert calls == [] and model.inner_ns >= 0


def test_the_stand_in_model_launches_what_it_is_told(bench, tmp_path) -> None:
    """``--model-launches N``: the stand-in model runs N ``add_`` per forward (the model's own launches) and its own
    host time is reported beside kvcanary's, outside kvcanary's columns (how 2026-12-04's experiment with the check
    launched after the model told whose cost the check's extra units were)."""
    model = bench.StandInModel(3, torch.device("cpu"))
    ids = torch.zeros(2, dtype=torch.int64)
    for _ in range(4):
        model.forward(ids, ids, None)
    assert int(model.x.item()) == 12 and model.inner_ns > 0
    out = tmp_path / "bench.json"
    case = "decode bs64 PARTIAL + deferred write"
    assert bench.main(["--quick", "--forwards", "3", "--rounds", "2", "--cases", case, "--model-launches", "5",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["model_launches"] == 5 and "the model 5 launches per forward" in data["markdown"]
    result = data["cases"][0]
    assert result["model_us"] > 0 and all(rnd["model"] > 0 for rnd in result["rounds"])
    # (the model's time is not kvcanary's: HostTime's launches stay within the bench's, which exclude the model)
    for rnd in result["rounds"]:
        assert rnd["host_time"]["launches"] <= rnd["bench"]["launches"] + 1e-6


def test_the_bench_version_installs_without_sglang(bench, monkeypatch) -> None:
    """Regression: the install's speculative check asks ``pools.pool_kind`` with the version's ``POOL_CLASSES``; the
    bench's version module kept 0.5.12's, whose sglang classes the bench (which runs without sglang) then imported:
    every case failed at install since b450279. The bench's version names its stand-in classes there too, and a
    case's install imports no sglang module."""
    imported: list[str] = []
    real_resolve = bench.pools.pkgutil.resolve_name

    def resolve(name: str):
        imported.append(name)
        return real_resolve(name)

    monkeypatch.setattr(bench.pools.pkgutil, "resolve_name", resolve)
    monkeypatch.setenv("KVCANARY_MODE", "log")
    v = bench.bench_version()
    assert v.POOL_CLASSES.mha.endswith("StandInMHAPool")
    runner = bench.StandInRunner(4, 64, 256, torch.device("cpu"))
    bench.AdapterHooks(v).after_init_memory_pool(None, runner)
    assert bench.installation_of(runner) is not None
    assert imported and not [name for name in imported if name.startswith("sglang")]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_small_batch_sizes_run_every_case_they_can_hold(bench, tmp_path, monkeypatch, batch_size) -> None:
    """``--batch-size 1`` crashed in the first mixed case (its 8 extend rows written past the table); a mixed batch
    needs an extend and a decode row, so batch size 1 has no mixed case and 2 has one extend row."""
    monkeypatch.setattr(bench, "BS", bench.BS)  # main sets the module-wide batch size: restored after the test
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--forwards", "2", "--rounds", "1", "--batch-size", str(batch_size),
                       "--cases", "PARTIAL + tokens", "--json", str(out)]) == 0
    names = [c["case"] for c in json.loads(out.read_text())["cases"]]
    kinds = ["decode", "extend"] + (["mixed"] if batch_size >= 2 else [])
    assert [n.split()[0] for n in names if "sweep" not in n and "deferred" not in n] == kinds, names
    assert any("deferred write" in n for n in names), names  # the eager engine with --disable-cuda-graph
