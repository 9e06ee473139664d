"""The verify kernel's wrapper: ``canary_verify_step`` (SPEC §4.2; csrc/canary_verify.cuh), which the runtime's
sweep launches over a ``VerifyPlan``. Reference: ``verify_ref``."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.call import INT, OPTIONAL, REAL_KV, Arg, KernelSpec, RealKvLaunch
from kvcanary.kernels.real_kv import RealKvSource

logger = logging.getLogger(__name__)

# The export's order; the attributed export appends the kvcanary+ tensors.
SPEC = KernelSpec(
    fn="canary_verify_step", device="canary_buf",
    args=(
        Arg("canary_buf"), Arg("verify_slot_indices"), Arg("verify_expected_tokens"), Arg("verify_expected_positions"),
        Arg("verify_prev_slot_indices"), Arg("verify_num_valid"), Arg("verify_enable"), Arg("kernel_kind", INT),
        Arg("violation_ring"), Arg("violation_write_index"), Arg("slot_run_counter"), Arg("kernel_run_counter"),
        Arg("real_kv_sources", REAL_KV), Arg("real_kv_hash_mode", INT), Arg("check_tokens", INT),
        Arg("violation_meta", OPTIONAL, True), Arg("forward_step", OPTIONAL, True),
        Arg("verify_request_rows", OPTIONAL, True), Arg("slot_attribution", OPTIONAL, True),
    ),
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
    violation_meta: torch.Tensor | None = None,
    forward_step: torch.Tensor | None = None,
    verify_request_rows: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
) -> None:
    """Check the records of planned prefix entries (SPEC §4.2; see csrc/canary_verify.cuh).

    Never modifies ``canary_buf``; runs on its device without synchronising.

    kvcanary+ (all optional): ``violation_meta`` int64 [R, VIOLATION_META_FIELDS] gets one metadata row per
    ring row: ``forward_step``'s value, the entry's row from ``verify_request_rows`` int64 [cap] and the
    failing slot's ``slot_attribution`` row (read for failing entries only).
    """
    SPEC.run(locals())
