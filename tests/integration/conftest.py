"""Shared fixtures of the driver tests: integration/sglang_e2e.py loaded once as a module (it is a script, not a
package module, and must never import kvcanary itself), and the modules it imports: its core and phase families."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parents[2] / "integration"
DRIVER = INTEGRATION / "sglang_e2e.py"


def _script(name: str, path: Path):
    """``path`` loaded once as the module ``name`` (a script of integration/, not a package module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def e2e():
    return _script("sglang_e2e_driver", DRIVER)


@pytest.fixture(scope="module")
def core(e2e):
    """integration/e2e_core.py (what every phase family reads and judges alike), as the driver imports it."""
    return sys.modules["e2e_core"]


@pytest.fixture(scope="module")
def eagle(e2e):
    """integration/eagle_phases.py (the EAGLE phases), as the driver imports it."""
    return e2e.eagle_phases


@pytest.fixture(scope="module")
def pool(e2e):
    """integration/pool_phases.py (the pool-kind phases 24-30), as the driver imports it."""
    return e2e.pool_phases


@pytest.fixture(scope="module")
def overhead(e2e):
    """integration/overhead_phases.py (phase 4 and --piecewise), as the driver imports it."""
    return sys.modules["overhead_phases"]


@pytest.fixture(scope="module")
def probe():
    """integration/loop_probe.py (the driver's --loop-probe)."""
    return _script("loop_probe_under_test", INTEGRATION / "loop_probe.py")
