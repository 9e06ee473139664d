"""KVCANARY_FAULT in a REAL sglang 0.5.12 ModelRunner on CPU: every fault class the live-engine injector takes is
written to the JSONL report (``kvcanary.injection/1``), detected with its expected reason within the driver's
window, and no violation names a slot that no injection touched (the injectors undo what they break).

The matching is integration/sglang_e2e.py's own (the GPU driver's), so this also checks the driver's matcher on
real reports.
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sglang  # noqa: E402,F401

from kvcanary.runtime import faults  # noqa: E402
from kvcanary.sglang.installed import runner_state_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FORWARDS = 220


def _driver():
    import sys

    if "sglang_e2e_driver" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sglang_e2e_driver", ROOT / "integration" / "sglang_e2e.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["sglang_e2e_driver"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["sglang_e2e_driver"]



def _run(tmp_path, monkeypatch, fault: str, port: int):
    import sglang.srt.plugins as plugins

    hooks_state.clear_kvcanary_env(monkeypatch)
    report = tmp_path / "kvc-{rank}.jsonl"
    for k, v in {"KVCANARY_MODE": "log", "KVCANARY_VERIFY_TOKENS": "1", "KVCANARY_SWEEP_INTERVAL": "4",
                 "KVCANARY_REPORT": str(report), "KVCANARY_FAULT": fault, "KVCANARY_FAULT_EVERY": "5",
                 "KVCANARY_FAULT_WARMUP": "3", "KVCANARY_FAULT_SEED": "1", "SGLANG_PLUGINS": "kvcanary"}.items():
        monkeypatch.setenv(k, v)
    sgl_engine.ensure_entry_point(tmp_path, monkeypatch)
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)
    plugins.load_plugins()
    try:
        sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), chunked_prefill_size=48)
        mr = sgl_engine.build_runner(sa, nccl_port=port)
        tree = sgl_engine.build_tree_cache(mr, sa)
        runner = runner_state_of(mr)
        assert runner is not None and runner.faults is not None and runner.prefix_cache is tree
        inst = runner.inst
        rng = random.Random(7)
        prefix = [rng.randrange(3, 2000) for _ in range(40)]
        sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=48)
        while len(sched.forwards) < FORWARDS:
            if len(sched.waiting) < 2 and rng.random() < 0.3 and len(sched.finished) + 14 > sched._rid:
                tail = [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 70))]
                sched.add((prefix if rng.random() < 0.7 else []) + tail, rng.randrange(3, 15))
            if not sched.idle:
                sched.step()
        inst.manager.flush()
        inst.close()
        path = Path(str(report).replace("{rank}", "0"))
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return runner, rows, collections.Counter(sched.forwards)
    finally:
        hooks_state.restore(state)
        sgl_engine.destroy_distributed()


LIVE_FAULTS = ("req_to_token_redirect", "real_kv_flip", "cached_idle_corruption", "token_swap", "position_skew")


@pytest.mark.parametrize("fault", LIVE_FAULTS)
def test_each_fault_class_is_recorded_detected_and_contained(tmp_path, monkeypatch, capsys, fault) -> None:
    driver = _driver()
    runner, rows, modes = _run(tmp_path, monkeypatch, fault, sgl_engine.free_port())
    injected = runner.faults
    m = driver.match_injections(rows)
    injections = [r for r in rows if r["schema"] == "kvcanary.injection/1"]
    violations = [r for r in rows if r["schema"] == "kvcanary.violation/1"]
    with capsys.disabled():
        print(f"\n{fault}: forwards={dict(modes)} injections={len(injections)} detected={dict(m.detected)} "
              f"violations={len(violations)} reasons={ {k: dict(v) for k, v in m.reasons.items()} } "
              f"tags={ {k: dict(v) for k, v in m.tags.items()} } late={m.late} skips={injected.skips}")
    assert len(injections) >= 8, (len(injections), injected.skips)
    assert {r["fault"] for r in injections} == {fault}
    assert len(injected.injections) == len(injections)
    for r in injections:
        assert r["slots"] and all(isinstance(s, int) for s in r["slots"]) and r["rank"] == {"tp_rank": 0}
        assert isinstance(r["step"], int) and r["detail"]
    assert m.detected[fault] == len(injections), [i["detail"] for i in m.missed]
    assert m.unexplained == [], m.unexplained[:5]
    assert set(m.reasons[fault]) and all(
        set(k.split("+")) & set(faults.EXPECTED_REASONS[fault]) for k in m.reasons[fault])
    if fault == "cached_idle_corruption":
        assert set(m.tags[fault]) == {"sweep"}
    if fault in ("req_to_token_redirect", "real_kv_flip", "cached_idle_corruption", "position_skew"):
        assert m.late == 0  # undone after the detecting forward: nothing lingers
    assert injected.pending is None or injected.pending[1] >= FORWARDS - 5 * 4


def _tree_paths(tree):
    """(slots, tokens) of every root-to-node path of a RadixCache, node by node (tokens from the tree keys)."""
    stack = [(tree.root_node, [], [])]
    while stack:
        node, slots, tokens = stack.pop()
        for child in list(node.children.values()):
            if child.value is None:
                continue
            key = child.key.token_ids if hasattr(child.key, "token_ids") else child.key
            s, t = slots + [int(x) for x in child.value.tolist()], tokens + [int(x) for x in key][: len(child.value)]
            yield s, t
            stack.append((child, s, t))


def test_token_swap_leaves_no_record_the_prefix_cache_disagrees_with(tmp_path, monkeypatch) -> None:
    """H200 run regression: a token-swapped row kept records (the swapped token and every chain hash after it)
    that disagreed with the tokens sglang stores. Once the finished request entered the RadixCache behind another
    request's identical prefix, the tree linked the first slot after the shared part to that request's record
    and the sweep reported a slot no injection touched. The row is now rewritten after its detecting forward:
    every slot the RadixCache holds must carry the tree's token and the chain hash of the tree path before it."""
    from kvcanary.kernels import hash_ref, layout

    runner, rows, _ = _run(tmp_path, monkeypatch, "token_swap", sgl_engine.free_port())
    injections = [r for r in rows if r["schema"] == "kvcanary.injection/1"]
    assert len(injections) >= 8
    records = runner.inst.manager.canary_buf.view(torch.int64).tolist()
    checked, swapped = 0, {s for r in injections for s in r["slots"]}
    for slots, tokens in _tree_paths(runner.prefix_cache):
        running = hash_ref.chain_head_hash()
        for pos, (slot, tok) in enumerate(zip(slots, tokens, strict=True)):
            rec = records[slot]
            assert (rec[layout.RECORD_FIELD_TOKEN], rec[layout.RECORD_FIELD_POSITION]) == (tok, pos), (slot, pos)
            assert rec[layout.RECORD_FIELD_PREV_HASH] == hash_ref.to_i64(running), (slot, pos)
            running = hash_ref.chain_step(running, tok, pos)
            checked += 1
    assert checked > 1000
    # the test is only meaningful if swapped rows reached the tree
    assert swapped & {s for slots, _ in _tree_paths(runner.prefix_cache) for s in slots}
