"""Scenario builders shared by the kernel tests: valid-by-construction launches, random scenarios
for the differential suite, and comparison helpers."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcanary.kernels import layout, write_ref
from kvcanary.kernels.real_kv import RealKvSource

STRIDES = (32, 48, 64)
PAGE_SIZES = (1, 2, 16)
BYTES_PER_TOKEN = (16, 32, 64)


def capture_after_warmup(forward: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``forward``, captured after one warm-up run on a side stream (as torch asks: the first call
    may load modules and allocate), everything synchronised."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    torch.cuda.synchronize()
    return graph


def write_state_args(state: torch.Tensor, *, chain_position_assert: bool) -> dict[str, torch.Tensor]:
    """A runtime's write-launch arguments over its flat state buffer (header, then the ring), as DeviceState builds
    them: the ring, its int32 write index, the WRITE tag's counters, and the chain-position assert flag."""
    tag = layout.LAUNCH_TAG_WRITE
    return {
        "violation_ring": state[layout.STATE_HEADER_FIELDS :].view(-1, layout.VIOLATION_FIELDS),
        "violation_write_index": state[layout.STATE_WRITE_INDEX : layout.STATE_WRITE_INDEX + 1].view(torch.int32)[0:1],
        "slot_run_counter": state[layout.STATE_SLOT_RUNS + tag : layout.STATE_SLOT_RUNS + tag + 1],
        "kernel_run_counter": state[layout.STATE_KERNEL_RUNS + tag : layout.STATE_KERNEL_RUNS + tag + 1],
        "enable_chain_position_assert": torch.full((1,), int(chain_position_assert), dtype=torch.int32,
                                                   device=state.device),
    }


def int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def scalar_i32(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32)


def scalar_i64(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def random_bytes(rng: random.Random, *shape: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.tensor([rng.randrange(256) for _ in range(n)], dtype=torch.uint8).view(*shape)


def random_sources(rng: random.Random, num_slots: int, count: int) -> list[RealKvSource]:
    """`count` sources covering `num_slots`, with row holes and sometimes a per-layer view."""
    sources = []
    for _ in range(count):
        page = rng.choice(PAGE_SIZES)
        nbpt = rng.choice(BYTES_PER_TOKEN)
        read = rng.choice([b for b in range(16, nbpt + 1, 16)])
        rows = -(-num_slots // page) + rng.randint(0, 2)
        width = page * nbpt + rng.choice([0, 16, 32])
        if rng.random() < 0.3:
            layers = rng.randint(2, 3)
            big = random_bytes(rng, rows, layers, width)
            tensor = big[:, rng.randrange(layers)]
        else:
            tensor = random_bytes(rng, rows, width)
        sources.append(RealKvSource(tensor, page, nbpt, read))
    return sources


@dataclass
class Launch:
    """Keyword arguments of one ops/ref call; tensors on CPU."""

    kwargs: dict[str, Any]
    sources: list[RealKvSource] = field(default_factory=list)

    def clone_to(self, device: str | torch.device) -> dict[str, Any]:
        """A deep copy of the arguments on `device` (sources rebuilt over copied bytes)."""
        out: dict[str, Any] = {}
        for k, v in self.kwargs.items():
            out[k] = v.clone().to(device) if isinstance(v, torch.Tensor) else v
        out["real_kv_sources"] = tuple(
            RealKvSource(s.tensor.clone().to(device), s.page_size, s.num_bytes_per_token, s.read_bytes)
            for s in self.sources
        )
        return out


def sink_tensors(rng: random.Random, ring_capacity: int) -> dict[str, torch.Tensor]:
    start = rng.choice([0, 0, 0, 1, 3])
    return {
        "violation_ring": torch.full((ring_capacity, layout.VIOLATION_FIELDS), -7, dtype=torch.int64),
        "violation_write_index": scalar_i32(start),
        "slot_run_counter": scalar_i64(rng.randint(0, 1000)),
        "kernel_run_counter": scalar_i64(rng.randint(0, 1000)),
    }


def random_write_launch(rng: random.Random, *, allow_out_of_range: bool = True) -> Launch:
    num_slots = rng.randint(1, 96)
    stride = rng.choice(STRIDES)
    canary = random_bytes(rng, num_slots, stride)
    # Zero some records so heads, skips and fresh slots all appear.
    for s in range(num_slots):
        if rng.random() < 0.3:
            canary[s].zero_()
    capacity = rng.randint(0, 6)
    oob = allow_out_of_range and rng.random() < 0.25
    free = list(range(1, num_slots))
    rng.shuffle(free)
    tokens: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    offsets = [0]
    seeds = []
    for _ in range(capacity):
        length = rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 40])
        seed_kind = rng.random()
        if seed_kind < 0.4 or not free:
            seed = layout.CHAIN_HEAD_SLOT
        elif oob and seed_kind > 0.9:
            seed = rng.choice([-2, -9, num_slots, num_slots + 5])
        else:
            seed = free.pop()
        seeds.append(seed)
        base_pos = rng.randint(0, 50)
        for i in range(length):
            if rng.random() < 0.15:
                loc = layout.SKIP_WRITE_SLOT if rng.random() < 0.7 else -rng.randint(2, 5)
            elif oob and rng.random() < 0.15:
                loc = num_slots + rng.randint(0, 7)
            elif free:
                loc = free.pop()
            else:
                loc = layout.SKIP_WRITE_SLOT
            locs.append(loc)
            tokens.append(rng.randint(-3, 50000) if rng.random() < 0.95 else rng.randint(-(1 << 63), (1 << 63) - 1))
            positions.append(base_pos + i + (rng.randint(-2, 2) if rng.random() < 0.15 else 0))
        offsets.append(len(locs))
    if oob and capacity and rng.random() < 0.5:
        r = rng.randrange(capacity)
        offsets[r + 1 if rng.random() < 0.5 else r] = rng.choice([-4, len(locs) + 3])
    input_assert = rng.random() < 0.4
    kwargs: dict[str, Any] = {
        "canary_buf": canary,
        "write_offsets": int64(offsets),
        "write_seed_slot_indices": int64(seeds),
        "write_num_valid_reqs": scalar_i32(rng.choice([capacity, capacity, capacity, capacity - 1, capacity + 2, -1])),
        "input_ids": int64(tokens),
        "positions": int64(positions),
        "out_cache_loc": int64(locs),
        "kernel_kind": rng.randint(0, 11),
        "enable_write_input_assert": input_assert,
        "expected_input_tokens": None,
        "expected_input_positions": None,
        "enable_chain_position_assert": scalar_i32(rng.choice([0, 1, 1])),
        "real_kv_hash_mode": rng.choice([0, 1, 2]),
    }
    if input_assert:
        kwargs["expected_input_tokens"] = int64([t if rng.random() < 0.85 else t + 1 for t in tokens])
        kwargs["expected_input_positions"] = int64([p if rng.random() < 0.85 else p - 1 for p in positions])
    kwargs.update(sink_tensors(rng, rng.choice([0, 1, 4, 64])))
    sources = random_sources(rng, num_slots, rng.randint(0, 4))
    return Launch(kwargs, sources)


def random_verify_launch(rng: random.Random, *, allow_out_of_range: bool = True) -> Launch:
    """A written buffer (through the reference) and a plan over it, with planted corruption."""
    num_slots = rng.randint(2, 96)
    stride = rng.choice(STRIDES)
    canary = torch.zeros((num_slots, stride), dtype=torch.uint8)
    sources = random_sources(rng, num_slots, rng.randint(0, 4))
    mode = rng.choice([0, 1, 2])
    # Write a few chains with the reference so most entries verify clean.
    free = list(range(1, num_slots))
    rng.shuffle(free)
    chains: list[list[int]] = []
    chain_tokens: list[list[int]] = []
    while free and len(chains) < 5:
        length = min(len(free), rng.randint(1, 12))
        chain = [free.pop() for _ in range(length)]
        toks = [rng.randint(0, 30000) for _ in chain]
        chains.append(chain)
        chain_tokens.append(toks)
    locs = [s for c in chains for s in c]
    offsets = [0]
    for c in chains:
        offsets.append(offsets[-1] + len(c))
    write_mode = mode if rng.random() < 0.9 else rng.choice([0, 1, 2])
    write_ref.canary_write_step(
        canary_buf=canary,
        write_offsets=int64(offsets),
        write_seed_slot_indices=int64([-1] * len(chains)),
        write_num_valid_reqs=scalar_i32(len(chains)),
        input_ids=int64([t for ts in chain_tokens for t in ts]),
        positions=int64([p for c in chains for p in range(len(c))]),
        out_cache_loc=int64(locs),
        kernel_kind=0,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        enable_chain_position_assert=scalar_i32(0),
        real_kv_sources=sources,
        real_kv_hash_mode=write_mode,
        **sink_tensors(rng, 4),
    )
    # Plant corruption in records and KV bytes.
    for _ in range(rng.choice([0, 0, 1, 2])):
        s = rng.randrange(num_slots)
        canary[s, rng.randrange(32)] ^= 1 << rng.randrange(8)
    for src in sources:
        if rng.random() < 0.2:
            src.kv_bytes[rng.randrange(src.kv_bytes.shape[0]), rng.randrange(16)] ^= 0xFF
    slots, exp_tok, exp_pos, prevs = [], [], [], []
    for c, toks in zip(chains, chain_tokens, strict=True):
        for p, (s, t) in enumerate(zip(c, toks, strict=True)):
            slot, prev, tok, pos = s, (c[p - 1] if p else -1), t, p
            roll = rng.random()
            if roll < 0.05:
                slot = 0
            elif roll < 0.08:
                prev = 0
            elif roll < 0.11:
                prev = rng.randrange(1, num_slots)
            elif roll < 0.14:
                tok = tok + 1
            elif roll < 0.16:
                tok = layout.NO_EXPECTED_TOKEN
            elif roll < 0.18:
                pos = pos + 1
            elif allow_out_of_range and roll < 0.21:
                slot = rng.choice([-1, -5, num_slots, num_slots + 100])
            elif allow_out_of_range and roll < 0.24:
                prev = rng.choice([-2, -8, num_slots, num_slots + 3])
            slots.append(slot)
            prevs.append(prev)
            exp_tok.append(tok)
            exp_pos.append(pos)
    cap = len(slots) + rng.choice([0, 0, 1, 5])
    pad = cap - len(slots)
    slots += [rng.randrange(num_slots) for _ in range(pad)]
    prevs += [rng.randrange(-1, num_slots) for _ in range(pad)]
    exp_tok += [rng.randint(-1, 100) for _ in range(pad)]
    exp_pos += [rng.randint(0, 20) for _ in range(pad)]
    kwargs: dict[str, Any] = {
        "canary_buf": canary,
        "verify_slot_indices": int64(slots),
        "verify_expected_tokens": int64(exp_tok),
        "verify_expected_positions": int64(exp_pos),
        "verify_prev_slot_indices": int64(prevs),
        "verify_num_valid": scalar_i32(rng.choice([len(slots), len(slots), cap, cap + 3, max(0, len(slots) - 2), -1])),
        "verify_enable": scalar_i32(rng.choice([1, 1, 1, 1, 0, 2])),
        "kernel_kind": rng.randint(0, 11),
        "real_kv_hash_mode": mode,
        "check_tokens": rng.random() < 0.5,
    }
    kwargs.update(sink_tensors(rng, rng.choice([0, 1, 4, 64])))
    return Launch(kwargs, sources)


RESULT_KEYS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")


def run_launch(
    fn: Callable[..., None], launch: Launch, device: str, *, ring_capacity: int | None = None
) -> dict[str, Any]:
    """Run `fn` on a fresh copy of `launch` on `device`; return the result tensors on CPU."""
    kwargs = launch.clone_to(device)
    if ring_capacity is not None:
        kwargs["violation_ring"] = torch.full(
            (ring_capacity, layout.VIOLATION_FIELDS), -7, dtype=torch.int64, device=device
        )
    fn(**kwargs)
    if device != "cpu":
        torch.cuda.synchronize()
    out = {k: kwargs[k].cpu() for k in RESULT_KEYS}
    out["real_kv_bytes"] = [s.tensor.cpu() for s in kwargs["real_kv_sources"]]
    return out


def kept_rows(result: dict[str, Any]) -> list[tuple[int, ...]]:
    """The rows a launch stored (its own rows only: the ring starts filled with -7 sentinels)."""
    ring = result["violation_ring"]
    rows = [tuple(r) for r in ring.tolist()]
    return [r for r in rows if r != (-7,) * layout.VIOLATION_FIELDS]
