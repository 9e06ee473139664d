"""Protect mode (``KVCANARY_MODE=protect``, issue 26) on REAL sglang 0.5.12 objects on CPU: a ModelRunner, its
RadixCache built by a (bare) Scheduler's ``init_cache_with_memory_pool``, sglang's Req / ScheduleBatch, driven by the
overlap scheduler loop (``sgl_protect.OverlapLoop``); kvcanary loaded through its entry point, protect's hooks
registered.

* a corrupted cached prefix: the request that reads it is recomputed and ends with the clean run's greedy output,
  the radix node is evicted (its slot freed), the other requests are untouched;
* the detection window at the default drain (8), measured: the tokens a decoding request produced over a corrupted
  KV byte before protect acted; its output still equals the clean run's (nothing had been sent);
* the abort path: a streaming request in the same situation had tokens sent: it ends with the named finish reason;
* ``KVCANARY_PROTECT_HOLD=1`` closes the window: no token over the bad KV, the streaming request is recomputed to the
  clean output;
* the counters and the log lines.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sgl_protect  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

from kvcanary.runtime import faults, protect  # noqa: E402
from kvcanary.sglang import hooks, installed, v0_5_12  # noqa: E402
from kvcanary.sglang import protect as sgl_protect_mod  # noqa: E402
from kvcanary.sglang.radix import cached_nodes  # noqa: E402

PREFIX = [(7 * i + 3) % 1900 + 50 for i in range(40)]  # a shared "system prompt"


def _prompt(seed: int, n: int = 12) -> list[int]:
    return PREFIX + [(seed * 31 + 11 * i) % 1900 + 50 for i in range(n)]


def _other(seed: int) -> list[int]:
    return [(seed * 17 + 13 * i) % 1900 + 60 for i in range(30)]


@pytest.fixture
def make_engine(tmp_path, monkeypatch):
    import sglang.srt.plugins as plugins

    made = []

    def make(page_size: int = 1, **env):
        hooks_state.clear_kvcanary_env(monkeypatch)
        report = tmp_path / f"kv-{len(made)}.jsonl"
        for key, value in {"KVCANARY_MODE": "protect", "KVCANARY_REPORT": str(report), **env}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("SGLANG_PLUGINS", "kvcanary")
        sgl_engine.ensure_entry_point(tmp_path, monkeypatch)
        state = hooks_state.snapshot(hooks_state.all_targets())
        hooks_state.restore(state)
        made.append(state)
        plugins.load_plugins()
        for t in (*v0_5_12.TARGETS, *v0_5_12.PROTECT_HOOK_TARGETS.values()):
            assert hooks_state.is_patched(t.dotted), t.dotted
        sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), page_size=page_size,
                                    dtype="float32", chunked_prefill_size=4096)
        mr = sgl_engine.build_runner(sa)
        sched = sgl_protect.build_scheduler(mr, sa)
        inst = hooks.installation_of(mr)
        state_p = sgl_protect_mod.state_of(sched)
        runner = installed.runner_state_of(mr)
        assert inst is not None and runner is not None and runner.protect is not None and state_p is not None
        return mr, sched, inst, state_p, report

    yield make
    for state in made:
        hooks_state.restore(state)
    if made:
        sgl_engine.destroy_distributed()


def _records(report, schema: str) -> list[dict]:
    lines = report.read_text().splitlines() if report.exists() else []
    return [r for r in map(json.loads, lines) if r["schema"] == schema]


def _clean_outputs(loop, prompts, max_new: int) -> list[list[int]]:
    reqs = [loop.add(p, max_new) for p in prompts]
    loop.run_until_idle()
    return [list(r.output_ids) for r in reqs]


def _evict_all(sched) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    sched.tree_cache.evict(EvictParams(num_tokens=1 << 30))


def _flip(inst, slot: int, step: int = 0):
    return faults.flip_real_kv(inst.groups[0].spec.sources[0], slot, byte=0, step=step)


def test_corrupted_cached_prefix_is_recomputed_to_the_clean_output(make_engine) -> None:
    mr, sched, inst, state, report = make_engine()
    loop = sgl_protect.OverlapLoop(sched, mr)
    prompts = [_prompt(1), _other(2), _other(3)]
    clean = _clean_outputs(loop, prompts, 10)  # the first leaves PREFIX + its suffix cached
    assert not inst.manager.violations and not state.records
    # the shared prefix is cached in an idle node: corrupt the K bytes of a slot in its middle
    nodes = [(n, d) for n, d, _ in cached_nodes(sched.tree_cache) if n.lock_ref == 0]
    node, depth = next((n, d) for n, d in nodes if d == 0 and n.value.numel() >= 20)
    bad_slot = int(node.value[12])
    _flip(inst, bad_slot)
    reqs = [loop.add(p, 10) for p in prompts]
    loop.run_until_idle()
    acts = _records(report, protect.ACTION_SCHEMA)
    recomputed = [a for a in acts if a["action"] == protect.RECOMPUTE]
    assert [a["request_id"] for a in recomputed] == [reqs[0].rid], acts  # only the reader, once
    assert bad_slot in recomputed[0]["slots"] and "verify_real_kv_hash" in recomputed[0]["reasons"]
    evicted = [a for a in acts if a["action"] == protect.EVICT]
    assert evicted and bad_slot in evicted[0]["slots"]
    assert all(bad_slot not in n.value.tolist() for n, _, _ in cached_nodes(sched.tree_cache))  # node evicted
    # the positions before the bad slot stay cached (the node was split there)
    assert any(d == 0 and n.value.numel() == 12 for n, d, _ in cached_nodes(sched.tree_cache))
    assert [list(r.output_ids) for r in reqs] == clean  # the reader's final output is the clean one; others untouched
    assert all(r.finished_reason is not None and not protect.is_protect_abort(r.finished_reason.to_json())
               for r in reqs)
    assert reqs[1].retraction_count == 0 and reqs[2].retraction_count == 0  # the other requests were not touched
    assert reqs[0].retraction_count == 1
    assert state.stats.recomputed == 1 and state.stats.aborted == 0
    assert _records(report, "kvcanary.violation/1")
    # the recomputed request re-prefilled into fresh slots: no violation after the action
    last_action = max(a["step"] for a in acts)
    assert all(v.step <= last_action for v in inst.manager.violations)


def _decode_fault(make_engine, *, stream: bool, max_new: int = 24, **env):
    """A decoding request's own prompt slot corrupted after 4 output tokens, at the default drain."""
    mr, sched, inst, state, report = make_engine(**env)
    loop = sgl_protect.OverlapLoop(sched, mr)
    prompts = [_other(5), _other(6)]
    clean = _clean_outputs(loop, prompts, max_new)
    _evict_all(sched)  # nothing cached: the second run computes everything again
    reqs = [loop.add(p, max_new, stream=stream) for p in prompts]
    # the worst case of the drain's phase: found by the forward right after a status read
    while len(reqs[0].output_ids) < 4 or (inst.steps + 1) % inst.config.drain_every != 0:
        loop.iteration()
    slot = int(mr.req_to_token_pool.req_to_token[reqs[0].req_pool_idx, 5])
    _flip(inst, slot)
    flipped_at = inst.steps + 1  # the next forward's verify sees it
    loop.run_until_idle()
    return clean, reqs, state, report, flipped_at, loop, inst


def test_detection_window_measured_and_the_request_recomputed(make_engine) -> None:
    clean, reqs, state, report, flipped_at, loop, inst = _decode_fault(make_engine, stream=False)
    assert inst.config.drain_every == 8
    acts = [a for a in _records(report, protect.ACTION_SCHEMA) if a["request_id"] == reqs[0].rid]
    assert len(acts) == 1 and acts[0]["action"] == protect.RECOMPUTE, acts
    act = acts[0]
    assert act["violation_step"] == flipped_at
    # The window at drain_every=8, worst phase: on the CPU the status copy is read on the step that takes it (every
    # 8th, phase 7), so a violation found by a forward of phase 0 is read 7 forwards later and acted on before the next
    # batch; the request had appended one token per forward from the bad one on (the 8th is in flight, discarded).
    # (On a GPU the copy is read one step later: +1.)
    assert act["window_forwards"] == inst.config.drain_every - 1
    assert act["tokens_over_bad_kv"] == inst.config.drain_every - 1
    assert act["tokens_sent"] == 0 and act["tokens_discarded"] == act["tokens_over_bad_kv"]
    print(f"detection window at drain_every=8: {act['window_forwards']} forwards, {act['tokens_over_bad_kv']} tokens")
    assert [list(r.output_ids) for r in reqs] == clean
    assert loop.sent[reqs[0].rid] == clean[0]  # a non-streaming request is sent once, finished: the clean output
    assert reqs[1].retraction_count == 0


def test_streaming_request_with_bad_tokens_sent_is_aborted_by_name(make_engine) -> None:
    clean, reqs, state, report, flipped_at, loop, inst = _decode_fault(make_engine, stream=True)
    acts = [a for a in _records(report, protect.ACTION_SCHEMA) if a["request_id"] == reqs[0].rid]
    assert [a["action"] for a in acts] == [protect.ABORT], acts
    assert acts[0]["tokens_sent"] >= 1
    reason = reqs[0].finished_reason.to_json()
    assert reason["type"] == "abort" and reason["status_code"] == 500 and reason["err_type"] == "KVCanaryViolation"
    assert protect.is_protect_abort(reason) and "already sent" in reason["message"]
    assert reqs[0].skip_radix_cache_insert
    assert list(reqs[1].output_ids) == clean[1] and reqs[1].finished_reason.to_json()["type"] == "length"
    assert state.stats.aborted == 1 and state.stats.recomputed == 0


def test_hold_closes_the_window(make_engine) -> None:
    clean, reqs, state, report, flipped_at, loop, inst = _decode_fault(make_engine, stream=True,
                                                                        KVCANARY_PROTECT_HOLD="1")
    acts = [a for a in _records(report, protect.ACTION_SCHEMA) if a["request_id"] == reqs[0].rid]
    assert [a["action"] for a in acts] == [protect.RECOMPUTE], acts
    assert acts[0]["tokens_over_bad_kv"] == 0 and acts[0]["tokens_sent"] == 0
    assert acts[0]["violation_step"] == flipped_at
    assert [list(r.output_ids) for r in reqs] == clean
    assert loop.sent[reqs[0].rid] == clean[0]  # streamed token by token: every token sent is the clean one


@pytest.mark.parametrize("hold", ["0", "1"])
def test_request_mid_chunked_prefill_is_aborted_once_and_leaks_nothing(make_engine, hold: str) -> None:
    """Regression (H200 phases 22/23, 2026-12-02): a request condemned mid chunked prefill was aborted with
    ``skip_radix_cache_insert``, which also stops sglang caching its chunks between chunks - the only way its prefix
    advances - so every later chunk was computed again into new slots, the old ones leaked, it was aborted again on
    every pass (it held a condemned node) and the pool ran out. Now: one abort, its chunks advance, it finishes with
    kvcanary's reason, the bad node is evicted once released, and every slot comes back."""
    mr, sched, inst, state, report = make_engine(KVCANARY_PROTECT_HOLD=hold)
    loop = sgl_protect.OverlapLoop(sched, mr, chunk=16)
    allocator = mr.token_to_kv_pool_allocator
    free_at_start = allocator.available_size()
    prompt = [(13 * i + 5) % 1900 + 50 for i in range(200)]  # 13 chunks of 16
    req = loop.add(prompt, 4)
    other = loop.add(_other(9), 4)
    while sched.chunked_req is not req or len(req.prefix_indices) < 32:
        loop.iteration()
    bad_slot = int(mr.req_to_token_pool.req_to_token[req.req_pool_idx, 3])
    _flip(inst, bad_slot)  # its first chunk's KV, read again by every later chunk's verify
    loop.run_until_idle(limit=400)
    acts = [a for a in _records(report, protect.ACTION_SCHEMA) if a["request_id"] == req.rid]
    assert [a["action"] for a in acts] == [protect.ABORT], acts
    assert "mid chunked prefill" in acts[0]["detail"]
    reason = req.finished_reason.to_json()
    assert protect.is_protect_abort(reason) and reason["status_code"] == 500
    assert other.finished_reason.to_json()["type"] == "length"
    assert all(bad_slot not in n.value.tolist() for n, _, _ in cached_nodes(sched.tree_cache))  # evicted
    _evict_all(sched)
    assert allocator.available_size() == free_at_start  # nothing leaked


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("hold", ["0", "1"])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_driver_fault_mix_leaks_no_slot(make_engine, hold: str, seed: int, page_size: int) -> None:
    """The H200 protect phases' faults (all five classes, one every 4 forwards, sweep every 3) over shared-prefix,
    chunked, streaming and plain requests: every request finishes, and every KV slot is back (free, or held by the
    radix cache). Regression (H200 phase 23, 2026-12-02, sglang's idle check: "pool memory leak detected"): with
    hold, protect recomputed a decoding request after the overlap scheduler had launched the next batch, whose slot
    sglang's release does not cover; every such recompute leaked one slot."""
    import random

    mr, sched, inst, state, report = make_engine(
        page_size=page_size, KVCANARY_PROTECT_HOLD=hold, KVCANARY_SWEEP_INTERVAL="3", KVCANARY_VERIFY_TOKENS="1",
        KVCANARY_FAULT=",".join((faults.REQ_TO_TOKEN_REDIRECT, faults.REAL_KV_FLIP, faults.CACHED_IDLE_CORRUPTION,
                                 faults.TOKEN_SWAP, faults.POSITION_SKEW)),
        KVCANARY_FAULT_EVERY="4", KVCANARY_FAULT_WARMUP="10", KVCANARY_FAULT_SEED=str(seed))
    loop = sgl_protect.OverlapLoop(sched, mr, chunk=64)
    allocator, tree = mr.token_to_kv_pool_allocator, sched.tree_cache
    free_at_start = allocator.available_size()
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50, 1900) for _ in range(rng.randrange(20, 120))] for _ in range(4)]
    reqs = []
    for _ in range(4):
        for _ in range(12):
            prompt = rng.choice(prefixes)[: rng.randrange(5, 120)] + [rng.randrange(50, 1900)
                                                                       for _ in range(rng.randrange(1, 60))]
            reqs.append(loop.add(prompt, rng.randrange(2, 30), stream=rng.random() < 0.3))
        loop.run_until_idle(limit=3000)
    assert all(r.finished() for r in reqs)
    acts = _records(report, protect.ACTION_SCHEMA)
    assert any(a["action"] == protect.RECOMPUTE for a in acts)
    assert allocator.available_size() + tree.evictable_size() + tree.protected_size() == free_at_start


def test_protect_counters_and_log_lines(make_engine, caplog) -> None:
    pytest.importorskip("prometheus_client")
    import prometheus_client

    from kvcanary.report import metrics

    caplog.set_level("INFO")
    clean, reqs, state, report, flipped_at, loop, inst = _decode_fault(make_engine, stream=False, max_new=16)
    names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert metrics.PREFIX + "requests_recomputed" in names
    value = prometheus_client.REGISTRY.get_sample_value(metrics.PREFIX + "requests_recomputed_total",
                                                         inst.metrics.labels)
    assert value is not None and value >= 1
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(protect.ACTION_LOG_PREFIX) and "action=recompute" in m for m in lines)
    assert any(m.startswith(protect.SUMMARY_LOG_PREFIX) and "recomputed=1" in m for m in lines)


def test_protect_refuses_a_prefix_cache_it_cannot_evict_from() -> None:
    """Protect evicts bad nodes from sglang's exact RadixCache only. Under an SWARadixCache (swept since the full
    group walks its full slots) a bad cached slot would go to the next request that matches it: refused at start-up,
    by name. A RadixCache is protected; no prefix cache needs no eviction."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

    swa, radix = object.__new__(SWARadixCache), object.__new__(RadixCache)
    with pytest.raises(sgl_protect_mod.ProtectRefused,
                       match="KVCANARY_MODE=protect with the prefix cache SWARadixCache: evicting its nodes is not "
                             "taught yet"):
        sgl_protect_mod.check_evictable(v0_5_12, swa, v0_5_12.radix_cache(swa), RadixCache)
    sgl_protect_mod.check_evictable(v0_5_12, radix, v0_5_12.radix_cache(radix), RadixCache)
    sgl_protect_mod.check_evictable(v0_5_12, None, None, RadixCache)

