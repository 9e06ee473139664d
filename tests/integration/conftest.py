"""Shared fixture of the driver tests: integration/sglang_e2e.py loaded once as a module (it is a script, not a
package module, and must never import kvcanary itself)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parents[2] / "integration" / "sglang_e2e.py"


@pytest.fixture(scope="module")
def e2e():
    name = "sglang_e2e_driver"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DRIVER)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
