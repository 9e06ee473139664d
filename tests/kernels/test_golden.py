"""Golden values computed by SGLang's own reference of the seed semantics
(/work/shared/golden/canary_golden.json, copied into tests/data), checked against the CPU kernels
(and CUDA when present) directly, independent of the references (kvcanary.kernels.*_ref)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcanary.kernels import layout, verify, write
from kvcanary.kernels.real_kv import RealKvSource

GOLDEN = json.loads((Path(__file__).parent.parent / "data" / "canary_golden.json").read_text())
MASK = (1 << 64) - 1


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def golden_sources(device: str) -> list[RealKvSource]:
    out = []
    for name in ("source0", "source1"):
        spec = GOLDEN["real_kv_sources"][name]
        data = torch.tensor(list(bytes.fromhex(spec["bytes_hex"])), dtype=torch.uint8).view(*spec["shape"])
        out.append(RealKvSource(data.to(device), spec["page_size"], spec["num_bytes_per_token"], spec["read_bytes"]))
    return out


def write_chain5(device: str, mode: int) -> dict[str, torch.Tensor]:
    case = GOLDEN[f"chain5_mode{mode}"]
    n = len(case["slots"])
    t = {
        "canary_buf": torch.zeros((16, 32), dtype=torch.uint8, device=device),
        "violation_ring": torch.zeros((8, layout.VIOLATION_FIELDS), dtype=torch.int64, device=device),
        "violation_write_index": torch.zeros(1, dtype=torch.int32, device=device),
        "slot_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
        "kernel_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
    }
    write.canary_write_step(
        write_offsets=torch.tensor([0, n], dtype=torch.int64, device=device),
        write_seed_slot_indices=torch.tensor([-1], dtype=torch.int64, device=device),
        write_num_valid_reqs=torch.tensor([1], dtype=torch.int32, device=device),
        input_ids=torch.tensor(case["tokens"], dtype=torch.int64, device=device),
        positions=torch.tensor(case["positions"], dtype=torch.int64, device=device),
        out_cache_loc=torch.tensor(case["slots"], dtype=torch.int64, device=device),
        kernel_kind=2,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=device),
        real_kv_sources=golden_sources(device) if mode else (),
        real_kv_hash_mode=mode,
        **t,
    )
    return t


def records_of(canary: torch.Tensor, slots: list[int]) -> list[list[int]]:
    return canary.cpu()[slots, :32].contiguous().view(torch.int64).view(len(slots), 4).tolist()


def test_splitmix64_and_mix3_golden() -> None:
    # The kernels' hashes surface through the chain: a head's prev_hash is splitmix64(anchor).
    records = GOLDEN["chain5_mode0"]["records_[token,position,prev_hash,real_kv_hash]"]
    assert GOLDEN["chain_head_prev_hash"] == records[0][2]
    from kvcanary.kernels import hash_ref  # the reference must agree with the golden file too

    for case in GOLDEN["splitmix64_u64"]:
        assert hash_ref.splitmix64(case["in"]) == case["out"]
    for case in GOLDEN["mix3_u64"]:
        assert hash_ref.mix3(*case["in"]) == case["out"]
    assert hash_ref.to_i64(hash_ref.chain_head_hash()) == GOLDEN["chain_head_prev_hash"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_chain5_records_match_golden(device: str, mode: int) -> None:
    case = GOLDEN[f"chain5_mode{mode}"]
    t = write_chain5(device, mode)
    assert records_of(t["canary_buf"], case["slots"]) == case["records_[token,position,prev_hash,real_kv_hash]"]
    assert int(t["slot_run_counter"][0]) == case["slot_run_counter"]
    assert int(t["kernel_run_counter"][0]) == case["kernel_run_counter"]
    assert int(t["violation_write_index"][0]) == case["violations"]
    untouched = [s for s in range(16) if s not in case["slots"]]
    assert int(t["canary_buf"].cpu()[untouched].sum()) == 0


@pytest.mark.parametrize("device", devices())
def test_verify_after_corruption_matches_golden(device: str) -> None:
    case = GOLDEN["chain5_mode2"]
    golden = GOLDEN["verify_after_corruption"]
    t = write_chain5(device, 2)
    sources = golden_sources(device)
    canary = t["canary_buf"]
    # token of slot 4 := 999; byte 0 of source0 row 12 ^= 0xFF
    canary[4, 0:8] = torch.tensor([999], dtype=torch.int64).view(torch.uint8).to(device)
    sources[0].kv_bytes[12, 0] ^= 0xFF
    slots = case["slots"]
    n = len(slots)
    t["violation_write_index"].zero_()
    t["slot_run_counter"].zero_()
    verify.canary_verify_step(
        canary_buf=canary,
        verify_slot_indices=torch.tensor(slots, dtype=torch.int64, device=device),
        verify_expected_tokens=torch.tensor(case["tokens"], dtype=torch.int64, device=device),
        verify_expected_positions=torch.tensor(case["positions"], dtype=torch.int64, device=device),
        verify_prev_slot_indices=torch.tensor([-1, *slots[:-1]], dtype=torch.int64, device=device),
        verify_num_valid=torch.tensor([n], dtype=torch.int32, device=device),
        verify_enable=torch.ones(1, dtype=torch.int32, device=device),
        kernel_kind=2,
        violation_ring=t["violation_ring"],
        violation_write_index=t["violation_write_index"],
        slot_run_counter=t["slot_run_counter"],
        kernel_run_counter=t["kernel_run_counter"],
        real_kv_sources=sources,
        real_kv_hash_mode=2,
        check_tokens=True,
    )
    count = int(t["violation_write_index"][0])
    assert count == golden["violation_count"]
    rows = sorted(t["violation_ring"].cpu()[:count].tolist())
    rows_key = "rows_[kind,slot,position,stored_token,expected_token,stored_chain_hash,expected_aux,fail_reason_bits]"
    assert rows == sorted(golden[rows_key])
    assert int(t["slot_run_counter"][0]) == golden["slot_run_counter"]


def test_real_kv_fold_of_fixed_bytes_hand_computed() -> None:
    """A hand-rolled fold (not kvcanary.kernels.hash_ref) over fixed bytes equals the kernel's fingerprint."""

    def sm(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & MASK
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & MASK
        return x ^ (x >> 31)

    data = bytes(range(64))
    src = torch.tensor(list(data), dtype=torch.uint8).view(2, 32)  # 2 slots of 32 bytes
    expected = {}
    for slot in range(2):
        chunk = data[32 * slot : 32 * slot + 32]
        acc = 0
        for off in (0, 16):
            acc = sm(acc ^ int.from_bytes(chunk[off : off + 8], "little"))
            acc = sm(acc ^ int.from_bytes(chunk[off + 8 : off + 16], "little"))
        total = sm(0 ^ acc)
        expected[slot] = total - (1 << 64) if total >> 63 else total
    canary = torch.zeros((2, 32), dtype=torch.uint8)
    write.canary_write_step(
        canary_buf=canary,
        write_offsets=torch.tensor([0, 2], dtype=torch.int64),
        write_seed_slot_indices=torch.tensor([-1], dtype=torch.int64),
        write_num_valid_reqs=torch.tensor([1], dtype=torch.int32),
        input_ids=torch.tensor([5, 6], dtype=torch.int64),
        positions=torch.tensor([0, 1], dtype=torch.int64),
        out_cache_loc=torch.tensor([0, 1], dtype=torch.int64),
        kernel_kind=0,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        violation_ring=torch.zeros((1, 8), dtype=torch.int64),
        violation_write_index=torch.zeros(1, dtype=torch.int32),
        slot_run_counter=torch.zeros(1, dtype=torch.int64),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64),
        enable_chain_position_assert=torch.zeros(1, dtype=torch.int32),
        real_kv_sources=[RealKvSource(src, 1, 32, 32)],
        real_kv_hash_mode=2,
    )
    stored = canary[:, 24:32].contiguous().view(torch.int64).view(-1).tolist()
    assert stored == [expected[0], expected[1]]
