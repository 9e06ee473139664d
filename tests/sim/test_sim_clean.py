"""A clean serving workload through the real CanaryManager (CPU kernels) must report nothing, and the workload
must really exercise what can go wrong: prefix-cache sharing, chunked prefill, decode, mixed and idle forwards,
eviction, slot reuse by other requests, and sweeps over the cache."""

from __future__ import annotations

import pytest

from kvcanary.sim.engine import SimConfig, build_sim

STEPS = 2000

CASES = {
    "page1": SimConfig(seed=1, page_size=1, num_pages=1024),
    "page16": SimConfig(seed=2, page_size=16, num_pages=128),
    # the token check's decode appends through the check launch's mailbox (CanaryManager(token_mail=True))
    "page1-token-mail": SimConfig(seed=1, page_size=1, num_pages=1024, token_mail=True),
}


@pytest.mark.parametrize("defer_writes", [False, True], ids=["write", "deferred_write"])
@pytest.mark.parametrize("name", list(CASES))
def test_clean_workload_has_no_violations(name: str, defer_writes: bool) -> None:
    """Also with each forward's write deferred into the next forward's check launch (issue 25)."""
    # raise: any violation fails the run
    sim = build_sim(CASES[name], mode="raise", sweep_interval=10, defer_writes=defer_writes)
    sim.run(STEPS)
    sim.mgr.close()
    mgr, st = sim.mgr, sim.stats
    assert mgr.violations == []

    rows = {
        "forwards": STEPS,
        "extend forwards": st["forward_extend"],
        "decode forwards": st["forward_decode"],
        "mixed forwards": st["forward_mixed"],
        "idle forwards": st["forward_idle"],
        "extend rows with prefix > 0": st["extend_rows_prefix_gt0"],
        "chunked-prefill continuations": st["chunk_continuations"],
        "prefix-cache hits (requests)": st["cache_hits"],
        "prefix-cache hit tokens": st["cache_hit_tokens"],
        "requests finished": st["finished"],
        "evicted pages": st["evicted_pages"],
        "slot writes over another request's": st["slot_rewrites_by_other_request"],
        "sweeps (entries)": f"{st['sweeps']} ({st['sweep_entries']})",
        "tokens written": st["tokens"],
        "entries verified (manager)": mgr.stats.slot_runs[0],
        "violations": len(mgr.violations),
    }
    print(f"\nclean workload {name} (page_size {CASES[name].page_size}):")
    for k, v in rows.items():
        print(f"  {k:<36} {v}")

    assert sum(st[k] for k in ("forward_extend", "forward_decode", "forward_mixed", "forward_idle")) == STEPS
    for key in ("forward_extend", "forward_decode", "forward_mixed", "forward_idle", "extend_rows_prefix_gt0",
                "chunk_continuations", "cache_hits", "finished", "evicted_pages", "slot_rewrites_by_other_request"):
        assert st[key] > 0, key
    assert st["sweeps"] >= STEPS // 10 - 1 and st["sweep_entries"] > 0
    assert mgr.stats.sweeps == st["sweeps"] - 1  # (the source's first call primed the sweep when it was set)
    assert mgr.stats.slot_runs[0] > 0 and mgr.stats.slot_runs[2] > 0  # verify and sweep entries really ran
