"""canary_verify_step + canary_write_step captured in one CUDA graph, replayed with fresh inputs.

The kernels must launch on torch's current stream (the capture stream), read every input through
device pointers (so new values copied into the static tensors reach a replay) and size their grids
from capacities only. A launch on the wrong stream is not an error during capture: the graph is
just empty or wrong, so this test compares every replay with an eager run of the same calls on the
CPU backend: canary bytes, violation rows (as a multiset), the ring's write index and both counters
must be equal. kernel_run_counter must advance by exactly two per replay (one verify, one write).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvcanary.kernels import layout, verify, write
from kvcanary.kernels.real_kv import RealKvSource

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]

NUM_SLOTS = 2048
STRIDE = 32
WRITE_REQ_CAP = 8
WRITE_TOKEN_CAP = 64
VERIFY_CAP = 96
RING_CAP = 512  # > the most rows one round can produce (VERIFY_CAP + 2 * WRITE_TOKEN_CAP + WRITE_REQ_CAP)
KV_ROW_BYTES = 64
KIND_WRITE = 1
KIND_VERIFY = 2
ROUNDS = 6


@dataclass
class State:
    """Every tensor the two kernels touch, on one device."""

    device: torch.device
    canary: torch.Tensor = field(init=False)
    kv: torch.Tensor = field(init=False)
    # write plan and inputs
    offsets: torch.Tensor = field(init=False)
    seeds: torch.Tensor = field(init=False)
    num_reqs: torch.Tensor = field(init=False)
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    out_cache_loc: torch.Tensor = field(init=False)
    chain_assert: torch.Tensor = field(init=False)
    # verify plan
    v_slots: torch.Tensor = field(init=False)
    v_tokens: torch.Tensor = field(init=False)
    v_positions: torch.Tensor = field(init=False)
    v_prevs: torch.Tensor = field(init=False)
    v_num_valid: torch.Tensor = field(init=False)
    v_enable: torch.Tensor = field(init=False)
    # sinks
    ring: torch.Tensor = field(init=False)
    ring_index: torch.Tensor = field(init=False)
    slot_runs: torch.Tensor = field(init=False)
    kernel_runs: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        d = self.device

        def i64(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=d)

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=d)

        self.canary = torch.zeros((NUM_SLOTS, STRIDE), dtype=torch.uint8, device=d)
        self.kv = torch.zeros((NUM_SLOTS, KV_ROW_BYTES), dtype=torch.uint8, device=d)
        self.offsets = i64(WRITE_REQ_CAP + 1)
        self.seeds = i64(WRITE_REQ_CAP)
        self.num_reqs = i32(1)
        self.input_ids = i64(WRITE_TOKEN_CAP)
        self.positions = i64(WRITE_TOKEN_CAP)
        self.out_cache_loc = i64(WRITE_TOKEN_CAP)
        self.chain_assert = i32(1)
        self.v_slots = i64(VERIFY_CAP)
        self.v_tokens = i64(VERIFY_CAP)
        self.v_positions = i64(VERIFY_CAP)
        self.v_prevs = i64(VERIFY_CAP)
        self.v_num_valid = i32(1)
        self.v_enable = i32(1)
        self.ring = i64(RING_CAP, layout.VIOLATION_FIELDS)
        self.ring_index = i32(1)
        self.slot_runs = i64(1)
        self.kernel_runs = i64(1)

    def source(self) -> RealKvSource:
        return RealKvSource(self.kv, page_size=1, num_bytes_per_token=KV_ROW_BYTES, read_bytes=KV_ROW_BYTES)

    def step(self, source: RealKvSource) -> None:
        """One forward's canary work: verify the planned prefixes, then write the new records."""
        verify.canary_verify_step(
            canary_buf=self.canary,
            verify_slot_indices=self.v_slots,
            verify_expected_tokens=self.v_tokens,
            verify_expected_positions=self.v_positions,
            verify_prev_slot_indices=self.v_prevs,
            verify_num_valid=self.v_num_valid,
            verify_enable=self.v_enable,
            kernel_kind=KIND_VERIFY,
            violation_ring=self.ring,
            violation_write_index=self.ring_index,
            slot_run_counter=self.slot_runs,
            kernel_run_counter=self.kernel_runs,
            real_kv_sources=[source],
            real_kv_hash_mode=layout.REAL_KV_HASH_MODE_PARTIAL,
            check_tokens=True,
        )
        write.canary_write_step(
            canary_buf=self.canary,
            write_offsets=self.offsets,
            write_seed_slot_indices=self.seeds,
            write_num_valid_reqs=self.num_reqs,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            kernel_kind=KIND_WRITE,
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
            violation_ring=self.ring,
            violation_write_index=self.ring_index,
            slot_run_counter=self.slot_runs,
            kernel_run_counter=self.kernel_runs,
            enable_chain_position_assert=self.chain_assert,
            real_kv_sources=[source],
            real_kv_hash_mode=layout.REAL_KV_HASH_MODE_PARTIAL,
        )

    def load(self, inputs: dict[str, torch.Tensor]) -> None:
        """Copy one round's inputs (CPU tensors) into the static tensors, in place."""
        for name, value in inputs.items():
            getattr(self, name).copy_(value)

    def snapshot(self) -> dict[str, object]:
        index = int(self.ring_index.item())
        rows = self.ring[: min(max(index, 0), RING_CAP)].cpu().tolist()
        return {
            "canary": self.canary.cpu(),
            "rows": sorted(tuple(r) for r in rows),
            "ring_index": index,
            "slot_runs": int(self.slot_runs.item()),
            "kernel_runs": int(self.kernel_runs.item()),
        }


class Workload:
    """Random but reproducible rounds: chains started and extended by writes, checked by verifies."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.free_slots = list(range(1, NUM_SLOTS))
        self.rng.shuffle(self.free_slots)
        self.chains: list[list[tuple[int, int, int]]] = []  # per chain: (slot, token, position) in order

    def _fresh_slot(self) -> int:
        return self.free_slots.pop()

    def verify_inputs(self) -> dict[str, torch.Tensor]:
        rng = self.rng
        entries: list[tuple[int, int, int, int]] = []  # slot, expected token, expected position, prev
        for chain in rng.sample(self.chains, k=min(len(self.chains), 6)):
            for i, (slot, token, position) in enumerate(chain):
                prev = chain[i - 1][0] if i > 0 else layout.CHAIN_HEAD_SLOT
                expected = token if rng.random() < 0.8 else layout.NO_EXPECTED_TOKEN
                entries.append((slot, expected, position, prev))
        for _ in range(rng.randint(4, 16)):  # noise: wrong expectations, padding, unknown prev, bad indices
            slot = rng.choice([0, rng.randrange(1, NUM_SLOTS), rng.randrange(1, NUM_SLOTS), NUM_SLOTS + 3])
            prev = rng.choice([layout.CHAIN_HEAD_SLOT, layout.UNKNOWN_PREV_SLOT, rng.randrange(1, NUM_SLOTS), -7])
            entries.append((slot, rng.randrange(-1, 50), rng.randrange(0, 40), prev))
        rng.shuffle(entries)
        entries = entries[:VERIFY_CAP]
        pad = VERIFY_CAP - len(entries)
        cols = list(zip(*entries, strict=True)) if entries else [(), (), (), ()]
        num_valid = len(entries) if rng.random() < 0.85 else VERIFY_CAP + 5  # > capacity: clamped
        return {
            "v_slots": torch.tensor(list(cols[0]) + [0] * pad, dtype=torch.int64),
            "v_tokens": torch.tensor(list(cols[1]) + [-1] * pad, dtype=torch.int64),
            "v_positions": torch.tensor(list(cols[2]) + [0] * pad, dtype=torch.int64),
            "v_prevs": torch.tensor(list(cols[3]) + [0] * pad, dtype=torch.int64),
            "v_num_valid": torch.tensor([num_valid], dtype=torch.int32),
            "v_enable": torch.tensor([0 if rng.random() < 0.1 else 1], dtype=torch.int32),
        }

    def write_inputs(self) -> dict[str, torch.Tensor]:
        """Requests over fresh slots; each extends a distinct existing chain or starts one."""
        rng = self.rng
        num_reqs = rng.randint(1, WRITE_REQ_CAP)
        offsets = [0]
        seeds: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        locs: list[int] = []
        extendable = list(range(len(self.chains)))
        rng.shuffle(extendable)
        new_chains: list[list[tuple[int, int, int]]] = []
        for _ in range(num_reqs):
            budget = WRITE_TOKEN_CAP - len(ids)
            length = 0 if budget == 0 or rng.random() < 0.15 else rng.randint(1, min(12, budget))
            if length and extendable and rng.random() < 0.6:
                chain = self.chains[extendable.pop()]
                seeds.append(chain[-1][0])
                start = chain[-1][2] + 1
            else:
                chain = []
                new_chains.append(chain)
                seeds.append(layout.CHAIN_HEAD_SLOT)
                start = 0
            for i in range(length):
                token = rng.randrange(1 << 31)
                position = start + i + (3 if rng.random() < 0.05 else 0)  # occasional position skew
                r = rng.random()
                if r < 0.05:
                    slot = layout.SKIP_WRITE_SLOT
                elif r < 0.08:
                    slot = NUM_SLOTS + rng.randrange(1, 10)  # out of range: reported, not stored
                else:
                    slot = self._fresh_slot()
                    chain.append((slot, token, position))
                ids.append(token)
                positions.append(position)
                locs.append(slot)
            offsets.append(len(ids))
        self.chains.extend(c for c in new_chains if c)
        used_reqs = len(seeds)
        pad_reqs = WRITE_REQ_CAP - used_reqs
        pad_tokens = WRITE_TOKEN_CAP - len(ids)
        return {
            "offsets": torch.tensor(offsets + [offsets[-1]] * pad_reqs, dtype=torch.int64),
            "seeds": torch.tensor(seeds + [layout.CHAIN_HEAD_SLOT] * pad_reqs, dtype=torch.int64),
            "num_reqs": torch.tensor([used_reqs], dtype=torch.int32),
            "input_ids": torch.tensor(ids + [0] * pad_tokens, dtype=torch.int64),
            "positions": torch.tensor(positions + [0] * pad_tokens, dtype=torch.int64),
            "out_cache_loc": torch.tensor(locs + [layout.SKIP_WRITE_SLOT] * pad_tokens, dtype=torch.int64),
            "chain_assert": torch.tensor([1], dtype=torch.int32),
        }

    def kv_update(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the real-KV source to overwrite before a round (so some fingerprints change)."""
        rows = torch.tensor(self.rng.sample(range(NUM_SLOTS), 16), dtype=torch.int64)
        values = torch.tensor(
            [[self.rng.randrange(256) for _ in range(KV_ROW_BYTES)] for _ in range(16)], dtype=torch.uint8
        )
        return rows, values


def _assert_same(gpu: dict[str, object], cpu: dict[str, object], round_no: int) -> None:
    assert gpu["ring_index"] == cpu["ring_index"], f"round {round_no}: violation_write_index differs"
    assert gpu["rows"] == cpu["rows"], f"round {round_no}: violation rows differ"
    assert gpu["slot_runs"] == cpu["slot_runs"], f"round {round_no}: slot_run_counter differs"
    assert gpu["kernel_runs"] == cpu["kernel_runs"], f"round {round_no}: kernel_run_counter differs"
    g, c = gpu["canary"], cpu["canary"]
    assert isinstance(g, torch.Tensor) and isinstance(c, torch.Tensor)
    if not torch.equal(g, c):
        bad = (g != c).any(dim=1).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"round {round_no}: canary_buf differs at slots {bad}")


@pytest.mark.parametrize("seed", [0, 1])
def test_graph_replay_with_fresh_inputs_matches_cpu(seed: int) -> None:
    gpu = State(torch.device("cuda"))
    cpu = State(torch.device("cpu"))
    gpu.kv.copy_(torch.randint(0, 256, gpu.kv.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    cpu.kv.copy_(gpu.kv.cpu())
    gpu_source, cpu_source = gpu.source(), cpu.source()

    # Warm up on a side stream (builds/loads the module, fills the wrapper's caches), as torch asks.
    gpu.num_reqs.zero_()
    gpu.v_num_valid.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            gpu.step(gpu_source)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert int(gpu.kernel_runs.item()) == 4, "eager warmup did not run both kernels"
    gpu.kernel_runs.zero_()
    gpu.slot_runs.zero_()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on torch's side stream; our kernels must follow it
        gpu.step(gpu_source)
    torch.cuda.synchronize()
    assert int(gpu.kernel_runs.item()) == 0, "capture must not execute the kernels"

    work = Workload(seed)
    previous_canary = gpu.canary.cpu()
    for round_no in range(ROUNDS):
        inputs = {**work.verify_inputs(), **work.write_inputs()}
        rows, values = work.kv_update()
        for state in (gpu, cpu):
            state.load(inputs)
            state.kv[rows.to(state.device)] = values.to(state.device)
            state.ring.zero_()
            state.ring_index.zero_()
        graph.replay()
        cpu.step(cpu_source)
        torch.cuda.synchronize()
        g, c = gpu.snapshot(), cpu.snapshot()
        _assert_same(g, c, round_no)
        assert g["kernel_runs"] == 2 * (round_no + 1), "each replay must run verify and write exactly once"
        if int(inputs["offsets"][-1]) > 0 and (inputs["out_cache_loc"] > 0).any():
            stored = inputs["out_cache_loc"][(inputs["out_cache_loc"] > 0) & (inputs["out_cache_loc"] < NUM_SLOTS)]
            if stored.numel():
                assert not torch.equal(g["canary"], previous_canary), f"round {round_no}: replay wrote nothing"
        previous_canary = g["canary"]

    # The test is only meaningful if the rounds produced both passing and failing entries.
    assert work.chains, "the workload wrote no chains"
    assert cpu.slot_runs.item() > 0


def test_graph_replay_after_input_change_sees_new_values() -> None:
    """Negative control: a replay must read the static tensors' current contents, not capture-time values."""
    gpu = State(torch.device("cuda"))
    source = gpu.source()
    gpu.num_reqs.zero_()
    gpu.v_num_valid.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gpu.step(source)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.step(source)
    torch.cuda.synchronize()
    runs_before = int(gpu.kernel_runs.item())

    # Capture-time plan wrote nothing (num_reqs == 0). Now ask for one request of one token at slot 5.
    gpu.offsets.copy_(torch.tensor([0] + [1] * WRITE_REQ_CAP, dtype=torch.int64))
    gpu.seeds.fill_(layout.CHAIN_HEAD_SLOT)
    gpu.num_reqs.fill_(1)
    gpu.input_ids[0] = 1234
    gpu.positions[0] = 0
    gpu.out_cache_loc[0] = 5
    replays = 3
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert int(gpu.kernel_runs.item()) - runs_before == 2 * replays
    record = gpu.canary[5].cpu().view(torch.int64).tolist()
    assert record[layout.RECORD_FIELD_TOKEN] == 1234
    assert record[layout.RECORD_FIELD_POSITION] == 0
    assert int(gpu.ring_index.item()) == 0
    assert int(gpu.slot_runs.item()) == replays  # one stored record per replay
