"""Import shim for sglang 0.5.23 on a CPU-only machine (measured; see requirements-sglang-0.5.23-cpu.txt).

sglang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports CPU kernels from ``sgl_kernel`` at module level
(``from sgl_kernel import copy_all_layer_kv_cache_cpu``, ...). Those kernels ship only in sgl-kernel's CPU build,
which PyPI does not serve (``sglang-kernel`` 0.4.10 is the CUDA build; it cannot load without CUDA 13). So:

1. the torchvision fix of the 0.5.12 shim (PyPI's torchvision is a CUDA build: define the two op schemas);
2. an ``sgl_kernel`` package that answers exactly the names below: the one kernel a plain (non-speculative) CPU
   forward calls, ``assign_req_to_token_pool_cpu`` (ScheduleBatch writes ``req_to_token`` with it), gets a pure
   torch implementation with the kernel's semantics; every other name is a placeholder that raises
   NotImplementedError when called (speculative decoding and KV-move paths, which these tests never take). Any
   other attribute is absent, so sglang's own ``try: from sgl_kernel... except ImportError`` fallbacks still apply.

Imported by tests/adapters/conftest.py (instead of the 0.5.12 shim) when the installed sglang is 0.5.23.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch
from _sglang_cpu_shims import allow_cuda_torchvision_on_cpu_torch

# Names sglang 0.5.23 imports from sgl_kernel at module level on the CPU engine (found by importing
# model_runner, scheduler and kv_cache_builder until no ImportError was left).
PLACEHOLDERS = (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)

_KVCACHEIO = (
    "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """sgl_kernel's CPU kernel in torch: row ``req_pool_indices[i]`` of ``req_to_token`` gets, at columns
    ``[start_offset[i], end_offset[i])``, the next ``end - start`` entries of ``out_cache_loc`` (requests in order)."""
    del pool_len  # the kernel's row stride; req_to_token carries it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = int(end) - int(start)
        if n > 0:
            req_to_token[int(row), int(start):int(end)] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def _placeholder(qualified: str):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"{qualified} is a CPU-CI placeholder (PyPI serves no CPU build of sgl-kernel)")

    unavailable.__name__ = qualified.rsplit(".", 1)[-1]
    return unavailable


def stub_sgl_kernel() -> None:
    try:
        import sgl_kernel  # noqa: F401

        if hasattr(sgl_kernel, "assign_req_to_token_pool_cpu"):
            return  # a real CPU build of sgl-kernel wins
    except Exception:
        pass
    for k in [k for k in sys.modules if k == "sgl_kernel" or k.startswith("sgl_kernel.")]:
        del sys.modules[k]
    pkg = types.ModuleType("sgl_kernel")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", None, is_package=True)
    for name in PLACEHOLDERS:
        setattr(pkg, name, _placeholder(f"sgl_kernel.{name}"))
    pkg.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
    io = types.ModuleType("sgl_kernel.kvcacheio")
    io.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel.kvcacheio", None)
    for name in _KVCACHEIO:
        setattr(io, name, _placeholder(f"sgl_kernel.kvcacheio.{name}"))
    pkg.kvcacheio = io
    sys.modules["sgl_kernel"] = pkg
    sys.modules["sgl_kernel.kvcacheio"] = io


def apply() -> None:
    allow_cuda_torchvision_on_cpu_torch()
    stub_sgl_kernel()
