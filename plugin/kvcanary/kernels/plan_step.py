"""The plan kernel's wrapper: ``canary_plan_step`` (SPEC §4.3; csrc/canary_plan.cuh) fills a ``WritePlan`` and a
``VerifyPlan`` (the buffers: ``kernels.plan``) for one forward. Reference: ``plan_step_ref``."""

from __future__ import annotations

import logging

import torch

from kvcanary.kernels.call import INT, OPTIONAL, Arg, KernelSpec, plan_args
from kvcanary.kernels.plan import VerifyPlan, WritePlan

logger = logging.getLogger(__name__)

# The export's order; the attributed export appends the plans' request rows, the forward counter, its value and the
# forward's slots (the plans' kvcanary+ fields are named in errors where the plan lists them).
SPEC = KernelSpec(
    fn="canary_plan_step", device="write_plan.write_offsets",
    args=(
        *plan_args("write_plan", WritePlan, attributed=True), *plan_args("verify_plan", VerifyPlan, attributed=True),
        Arg("req_pool_indices"), Arg("prefix_lens"), Arg("extend_lens"), Arg("req_to_token"),
        Arg("swa_window_size", INT), Arg("full_to_swa_index_mapping", OPTIONAL), Arg("expected_tokens", OPTIONAL),
        Arg("expected_tokens_valid_lens", OPTIONAL), Arg("kv_token_id_vs_position_offset", INT),
        Arg("forward_counter", OPTIONAL, True), Arg("forward_step_value", INT, True),
        Arg("out_cache_loc", OPTIONAL, True),
    ),
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
    forward_counter: torch.Tensor | None = None,
    forward_step_value: int = -1,
    out_cache_loc: torch.Tensor | None = None,
) -> None:
    """Fill ``write_plan`` and ``verify_plan`` for one forward (SPEC §4.3; see csrc/canary_plan.cuh).

    Runs on the plans' device without synchronising; the amount of work lives in the plans' device
    scalars, so the launch is CUDA-graph capturable. An overflowing verify plan is disabled
    (``verify_enable == 0``), which the caller drains and reports. ``expected_tokens`` may be int32 (like
    ``req_to_token``) or int64.

    kvcanary+: the plans' ``write_request_rows`` / ``verify_request_rows`` (when allocated) get each batch
    row's and each entry's req_to_token row. ``forward_counter`` (int64 [1], optional) becomes the number of the
    forward this plan starts: ``forward_step_value`` when it is >= 0, else the counter + 1 (what a launch
    captured in a CUDA graph needs: every replay counts one forward). ``out_cache_loc`` (the forward's slots,
    int32 or int64, optional): a row that writes and whose first new token is on the padding slot is a padding row
    (no window entries, no write, no seed), as ``canary_check_step`` plans it.
    """
    # (the plans' fields are named in errors: not to be read from anything else)
    if not isinstance(write_plan, WritePlan):
        raise TypeError(f"canary_plan_step: write_plan: expected WritePlan, got {type(write_plan).__name__}")
    if not isinstance(verify_plan, VerifyPlan):
        raise TypeError(f"canary_plan_step: verify_plan: expected VerifyPlan, got {type(verify_plan).__name__}")
    SPEC.run(locals())
