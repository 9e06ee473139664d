"""Shared fixture of the driver tests: integration/sglang_e2e.py loaded once as a module (it is a script, not a
package module, and must never import kvcanary itself)."""

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
def probe():
    """integration/loop_probe.py (the driver's --loop-probe)."""
    return _script("loop_probe_under_test", INTEGRATION / "loop_probe.py")
