"""GPU tests: register the ``gpu`` marker (also declared in pyproject.toml) and make ``kvcanary`` importable
from a source checkout when PYTHONPATH does not already name ``plugin/``."""

from __future__ import annotations

import sys
from pathlib import Path

_PLUGIN = Path(__file__).resolve().parents[2] / "plugin"

try:
    import kvcanary  # noqa: F401
except ImportError:
    if _PLUGIN.is_dir():
        sys.path.insert(0, str(_PLUGIN))


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook signature
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
