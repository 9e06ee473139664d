"""A paged-KV serving simulator and a fault driver, for ``kvcanary demo`` and the tests.

* :mod:`kvcanary.sim.engine`: :class:`~kvcanary.sim.engine.Simulator`, a small SGLang-like serving loop (prefix
  cache with eviction, slot reuse, chunked prefill, decode, mixed and idle forwards, optionally a HiCache-like host
  KV tier with backups and load-backs) that drives a real :class:`~kvcanary.runtime.manager.CanaryManager` once per
  forward.
* :mod:`kvcanary.sim.injector`: :class:`~kvcanary.sim.injector.FaultDriver`, which injects the fault classes of
  :mod:`kvcanary.runtime.faults` into a running simulator one at a time, repairs each after it is reported, and scores
  the canary's reports (detections, latency, false positives).
* :mod:`kvcanary.sim.protect`: :class:`~kvcanary.sim.protect.SimProtect`, protect mode over the simulator (the
  requests that read bad KV recomputed, the cached nodes holding bad slots dropped), for ``kvcanary demo --mode
  protect``.
* :mod:`kvcanary.sim.workload`: ``DecodeRig``, a synthetic decode workload (no serving loop) for the GPU tests and
  the per-forward device benchmarks.

None needs sglang or a GPU.
"""

from __future__ import annotations

from kvcanary.sim.engine import SimConfig, Simulator, build_sim
from kvcanary.sim.injector import ClassResult, FaultDriver
from kvcanary.sim.protect import SimProtect

__all__ = ["ClassResult", "FaultDriver", "SimConfig", "SimProtect", "Simulator", "build_sim"]
