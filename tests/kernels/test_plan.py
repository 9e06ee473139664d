"""Plan kernel: CPU (and CUDA when present) bit-exact with kvcanary.kernels.plan_step_ref over random batches, plus
hand-checked cases."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from kvcanary.kernels import layout, plan_step, plan_step_ref, verify
from kvcanary.kernels.plan import VerifyPlan, WritePlan

SCENARIOS = 1000
CHUNKS = 5
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_plan_case(rng: random.Random) -> dict:
    req_rows = rng.randint(1, 12)
    max_ctx = rng.randint(1, 40)
    num_slots = rng.randint(2, 200)
    table = torch.tensor(
        [[rng.randrange(num_slots) for _ in range(max_ctx)] for _ in range(req_rows)], dtype=torch.int32
    )
    if rng.random() < 0.2:  # a view with a row stride larger than its width
        wide = torch.zeros((req_rows, max_ctx + 3), dtype=torch.int32)
        wide[:, :max_ctx] = table
        table = wide[:, :max_ctx]
    if rng.random() < 0.1:
        table[rng.randrange(req_rows), rng.randrange(max_ctx)] = rng.choice([-3, num_slots + 10, 1 << 30])
    bs = rng.randint(0, 8)
    rps, prefixes, extends = [], [], []
    for _ in range(bs):
        roll = rng.random()
        rp = 0 if roll < 0.15 else (rng.choice([-1, req_rows, req_rows + 7]) if roll < 0.2 else rng.randrange(req_rows))
        prefix = rng.choice([0, 0, rng.randint(0, max_ctx), rng.randint(0, max_ctx), max_ctx])
        if rng.random() < 0.05:
            prefix = rng.choice([-2, max_ctx + 1, max_ctx + 9])
        extend = rng.choice([0, 1, 1, rng.randint(0, 9)])
        if rng.random() < 0.04:
            extend = -rng.randint(1, 3)
        rps.append(rp)
        prefixes.append(prefix)
        extends.append(extend)
    case: dict = {
        "req_pool_indices": torch.tensor(rps, dtype=torch.int64),
        "prefix_lens": torch.tensor(prefixes, dtype=torch.int64),
        "extend_lens": torch.tensor(extends, dtype=torch.int64),
        "req_to_token": table,
        "swa_window_size": 0,
        "full_to_swa_index_mapping": None,
        "expected_tokens": None,
        "expected_tokens_valid_lens": None,
        "kv_token_id_vs_position_offset": rng.choice([0, 0, 1, -1]),
    }
    if rng.random() < 0.4:  # SWA: window + LUT with evicted (0) and trailing -1 entries
        case["swa_window_size"] = rng.randint(1, max_ctx + 2)
        lut_len = rng.randint(num_slots // 2, num_slots + 1)
        lut = [0 if rng.random() < 0.3 else rng.randrange(1, num_slots) for _ in range(lut_len)]
        lut[-1] = -1
        case["full_to_swa_index_mapping"] = torch.tensor(lut, dtype=torch.int64)
    if rng.random() < 0.5:
        exp_cols = rng.randint(1, max_ctx + 3)
        exp_rows = rng.randint(1, req_rows + 2)
        case["expected_tokens"] = torch.randint(0, 50000, (exp_rows, exp_cols), dtype=torch.int64)
        case["expected_tokens_valid_lens"] = torch.tensor(
            [rng.randint(0, exp_cols + 2) for _ in range(bs)], dtype=torch.int64
        )
    case["write_capacity"] = bs + rng.choice([0, 0, 1, 4])
    total = sum(
        (1 if not 0 <= rp < req_rows else min(max(p, 0), max_ctx)) if rp != 0 else 0
        for rp, p in zip(rps, prefixes, strict=True)
    )
    case["verify_capacity"] = max(0, total + rng.choice([0, 3, 20, -1, -5]))
    return case


def run_plan(fn, case: dict, device: str) -> tuple[WritePlan, VerifyPlan]:
    write_plan = WritePlan.allocate(case["write_capacity"], device)
    verify_plan = VerifyPlan.allocate(case["verify_capacity"], device)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items() if "capacity" not in k}
    fn(write_plan=write_plan, verify_plan=verify_plan, **kwargs)
    return write_plan, verify_plan


def assert_plans_equal(a: tuple[WritePlan, VerifyPlan], b: tuple[WritePlan, VerifyPlan], ctx: str) -> None:
    for pa, pb in zip(a, b, strict=True):
        for f in fields(pa):
            ta, tb = getattr(pa, f.name).cpu(), getattr(pb, f.name).cpu()
            assert torch.equal(ta, tb), f"{f.name} differs ({ctx}): {ta.tolist()} != {tb.tolist()}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_plan_matches_reference(backend: str, chunk: int) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for seed in range(chunk * SCENARIOS // CHUNKS, (chunk + 1) * SCENARIOS // CHUNKS):
        case = random_plan_case(random.Random(seed))
        got = run_plan(plan_step.canary_plan_step, case, backend)
        want = run_plan(plan_step_ref.canary_plan_step, case, "cpu")
        assert_plans_equal(got, want, f"seed={seed} backend={backend}")


def test_random_cases_cover_the_interesting_shapes() -> None:
    seen = {"overflow": 0, "padding": 0, "swa": 0, "tokens": 0, "index_error": 0, "extend0": 0, "prefix0": 0}
    for seed in range(SCENARIOS):
        case = random_plan_case(random.Random(seed))
        wp, vp = run_plan(plan_step_ref.canary_plan_step, case, "cpu")
        seen["overflow"] += int(vp.verify_enable[0]) == 0
        seen["padding"] += int((case["req_pool_indices"] == 0).any())
        seen["swa"] += case["swa_window_size"] > 0
        if vp.capacity:
            seen["tokens"] += int((vp.verify_expected_tokens[: int(vp.verify_num_valid[0])] != -1).any())
        n = int(vp.verify_num_valid[0]) if int(vp.verify_enable[0]) else 0
        seen["index_error"] += any(
            layout.decode_plan_index_error(s) is not None for s in vp.verify_slot_indices[:n].tolist()
        )
        seen["extend0"] += int((case["extend_lens"] == 0).any())
        seen["prefix0"] += int((case["prefix_lens"] == 0).any())
    assert all(v >= 20 for v in seen.values()), seen


def _hand_case(device: str = "cpu") -> tuple[WritePlan, VerifyPlan]:
    table = torch.zeros((4, 8), dtype=torch.int32)
    table[1, :5] = torch.tensor([11, 12, 13, 14, 15])
    table[3, :3] = torch.tensor([31, 32, 33])
    wp, vp = WritePlan.allocate(4, device), VerifyPlan.allocate(16, device)
    plan_step.canary_plan_step(
        write_plan=wp,
        verify_plan=vp,
        # row 0: rp 1, prefix 4, extend 1 (decode); row 1: padding; row 2: rp 3, prefix 0, extend 3 (prefill)
        req_pool_indices=torch.tensor([1, 0, 3], dtype=torch.int64),
        prefix_lens=torch.tensor([4, 0, 0], dtype=torch.int64),
        extend_lens=torch.tensor([1, 1, 3], dtype=torch.int64),
        req_to_token=table,
    )
    return wp, vp


def test_hand_built_decode_and_prefill_plan() -> None:
    wp, vp = _hand_case()
    assert wp.write_offsets.tolist() == [0, 1, 1, 4, 4]
    assert wp.write_seed_slot_indices.tolist() == [14, -1, -1, -1]
    assert wp.write_num_valid_reqs.tolist() == [3]
    assert vp.verify_num_valid.tolist() == [4] and vp.verify_enable.tolist() == [1]
    assert vp.verify_slot_indices[:4].tolist() == [11, 12, 13, 14]
    assert vp.verify_prev_slot_indices[:4].tolist() == [-1, 11, 12, 13]
    assert vp.verify_expected_positions[:4].tolist() == [0, 1, 2, 3]
    assert vp.verify_expected_tokens[:4].tolist() == [-1, -1, -1, -1]


def test_overflow_disables_verify() -> None:
    table = torch.arange(1, 33, dtype=torch.int32).view(2, 16)
    wp, vp = WritePlan.allocate(2, "cpu"), VerifyPlan.allocate(5, "cpu")
    plan_step.canary_plan_step(
        write_plan=wp,
        verify_plan=vp,
        req_pool_indices=torch.tensor([1], dtype=torch.int64),
        prefix_lens=torch.tensor([6], dtype=torch.int64),
        extend_lens=torch.tensor([1], dtype=torch.int64),
        req_to_token=table,
    )
    assert vp.verify_enable.tolist() == [0] and vp.verify_num_valid.tolist() == [5]


def test_batch_larger_than_write_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="canary_plan_step: req_pool_indices: batch has 3 rows"):
        plan_step.canary_plan_step(
            write_plan=WritePlan.allocate(2, "cpu"),
            verify_plan=VerifyPlan.allocate(4, "cpu"),
            req_pool_indices=torch.ones(3, dtype=torch.int64),
            prefix_lens=torch.zeros(3, dtype=torch.int64),
            extend_lens=torch.zeros(3, dtype=torch.int64),
            req_to_token=torch.zeros((2, 4), dtype=torch.int32),
        )


def test_plan_index_errors_are_reported_by_verify() -> None:
    """A row whose req_pool_index lies outside req_to_token becomes an out-of-range verify row."""
    table = torch.zeros((2, 4), dtype=torch.int32)
    wp, vp = WritePlan.allocate(1, "cpu"), VerifyPlan.allocate(4, "cpu")
    plan_step.canary_plan_step(
        write_plan=wp,
        verify_plan=vp,
        req_pool_indices=torch.tensor([9], dtype=torch.int64),
        prefix_lens=torch.tensor([2], dtype=torch.int64),
        extend_lens=torch.tensor([1], dtype=torch.int64),
        req_to_token=table,
    )
    assert vp.verify_num_valid.tolist() == [1]
    assert layout.decode_plan_index_error(int(vp.verify_slot_indices[0])) == 9
    ring = torch.zeros((2, 8), dtype=torch.int64)
    index = torch.zeros(1, dtype=torch.int32)
    verify.canary_verify_step(
        canary_buf=torch.zeros((4, 32), dtype=torch.uint8),
        **vp.kernel_args(),
        kernel_kind=0,
        violation_ring=ring,
        violation_write_index=index,
        slot_run_counter=torch.zeros(1, dtype=torch.int64),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64),
    )
    assert int(index[0]) == 1
    assert ring[0, layout.VIOLATION_COL_FAIL_REASON_BITS] == layout.REASON_SLOT_OUT_OF_RANGE
    assert layout.decode_plan_index_error(int(ring[0, layout.VIOLATION_COL_SLOT])) == 9


def _plan_call_kwargs() -> dict:
    """A valid canary_plan_step call with expected tokens (batch of 2 rows, write plan of 2)."""
    return {
        "write_plan": WritePlan.allocate(2, "cpu"),
        "verify_plan": VerifyPlan.allocate(8, "cpu"),
        "req_pool_indices": torch.tensor([1, 0], dtype=torch.int64),
        "prefix_lens": torch.tensor([2, 0], dtype=torch.int64),
        "extend_lens": torch.tensor([1, 1], dtype=torch.int64),
        "req_to_token": torch.zeros((3, 4), dtype=torch.int32),
        "expected_tokens": torch.zeros((3, 4), dtype=torch.int32),
        "expected_tokens_valid_lens": torch.tensor([2, 2], dtype=torch.int64),
    }


@pytest.mark.parametrize(("name", "value", "exc", "message"), [
    # the plan's side of the helpers canary_check_step shares (csrc/canary_plan.cuh): int64-only batch arrays and
    # valid lengths per batch row, under the plan's own argument name
    ("prefix_lens", torch.tensor([2, 0], dtype=torch.int32), TypeError,
     "canary_plan_step: prefix_lens: expected dtype int64, got int32"),
    ("expected_tokens", None, ValueError,
     "canary_plan_step: expected_tokens: expected_tokens and expected_tokens_valid_lens must be given together"),
    ("expected_tokens_valid_lens", None, ValueError,
     "canary_plan_step: expected_tokens_valid_lens: expected_tokens and expected_tokens_valid_lens must be given "
     "together"),
    ("expected_tokens_valid_lens", torch.tensor([2, 2, 2], dtype=torch.int64), ValueError,
     "canary_plan_step: expected_tokens_valid_lens: expected shape [batch_rows=2], got [3] (batch_rows=2 bound by "
     "req_pool_indices)"),
])
def test_plan_argument_errors_keep_their_text(name: str, value: torch.Tensor | None, exc: type[Exception],
                                              message: str) -> None:
    plan_step.canary_plan_step(**_plan_call_kwargs())
    with pytest.raises(exc) as info:
        plan_step.canary_plan_step(**{**_plan_call_kwargs(), name: value})
    assert type(info.value) is exc and str(info.value) == message
