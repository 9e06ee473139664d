"""Typed wrappers of the kernels: keyword-only, dispatching on ``canary_buf.device``.

Argument checks live in C++ (one layer for the CPU build, the CUDA build and direct tvm-ffi calls);
this module only turns ``real_kv_sources`` into the fixed four-buffer ABI and forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcanary import layout
from kvcanary.jit import load_module
from kvcanary.plan import VerifyPlan, WritePlan
from kvcanary.real_kv import RealKvSource

__all__ = [
    "RealKvLaunch", "canary_plan_step", "canary_verify_step", "canary_write_step", "load_module", "prepare_real_kv",
    "real_kv_launch_args",
]

_unused_source_cache: dict[torch.device, torch.Tensor] = {}


def _backend_of(device: torch.device) -> str:
    if device.type in ("cpu", "cuda"):
        return device.type
    raise ValueError(f"kvcanary: canary_buf: device {device} is not supported (cpu or cuda)")


def _unused_source(device: torch.device) -> torch.Tensor:
    """A tiny aligned uint8 [1, 16] tensor standing in for unused ABI source slots (never read)."""
    t = _unused_source_cache.get(device)
    if t is None:
        t = torch.zeros((1, layout.REAL_KV_ALIGN_BYTES), dtype=torch.uint8, device=device)
        _unused_source_cache[device] = t
    return t


@dataclass(frozen=True)
class RealKvLaunch:
    """``real_kv_sources`` in the kernels' fixed four-buffer ABI, built once and reused for every launch.

    Building it costs a dozen small tensor writes (~50 us of host time); a manager prepares it once, so a
    forward's launches pay nothing. Holds the sources, so their buffers stay alive as long as it does.
    """

    sources: tuple[RealKvSource, ...]
    buffers: tuple[torch.Tensor, ...]  # MAX_REAL_KV_SOURCES byte tensors (unused slots: a tiny dummy)
    params: torch.Tensor  # CPU int32 [MAX_REAL_KV_SOURCES, REAL_KV_PARAM_FIELDS]
    num_sources: int


def prepare_real_kv(real_kv_sources: Sequence[RealKvSource] | RealKvLaunch, device: torch.device) -> RealKvLaunch:
    """Check ``real_kv_sources`` and lay them out for the kernels (a ``RealKvLaunch`` passes through)."""
    if isinstance(real_kv_sources, RealKvLaunch):
        return real_kv_sources
    sources = tuple(real_kv_sources)
    if len(sources) > layout.MAX_REAL_KV_SOURCES:
        raise ValueError(
            f"kvcanary: real_kv_sources: at most {layout.MAX_REAL_KV_SOURCES} sources, got {len(sources)}"
        )
    for i, src in enumerate(sources):
        if not isinstance(src, RealKvSource):
            raise TypeError(f"kvcanary: real_kv_sources[{i}]: expected RealKvSource, got {type(src).__name__}")
    rows = []
    for i in range(layout.MAX_REAL_KV_SOURCES):
        row = [0] * layout.REAL_KV_PARAM_FIELDS
        if i < len(sources):
            row[layout.REAL_KV_PARAM_PAGE_SIZE] = sources[i].page_size
            row[layout.REAL_KV_PARAM_BYTES_PER_TOKEN] = sources[i].num_bytes_per_token
            row[layout.REAL_KV_PARAM_READ_BYTES] = sources[i].read_bytes
        rows.append(row)
    buffers = tuple(src.kv_bytes for src in sources) + (_unused_source(device),) * (
        layout.MAX_REAL_KV_SOURCES - len(sources))
    return RealKvLaunch(sources, buffers, torch.tensor(rows, dtype=torch.int32), len(sources))


def real_kv_launch_args(
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch, device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """(four byte tensors, CPU int32 [4, 3] param table, num_sources) for the raw ABI."""
    launch = prepare_real_kv(real_kv_sources, device)
    return list(launch.buffers), launch.params, launch.num_sources


def canary_write_step(
    *,
    canary_buf: torch.Tensor,
    write_offsets: torch.Tensor,
    write_seed_slot_indices: torch.Tensor,
    write_num_valid_reqs: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    kernel_kind: int,
    enable_write_input_assert: bool,
    expected_input_tokens: torch.Tensor | None,
    expected_input_positions: torch.Tensor | None,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    slot_run_counter: torch.Tensor,
    kernel_run_counter: torch.Tensor,
    enable_chain_position_assert: torch.Tensor,
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
) -> None:
    """Store the shadow records of the slots one forward filled (SPEC §4.1; see csrc/canary_write.cuh).

    Runs on ``canary_buf.device`` (CPU build or CUDA build, on torch's current stream) and never
    synchronises. Violations go to ``violation_ring``; counters are bumped on the device.
    """
    module: Any = load_module(_backend_of(canary_buf.device))
    bufs, params, num_sources = real_kv_launch_args(real_kv_sources, canary_buf.device)
    module.canary_write_step(
        canary_buf,
        write_offsets,
        write_seed_slot_indices,
        write_num_valid_reqs,
        input_ids,
        positions,
        out_cache_loc,
        int(kernel_kind),
        int(enable_write_input_assert),
        expected_input_tokens,
        expected_input_positions,
        violation_ring,
        violation_write_index,
        slot_run_counter,
        kernel_run_counter,
        enable_chain_position_assert,
        *bufs,
        params,
        num_sources,
        int(real_kv_hash_mode),
    )


def canary_verify_step(
    *,
    canary_buf: torch.Tensor,
    verify_slot_indices: torch.Tensor,
    verify_expected_tokens: torch.Tensor,
    verify_expected_positions: torch.Tensor,
    verify_prev_slot_indices: torch.Tensor,
    verify_num_valid: torch.Tensor,
    verify_enable: torch.Tensor,
    kernel_kind: int,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    slot_run_counter: torch.Tensor,
    kernel_run_counter: torch.Tensor,
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
) -> None:
    """Check the records of planned prefix entries (SPEC §4.2; see csrc/canary_verify.cuh).

    Never modifies ``canary_buf``; runs on its device without synchronising.
    """
    module: Any = load_module(_backend_of(canary_buf.device))
    bufs, params, num_sources = real_kv_launch_args(real_kv_sources, canary_buf.device)
    module.canary_verify_step(
        canary_buf,
        verify_slot_indices,
        verify_expected_tokens,
        verify_expected_positions,
        verify_prev_slot_indices,
        verify_num_valid,
        verify_enable,
        int(kernel_kind),
        violation_ring,
        violation_write_index,
        slot_run_counter,
        kernel_run_counter,
        *bufs,
        params,
        num_sources,
        int(real_kv_hash_mode),
        int(check_tokens),
    )


def canary_plan_step(
    *,
    write_plan: WritePlan,
    verify_plan: VerifyPlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    expected_tokens: torch.Tensor | None = None,
    expected_tokens_valid_lens: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
) -> None:
    """Fill ``write_plan`` and ``verify_plan`` for one forward (SPEC §4.3; see csrc/canary_plan.cuh).

    Runs on the plans' device without synchronising; the amount of work lives in the plans' device
    scalars, so the launch is CUDA-graph capturable. An overflowing verify plan is disabled
    (``verify_enable == 0``), which the caller drains and reports.
    """
    if not isinstance(write_plan, WritePlan):
        raise TypeError(f"canary_plan_step: write_plan: expected WritePlan, got {type(write_plan).__name__}")
    if not isinstance(verify_plan, VerifyPlan):
        raise TypeError(f"canary_plan_step: verify_plan: expected VerifyPlan, got {type(verify_plan).__name__}")
    module: Any = load_module(_backend_of(write_plan.write_offsets.device))
    module.canary_plan_step(
        write_plan.write_offsets,
        write_plan.write_seed_slot_indices,
        write_plan.write_num_valid_reqs,
        write_plan.verify_row_offsets,
        verify_plan.verify_slot_indices,
        verify_plan.verify_expected_tokens,
        verify_plan.verify_expected_positions,
        verify_plan.verify_prev_slot_indices,
        verify_plan.verify_num_valid,
        verify_plan.verify_enable,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        req_to_token,
        int(swa_window_size),
        full_to_swa_index_mapping,
        expected_tokens,
        expected_tokens_valid_lens,
        int(kv_token_id_vs_position_offset),
    )
