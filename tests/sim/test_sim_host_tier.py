"""The simulator's host KV tier (HiCache-like: cached pages backed up to host memory on eviction, loaded back into new
device slots when a later request's prefix reaches them) under the real CanaryManager (CPU kernels).

Clean traffic through it must report nothing while backups and load-backs really happen; a load-back whose records
do not follow (no ``load_from_host``) or whose K/V does not follow must be reported, on the loaded slots first; the
host-tier fault classes are detected with ``via=host_tier`` at page size 16 too (tests/sim/test_sim_faults.py runs
them 100 times each at page size 1)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime import faults
from kvcanary.sim.engine import SimConfig, Simulator, build_sim
from kvcanary.sim.injector import FaultDriver

STEPS = 1500

CASES = {
    "page1": SimConfig(seed=11, page_size=1, num_pages=1024, host_pages=2048),
    "page16": SimConfig(seed=12, page_size=16, num_pages=128, host_pages=256),
    # a host tier smaller than the device pool: host copies are evicted all the time
    "page1_small_host": SimConfig(seed=13, page_size=1, num_pages=1024, host_pages=300, host_evict_batch=32),
}


def _check_accounting(sim: Simulator) -> None:
    """Every device and host page is in exactly one place: free, a cached node's, or a running request's own."""
    device = list(sim.free_pages) + [n.page for n in sim.device_nodes] + [p for r in sim.running for p in r.owned]
    assert sorted(device) == list(range(1, sim.cfg.num_pages))
    host = list(sim.free_host_pages) + [n.host_page for n in sim.nodes() if n.host_page is not None]
    assert sorted(host) == list(range(1, sim.cfg.host_pages))
    for n in sim.nodes():  # the pages on the device hang from the root without a gap
        assert sim.cached(n)
        assert n.on_device == (n in sim.device_nodes) and (not n.on_device) == (n in sim.host_nodes)
        if n.on_device and n.parent is not sim.root:
            assert n.parent.on_device, "a page on the device below one that is on the host only"
        if not n.on_device:
            assert n.host_page is not None


@pytest.mark.parametrize("name", list(CASES))
def test_clean_serving_with_a_host_tier_reports_nothing(name: str) -> None:
    cfg = CASES[name]
    sim = build_sim(cfg, mode="raise", sweep_interval=10)  # raise: any violation fails the run
    sim.run(STEPS)
    sim.mgr.close()
    st, tier = sim.stats, sim.mgr.host_tier
    print(f"\n{name}: backups {st['host_backups']} pages ({st['slots_backed_up']} slots), load-backs "
          f"{st['load_backs']} ({st['slots_loaded_back']} slots), host evictions {st['host_evicted_pages']}, "
          f"revived {st['host_nodes_revived']}, cache hits {st['cache_hits']}, evicted {st['evicted_pages']}")
    assert sim.mgr.violations == []
    assert st["host_backups"] > 0 and st["load_backs"] > 10 and st["slots_loaded_back"] > st["load_backs"]
    # the records followed every page the simulator moved
    assert tier.slots_backed_up == st["slots_backed_up"] and tier.slots_loaded == st["slots_loaded_back"]
    if name == "page1_small_host":
        assert st["host_evicted_pages"] > 0
    _check_accounting(sim)
    assert sim.repair_kv() == 0  # every copy, on the device and on the host, is what the model wrote


def _loaded_slots(sim: Simulator) -> set[int]:
    loaded: set[int] = set()
    prev = sim.hook

    def hook(point: str, s: Simulator) -> None:
        if point == "pre_load":
            loaded.update(s.load.device_slots)
        if prev is not None:
            prev(point, s)
    sim.hook = hook
    return loaded


def test_a_load_back_without_its_records_is_reported() -> None:
    """Proof that the clean runs above can fail: skip ``load_from_host`` and the loaded slots keep the records of
    their previous occupants, which the next verify rejects (on those slots only)."""
    sim = build_sim(SimConfig(seed=11, page_size=1, num_pages=1024, host_pages=2048), mode="log", sweep_interval=10)
    sim.mgr.load_from_host = lambda host_slots, device_slots: None  # the records stay behind
    loaded = _loaded_slots(sim)
    sim.run(400)
    sim.mgr.close()
    assert sim.stats["load_backs"] > 0
    assert sim.mgr.violations, "a load-back whose records did not follow went unreported"
    # first on a loaded slot; later ones also on slots written after them (their chains build on the bad records)
    assert sim.mgr.violations[0].slot in loaded
    assert all(v.via is None for v in sim.mgr.violations)  # no record says it came through the host tier


def test_a_load_back_without_its_kv_is_reported_via_host_tier() -> None:
    """The records follow but the K/V copy goes nowhere (to the padding slot): the loaded slots' fingerprints fail,
    and the violations say the slots came through the host tier."""
    sim = build_sim(SimConfig(seed=11, page_size=1, num_pages=1024, host_pages=2048), mode="log", sweep_interval=10)
    loaded = _loaded_slots(sim)
    prev = sim.hook

    def hook(point: str, s: Simulator) -> None:
        prev(point, s)
        if point == "pre_load":
            s.load.kv_device_slots = torch.zeros_like(s.load.kv_device_slots)
    sim.hook = hook
    sim.run(400)
    sim.mgr.close()
    assert sim.stats["load_backs"] > 0 and sim.mgr.violations
    assert {v.slot for v in sim.mgr.violations} <= loaded
    assert all(v.reasons == ("verify_real_kv_hash",) and v.via == "host_tier" for v in sim.mgr.violations)


@pytest.mark.parametrize("fault", faults.HOST_TIER_CLASSES)
def test_host_tier_classes_at_page_size_16(fault: str) -> None:
    target = 20
    driver = FaultDriver((fault,), seed=7, per_class=target, warmup=40, gap=3, deadline=30, grace=2)
    sim = build_sim(SimConfig(seed=21, page_size=16, num_pages=128, host_pages=256), mode="log", sweep_interval=10,
                    hook=driver)
    while len(driver.closed) < target and sim.step_no < 4000:
        sim.step()
    sim.mgr.close()
    result = driver.results()[fault]
    assert result.injected == target, f"only {result.injected} injections in {sim.step_no} steps"
    assert result.all_detected and result.via_host_tier == target, result
    assert not driver.false_positives, driver.false_positives[:3]
    assert all(v.via == "host_tier" for v in sim.mgr.violations)
    _check_accounting(sim)
    assert sim.repair_kv() == 0


def test_host_tier_classes_need_a_host_tier() -> None:
    driver = FaultDriver((faults.LOAD_WRONG_SLOTS,), warmup=0)
    sim = build_sim(SimConfig(seed=11, page_size=1, num_pages=1024), mode="log", hook=driver)
    with pytest.raises(ValueError, match="load_wrong_slots needs a simulator with a host tier"):
        sim.step()


def test_a_simulator_without_a_host_tier_keeps_dropping_evicted_pages() -> None:
    sim = build_sim(SimConfig(seed=11, page_size=1, num_pages=1024), mode="raise", sweep_interval=10)
    sim.run(400)
    sim.mgr.close()
    st = sim.stats
    assert sim.mgr.host_tier is None and st["evicted_pages"] > 0
    assert st["evicted_to_host"] == st["host_backups"] == st["load_backs"] == 0 and not sim.host_nodes
