"""The typed wrappers name every argument they cannot pass on: ``None`` where a tensor is required, a Python list,
a meta tensor, a non-integer flag. Each gives a ``TypeError`` / ``ValueError`` whose message starts with
``"<fn>: <argument>: "`` (like the C++ checks), not tvm-ffi's positional message or torch's C++ stack.

The check runs only when a call fails (kvcanary.kernels.call), so a valid call pays nothing; these tests also pin that
an invalid argument the C++ layer names (a wrong dtype) still reaches the caller unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcanary.kernels import layout, plan_step, verify, write
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.real_kv import RealKvSource

NUM_SLOTS = 16
RING = 4


def i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _sinks() -> dict[str, torch.Tensor]:
    return {
        "violation_ring": torch.zeros((RING, layout.VIOLATION_FIELDS), dtype=torch.int64),
        "violation_write_index": i32(0),
        "slot_run_counter": i64(0),
        "kernel_run_counter": i64(0),
        "violation_meta": torch.zeros((RING, layout.VIOLATION_META_FIELDS), dtype=torch.int64),
        "forward_step": i64(3),
        "slot_attribution": torch.zeros((NUM_SLOTS, layout.SLOT_ATTRIBUTION_FIELDS), dtype=torch.int64),
    }


def _sources() -> tuple[RealKvSource, ...]:
    return (RealKvSource(torch.zeros((NUM_SLOTS, 32), dtype=torch.uint8), 1, 32, 32),)


def write_kwargs() -> dict[str, Any]:
    return {
        "canary_buf": torch.zeros((NUM_SLOTS, 32), dtype=torch.uint8),
        "write_offsets": i64(0, 2, 4),
        "write_seed_slot_indices": i64(-1, -1),
        "write_num_valid_reqs": i32(2),
        "input_ids": i64(11, 12, 21, 22),
        "positions": i64(0, 1, 0, 1),
        "out_cache_loc": i64(1, 2, 3, 4),
        "kernel_kind": 1,
        "enable_write_input_assert": True,
        "expected_input_tokens": i64(11, 12, 21, 22),
        "expected_input_positions": i64(0, 1, 0, 1),
        "enable_chain_position_assert": i32(1),
        "real_kv_sources": _sources(),
        "real_kv_hash_mode": layout.REAL_KV_HASH_MODE_ALL,
        "write_request_rows": i64(1, 2),
        "row_serials": i64(0, 10, 20),
        **_sinks(),
    }


def verify_kwargs() -> dict[str, Any]:
    return {
        "canary_buf": torch.zeros((NUM_SLOTS, 32), dtype=torch.uint8),
        "verify_slot_indices": i64(1, 2, 3, 4),
        "verify_expected_tokens": i64(-1, -1, -1, -1),
        "verify_expected_positions": i64(0, 1, 2, 3),
        "verify_prev_slot_indices": i64(-1, 1, 2, 3),
        "verify_num_valid": i32(0),
        "verify_enable": i32(1),
        "kernel_kind": 0,
        "real_kv_sources": _sources(),
        "real_kv_hash_mode": layout.REAL_KV_HASH_MODE_ALL,
        "check_tokens": True,
        "verify_request_rows": i64(1, 1, 1, 1),
        **_sinks(),
    }


def plan_kwargs() -> dict[str, Any]:
    return {
        "write_plan": WritePlan.allocate(2, "cpu"),
        "verify_plan": VerifyPlan.allocate(8, "cpu"),
        "req_pool_indices": i64(1, 0),
        "prefix_lens": i64(2, 0),
        "extend_lens": i64(1, 0),
        "req_to_token": torch.tensor([[0, 0, 0], [5, 6, 7]], dtype=torch.int32),
        "swa_window_size": 0,
        "full_to_swa_index_mapping": torch.arange(NUM_SLOTS, dtype=torch.int64),
        "expected_tokens": torch.zeros((2, 3), dtype=torch.int32),
        "expected_tokens_valid_lens": i64(3, 0),
        "kv_token_id_vs_position_offset": 0,
        "forward_counter": i64(0),
        "forward_step_value": 7,
    }


OPS: dict[str, tuple[Callable[..., None], Callable[[], dict[str, Any]]]] = {
    "canary_write_step": (write.canary_write_step, write_kwargs),
    "canary_verify_step": (verify.canary_verify_step, verify_kwargs),
    "canary_plan_step": (plan_step.canary_plan_step, plan_kwargs),
}
OPTIONAL = {"expected_input_tokens", "expected_input_positions", "full_to_swa_index_mapping", "expected_tokens",
            "expected_tokens_valid_lens", "forward_counter", "violation_meta", "forward_step", "slot_attribution",
            "write_request_rows", "row_serials", "verify_request_rows"}


def _tensor_cases() -> list[Any]:
    out = []
    for fn, (_, make) in OPS.items():
        for name, value in make().items():
            if isinstance(value, torch.Tensor):
                out.append(pytest.param(fn, name, id=f"{fn}-{name}"))
    return out


def _int_cases() -> list[Any]:
    out = []
    for fn, (_, make) in OPS.items():
        for name, value in make().items():
            if isinstance(value, int):
                out.append(pytest.param(fn, name, id=f"{fn}-{name}"))
    return out


def _expect(fn: str, kwargs: dict[str, Any], exc: type[Exception], arg: str, text: str) -> None:
    call = OPS[fn][0]
    with pytest.raises(exc) as info:
        call(**kwargs)
    assert type(info.value) is exc
    message = str(info.value)
    assert re.match(re.escape(f"{fn}: {arg}: ") + ".*" + re.escape(text), message), message
    assert "frame #" not in message and "Mismatched type" not in message, message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained C++ / tvm-ffi trace


def test_valid_calls_run() -> None:
    for call, make in OPS.values():
        call(**make())


@pytest.mark.parametrize(("fn", "name"), _tensor_cases())
def test_none_list_and_meta_tensor_are_named(fn: str, name: str) -> None:
    make = OPS[fn][1]
    value = make()[name]
    if name not in OPTIONAL:
        _expect(fn, {**make(), name: None}, TypeError, name, "expected a torch.Tensor, got None")
    _expect(fn, {**make(), name: value.tolist()}, TypeError, name, "expected a torch.Tensor, got list")
    meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
    _expect(fn, {**make(), name: meta}, ValueError, name, "expected a cpu or cuda tensor, got a tensor on device meta")


@pytest.mark.parametrize(("fn", "name"), _int_cases())
def test_non_integer_flags_are_named(fn: str, name: str) -> None:
    make = OPS[fn][1]
    _expect(fn, {**make(), name: None}, TypeError, name, "expected an int, got NoneType")
    _expect(fn, {**make(), name: [1]}, TypeError, name, "expected an int, got list")


@pytest.mark.parametrize("fn", ["canary_write_step", "canary_verify_step"])
def test_real_kv_sources_not_a_sequence_is_named(fn: str) -> None:
    _expect(fn, {**OPS[fn][1](), "real_kv_sources": None}, TypeError, "real_kv_sources",
            "expected a sequence of RealKvSource or a RealKvLaunch, got NoneType")


@pytest.mark.parametrize("plan", ["write_plan", "verify_plan"])
def test_plan_fields_are_named(plan: str) -> None:
    kwargs = plan_kwargs()
    field = "write_offsets" if plan == "write_plan" else "verify_slot_indices"
    broken = dataclasses.replace(kwargs[plan], **{field: None})
    _expect("canary_plan_step", {**kwargs, plan: broken}, TypeError, f"{plan}.{field}",
            "expected a torch.Tensor, got None")
    meta = dataclasses.replace(kwargs[plan], **{field: torch.empty(3, dtype=torch.int64, device="meta")})
    _expect("canary_plan_step", {**kwargs, plan: meta}, ValueError, f"{plan}.{field}", "tensor on device meta")
    with pytest.raises(TypeError, match=f"^canary_plan_step: {plan}: expected "):
        plan_step.canary_plan_step(**{**kwargs, plan: object()})


def test_errors_the_kernels_name_pass_through_unchanged() -> None:
    with pytest.raises(TypeError, match=r"^canary_write_step: positions: expected dtype int64, got int32"):
        write.canary_write_step(**{**write_kwargs(), "positions": i32(0, 1, 0, 1)})
    with pytest.raises(ValueError, match=r"^canary_verify_step: violation_meta: expected shape \[ring_capacity=4, 4\]"):
        verify.canary_verify_step(**{**verify_kwargs(), "violation_meta": torch.zeros((3, 4), dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"^canary_write_step: row_serials: needs write_request_rows"):
        write.canary_write_step(**{**write_kwargs(), "write_request_rows": None})
    with pytest.raises(ValueError, match=r"^canary_write_step: slot_attribution: expected shape \[num_slots=16, 2\]"):
        write.canary_write_step(**{**write_kwargs(), "slot_attribution": torch.zeros((15, 2), dtype=torch.int64)})
    kwargs = plan_kwargs()
    with pytest.raises(ValueError, match=r"^canary_plan_step: verify_request_rows: expected shape \[verify_capacity=8"):
        vp = dataclasses.replace(kwargs["verify_plan"], verify_request_rows=torch.zeros(7, dtype=torch.int64))
        plan_step.canary_plan_step(**{**kwargs, "verify_plan": vp})
