"""Reference-independent invariants of the kernels (SPEC §3, §4)."""

from __future__ import annotations

import random

import pytest
import torch
from canary_cases import int64, random_verify_launch, random_write_launch, scalar_i32, scalar_i64

from kvcanary.kernels import layout, verify, write


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", devices())
def test_verify_never_modifies_canary_buf(device: str) -> None:
    for seed in range(200):
        kwargs = random_verify_launch(random.Random(seed)).clone_to(device)
        before = kwargs["canary_buf"].clone()
        verify.canary_verify_step(**kwargs)
        assert torch.equal(kwargs["canary_buf"], before), f"seed={seed}"


def _empty_write(device: str, capacity: int) -> dict:
    return {
        "canary_buf": torch.zeros((4, 32), dtype=torch.uint8, device=device),
        "write_offsets": torch.zeros(capacity + 1, dtype=torch.int64, device=device),
        "write_seed_slot_indices": torch.full((capacity,), -1, dtype=torch.int64, device=device),
        "write_num_valid_reqs": torch.tensor([capacity], dtype=torch.int32, device=device),
        "input_ids": torch.zeros(0, dtype=torch.int64, device=device),
        "positions": torch.zeros(0, dtype=torch.int64, device=device),
        "out_cache_loc": torch.zeros(0, dtype=torch.int64, device=device),
        "kernel_kind": 3,
        "enable_write_input_assert": False,
        "expected_input_tokens": None,
        "expected_input_positions": None,
        "violation_ring": torch.zeros((2, 8), dtype=torch.int64, device=device),
        "violation_write_index": torch.zeros(1, dtype=torch.int32, device=device),
        "slot_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
        "kernel_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
        "enable_chain_position_assert": torch.ones(1, dtype=torch.int32, device=device),
    }


def _empty_verify(device: str, capacity: int, enable: int) -> dict:
    z = torch.zeros(capacity, dtype=torch.int64, device=device)
    return {
        "canary_buf": torch.zeros((4, 32), dtype=torch.uint8, device=device),
        "verify_slot_indices": z.clone(),
        "verify_expected_tokens": z.clone(),
        "verify_expected_positions": z.clone(),
        "verify_prev_slot_indices": z.clone(),
        "verify_num_valid": torch.tensor([capacity], dtype=torch.int32, device=device),
        "verify_enable": torch.tensor([enable], dtype=torch.int32, device=device),
        "kernel_kind": 4,
        "violation_ring": torch.zeros((2, 8), dtype=torch.int64, device=device),
        "violation_write_index": torch.zeros(1, dtype=torch.int32, device=device),
        "slot_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
        "kernel_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
    }


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("capacity", [0, 1, 7])
def test_kernel_run_counter_bumps_once_per_call_without_work(device: str, capacity: int) -> None:
    w = _empty_write(device, capacity)
    for i in range(1, 6):
        write.canary_write_step(**w)
        assert int(w["kernel_run_counter"][0]) == i
    assert int(w["slot_run_counter"][0]) == 0
    for enable in (0, 1):
        v = _empty_verify(device, capacity, enable)
        for i in range(1, 4):
            verify.canary_verify_step(**v)
            assert int(v["kernel_run_counter"][0]) == i
        # slot-0 entries are skipped but still counted as visited when verify is enabled
        assert int(v["slot_run_counter"][0]) == (3 * capacity if enable else 0)
        assert int(v["violation_write_index"][0]) == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("ring_capacity", [0, 1, 3])
def test_ring_keeps_first_rows_and_index_counts_all(device: str, ring_capacity: int) -> None:
    n = 10
    canary = torch.zeros((n + 1, 32), dtype=torch.uint8, device=device)
    ring = torch.full((ring_capacity, 8), -7, dtype=torch.int64, device=device)
    index = torch.zeros(1, dtype=torch.int32, device=device)
    # Every entry expects position 5 on zeroed records: one violation per entry.
    verify.canary_verify_step(
        canary_buf=canary,
        verify_slot_indices=torch.arange(1, n + 1, dtype=torch.int64, device=device),
        verify_expected_tokens=torch.full((n,), -1, dtype=torch.int64, device=device),
        verify_expected_positions=torch.full((n,), 5, dtype=torch.int64, device=device),
        verify_prev_slot_indices=torch.zeros(n, dtype=torch.int64, device=device),
        verify_num_valid=torch.tensor([n], dtype=torch.int32, device=device),
        verify_enable=torch.ones(1, dtype=torch.int32, device=device),
        kernel_kind=1,
        violation_ring=ring,
        violation_write_index=index,
        slot_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
    )
    assert int(index[0]) == n
    rows = ring.cpu().tolist()
    assert all(r[layout.VIOLATION_COL_FAIL_REASON_BITS] == layout.REASON_VERIFY_POSITION for r in rows)
    assert len({r[layout.VIOLATION_COL_SLOT] for r in rows}) == ring_capacity
    if device == "cpu":  # the CPU loop appends in entry order: the first rows are slots 1..capacity
        assert [r[layout.VIOLATION_COL_SLOT] for r in rows] == list(range(1, ring_capacity + 1))


def test_write_stores_inputs_and_leaves_other_slots_untouched() -> None:
    for seed in range(200):
        launch = random_write_launch(random.Random(seed), allow_out_of_range=False)
        kw = launch.clone_to("cpu")
        kw["enable_write_input_assert"] = False
        kw["expected_input_tokens"] = kw["expected_input_positions"] = None
        kw["write_num_valid_reqs"] = scalar_i32(kw["write_seed_slot_indices"].numel())
        before = kw["canary_buf"].clone()
        write.canary_write_step(**kw)
        locs = kw["out_cache_loc"].tolist()
        written = {s for s in locs if s >= 0}
        for e, s in enumerate(locs):
            if s >= 0:
                rec = kw["canary_buf"][s, :32].contiguous().view(torch.int64).tolist()
                assert rec[:2] == [kw["input_ids"][e].item(), kw["positions"][e].item()], f"seed={seed}"
        stride = before.shape[1]
        for s in range(before.shape[0]):
            if s not in written:
                assert torch.equal(kw["canary_buf"][s], before[s]), f"seed={seed} slot={s}"
            elif stride > 32:
                assert torch.equal(kw["canary_buf"][s, 32:], before[s, 32:]), "bytes past 32 are reserved"


def test_write_then_verify_is_clean_for_a_chunked_chain() -> None:
    """Chunked prefill: chunk 2 seeds from chunk 1's last slot; verifying the prefix is clean."""
    canary = torch.zeros((64, 32), dtype=torch.uint8)
    sink = {
        "violation_ring": torch.zeros((8, 8), dtype=torch.int64),
        "violation_write_index": torch.zeros(1, dtype=torch.int32),
        "slot_run_counter": scalar_i64(0),
        "kernel_run_counter": scalar_i64(0),
    }
    slots = [5, 9, 2, 40, 41, 7, 8]
    tokens = [11, 12, 13, 14, 15, 16, 17]
    for begin, end in ((0, 3), (3, 7)):
        write.canary_write_step(
            canary_buf=canary,
            write_offsets=int64([0, end - begin]),
            write_seed_slot_indices=int64([slots[begin - 1] if begin else -1]),
            write_num_valid_reqs=scalar_i32(1),
            input_ids=int64(tokens[begin:end]),
            positions=int64(list(range(begin, end))),
            out_cache_loc=int64(slots[begin:end]),
            kernel_kind=0,
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
            enable_chain_position_assert=scalar_i32(1),
            **sink,
        )
    verify.canary_verify_step(
        canary_buf=canary,
        verify_slot_indices=int64(slots),
        verify_expected_tokens=int64(tokens),
        verify_expected_positions=int64(list(range(7))),
        verify_prev_slot_indices=int64([-1, *slots[:-1]]),
        verify_num_valid=scalar_i32(7),
        verify_enable=scalar_i32(1),
        kernel_kind=1,
        check_tokens=True,
        **sink,
    )
    assert int(sink["violation_write_index"][0]) == 0
    assert int(sink["slot_run_counter"][0]) == 7 + 7
