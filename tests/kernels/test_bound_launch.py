"""The bound launches (``canary_check_bind`` / ``canary_write_bind`` behind ops.CheckLaunch / ops.WriteLaunch, and the
sweep's SweepLaunch over ``canary_verify_step``'s laid-out arguments) equal the keyword exports they stand for.

* Bit-identical results: on random cases (extend, decode, padding rows, corrupted records: violations), a few
  forwards in a row through the bound function leave exactly what the same forwards through
  ``ops.canary_check_step`` / ``ops.canary_write_step`` leave (state header, ring, metadata, write plan, snapshots,
  records, attribution).
* Errors: a malformed per-forward argument through the bound path raises the same named error as the keyword export;
  a bad fixed argument (one tvm-ffi cannot take, or one the export's checks refuse) raises at binding, as the export
  would name it: the bind validates the fixed arguments once.
* Ownership: the bound function keeps its fixed tensors alive after every Python reference is dropped.
* CUDA: a captured graph of the bound check + write replays on the capturing stream.
"""

from __future__ import annotations

import functools
import gc
import random
import types
from collections import Counter
from typing import Any

import pytest
import torch
from canary_cases import (
    RESULT_KEYS,
    capture_after_warmup,
    random_sources,
    random_verify_launch,
    random_write_launch,
    write_state_args,
)
from test_check import _mirror, assert_same, random_check_case, run_fused

from kvcanary.kernels import layout
from kvcanary.kernels.call import load_module, real_kv_launch_args
from kvcanary.kernels.check import CheckLaunch, canary_check_step
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.kernels.verify import SweepLaunch, canary_verify_step
from kvcanary.kernels.write import WriteLaunch, canary_write_step

SCENARIOS = 60
H = layout.STATE_HEADER_FIELDS
CHECK_PER_FORWARD = ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")
CHECK_FLAGS = ("new_forward", "forward_step_value")
WRITE_PER_FORWARD = ("input_ids", "positions", "out_cache_loc")


# ---------------------------------------------------------------------------------------------- check


def _decode_batch(kw: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A decode forward over the case's first rows (extend 1 each), as many as its snapshot buffers hold."""
    rows = min(kw["req_pool_indices"].shape[0], kw["input_ids_out"].shape[0])
    device = kw["req_pool_indices"].device  # (the case's: CPU or CUDA)
    tokens = torch.arange(100, 100 + rows, device=device)
    return {
        "req_pool_indices": kw["req_pool_indices"][:rows],
        "prefix_lens": kw["prefix_lens"][:rows],
        "extend_lens": torch.ones(rows, dtype=kw["extend_lens"].dtype, device=device),
        "input_ids": tokens.to(kw["input_ids"].dtype),
        "positions": kw["prefix_lens"][:rows].to(kw["positions"].dtype),
        "out_cache_loc": (tokens % 7).to(kw["out_cache_loc"].dtype),
    }


def _check_forwards(kw: dict[str, Any]) -> list[tuple[dict[str, torch.Tensor], bool, int]]:
    """(batch, new_forward, forward_step_value) of three forwards: the case's, a decode, the case's uncounted."""
    case_batch = {k: kw[k] for k in CHECK_PER_FORWARD}
    return [(case_batch, kw["new_forward"], kw["forward_step_value"]), (_decode_batch(kw), True, -1),
            (case_batch, False, -1)]


def _check_unbound(**kw: Any) -> None:
    for batch, new_forward, step in _check_forwards(kw):
        canary_check_step(**{**kw, **batch, "new_forward": new_forward, "forward_step_value": step})


def _check_bound(**kw: Any) -> None:
    launch = CheckLaunch(**{k: v for k, v in kw.items() if k not in CHECK_PER_FORWARD + CHECK_FLAGS})
    for batch, new_forward, step in _check_forwards(kw):
        launch(*(batch[k] for k in CHECK_PER_FORWARD), new_forward=new_forward, forward_step_value=step)


def _check_bound_of_batch(**kw: Any) -> None:
    """As _check_bound, through ``CheckLaunch.of_batch`` (the manager's per-forward call: the batch's arrays read from
    one object, the flags as ints)."""
    launch = CheckLaunch(**{k: v for k, v in kw.items() if k not in CHECK_PER_FORWARD + CHECK_FLAGS})
    for batch, new_forward, step in _check_forwards(kw):
        launch.of_batch(types.SimpleNamespace(**batch), int(new_forward), int(step))


BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _need(backend: str) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bound", [_check_bound, _check_bound_of_batch], ids=["call", "of_batch"])
def test_bound_check_equals_the_export(bound, backend: str) -> None:
    """CUDA too: the parameters the bind prepared once (the pinned mirror's device address among them, when given)
    launch exactly what the export's call launches."""
    _need(backend)
    appended = 0
    for scenario in range(SCENARIOS if backend == "cpu" else SCENARIOS // 4):
        case = random_check_case(random.Random(1000 + scenario))
        want = run_fused(_check_unbound, case, backend)
        got = run_fused(bound, case, backend)
        # (on CUDA the ring's row order is the order the atomics won: compared as multisets)
        assert_same(got, want, f"scenario {scenario}", ordered=backend == "cpu")
        appended += int(torch.count_nonzero(want["ring"][:, 0] != -7))
    assert appended > 0, "the scenarios must reach violations"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bound_check_writes_the_status_mirror(backend: str) -> None:
    """The mirror bound once (on CUDA its pinned memory's device address resolved at binding) gets each launch's
    finished header, as the export's call leaves it."""
    _need(backend)
    for scenario in range(8):
        case = random_check_case(random.Random(4000 + scenario))
        mirror, export_mirror = _mirror(backend), _mirror(backend)
        got = run_fused(functools.partial(_check_bound, status_mirror=mirror), case, backend)
        want = run_fused(functools.partial(_check_unbound, status_mirror=export_mirror), case, backend)
        assert_same(got, want, f"scenario {scenario}", ordered=backend == "cpu")
        assert mirror.tolist() == got["header"].tolist() == export_mirror.tolist(), f"scenario {scenario}"


# ---------------------------------------------------------------------------------------------- write


def _write_case(seed: int) -> dict[str, Any]:
    """A write launch's keywords (input assert off: WriteLaunch has none) with snapshot buffers longer than the
    forward's tokens, sometimes with the kvcanary+ attribution arguments."""
    rng = random.Random(seed)
    launch = random_write_launch(rng)
    kw = dict(launch.kwargs, enable_write_input_assert=False, expected_input_tokens=None,
              expected_input_positions=None, real_kv_sources=tuple(launch.sources))
    pad = rng.choice([0, 1, 5])
    for name in WRITE_PER_FORWARD:
        kw[name] = torch.cat([kw[name], torch.full((pad,), 3, dtype=torch.int64)])
    kw["num_tokens"] = launch.kwargs["input_ids"].shape[0]
    cap = kw["write_seed_slot_indices"].shape[0]
    kw["write_request_rows"] = None
    if rng.random() < 0.6:
        serial_rows = rng.randint(1, 6)
        kw["write_request_rows"] = torch.tensor([rng.randrange(serial_rows) for _ in range(cap)], dtype=torch.int64)
        kw["row_serials"] = torch.tensor([rng.randint(1, 999) for _ in range(serial_rows)], dtype=torch.int64)
        kw["violation_meta"] = torch.full((kw["violation_ring"].shape[0], layout.VIOLATION_META_FIELDS), -7,
                                          dtype=torch.int64)
        kw["forward_step"] = torch.tensor([rng.randint(0, 99)], dtype=torch.int64)
        kw["slot_attribution"] = torch.full((kw["canary_buf"].shape[0], layout.SLOT_ATTRIBUTION_FIELDS), -7,
                                            dtype=torch.int64)
    return kw


def _clone(kw: dict[str, Any]) -> dict[str, Any]:
    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out["real_kv_sources"] = tuple(RealKvSource(s.tensor.clone(), s.page_size, s.num_bytes_per_token, s.read_bytes)
                                   for s in kw["real_kv_sources"])
    return out


def _token_counts(kw: dict[str, Any]) -> list[int]:
    """The forward's count twice (the second call reuses the cached slices), then one fewer: a plan entry past
    the tokens (an out-of-range row) whenever the plan used the last token."""
    n = kw["num_tokens"]
    return [n, n, max(n - 1, 0)]


def _write_unbound(kw: dict[str, Any]) -> None:
    args = {k: v for k, v in kw.items() if k != "num_tokens"}
    for n in _token_counts(kw):
        canary_write_step(**{**args, **{k: kw[k][:n] for k in WRITE_PER_FORWARD}})


def _write_launch(kw: dict[str, Any]) -> WriteLaunch:
    plan = WritePlan(kw["write_offsets"], kw["write_seed_slot_indices"], kw["write_num_valid_reqs"],
                     torch.zeros_like(kw["write_offsets"]), kw["write_request_rows"])
    skip = {"num_tokens", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs", "write_request_rows",
            "enable_write_input_assert", "expected_input_tokens", "expected_input_positions"}
    return WriteLaunch(write_plan=plan, **{k: v for k, v in kw.items() if k not in skip})


def _write_bound(kw: dict[str, Any]) -> None:
    launch = _write_launch(kw)
    for n in _token_counts(kw):
        launch(n)


WRITE_RESULTS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter",
                 "violation_meta", "slot_attribution")


def _to(kw: dict[str, Any], backend: str) -> dict[str, Any]:
    if backend == "cpu":
        return kw
    out = {k: v.to(backend) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out["real_kv_sources"] = tuple(RealKvSource(s.tensor.to(backend), s.page_size, s.num_bytes_per_token,
                                                s.read_bytes) for s in kw["real_kv_sources"])
    return out


def _assert_same_ring_rows(a: dict[str, Any], b: dict[str, Any], ctx: str) -> None:
    """The write's ring rows (each with its metadata row) as multisets, unless the ring overflowed: on CUDA which
    rows a full ring keeps depends on which atomics won. A CUDA failure of the in-order compare under memcheck
    (launches serialised, another order of the atomics: the H200, 2026-12-03) is what this allows."""
    ring = a["violation_ring"]
    if (int(a["violation_write_index"][0]) & 0xFFFFFFFF) > ring.shape[0]:
        return

    def rows(r: dict[str, Any]) -> Counter:
        metas = r["violation_meta"].tolist() if r.get("violation_meta") is not None else [[]] * ring.shape[0]
        return Counter(tuple(x) + tuple(m) for x, m in zip(r["violation_ring"].tolist(), metas, strict=True))

    assert rows(a) == rows(b), f"ring rows differ ({ctx})"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bound_write_equals_the_export(backend: str) -> None:
    _need(backend)
    violations = 0
    for scenario in range(SCENARIOS if backend == "cpu" else SCENARIOS // 4):
        case = _to(_write_case(2000 + scenario), backend)
        want, got = _clone(case), _clone(case)
        _write_unbound(want)
        _write_bound(got)
        ordered = backend == "cpu"  # (on CUDA the ring's row order is the order the atomics won)
        for name in WRITE_RESULTS:
            if name in case and (ordered or name not in ("violation_ring", "violation_meta")):
                assert torch.equal(got[name], want[name]), f"{name} differs (scenario {scenario})"
        if not ordered:
            _assert_same_ring_rows(got, want, f"scenario {scenario}")
        violations += int(want["violation_write_index"][0]) - int(case["violation_write_index"][0])
    assert violations > 0, "the scenarios must reach violations"


# ---------------------------------------------------------------------------------------------- errors


def _small_check_case() -> dict[str, Any]:
    kw = random_check_case(random.Random(7), bs_max=3)
    kw["write_plan"] = WritePlan.allocate(kw.pop("write_capacity"), "cpu")
    kw["real_kv_sources"] = tuple(kw.pop("sources"))
    return kw


def _raised(fn: Any) -> Exception:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def _check_bad_batches() -> list[tuple[str, Any]]:
    return [("req_pool_indices", None), ("prefix_lens", [0]), ("extend_lens", torch.empty(1, device="meta")),
            ("input_ids", torch.ones(1, dtype=torch.float32)), ("positions", torch.ones(99, dtype=torch.int64)),
            ("out_cache_loc", torch.ones(1, dtype=torch.uint8)), ("new_forward", 2), ("forward_step_value", None)]


@pytest.mark.parametrize("call", ["bound", "of_batch"])
@pytest.mark.parametrize(("name", "value"), _check_bad_batches(), ids=lambda v: v if isinstance(v, str) else "")
def test_bound_check_names_a_bad_batch_like_the_export(name: str, value: Any, call: str) -> None:
    """Called with the per-forward tensors, or with a batch holding them (``of_batch``, the eager path)."""
    kw = _small_check_case()
    want = _raised(lambda: canary_check_step(**{**kw, name: value}))
    bad = {**kw, name: value}
    launch = CheckLaunch(**{k: v for k, v in kw.items() if k not in CHECK_PER_FORWARD + CHECK_FLAGS})
    if call == "bound":
        got = _raised(lambda: launch(*(bad[k] for k in CHECK_PER_FORWARD), new_forward=bad["new_forward"],
                                     forward_step_value=bad["forward_step_value"]))
    else:
        batch = types.SimpleNamespace(**{k: bad[k] for k in CHECK_PER_FORWARD})
        got = _raised(lambda: launch.of_batch(batch, bad["new_forward"], bad["forward_step_value"]))
    assert type(got) is type(want) and str(got) == str(want)
    assert str(got).startswith(f"canary_check_step: {name}: ")


@pytest.mark.parametrize("name", ["state", "req_to_token", "input_ids_out", "expected_tokens"])
@pytest.mark.parametrize("kind", ["list", "meta"])
def test_bound_check_names_a_bad_fixed_argument_at_binding(name: str, kind: str) -> None:
    kw = {**_small_check_case(), "expected_tokens": torch.zeros((2, 3), dtype=torch.int32),
          "expected_valid_lens_by_row": torch.zeros(2, dtype=torch.int64)}
    value = kw[name].tolist() if kind == "list" else torch.empty(kw[name].shape, device="meta")
    bad = {**kw, name: value}
    want = _raised(lambda: canary_check_step(**bad))
    got = _raised(lambda: CheckLaunch(**{k: v for k, v in bad.items()
                                             if k not in CHECK_PER_FORWARD + CHECK_FLAGS}))
    assert type(got) is type(want) and str(got) == str(want)
    assert str(got).startswith(f"canary_check_step: {name}: ")


def _check_bad_fixed() -> list[tuple[str, Any]]:
    """Fixed arguments tvm-ffi takes but the export's checks refuse (wrong dtype, shape or value)."""
    return [("state", lambda kw: kw["state"].to(torch.int32)), ("state", lambda kw: kw["state"][:-1]),
            ("canary_buf", lambda kw: kw["canary_buf"][:, :8]), ("req_to_token", lambda kw: kw["req_to_token"].long()),
            ("input_ids_out", lambda kw: kw["input_ids_out"].to(torch.int32)),
            ("swa_window_size", lambda kw: -1), ("check_tokens", lambda kw: 2),
            ("violation_meta", lambda kw: kw["violation_meta"][:, :1].contiguous())]


@pytest.mark.parametrize(("name", "make"), _check_bad_fixed(), ids=lambda v: v if isinstance(v, str) else "")
def test_bound_check_refuses_a_bad_fixed_argument_at_binding(name: str, make: Any) -> None:
    """The bind validates the fixed arguments once (a forward's call checks only its own arrays): one the export
    refuses raises when the launch is bound, with the export's error, before any forward."""
    kw = _small_check_case()
    bad = {**kw, name: make(kw)}
    want = _raised(lambda: canary_check_step(**bad))
    got = _raised(lambda: CheckLaunch(**{k: v for k, v in bad.items() if k not in CHECK_PER_FORWARD + CHECK_FLAGS}))
    assert type(got) is type(want) and str(got) == str(want)
    assert str(got).startswith(f"canary_check_step: {name}: ")


@pytest.mark.gpu
def test_bound_check_refuses_a_pageable_status_mirror_at_binding() -> None:
    """On CUDA the bind resolves the pinned mirror's device address once: pageable memory is refused at binding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _small_check_case().items()}
    kw["write_plan"] = WritePlan.allocate(kw["write_plan"].write_seed_slot_indices.shape[0], "cuda")
    kw["real_kv_sources"] = tuple(RealKvSource(s.tensor.cuda(), s.page_size, s.num_bytes_per_token, s.read_bytes)
                                  for s in kw["real_kv_sources"])
    kw["status_mirror"] = torch.zeros(H, dtype=torch.int64)  # pageable
    with pytest.raises(ValueError, match=r"^canary_check_step: status_mirror: expected pinned host memory"):
        CheckLaunch(**{k: v for k, v in kw.items() if k not in CHECK_PER_FORWARD + CHECK_FLAGS})


@pytest.mark.parametrize(("name", "value"), [
    ("input_ids", torch.zeros(8, dtype=torch.int32)), ("positions", torch.empty(8, dtype=torch.int64, device="meta")),
    ("out_cache_loc", torch.zeros((8, 1), dtype=torch.int64)),
], ids=["dtype", "meta", "shape"])
def test_bound_write_names_bad_snapshots_like_the_export(name: str, value: torch.Tensor) -> None:
    kw = _write_case(5)
    n = kw["num_tokens"]
    args = {k: v for k, v in kw.items() if k != "num_tokens"}
    want = _raised(lambda: canary_write_step(**{**args, **{k: kw[k][:n] for k in WRITE_PER_FORWARD},
                                                    name: value[:n]}))
    launch = _write_launch({**kw, name: value})
    got = _raised(lambda: launch(n))
    assert type(got) is type(want) and str(got) == str(want)
    assert str(got).startswith(f"canary_write_step: {name}: ")


@pytest.mark.parametrize("name", ["write_offsets", "violation_ring", "enable_chain_position_assert", "forward_step"])
def test_bound_write_names_a_bad_fixed_argument_at_binding(name: str) -> None:
    kw = _write_case(5)
    kw.setdefault(name, torch.zeros(1, dtype=torch.int64))
    meta = torch.empty(kw[name].shape, dtype=kw[name].dtype, device="meta")
    args = {k: v for k, v in kw.items() if k != "num_tokens"}
    want = _raised(lambda: canary_write_step(**{**args, name: meta}))
    got = _raised(lambda: _write_launch({**kw, name: meta}))
    assert type(got) is type(want) and str(got) == str(want)
    assert str(got).startswith(f"canary_write_step: {name}: ")


@pytest.mark.parametrize(("name", "make"), [
    ("write_offsets", lambda t: t.to(torch.int32)), ("violation_ring", lambda t: t[:, :3].contiguous()),
    ("slot_run_counter", lambda t: t.to(torch.int32)), ("enable_chain_position_assert", lambda t: t.repeat(2)),
], ids=["dtype", "shape", "counter-dtype", "flag-shape"])
def test_bound_write_refuses_a_bad_fixed_argument_at_binding(name: str, make: Any) -> None:
    """The bind validates the fixed arguments once (a forward's call checks only its three token arrays): one the
    export refuses raises when the launch is bound, with the export's error."""
    kw = _write_case(5)
    n = kw["num_tokens"]
    bad = {**kw, name: make(kw[name])}
    args = {k: v for k, v in bad.items() if k != "num_tokens"}
    want = _raised(lambda: canary_write_step(**{**args, **{k: kw[k][:n] for k in WRITE_PER_FORWARD}}))
    got = _raised(lambda: _write_launch(bad))
    assert type(got) is type(want) and str(got) == str(want)
    assert str(got).startswith(f"canary_write_step: {name}: ")


# ---------------------------------------------------------------------------------------------- ownership


def _overwrite_freed_memory() -> list[torch.Tensor]:
    """Allocations that reuse what was just freed, filled with garbage (kept alive until the next launch ran)."""
    return [torch.full((n,), 0x5A, dtype=torch.uint8) for n in (64, 256, 1024, 4096, 16384) for _ in range(8)]


# CheckLaunch / WriteLaunch keep Python references to their fixed arguments (to name errors), so these tests
# call the raw binds, whose returned functions are the only owners once the test drops its references.
def _check_bind_args(kw: dict[str, Any]) -> tuple:
    """canary_check_bind's positional arguments (the export's ABI, csrc/canary_check.cuh)."""
    bufs, params, num_sources = real_kv_launch_args(kw.pop("real_kv_sources"), torch.device("cpu"))
    plan = kw["write_plan"]
    # canary_buf: a copy only the bind owns (the results read the case's, which the check never writes)
    return (kw["state"], kw.get("status_mirror"), kw["violation_meta"], kw["slot_attribution"],
            kw["canary_buf"].clone(), plan.write_offsets,
            plan.write_seed_slot_indices, plan.write_num_valid_reqs, plan.write_request_rows, kw.pop("req_to_token"),
            kw["swa_window_size"], kw.pop("full_to_swa_index_mapping"), kw.pop("expected_tokens"),
            kw.pop("expected_valid_lens_by_row"), kw.pop("token_mail", None), kw.pop("token_mail_published", None),
            kw["kv_token_id_vs_position_offset"], kw["input_ids_out"],
            kw["positions_out"], kw["out_cache_loc_out"], *bufs, params, num_sources, kw["real_kv_hash_mode"],
            int(kw["check_tokens"]), None, None)  # (no deferred write)


def _check_through_the_raw_bind(**kw: Any) -> None:
    forwards = _check_forwards(kw)
    bound = load_module("cpu").canary_check_bind(*_check_bind_args(kw))  # pops the inputs the check only reads
    gc.collect()
    garbage = _overwrite_freed_memory()
    for batch, new_forward, step in forwards:
        bound(*(batch[k] for k in CHECK_PER_FORWARD), int(new_forward), step, -1)  # (-1: no pending write)
    del garbage


def test_bound_check_keeps_its_fixed_tensors_alive() -> None:
    """The inputs the check only reads (records, table, LUT, token table, real-KV bytes) lose every Python
    reference but the bound function's; it still reads the same bytes."""
    for scenario in range(8):
        case = random_check_case(random.Random(3000 + scenario))
        want = run_fused(_check_unbound, case, "cpu")
        got = run_fused(_check_through_the_raw_bind, case, "cpu")
        assert_same(got, want, f"scenario {scenario}", ordered=True)


def _write_bind_args(kw: dict[str, Any]) -> tuple:
    """canary_write_bind's positional arguments (the export's ABI, csrc/canary_write.cuh); pops the inputs the write
    only reads."""
    bufs, params, num_sources = real_kv_launch_args(kw.pop("real_kv_sources"), torch.device("cpu"))
    return (kw["canary_buf"], kw.pop("write_offsets"), kw.pop("write_seed_slot_indices"),
            kw.pop("write_num_valid_reqs"), kw["kernel_kind"], 0, None, None, kw["violation_ring"],
            kw["violation_write_index"], kw["slot_run_counter"], kw["kernel_run_counter"],
            kw.pop("enable_chain_position_assert"), *bufs, params, num_sources, kw["real_kv_hash_mode"],
            kw.get("violation_meta"), kw.pop("forward_step", None), kw.pop("write_request_rows"),
            kw.get("slot_attribution"), kw.pop("row_serials", None))


def test_bound_write_keeps_its_fixed_tensors_alive() -> None:
    """The plan, the flags and the real-KV bytes lose every Python reference but the bound function's."""
    for scenario in range(8):
        case = _write_case(4000 + scenario)
        case["real_kv_sources"] = tuple(random_sources(random.Random(scenario), case["canary_buf"].shape[0], 2))
        want, got = _clone(case), _clone(case)
        _write_unbound(want)
        counts = _token_counts(got)
        bound = load_module("cpu").canary_write_bind(*_write_bind_args(got))
        gc.collect()
        garbage = _overwrite_freed_memory()
        for n in counts:
            bound(*(got[k][:n] for k in WRITE_PER_FORWARD))
        del garbage
        for name in WRITE_RESULTS:
            if name in case:
                assert torch.equal(got[name], want[name]), f"{name} differs (scenario {scenario})"


# ---------------------------------------------------------------------------------------------- CUDA graph


@pytest.mark.gpu
def test_bound_launches_capture_on_the_current_cuda_stream() -> None:
    """check + write through the bound functions captured once; each replay counts one forward: the launches went
    to the capturing stream (a launch on another stream would have run at capture time instead)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = "cuda"
    case = _small_check_case()
    case.update(expected_tokens=None, expected_valid_lens_by_row=None, check_tokens=False)
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    kw["write_plan"] = WritePlan.allocate(case["write_plan"].capacity, dev)
    kw["real_kv_sources"] = ()
    state = kw["state"]
    state[layout.STATE_DRAINED_TO] = -1
    check = CheckLaunch(**{k: v for k, v in kw.items() if k not in CHECK_PER_FORWARD + CHECK_FLAGS})
    write_tag = layout.LAUNCH_TAG_WRITE
    write = WriteLaunch(
        canary_buf=kw["canary_buf"], write_plan=kw["write_plan"], input_ids=kw["input_ids_out"],
        positions=kw["positions_out"], out_cache_loc=kw["out_cache_loc_out"], kernel_kind=write_tag,
        **write_state_args(state, chain_position_assert=False),
    )
    n = kw["input_ids"].shape[0]

    def forward() -> None:
        check(*(kw[k] for k in CHECK_PER_FORWARD), new_forward=True, forward_step_value=-1)
        write(n)

    graph = capture_after_warmup(forward)
    before = state[:H].cpu().tolist()
    for replay in (1, 2):
        graph.replay()
        torch.cuda.synchronize()
        header = state[:H].cpu().tolist()
        assert header[layout.STATE_FORWARD] == before[layout.STATE_FORWARD] + replay
        assert header[layout.STATE_KERNEL_RUNS + write_tag] == before[layout.STATE_KERNEL_RUNS + write_tag] + replay


# ---------------------------------------------------------------------------------------------- sweep (verify)

PLAN_FIELDS = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
               "verify_prev_slot_indices", "verify_num_valid", "verify_enable")


def _sweep_launch(kw: dict[str, Any]) -> tuple[SweepLaunch, VerifyPlan]:
    fixed = {k: v for k, v in kw.items() if k not in PLAN_FIELDS}
    return SweepLaunch(**fixed), VerifyPlan(**{k: kw[k] for k in PLAN_FIELDS})


@pytest.mark.parametrize("seed", range(40))
def test_sweep_launch_equals_the_export(seed: int) -> None:
    """The laid-out launch over a plan leaves exactly what ``canary_verify_step`` leaves with the same arguments,
    called twice (the second call reuses the laid-out arguments), on the same plan as on another."""
    launch = random_verify_launch(random.Random(seed))
    direct, bound = launch.clone_to("cpu"), launch.clone_to("cpu")
    canary_verify_step(**direct)
    canary_verify_step(**direct)
    sweep, plan = _sweep_launch(bound)
    sweep(plan)
    sweep(VerifyPlan(**{k: bound[k] for k in PLAN_FIELDS}))  # another plan object over the same tensors
    for key in RESULT_KEYS:
        assert torch.equal(direct[key], bound[key]), key


def test_sweep_launch_names_a_bad_plan_like_the_export() -> None:
    launch = random_verify_launch(random.Random(7))
    kw = launch.clone_to("cpu")
    kw["verify_prev_slot_indices"] = kw["verify_prev_slot_indices"].to(torch.int32)
    with pytest.raises(TypeError) as exported:
        canary_verify_step(**kw)
    sweep, plan = _sweep_launch(kw)
    with pytest.raises(TypeError) as laid_out:
        sweep(plan)
    assert "verify_prev_slot_indices" in str(exported.value)
    assert str(laid_out.value) == str(exported.value)
