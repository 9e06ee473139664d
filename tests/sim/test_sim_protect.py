"""Protect mode in the serving simulator (issue 26 item 5): ``SimConfig.kv_sampling`` makes a request's tokens depend on
the K/V it reads, ``Simulator.clean_tokens`` is its clean output, and ``SimProtect`` (kvcanary.runtime.protect.judge
over the simulator) recomputes every request a fault touched to that clean output, where log mode leaves outputs
changed."""

from __future__ import annotations

import pytest

from kvcanary.runtime import faults
from kvcanary.sim.engine import SimConfig, build_sim
from kvcanary.sim.injector import FaultDriver
from kvcanary.sim.protect import SimProtect, chain


def _cfg(**kw) -> SimConfig:
    return SimConfig(seed=3, page_size=1, num_pages=1024, host_pages=2048, kv_sampling=True, **kw)


def test_kv_sampling_clean_run_matches_the_reference_and_a_flip_changes_the_digest() -> None:
    sim = build_sim(_cfg(), mode="log", sweep_interval=8, drain_every=8)
    sim.run(300)
    assert len(sim.finished) > 20 and all(sim.output_is_clean(r) for r in sim.finished)
    assert not sim.mgr.flush() and not sim.mgr.violations
    req = next(r for r in sim.running if r.kv_len > 2)
    before = sim.kv_digest(req)
    sim.k_buf.view(-1, 64)[req.slots[1], 3] ^= 0x10
    assert sim.kv_digest(req) != before
    sim.k_buf.view(-1, 64)[req.slots[1], 3] ^= 0x10
    sim.req_to_token[req.row, 1] = sim.num_slots + 5  # an out-of-range entry reads zeros
    assert sim.kv_digest(req) != before


def test_kv_sampling_is_opt_in() -> None:
    """Without it the tokens are the (request id, position) function the other simulator tests were written for."""
    from kvcanary.sim.engine import mix

    sim = build_sim(SimConfig(seed=3, page_size=1, num_pages=1024), mode="log", sweep_interval=8)
    sim.run(200)
    assert sim.stats["finished"] > 0 and not sim.finished  # (finished requests are kept only with kv_sampling)
    req = next(r for r in sim.running if len(r.tokens) > len(r.prompt))
    assert all(req.tokens[p] == mix(req.rid, p) % sim.cfg.vocab for p in range(len(req.prompt), len(req.tokens)))


def _run(mode: str, classes, *, hold: bool = True, per_class: int = 2):
    driver = FaultDriver(classes, seed=0, per_class=per_class, warmup=1 << 62, gap=3, deadline=38, grace=10,
                         sweep_every=8)
    protector = SimProtect(hold=hold, drain_every=8, on_action=driver.note_action) if mode == "protect" else None
    sim = build_sim(_cfg(), mode=mode, sweep_interval=8, drain_every=8, hook=chain(protector, driver))
    sim.run(200)
    driver.arm(sim.step_no + 1)
    while not driver.done and sim.step_no < 5000:
        sim.step()
    in_flight = {r.rid for r in sim.running + sim.waiting}
    while any(r.rid in in_flight for r in sim.running + sim.waiting) and sim.step_no < 8000:
        sim.step()
    sim.mgr.flush()
    driver.score(sim)
    return sim, driver, protector


@pytest.mark.parametrize("hold", [True, False], ids=["hold", "no-hold"])
def test_protect_recomputes_every_touched_request_to_its_clean_output(hold: bool) -> None:
    sim, driver, protector = _run("protect", faults.FAULT_CLASSES, hold=hold)
    results = driver.results()
    assert not driver.false_positives
    for name, r in results.items():
        assert r.injected == r.detected == r.acted_on == 2, (name, r)
        assert r.actions["abort"] == 0 and r.actions["missed"] == 0, (name, r.actions)
        if name == faults.CACHED_IDLE_CORRUPTION:  # idle K/V no request reads: its node is evicted
            assert r.actions["evict"] >= 2 and r.nodes_evicted >= 2, r
        else:
            assert r.actions["recompute"] >= 2, (name, r.actions)
    finished = sim.finished
    assert finished and all(sim.output_is_clean(r) for r in finished)
    recomputed = {str(again.rid) for _, again in protector.recomputed}
    assert recomputed <= {str(r.rid) for r in finished}  # every recomputed request finished, cleanly
    assert any(r.recomputes for r in finished)
    assert protector.stats.recomputed == len(protector.recomputed) and protector.stats.missed == 0
    if hold:  # acted on in the forward whose verify (or write, or sweep) found it
        assert protector.stats.window_forwards_max == 0


def test_log_mode_leaves_changed_outputs() -> None:
    """The proof that the comparison can fail: the same faults without protect finish requests over bad K/V."""
    sim, driver, _ = _run("log", faults.FAULT_CLASSES)
    assert all(r.all_detected for r in driver.results().values())
    assert sum(not sim.output_is_clean(r) for r in sim.finished) > 0


def test_stale_slot_reuse_drops_the_output_read_during_the_rewrite() -> None:
    """Another request rewrites the stale slot in forward F, which the victim also reads; F+1's verify finds it.
    protect.judge keeps only what F was fed, so the victim's recomputed output is clean."""
    sim, driver, protector = _run("protect", [faults.STALE_SLOT_REUSE], per_class=4)
    assert driver.results()[faults.STALE_SLOT_REUSE].acted_on == 4
    assert sim.finished and all(sim.output_is_clean(r) for r in sim.finished)
