"""Every fault class (docs/faults.md), injected into the simulator >= 50 times, must be detected every time, with
the expected reason, attributed to a slot the injection touched, and nothing else may be reported.

Protocol (one fresh simulator + manager per class, Mode.LOG so the run continues; the driver is
``kvcanary.sim.injector.FaultDriver``, which ``kvcanary demo`` uses too):

* The first injection comes after WARMUP steps (a warm prefix cache, running requests); before it the
  canary must report nothing.
* At most one injection is open at a time. An injection is open until a violation with one of the class's
  expected reasons names one of its touched slots ("detected"), or until DEADLINE steps pass ("missed").
* Closing repairs the fault so the next injection starts clean: mapping faults (redirect, req_to_token
  out-of-range) restore the req_to_token entry; byte flips are flipped back; faults that left bad records
  in a request's own slots (stale reuse, token swap, position skew, out_cache_loc out-of-range) retire the
  victim requests (abort: their slots are freed, not cached; a freed slot is rewritten before any verify
  reads it again). Victims get extra decode budget (``extend_life``) so they cannot finish, and carry their
  bad records into the prefix cache, before detection.
* Precision: every violation must name a slot of the open injection, or of one closed less than GRACE
  steps ago (the same fault still draining), else it is a false positive.
* The next injection waits GAP steps after a close.
"""

from __future__ import annotations

import pytest
from engine import SimConfig, Simulator, build_sim

from kvcanary import faults
from kvcanary.faults import EXPECTED_REASONS
from kvcanary.sim.injector import FaultDriver

TARGET = 100  # injections per class (>= 50 asked)
WARMUP = 40
GAP = 3
DEADLINE = 30
GRACE = 2
MAX_STEPS = 4000


def run_class(fault: str) -> tuple[FaultDriver, Simulator]:
    driver = FaultDriver((fault,), seed=FAULT_SEEDS[fault], per_class=TARGET, warmup=WARMUP, gap=GAP,
                         deadline=DEADLINE, grace=GRACE)
    # cached-but-idle corruption is only visible to the sweep: sweep every step so it sees the flip first
    sweep = 1 if fault == faults.CACHED_IDLE_CORRUPTION else 10
    sim = build_sim(SimConfig(seed=FAULT_SEEDS[fault], page_size=1, num_pages=1024), mode="log",
                    sweep_interval=sweep, hook=driver)
    while len(driver.closed) < TARGET and sim.step_no < MAX_STEPS:
        sim.step()
        if sim.step_no < WARMUP:
            assert sim.mgr.violations == [], f"violation before the first injection: {sim.mgr.violations[:3]}"
    sim.mgr.close()
    return driver, sim


FAULT_SEEDS = {f: 100 + i for i, f in enumerate(faults.FAULT_CLASSES)}
RESULTS: dict[str, tuple[int, int, str, str, int, int, int]] = {}


@pytest.mark.parametrize("fault", faults.FAULT_CLASSES)
def test_fault_class_detected(fault: str) -> None:
    driver, sim = run_class(fault)
    closed = driver.closed
    detected = [o for o in closed if o.detected_step is not None]
    tags = sorted({t for o in detected for t in o.tags})
    latency = max((o.detected_step - o.step for o in detected), default=0)
    RESULTS[fault] = (len(closed), len(detected), "/".join(EXPECTED_REASONS[fault]), ",".join(tags),
                      len(sim.mgr.violations), len(driver.false_positives), latency)
    combos = sorted({"+".join(v.reasons) for v in sim.mgr.violations})
    print(f"\n{fault}: {len(closed)} injections, {len(detected)} detected, tags {tags}, steps {sim.step_no}, "
          f"max latency {latency} steps, {len(sim.mgr.violations)} violations, reasons seen {combos}")
    assert len(closed) >= TARGET, f"only {len(closed)} injections in {sim.step_no} steps"
    missed = [(o.step, o.injection) for o in closed if o.detected_step is None]
    assert not missed, f"missed {len(missed)}: {missed[:3]}"
    assert not driver.false_positives, f"{len(driver.false_positives)} false positives: {driver.false_positives[:3]}"
    if fault == faults.CACHED_IDLE_CORRUPTION:
        assert all("sweep" in o.tags for o in detected), "cached-idle corruption must be caught by the sweep"


def test_print_fault_table() -> None:
    """Runs last in this module: the summary table of the classes above (skipped if they did not run)."""
    if not RESULTS:
        pytest.skip("no fault class ran")
    print(f"\n{'fault class':<24} | {'injections':>10} | {'detections':>10} | {'expected reason':<48} | {'tags':<12} "
          f"| {'rate':>5} | {'rows':>5} | {'false pos':>9} | max latency")
    for fault, (n, d, reasons, tags, rows, fp, lat) in RESULTS.items():
        print(f"{fault:<24} | {n:>10} | {d:>10} | {reasons:<48} | {tags:<12} | {100.0 * d / max(n, 1):>4.0f}% "
              f"| {rows:>5} | {fp:>9} | {lat} steps")
