"""Simulator tests: make ``kvcanary`` (plugin/) and ``engine`` (tests/sim/engine.py, which re-exports the package's
``kvcanary.sim.engine``) importable; ``engine.build_sim`` wires a simulator to a real ``CanaryManager``."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PLUGIN = _HERE.parents[1] / "plugin"

try:
    import kvcanary  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_PLUGIN))
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
