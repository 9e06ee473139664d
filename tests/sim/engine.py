"""The serving simulator lives in the package (``kvcanary.sim.engine``, also used by ``kvcanary demo``); the tests
import it from here under its old name."""

from __future__ import annotations

from kvcanary.sim.engine import KV_BYTES, M64, Node, Request, SimConfig, Simulator, build_sim, mix

__all__ = ["KV_BYTES", "M64", "Node", "Request", "SimConfig", "Simulator", "build_sim", "mix"]
