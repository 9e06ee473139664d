"""HiCache on a REAL sglang 0.5.12 (CPU): HiRadixCache, HiCacheController, MHATokenToKVPoolHost and a CPU
ModelRunner, kvcanary activated through its entry point.

A workload of repeated long prefixes over a device pool too small to hold them makes HiRadixCache back prefixes up
to the host, evict them from the device and load them back into new device slots. In raise mode nothing may be
reported (the records follow: without the hand-off the loaded-back slots fail, see the last test), for every
write policy (the ``direct`` io backend, ``layer_first`` layout). The three host-tier fault classes are each
detected on the loaded-back slots, with ``via=host_tier``, and nothing else is reported.

sglang's host buffer allocation and the direct io backend's copy need CUDA; :mod:`sgl_hicache` replaces exactly
those two with torch code of the same effect (its docstring).
"""

from __future__ import annotations

import importlib.util
import random
import types

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sgl_hicache  # noqa: E402

from kvcanary.kernels.tags import LaunchTag  # noqa: E402
from kvcanary.report import VIA_HOST_TIER, CanaryViolationError  # noqa: E402
from kvcanary.runtime import faults  # noqa: E402
from kvcanary.sglang import hicache, hooks, installed, v0_5_12  # noqa: E402

PREFIXES = 6  # distinct long prefixes, each reused many times: more than the device pool holds at once
PREFIX_TOKENS = 150
MAX_TOTAL_TOKENS = 640  # device KV slots: fewer than the prefixes need, so HiCache evicts to the host


def _engine(tmp_path, monkeypatch, *, mode: str = "raise", policy: str = "write_through",
            layout: str = "layer_first", env: dict[str, str] | None = None, page_size: int = 1):
    state = sgl_engine.activate_kvcanary(tmp_path, monkeypatch, {
        "KVCANARY_MODE": mode, "KVCANARY_VERIFY_TOKENS": "1", "KVCANARY_SWEEP_INTERVAL": "5",
        "SGLANG_PLUGINS": "kvcanary", **(env or {})})
    sgl_hicache.patch_host_memory(monkeypatch)
    for t in v0_5_12.TARGETS:
        assert hooks_state.is_patched(t.dotted), t.dotted
    sa = sgl_engine.server_args(
        sgl_engine.write_model_dir(tmp_path / "tiny-llama"), page_size=page_size, chunked_prefill_size=64,
        max_total_tokens=MAX_TOTAL_TOKENS, enable_hierarchical_cache=True, hicache_ratio=4.0,
        hicache_io_backend="direct", hicache_mem_layout=layout, hicache_write_policy=policy,
    )
    mr = sgl_engine.build_runner(sa)
    tree = sgl_engine.build_tree_cache(mr, sa)
    assert mr.token_to_kv_pool.layer_transfer_counter is not None  # HiCache's load fence is registered
    inst = hooks.installation_of(mr)
    assert type(tree).__name__ == "HiRadixCache" and inst is not None
    follower = hicache.follower_of(tree.cache_controller)
    runner = installed.runner_state_of(mr)
    assert follower is not None and runner is not None and runner.host_tier is follower
    return mr, tree, inst, follower, state


def _drive(sched, rng, prefixes, forwards: int) -> None:
    """Requests over the prefixes, at most two in flight (the small pool must hold their locked prefixes)."""
    while len(sched.forwards) < forwards:
        running = 0 if sched.running is None else len(sched.running.reqs)
        if not sched.waiting and sched.chunked_req is None and running < 2:
            prefix = prefixes[rng.randrange(len(prefixes))]
            sched.add(prefix + [rng.randrange(3, 2000) for _ in range(rng.randrange(2, 20))], rng.randrange(2, 8))
        sched.step()


@pytest.fixture
def teardown():
    states = []
    yield states
    for state in states:
        hooks_state.restore(state)
    sgl_engine.destroy_distributed()


# (the direct io backend's other layout, page_first_direct, copies through sgl_kernel functions with no torch twin
# here; the record hand-off does not depend on the layout: it follows the indices write/load are given)
@pytest.mark.parametrize(("policy", "layout", "page_size"), [
    ("write_through", "layer_first", 1), ("write_through_selective", "layer_first", 1),
    ("write_back", "layer_first", 1), ("write_through", "layer_first", 16),
])
def test_records_follow_backup_and_load_back(tmp_path, monkeypatch, teardown, policy, layout, page_size) -> None:
    mr, tree, inst, follower, state = _engine(tmp_path, monkeypatch, policy=policy, layout=layout,
                                              page_size=page_size)
    teardown.append(state)
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 2000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    sched = sgl_hicache.HiMiniScheduler(mr, tree, chunk_size=64)
    _drive(sched, rng, prefixes, 160)  # raise mode: any violation raises here
    manager = inst.manager
    manager.flush()
    tier = manager.host_tier
    print(f"{policy}/{layout}/page{page_size}: forwards={len(sched.forwards)} backups={follower.backups} "
          f"load_backs={sched.load_backs} "
          f"loaded_tokens={sched.loaded_tokens} slots_backed_up={tier.slots_backed_up} "
          f"slots_loaded={tier.slots_loaded} verified={manager.stats.slot_runs[LaunchTag.VERIFY]} "
          f"swept={manager.stats.slot_runs[LaunchTag.SWEEP]}")
    assert sched.load_backs >= 3 and sched.loaded_tokens >= 3 * 64  # prefixes really came back from the host
    assert tier.slots_loaded == sched.loaded_tokens  # every loaded-back slot got its record
    assert tier.slots_backed_up > 0 and follower.backups > 0 and follower.loads == sched.load_backs
    assert manager.stats.violations_seen == 0 and manager.violations == []
    assert manager.stats.slot_runs[LaunchTag.SWEEP] > 0
    mail = manager.token_table.mail  # the decode appends rode the token mail beside the host tier's copies
    assert mail is not None and mail.posted > 0 and mail.full == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("fault", faults.HOST_TIER_CLASSES)
def test_host_tier_faults_are_detected_on_the_loaded_slots_only(tmp_path, monkeypatch, teardown, fault,
                                                                policy) -> None:
    mr, tree, inst, follower, state = _engine(
        tmp_path, monkeypatch, mode="log", policy=policy,
        env={"KVCANARY_FAULT": fault, "KVCANARY_FAULT_EVERY": "25", "KVCANARY_FAULT_WARMUP": "20"},
    )
    teardown.append(state)
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 2000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    sched = sgl_hicache.HiMiniScheduler(mr, tree, chunk_size=64)
    _drive(sched, rng, prefixes, 200)
    manager = inst.manager
    manager.flush()
    injector = installed.runner_state_of(mr).faults
    injected = [i for i in injector.injections if i.fault == fault]
    assert len(injected) >= 2, (injector.injections, injector.skips)
    touched = {s for i in injected for s in i.slots}
    found = manager.violations
    assert found, "no violation for an injected host-tier fault"
    assert {v.slot for v in found} <= touched, "a violation on a slot no injection touched"
    assert all("verify_real_kv_hash" in v.reasons and v.via == VIA_HOST_TIER for v in found)
    for inj in injected:  # each injection detected
        assert set(inj.slots) & {v.slot for v in found}, inj


def test_without_the_hand_off_loaded_back_slots_fail(tmp_path, monkeypatch, teardown) -> None:
    """The test above can fail: with load-backs not handed to the canary (the behaviour before this adapter followed
    HiCache) the first verify of a loaded-back prefix reports it."""
    mr, tree, inst, follower, state = _engine(tmp_path, monkeypatch)
    teardown.append(state)
    monkeypatch.setattr(follower, "load", lambda host_indices, device_indices: None)
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 2000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    sched = sgl_hicache.HiMiniScheduler(mr, tree, chunk_size=64)
    with pytest.raises(CanaryViolationError):
        _drive(sched, rng, prefixes, 160)
        inst.manager.flush()


class _Tree:
    def __init__(self, name: str, **controller) -> None:
        self.__class__ = type(name, (_Tree,), {})
        self.cache_controller = type("HiCacheController", (), controller)()


@pytest.mark.parametrize(("tree", "flag"), [
    (_Tree("HiMambaRadixCache"), "--enable-hierarchical-cache"),
    (_Tree("HiRadixCache", enable_storage=True), "--hicache-storage-backend"),
    (_Tree("HiRadixCache", has_draft=True), "--speculative-algorithm"),
])
def test_a_hicache_setup_it_does_not_follow_is_refused_by_name(tree, flag) -> None:
    from kvcanary.sglang.guards import UnsupportedSetupError

    with pytest.raises(UnsupportedSetupError, match=flag):
        hicache.follow(tree, [])


def test_a_prefix_cache_without_hicache_is_not_followed() -> None:
    assert hicache.follow(object(), []) is None


def test_a_stopped_canary_keeps_no_hand_offs(tmp_path, monkeypatch, teardown) -> None:
    """Log mode stopped kvcanary on the runner: its forward hook no longer hands copies over, so none may pile up."""
    mr, tree, inst, follower, state = _engine(tmp_path, monkeypatch, mode="log")
    teardown.append(state)
    inst.stopped = "stopped by a test"
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 2000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    sched = sgl_hicache.HiMiniScheduler(mr, tree, chunk_size=64)
    _drive(sched, rng, prefixes, 80)
    assert sched.load_backs > 0 and follower.backups > 0 and follower.pending == []


def test_the_fenced_sweep_source_reports_the_wrapped_source_s_counts() -> None:
    """Under HiCache the sweep source is wrapped to wait for unacknowledged loads first; the host-time line's
    ``sweep_walks`` once read 0 through the wrapper while every sweep walked the tree (a HiRadixCache is walked)."""
    from kvcanary.runtime.sweep import Sweeper
    from kvcanary.sglang.hicache import FencedSweepSource

    order = []

    def walking():
        order.append("source")
        walking.walks += 1
        return [], [], []

    walking.walks = 0
    fenced = FencedSweepSource(lambda: order.append("fence"), walking)
    sweeper = Sweeper(types.SimpleNamespace(sweep=lambda *a, **k: None), interval=1)
    sweeper.source = fenced
    sweeper.run = lambda *entries: None  # (no device state: the entries are not launched here)
    sweeper.run_source()
    sweeper.run_source()
    assert order == ["fence", "source"] * 2
    assert sweeper.tally().walks == 2 and sweeper.tally().sweeps == 2
    assert sweeper.tally().compactions == 0  # (the wrapped source has none: the getattr default)
