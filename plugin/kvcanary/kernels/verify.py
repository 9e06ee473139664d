"""The verify kernel's wrapper: ``canary_verify_step`` (SPEC §4.2; csrc/canary_verify.cuh), which the runtime's
sweep launches over a ``VerifyPlan``. Reference: ``verify_ref``."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.call import (
    CALL_ERRORS,
    INT,
    OPTIONAL,
    REAL_KV,
    Arg,
    KernelSpec,
    RealKvLaunch,
    module_for,
    prepare_real_kv,
)
from kvcanary.kernels.plan import VerifyPlan
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


class SweepLaunch:
    """``canary_verify_step`` over a plan, every other argument fixed for a runtime's lifetime: the sweep's launch.

    Why: a sweep is one launch, but through :func:`canary_verify_step` it built ~20 positional arguments from
    keywords on every call (the H200 engine timed the sweep's launch at ~136 µs per sweep, with its scheduler
    paying ~16 µs per torch call). Here the export's positional arguments are laid out once per plan object (an
    incremental sweep plan alternates between two buffers; a plan that grew is a new object), so a sweep is the
    export's call alone. A call that fails is named as :func:`canary_verify_step` names it.
    """

    def __init__(self, **fixed) -> None:
        fixed = {**_DEFAULTS, **fixed}
        fixed["real_kv_sources"] = prepare_real_kv(fixed["real_kv_sources"], fixed["canary_buf"].device)
        self._fixed = fixed
        self._device = fixed["canary_buf"].device
        self._laid_out: dict[int, tuple[VerifyPlan, object, tuple]] = {}  # id(plan) -> (plan, export, arguments)

    def __call__(self, plan: VerifyPlan) -> None:
        laid_out = self._laid_out.get(id(plan))
        if laid_out is None or laid_out[0] is not plan:
            laid_out = self._lay_out(plan)
        _, export, args = laid_out
        try:
            export(*args)
        except CALL_ERRORS as exc:
            SPEC.reraise(exc, {**self._fixed, **plan.kernel_args()})

    def _lay_out(self, plan: VerifyPlan) -> tuple[VerifyPlan, object, tuple]:
        export, args = SPEC.laid_out(module_for(self._device), {**self._fixed, **plan.kernel_args()}, self._device)
        if len(self._laid_out) >= 4:  # (plans replaced by larger ones: forget them, and the tensors they hold)
            self._laid_out.clear()
        laid_out = self._laid_out[id(plan)] = (plan, export, args)
        return laid_out


# canary_verify_step's keyword defaults (SweepLaunch's fixed arguments start from them, as a call's would)
_DEFAULTS = {name: p.default for name, p in inspect.signature(canary_verify_step).parameters.items()
             if p.default is not inspect.Parameter.empty}
