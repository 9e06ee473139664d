"""Out-of-range slot / predecessor / seed / offset indices are reported with SLOT_OUT_OF_RANGE and
never dereferenced. Checked three ways: exact rows, guard bytes around every buffer, and (CPU) the
same scenarios under AddressSanitizer in a subprocess."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from canary_cases import int64, random_verify_launch, random_write_launch, scalar_i32

from kvcanary.kernels import layout, verify, write

OOB = layout.REASON_SLOT_OUT_OF_RANGE
GUARD = 4096  # bytes of sentinel on each side of a guarded buffer
SENTINEL = 0xA5


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def guarded(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, fill: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of `shape` inside a uint8 arena with GUARD sentinel bytes before and after it."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    arena = torch.full((2 * GUARD + nbytes,), SENTINEL, dtype=torch.uint8, device=device)
    inner = arena[GUARD : GUARD + nbytes].view(dtype).view(*shape)
    inner.fill_(fill)
    return arena, inner


def assert_guards(arena: torch.Tensor) -> None:
    head, tail = arena[:GUARD], arena[-GUARD:]
    assert bool((head == SENTINEL).all()) and bool((tail == SENTINEL).all()), "write outside the buffer"


def _sink(device: str) -> dict[str, torch.Tensor]:
    return {
        "violation_ring": torch.zeros((16, 8), dtype=torch.int64, device=device),
        "violation_write_index": torch.zeros(1, dtype=torch.int32, device=device),
        "slot_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
        "kernel_run_counter": torch.zeros(1, dtype=torch.int64, device=device),
    }


def _rows(sink: dict[str, torch.Tensor]) -> list[list[int]]:
    return sorted(sink["violation_ring"].cpu()[: int(sink["violation_write_index"][0])].tolist())


@pytest.mark.parametrize("device", devices())
def test_write_reports_out_of_range_slot_seed_and_offsets(device: str) -> None:
    arena, canary = guarded((8, 32), torch.uint8, device)
    sink = _sink(device)
    d = lambda v: int64(v).to(device)  # noqa: E731
    write.canary_write_step(
        canary_buf=canary,
        # request 0: [0,2) with slot 8 (== num_slots) and slot 3; request 1: bad seed 99 over [2,3);
        # request 2: offsets [3, 50) beyond num_tokens=4
        write_offsets=d([0, 2, 3, 50]),
        write_seed_slot_indices=d([-1, 99, -1]),
        write_num_valid_reqs=scalar_i32(3).to(device),
        input_ids=d([10, 11, 12, 13]),
        positions=d([0, 1, 0, 1]),
        out_cache_loc=d([8, 3, 4, 5]),
        kernel_kind=7,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        enable_chain_position_assert=scalar_i32(1).to(device),
        **sink,
    )
    assert_guards(arena)
    rows = _rows(sink)
    reasons = [r[layout.VIOLATION_COL_FAIL_REASON_BITS] for r in rows]
    assert reasons == [OOB, OOB, OOB]
    by_aux = {r[layout.VIOLATION_COL_EXPECTED_AUX]: r for r in rows}
    assert by_aux[8][layout.VIOLATION_COL_SLOT] == 8  # the out-of-range write slot
    assert by_aux[99][layout.VIOLATION_COL_SLOT] == 99  # the bad seed
    assert by_aux[50][layout.VIOLATION_COL_STORED_CHAIN_HASH] == 2  # request row of the bad range
    # slot 3 is stored and its prev_hash continues the chain past the unstored entry
    assert int(sink["slot_run_counter"][0]) == 2  # slots 3 and 4
    rec3 = canary[3, :32].cpu().contiguous().view(torch.int64).tolist()
    assert rec3[:2] == [11, 1]


@pytest.mark.parametrize("device", devices())
def test_verify_reports_out_of_range_slot_and_prev(device: str) -> None:
    arena, canary = guarded((8, 32), torch.uint8, device)
    sink = _sink(device)
    d = lambda v: int64(v).to(device)  # noqa: E731
    verify.canary_verify_step(
        canary_buf=canary,
        verify_slot_indices=d([8, -3, 2, 2, 1 << 40]),
        verify_expected_tokens=d([-1, -1, -1, -1, -1]),
        verify_expected_positions=d([0, 0, 0, 0, 0]),
        verify_prev_slot_indices=d([-1, -1, 9, -2, 1]),
        verify_num_valid=scalar_i32(5).to(device),
        verify_enable=scalar_i32(1).to(device),
        kernel_kind=5,
        **sink,
    )
    assert_guards(arena)
    rows = _rows(sink)
    assert len(rows) == 5
    for r in rows:
        assert r[layout.VIOLATION_COL_FAIL_REASON_BITS] & OOB
    prev_rows = [r for r in rows if r[layout.VIOLATION_COL_SLOT] == 2]
    assert sorted(r[layout.VIOLATION_COL_EXPECTED_AUX] for r in prev_rows) == [-2, 9]
    assert int(sink["slot_run_counter"][0]) == 5


@pytest.mark.parametrize("device", devices())
def test_random_out_of_range_scenarios_stay_inside_guards(device: str) -> None:
    """Random launches (with out-of-range indices) on guarded canary buffers never touch the guards."""
    for seed in range(150):
        for make, fn in ((random_write_launch, write.canary_write_step),
                         (random_verify_launch, verify.canary_verify_step)):
            kwargs = make(random.Random(seed)).clone_to(device)
            arena, canary = guarded(tuple(kwargs["canary_buf"].shape), torch.uint8, device)
            canary.copy_(kwargs["canary_buf"])
            kwargs["canary_buf"] = canary
            ring_arena, ring = guarded(tuple(kwargs["violation_ring"].shape), torch.int64, device)
            kwargs["violation_ring"] = ring
            fn(**kwargs)
            assert_guards(arena)
            assert_guards(ring_arena)


ASAN_SCRIPT = r"""
import random, sys
sys.path.insert(0, sys.argv[1])
from canary_cases import random_write_launch, random_verify_launch
from kvcanary.kernels import verify, write
for seed in range(int(sys.argv[2])):
    write.canary_write_step(**random_write_launch(random.Random(seed)).clone_to("cpu"))
    verify.canary_verify_step(**random_verify_launch(random.Random(seed)).clone_to("cpu"))
print("asan-ok")
"""


def _libasan() -> str | None:
    try:
        proc = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
        path = proc.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow
def test_cpu_kernels_under_address_sanitizer(tmp_path: Path) -> None:
    libasan = _libasan()
    if libasan is None:
        pytest.skip("gcc's libasan is not available")
    import kvcanary

    env = dict(os.environ)
    package_parent = str(Path(kvcanary.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    env.update(
        KVCANARY_SANITIZE="address",
        KVCANARY_CACHE_DIR=str(tmp_path / "cache"),
        LD_PRELOAD=libasan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
    )
    proc = subprocess.run(
        [sys.executable, "-c", ASAN_SCRIPT, str(Path(__file__).parent), "300"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "asan-ok" in proc.stdout, proc.stderr[-4000:]
