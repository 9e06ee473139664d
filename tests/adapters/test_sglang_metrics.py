"""Prometheus metrics from a REAL sglang 0.5.12 ModelRunner on CPU: kvcanary activated through its entry point,
forwards through ScheduleBatch -> ForwardBatch -> ModelRunner.forward, then a scrape of prometheus_client's
registry finds every canary counter with sglang's labels (the served model name, the rank keys) and the
manager's own numbers, a K-byte flip included."""

from __future__ import annotations

import importlib.util
import random

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
prometheus_client = pytest.importorskip("prometheus_client", reason="the test extra installs prometheus_client")
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

from kvcanary.kernels.tags import LaunchTag  # noqa: E402
from kvcanary.report import metrics  # noqa: E402
from kvcanary.runtime import faults  # noqa: E402
from kvcanary.sglang import hooks  # noqa: E402


def test_counters_on_the_scrape_with_sglangs_labels(tmp_path, monkeypatch) -> None:
    import sglang.srt.plugins as plugins
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    hooks_state.clear_kvcanary_env(monkeypatch)
    monkeypatch.setenv("KVCANARY_MODE", "log")
    monkeypatch.setenv("KVCANARY_DRAIN_EVERY", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "kvcanary")
    sgl_engine.ensure_entry_point(tmp_path, monkeypatch)
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)
    plugins.load_plugins()
    try:
        sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), chunked_prefill_size=48)
        mr = sgl_engine.build_runner(sa)
        tree = sgl_engine.build_tree_cache(mr, sa)
        inst = hooks.installation_of(mr)
        assert inst is not None and inst.model_name == sa.served_model_name
        sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=48)
        rng = random.Random(0)
        while len(sched.forwards) < 30:
            if len(sched.waiting) < 2 and rng.random() < 0.3:
                sched.add([rng.randrange(3, 2000) for _ in range(rng.randrange(4, 40))], rng.randrange(8, 20))
            if not sched.idle:
                sched.step()
        req = next(r for r in sched.running.reqs if r.req_pool_idx)
        slot = int(mr.req_to_token_pool.req_to_token[req.req_pool_idx, 0])
        faults.flip_real_kv(inst.manager.real_kv_sources[0], slot, 0, 0xFF)  # a live slot: the next verify reads it
        for _ in range(3):
            sched.step()
        inst.flush_metrics()  # the volume counters host_after left for later (at most a second's worth)
    finally:
        hooks_state.restore(state)
        sgl_engine.destroy_distributed()

    manager = inst.manager
    labels = metrics.labels_from(manager.rank, sa.served_model_name)
    assert labels == {"model_name": sa.served_model_name, "tp_rank": "0"}  # pp_rank / dp_rank only when set
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()) for s in fam.samples
               if s.name.startswith(metrics.PREFIX) and s.labels.get("model_name") == sa.served_model_name}
    key = tuple(sorted(labels.items()))
    stats = manager.stats
    assert samples[(metrics.PREFIX + "forwards_total", key)] == stats.forwards == inst.steps
    assert samples[(metrics.PREFIX + "entries_verified_total", key)] == stats.slot_runs[LaunchTag.VERIFY] > 0
    assert samples[(metrics.PREFIX + "tokens_written_total", key)] == stats.slot_runs[LaunchTag.WRITE] > 0
    assert samples[(metrics.PREFIX + "lost_rows_total", key)] == 0
    assert samples[(metrics.PREFIX + "health_errors_total", key)] == 0
    flips = sum("verify_real_kv_hash" in v.reasons for v in manager.violations)
    assert flips >= 1
    assert samples[(metrics.PREFIX + "violations_total", tuple(sorted((*key, ("reason", "verify_real_kv_hash")))))] \
        == flips
