"""Import shim for sglang 0.5.12 on a CPU-only machine (../shared/notes/sglang-cpu.md, measured).

1. PyPI's torchvision 0.28.0 is a CUDA build; with torch+cpu its ops library does not load and two unguarded
   ``register_fake`` calls fail: define the two schemas they need first.
2. ``sgl_kernel`` (CUDA only) is imported by the scheduler module for HiCache copies: placeholders suffice.

Imported by tests/adapters/conftest.py before anything imports sglang; does nothing when sglang is absent.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

_TV_LIB = None

_KVCACHEIO = (
    "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)


def allow_cuda_torchvision_on_cpu_torch() -> None:
    global _TV_LIB
    if _TV_LIB is not None:
        return
    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return  # a working torchvision registered its ops already
    except RuntimeError:
        pass
    _TV_LIB = torch.library.Library("torchvision", "DEF")  # keep the reference: dropping it undoes the defs
    _TV_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def stub_sgl_kernel_kvcacheio() -> None:
    try:
        import sgl_kernel.kvcacheio  # noqa: F401  (a loadable sgl_kernel wins)

        return
    except Exception:
        for k in [k for k in sys.modules if k == "sgl_kernel" or k.startswith("sgl_kernel.")]:
            del sys.modules[k]
    pkg = types.ModuleType("sgl_kernel")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", None, is_package=True)
    mod = types.ModuleType("sgl_kernel.kvcacheio")
    mod.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel.kvcacheio", None)

    def make(name):
        def unavailable(*a, **k):
            raise NotImplementedError(f"sgl_kernel.kvcacheio.{name} is a CPU-CI stub")

        return unavailable

    for n in _KVCACHEIO:
        setattr(mod, n, make(n))
    pkg.kvcacheio = mod
    sys.modules["sgl_kernel"] = pkg
    sys.modules["sgl_kernel.kvcacheio"] = mod


def apply() -> None:
    allow_cuda_torchvision_on_cpu_torch()
    stub_sgl_kernel_kvcacheio()
