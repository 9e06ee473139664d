"""kvcanary: a KV-cache integrity canary for LLM serving (an out-of-tree SGLang plugin).

Kernels are JIT-built on first use (``kvcanary.ops``, the stable public path of the per-kernel wrappers in
``kvcanary.kernels``); each wrapper module has its plain reference beside it (``kvcanary.kernels.write_ref`` …).
"""

from __future__ import annotations

__version__ = "0.1.0"

from kvcanary.kernels import layout
from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.real_kv import RealKvSource

__all__ = ["BatchView", "ForwardKind", "RealKvSource", "VerifyPlan", "WritePlan", "__version__", "layout"]
