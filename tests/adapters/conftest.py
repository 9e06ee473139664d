"""tests/adapters: the SGLang adapter against a real sglang 0.5.12 on CPU (skipped when sglang is absent).

Install: ``pip install --no-deps -r requirements-sglang-cpu.txt`` (see that file). The import shim runs here,
before any sglang import; ``SGLANG_USE_CPU_ENGINE=1`` makes sglang's CPU paths (no vllm, torch_native) apply.
"""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("sglang") is not None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.dirname(__file__))
    from importlib.metadata import version as _installed

    if _installed("sglang").startswith("0.5.23"):  # its CPU engine imports sgl_kernel CPU kernels: another shim
        import _sglang_cpu_shims_0_5_23 as _shims  # noqa: E402
    else:
        import _sglang_cpu_shims as _shims  # noqa: E402

    _shims.apply()
