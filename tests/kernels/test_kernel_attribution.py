"""kvcanary+ kernel arguments: violation metadata, request rows, writer attribution, the forward counter and the
int32 expected-token table (csrc/canary_write.cuh, canary_verify.cuh, canary_plan.cuh; include/kvcanary/violation.h).

* With every new argument given, records, ring rows and counters stay bit-exact with the seed call (random
  scenarios of the differential suite, CPU and CUDA).
* The attribution table after a write is what the launch implies (every stored record: forward counter and the
  serial of its request's row), and each metadata row describes its ring row (counter value, request row, the
  slot's attribution before the launch).
* The plan writes each batch row's and each verify entry's req_to_token row (checked against
  kvcanary.kernels.plan_step_ref by tests/kernels/test_plan.py), counts a forward, and gives the same plan for an int32
  and an int64 token table.
* The raw exports: the seed ABI keeps its argument count; the ``*_attributed`` exports take the new ones after it.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from canary_cases import Launch, random_verify_launch, random_write_launch
from test_plan import random_plan_case, run_plan

from kvcanary.kernels import layout, plan_step, verify
from kvcanary.kernels.jit import load_module
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.write import canary_write_step

SCENARIOS = 300
CHUNKS = 3  # ids like [0-cuda]: integration/gpu_check.sh runs chunks 0 and 1 under compute-sanitizer memcheck
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SENTINEL = -7  # what canary_cases fills the ring with: rows still holding it were not stored by the launch
UNKNOWN = layout.META_UNKNOWN


def _skip_unavailable(backend: str) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _attribution_args(rng: random.Random, num_slots: int, ring_capacity: int, device: str) -> dict[str, torch.Tensor]:
    """Metadata table (sentinel-filled), a forward counter and a slot attribution table with prior writers."""
    attribution = torch.tensor(
        [[UNKNOWN, UNKNOWN] if rng.random() < 0.3 else [rng.randint(1, 999), rng.randint(1, 999)]
         for _ in range(num_slots)], dtype=torch.int64,
    ).view(num_slots, layout.SLOT_ATTRIBUTION_FIELDS)
    return {
        "violation_meta": torch.full((ring_capacity, layout.VIOLATION_META_FIELDS), SENTINEL, dtype=torch.int64,
                                     device=device),
        "forward_step": torch.tensor([rng.randint(1, 1 << 40)], dtype=torch.int64, device=device),
        "slot_attribution": attribution.to(device),
    }


def _run(fn, kwargs: dict) -> dict[str, torch.Tensor]:
    fn(**kwargs)
    _sync(str(kwargs["canary_buf"].device))
    return {k: v.cpu() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def _seed_results_equal(seed_out: dict, attributed_out: dict, device: str, ctx: str) -> None:
    for key in ("canary_buf", "violation_write_index", "slot_run_counter", "kernel_run_counter"):
        assert torch.equal(seed_out[key], attributed_out[key]), f"{key} differs with attribution on ({ctx})"
    ring_a, ring_b = seed_out["violation_ring"].tolist(), attributed_out["violation_ring"].tolist()
    if device == "cpu":
        assert ring_a == ring_b, f"ring differs with attribution on ({ctx})"
    elif int(seed_out["violation_write_index"][0]) > len(ring_a):
        # CUDA appends in any order, so once the ring overflows WHICH rows it keeps depends on which atomics won
        # (seen on the H200: one kept row differed between two identical launches); both keep a full ring.
        assert len(ring_a) == len(ring_b)
    else:  # CUDA appends in any order
        assert Counter(map(tuple, ring_a)) == Counter(map(tuple, ring_b)), f"ring differs ({ctx})"


# ---------------------------------------------------------------------------------------------- write


def _write_case(seed: int, device: str) -> tuple[Launch, dict, dict]:
    rng = random.Random(seed)
    launch = random_write_launch(rng)
    kwargs = launch.clone_to(device)
    num_slots = kwargs["canary_buf"].shape[0]
    cap = kwargs["write_seed_slot_indices"].shape[0]
    serial_rows = rng.randint(1, 6)
    extra = _attribution_args(rng, num_slots, kwargs["violation_ring"].shape[0], device)
    extra["write_request_rows"] = torch.tensor([rng.randint(-2, serial_rows + 1) for _ in range(cap)],
                                               dtype=torch.int64, device=device)
    extra["row_serials"] = torch.tensor([rng.randint(1, 1 << 20) for _ in range(serial_rows)], dtype=torch.int64,
                                        device=device)
    return launch, kwargs, extra


def _expected_write_attribution(kw: dict, extra: dict) -> torch.Tensor:
    """The attribution table a write must leave: every stored record gets (counter, serial of its request's row)."""
    table = extra["slot_attribution"].cpu().clone()
    offsets, locs = kw["write_offsets"].tolist(), kw["out_cache_loc"].tolist()
    rows, serials = extra["write_request_rows"].tolist(), extra["row_serials"].tolist()
    step = int(extra["forward_step"][0])
    num_slots, n = table.shape[0], len(locs)
    active = max(0, min(int(kw["write_num_valid_reqs"][0]), len(rows)))
    for r in range(active):
        begin, end = offsets[r], offsets[r + 1]
        if begin >= end or begin < 0 or end > n:
            continue
        serial = serials[rows[r]] if 0 <= rows[r] < len(serials) else UNKNOWN
        for e in range(begin, end):
            if 0 <= locs[e] < num_slots:
                table[locs[e]] = torch.tensor([step, serial])
    return table


def _requests_of_write_row(kw: dict, row: list[int]) -> set[int]:
    """Indices r of the requests that may have appended ``row`` (a slot can repeat only when out of range)."""
    offsets, locs = kw["write_offsets"].tolist(), kw["out_cache_loc"].tolist()
    seeds = kw["write_seed_slot_indices"].tolist()
    slot, position = row[layout.VIOLATION_COL_SLOT], row[layout.VIOLATION_COL_POSITION]
    bits = row[layout.VIOLATION_COL_FAIL_REASON_BITS]
    if bits == layout.REASON_SLOT_OUT_OF_RANGE and slot == layout.SKIP_WRITE_SLOT and position == -1:
        return {row[layout.VIOLATION_COL_STORED_CHAIN_HASH]}  # a bad range: the row carries r
    found = {r for r in range(len(seeds)) for e in range(max(offsets[r], 0), min(offsets[r + 1], len(locs)))
             if locs[e] == slot}
    if position == -1:
        found |= {r for r, s in enumerate(seeds) if s == slot}  # a bad seed
    return found


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_write_attribution_is_bit_exact_with_the_seed_and_fills_the_tables(backend: str, chunk: int) -> None:
    _skip_unavailable(backend)
    rows_checked = 0
    for seed in range(chunk * SCENARIOS // CHUNKS, (chunk + 1) * SCENARIOS // CHUNKS):
        launch, kw, extra = _write_case(seed, backend)
        before = extra["slot_attribution"].cpu().clone()
        seed_out = _run(canary_write_step, launch.clone_to(backend))
        out = _run(canary_write_step, {**kw, **extra})
        ctx = f"seed={seed} backend={backend}"
        _seed_results_equal(seed_out, out, backend, ctx)
        assert torch.equal(out["slot_attribution"], _expected_write_attribution(kw, extra)), ctx
        step = int(extra["forward_step"][0])
        request_rows = extra["write_request_rows"].tolist()
        for ring_row, meta in zip(out["violation_ring"].tolist(), out["violation_meta"].tolist(), strict=True):
            if ring_row == [SENTINEL] * layout.VIOLATION_FIELDS:
                assert meta == [SENTINEL] * layout.VIOLATION_META_FIELDS, ctx  # no row, no metadata
                continue
            rows_checked += 1
            assert meta[layout.VIOLATION_META_COL_STEP] == step, ctx
            candidates = _requests_of_write_row(kw, ring_row)
            assert meta[layout.VIOLATION_META_COL_REQUEST_ROW] in {request_rows[r] for r in candidates}, ctx
            slot = ring_row[layout.VIOLATION_COL_SLOT]
            # a bad seed or range is never an in-range slot; an entry's slot is: the writer before this launch
            want = before[slot].tolist() if 0 <= slot < before.shape[0] else [UNKNOWN, UNKNOWN]
            assert meta[layout.VIOLATION_META_COL_WRITTEN_STEP :] == want, ctx
    assert rows_checked > 30  # the scenarios do produce rows


def test_write_attribution_by_hand() -> None:
    """Request rows 5 and 7 (serials 50 and 70) write at forward 3; row 7 rewrites a slot of row 5 at forward 4
    with a wrong expected token: the row names request row 7 and the slot's previous writer (3, serial 50)."""
    canary = torch.zeros((16, 32), dtype=torch.uint8)
    attribution = torch.full((16, 2), UNKNOWN, dtype=torch.int64)
    meta = torch.full((4, layout.VIOLATION_META_FIELDS), SENTINEL, dtype=torch.int64)
    ring = torch.zeros((4, layout.VIOLATION_FIELDS), dtype=torch.int64)
    index = torch.zeros(1, dtype=torch.int32)
    serials = torch.zeros(8, dtype=torch.int64)
    serials[5], serials[7] = 50, 70

    def write(step: int, rows: list[int], offsets: list[int], tokens: list[int], locs: list[int], expected: list[int]):
        n = len(tokens)
        canary_write_step(
            canary_buf=canary, write_offsets=torch.tensor(offsets),
            write_seed_slot_indices=torch.full((len(rows),), -1),
            write_num_valid_reqs=torch.tensor([len(rows)], dtype=torch.int32), input_ids=torch.tensor(tokens),
            positions=torch.arange(n), out_cache_loc=torch.tensor(locs), kernel_kind=1, enable_write_input_assert=True,
            expected_input_tokens=torch.tensor(expected), expected_input_positions=torch.arange(n),
            violation_ring=ring, violation_write_index=index, slot_run_counter=torch.zeros(1, dtype=torch.int64),
            kernel_run_counter=torch.zeros(1, dtype=torch.int64),
            enable_chain_position_assert=torch.zeros(1, dtype=torch.int32), violation_meta=meta,
            forward_step=torch.tensor([step]), write_request_rows=torch.tensor(rows), slot_attribution=attribution,
            row_serials=serials,
        )

    write(3, [5, 7], [0, 2, 3], [10, 11, 20], [1, 2, 3], [10, 11, 20])
    assert int(index[0]) == 0
    assert attribution[1:4].tolist() == [[3, 50], [3, 50], [3, 70]]
    write(4, [7], [0, 1], [99], [2], [98])  # row 7 overwrites slot 2 (row 5's), token mismatch
    assert int(index[0]) == 1
    assert ring[0, layout.VIOLATION_COL_FAIL_REASON_BITS] == layout.REASON_WRITE_TOKEN
    assert meta[0].tolist() == [4, 7, 3, 50]  # step, request row, previous writer's step and serial
    assert attribution[2].tolist() == [4, 70]


# ---------------------------------------------------------------------------------------------- verify


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_verify_metadata_is_bit_exact_with_the_seed_and_describes_each_row(backend: str, chunk: int) -> None:
    _skip_unavailable(backend)
    rows_checked = 0
    for seed in range(chunk * SCENARIOS // CHUNKS, (chunk + 1) * SCENARIOS // CHUNKS):
        rng = random.Random(10**6 + seed)
        launch = random_verify_launch(rng)
        kw = launch.clone_to(backend)
        cap = kw["verify_slot_indices"].shape[0]
        extra = _attribution_args(rng, kw["canary_buf"].shape[0], kw["violation_ring"].shape[0], backend)
        extra["verify_request_rows"] = torch.arange(500, 500 + cap, dtype=torch.int64, device=backend)
        attribution = extra["slot_attribution"].cpu().clone()
        seed_out = _run(verify.canary_verify_step, launch.clone_to(backend))
        out = _run(verify.canary_verify_step, {**kw, **extra})
        ctx = f"seed={seed} backend={backend}"
        _seed_results_equal(seed_out, out, backend, ctx)
        assert torch.equal(out["slot_attribution"], attribution), f"verify wrote the attribution table ({ctx})"
        step = int(extra["forward_step"][0])
        slots = kw["verify_slot_indices"].tolist()
        for ring_row, meta in zip(out["violation_ring"].tolist(), out["violation_meta"].tolist(), strict=True):
            if ring_row == [SENTINEL] * layout.VIOLATION_FIELDS:
                assert meta == [SENTINEL] * layout.VIOLATION_META_FIELDS, ctx
                continue
            rows_checked += 1
            slot = ring_row[layout.VIOLATION_COL_SLOT]
            assert meta[layout.VIOLATION_META_COL_STEP] == step, ctx
            entries = {500 + e for e, s in enumerate(slots) if s == slot}
            assert meta[layout.VIOLATION_META_COL_REQUEST_ROW] in entries, ctx
            want = attribution[slot].tolist() if 0 <= slot < attribution.shape[0] else [UNKNOWN, UNKNOWN]
            assert meta[layout.VIOLATION_META_COL_WRITTEN_STEP :] == want, ctx
    assert rows_checked > 30


def test_metadata_arguments_are_optional_one_by_one() -> None:
    """Each kvcanary+ argument alone is accepted; what is missing reads as unknown (-1)."""
    launch = random_verify_launch(random.Random(10**6 + 3))
    kw = launch.clone_to("cpu")
    meta = torch.full((kw["violation_ring"].shape[0], layout.VIOLATION_META_FIELDS), SENTINEL, dtype=torch.int64)
    verify.canary_verify_step(**kw, violation_meta=meta)  # no step, no rows, no attribution
    kept = [m for m, r in zip(meta.tolist(), kw["violation_ring"].tolist(), strict=True)
            if r != [SENTINEL] * layout.VIOLATION_FIELDS]
    assert kept and all(m == [UNKNOWN] * layout.VIOLATION_META_FIELDS for m in kept)
    verify.canary_verify_step(**launch.clone_to("cpu"), forward_step=torch.tensor([5]))  # nothing to record into


# ---------------------------------------------------------------------------------------------- plan


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_expected_tokens_plan_equals_int64(backend: str) -> None:
    _skip_unavailable(backend)
    compared = 0
    for seed in range(SCENARIOS):
        case = random_plan_case(random.Random(seed))
        if case["expected_tokens"] is None:
            continue
        narrow = {**case, "expected_tokens": case["expected_tokens"].to(torch.int32)}
        wide_plans = run_plan(plan_step.canary_plan_step, case, backend)
        narrow_plans = run_plan(plan_step.canary_plan_step, narrow, backend)
        for a, b in zip(wide_plans, narrow_plans, strict=True):
            for name, t in a.__dict__.items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(t.cpu(), getattr(b, name).cpu()), f"{name} differs (seed={seed})"
        compared += 1
    assert compared > 50


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_sets_the_forward_counter_and_fills_request_rows(backend: str) -> None:
    _skip_unavailable(backend)
    table = torch.zeros((8, 6), dtype=torch.int32, device=backend)
    table[3, :4] = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    table[6, :2] = torch.tensor([21, 22], dtype=torch.int32)
    wp, vp = WritePlan.allocate(4, backend), VerifyPlan.allocate(16, backend)
    counter = torch.tensor([41], dtype=torch.int64, device=backend)
    i64 = {"dtype": torch.int64, "device": backend}
    for _ in range(3):
        plan_step.canary_plan_step(
            write_plan=wp, verify_plan=vp, req_pool_indices=torch.tensor([3, 0, 6], **i64),
            prefix_lens=torch.tensor([4, 0, 2], **i64), extend_lens=torch.tensor([1, 1, 1], **i64),
            req_to_token=table, forward_counter=counter,
        )
    _sync(backend)
    assert int(counter[0]) == 44  # forward_step_value -1 (a captured launch): +1 each
    plan_step.canary_plan_step(
        write_plan=wp, verify_plan=vp, req_pool_indices=torch.tensor([3, 0, 6], **i64),
        prefix_lens=torch.tensor([4, 0, 2], **i64), extend_lens=torch.tensor([1, 1, 1], **i64),
        req_to_token=table, forward_counter=counter, forward_step_value=7,
    )
    _sync(backend)
    assert int(counter[0]) == 7  # an eager launch whose forward number the host knows: set
    assert wp.write_request_rows.tolist() == [3, 0, 6, 0]
    assert vp.verify_request_rows[:6].tolist() == [3, 3, 3, 3, 6, 6]
    assert vp.verify_request_rows[6:].tolist() == [UNKNOWN] * 10  # past num_valid: untouched


def test_plan_without_request_rows_uses_the_seed_export() -> None:
    """A plan built without the kvcanary+ fields (e.g. by hand) still plans."""
    wp = WritePlan.allocate(2, "cpu")
    vp = VerifyPlan.allocate(4, "cpu")
    bare_w = WritePlan(wp.write_offsets, wp.write_seed_slot_indices, wp.write_num_valid_reqs, wp.verify_row_offsets)
    bare_v = VerifyPlan(vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
                        vp.verify_prev_slot_indices, vp.verify_num_valid, vp.verify_enable)
    table = torch.tensor([[0, 0], [5, 6]], dtype=torch.int32)
    plan_step.canary_plan_step(write_plan=bare_w, verify_plan=bare_v, req_pool_indices=torch.tensor([1]),
                         prefix_lens=torch.tensor([2]), extend_lens=torch.tensor([0]), req_to_token=table)
    assert bare_v.verify_slot_indices[:2].tolist() == [5, 6] and bare_v.verify_num_valid.tolist() == [2]


def test_plan_refuses_other_expected_token_dtypes() -> None:
    case = random_plan_case(random.Random(3))
    case["expected_tokens"] = torch.zeros((2, 4), dtype=torch.int16)
    case["expected_tokens_valid_lens"] = torch.zeros(case["req_pool_indices"].shape[0], dtype=torch.int64)
    with pytest.raises(TypeError, match="^canary_plan_step: expected_tokens: expected dtype int32 or int64"):
        run_plan(plan_step.canary_plan_step, case, "cpu")


# ---------------------------------------------------------------------------------------------- raw exports


def test_raw_exports_keep_the_seed_abi_and_append_the_new_arguments() -> None:
    module = load_module("cpu")
    for name in ("canary_write_step", "canary_verify_step", "canary_plan_step", "canary_write_step_attributed",
                 "canary_verify_step_attributed", "canary_plan_step_attributed"):
        assert getattr(module, name) is not None
    with pytest.raises(TypeError, match="Mismatched number of arguments|expected 23"):
        module.canary_write_step(*([None] * 28))  # the seed export takes exactly its 23 arguments
    with pytest.raises(TypeError, match="Mismatched number of arguments|expected 28"):
        module.canary_write_step_attributed(*([None] * 23))
