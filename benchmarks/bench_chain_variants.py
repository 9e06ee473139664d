"""Design experiment: ways to run the serial chain of the write kernel's chain warp.

Part 1 times only the chain part (loads of slot/token/position, the serial mix3 walk, a prev_hash store
per entry) for one request of N entries, against the one-thread serial-mix floors. Part 2 (issue 15) times
the real write kernel (csrc/canary_write.cuh, built here once per chain walk with
-DKVCANARY_WRITE_CHAIN_WALK / -DKVCANARY_WRITE_CHAIN_UNROLL) with every per-entry side effect it has
(prev_hash and payload stores, the chain-position assert, optionally the slot attribution), 1 request of N
tokens, real-KV NONE. Every variant is checked bit-exact against the Python model (kvcanary.kernels.write_ref). CUDA
only.

    python benchmarks/bench_chain_variants.py [--entries 8192] [--no-kernel]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include "kvcanary/hash.h"

using namespace kvcanary;
constexpr unsigned kFull = 0xffffffffu;

// V0: shuffles, dynamic trip count (unroll 4), branch on skip (the shipped kernel before this study)
// V1: shuffles, full unroll of 32 steps, branch-free select
// V2: shared-memory staging, full unroll, all lanes walk, branch-free
// V3: shared-memory staging, lane 0 walks alone and publishes the hash before each entry
// V4: floor: one thread, mix only
template <int V>
__global__ void chain_kernel(const int64_t* slots, const int64_t* tokens, const int64_t* positions, int64_t n,
                             int64_t* out) {
  const uint32_t lane = threadIdx.x;
  __shared__ int64_t s_slot[32], s_tok[32], s_pos[32];
  __shared__ uint64_t s_run[32];
  uint64_t running = chain_head_hash();
  int64_t ns = e_load(slots, n, lane), nt = e_load(tokens, n, lane), np = e_load(positions, n, lane);
  for (int64_t chunk = 0; chunk < n; chunk += 32) {
    const int64_t e = chunk + lane;
    const int64_t slot = ns, tok = nt, pos = np;
    ns = e_load(slots, n, e + 32); nt = e_load(tokens, n, e + 32); np = e_load(positions, n, e + 32);
    if (e >= n) { /* keep lanes in step */ }
    const int64_t my_slot = e < n ? slot : -1;
    uint64_t mine = running;
    if (V == 0) {
      const int64_t rem = n - chunk;
      const uint32_t steps = rem < 32 ? (uint32_t)rem : 32u;
#pragma unroll 4
      for (uint32_t j = 0; j < steps; ++j) {
        const int64_t sj = __shfl_sync(kFull, my_slot, j), tj = __shfl_sync(kFull, tok, j),
                      pj = __shfl_sync(kFull, pos, j);
        if (lane == j) mine = running;
        if (sj >= 0) running = chain_step(running, tj, pj);
      }
    } else if (V == 1) {
#pragma unroll
      for (uint32_t j = 0; j < 32; ++j) {
        const int64_t sj = __shfl_sync(kFull, my_slot, j), tj = __shfl_sync(kFull, tok, j),
                      pj = __shfl_sync(kFull, pos, j);
        mine = lane == j ? running : mine;
        const uint64_t next = chain_step(running, tj, pj);
        running = sj >= 0 ? next : running;
      }
    } else if (V == 2) {
      s_slot[lane] = my_slot; s_tok[lane] = tok; s_pos[lane] = pos;
      __syncwarp();
#pragma unroll
      for (uint32_t j = 0; j < 32; ++j) {
        mine = lane == j ? running : mine;
        const uint64_t next = chain_step(running, s_tok[j], s_pos[j]);
        running = s_slot[j] >= 0 ? next : running;
      }
      __syncwarp();
    } else if (V == 3) {
      s_slot[lane] = my_slot; s_tok[lane] = tok; s_pos[lane] = pos;
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (uint32_t j = 0; j < 32; ++j) {
          s_run[j] = running;
          const uint64_t next = chain_step(running, s_tok[j], s_pos[j]);
          running = s_slot[j] >= 0 ? next : running;
        }
      }
      __syncwarp();
      mine = s_run[lane];
      running = __shfl_sync(kFull, running, 0);
    }
    if (V != 4 && my_slot >= 0) out[my_slot] = (int64_t)mine;
  }
  if (V == 4 && lane == 0) {
    uint64_t h = chain_head_hash();
    for (int64_t i = 0; i < n; ++i) h = chain_step(h, i, i);
    out[0] = (int64_t)h;
  }
}

__device__ __forceinline__ int64_t e_load(const int64_t* a, int64_t n, int64_t i);
"""

# e_load must be declared before use: prepend a definition.
SOURCE = (
    r"""
#include <cstdint>
__device__ __forceinline__ int64_t e_load(const int64_t* a, int64_t n, int64_t i) { return i < n ? a[i] : -1; }
"""
    + SOURCE.replace("__device__ __forceinline__ int64_t e_load(const int64_t* a, int64_t n, int64_t i);\n", "")
)

SOURCE += r"""
// V5 (issue 15): the floor with the hash in vector registers (it starts from a per-lane load, so ptxas
// cannot prove it warp-uniform and does not use the uniform datapath as it does for V4): the floor any
// walk over per-entry data can reach.
__global__ void chain_floor_vector(const int64_t* slots, int64_t n, int64_t* out) {
  uint64_t h = chain_head_hash() ^ static_cast<uint64_t>(slots[threadIdx.x] < 0);  // slots are >= 0
  for (int64_t i = 0; i < n; ++i) h = chain_step(h, i, i);
  if (threadIdx.x == 0) out[0] = (int64_t)h;
}

// V6 (issue 15): shared-memory stage of (token, position) pairs, all lanes walk reading one 16-byte pair per
// step at a uniform address, lane 0 parks the hash before each step in shared memory; unrolled by U steps.
// (The kernel's kSharedStage walk; skipped entries take the kernel's shuffle path, so the slots here are >= 0.)
template <int U>
__global__ void chain_staged(const int64_t* slots, const int64_t* tokens, const int64_t* positions, int64_t n,
                             int64_t* out) {
  const uint32_t lane = threadIdx.x;
  __shared__ longlong2 s_in[32];
  __shared__ uint64_t s_run[32];
  uint64_t running = chain_head_hash();
  int64_t ns = e_load(slots, n, lane), nt = e_load(tokens, n, lane), np = e_load(positions, n, lane);
  for (int64_t chunk = 0; chunk < n; chunk += 32) {
    const int64_t e = chunk + lane;
    const int64_t slot = ns, tok = nt, pos = np;
    ns = e_load(slots, n, e + 32); nt = e_load(tokens, n, e + 32); np = e_load(positions, n, e + 32);
    s_in[lane] = make_longlong2(tok, pos);
    __syncwarp();
#pragma unroll 1
    for (uint32_t j0 = 0; j0 < 32; j0 += U) {
#pragma unroll
      for (uint32_t j = j0; j < j0 + U; ++j) {
        const longlong2 in = s_in[j];
        if (lane == 0) s_run[j] = running;
        running = chain_step(running, in.x, in.y);
      }
    }
    __syncwarp();
    if (e < n && slot >= 0) out[slot] = (int64_t)s_run[lane];
  }
}

void run_floor_vector(tvm::ffi::TensorView slots, tvm::ffi::TensorView tokens, tvm::ffi::TensorView positions,
                      tvm::ffi::TensorView out) {
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(slots.device().device_type, slots.device().device_id));
  chain_floor_vector<<<1, 32, 0, stream>>>(static_cast<const int64_t*>(slots.data_ptr()), slots.size(0),
                                           static_cast<int64_t*>(out.data_ptr()));
}
template <int U>
void run_staged(tvm::ffi::TensorView slots, tvm::ffi::TensorView tokens, tvm::ffi::TensorView positions,
                tvm::ffi::TensorView out) {
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(slots.device().device_type, slots.device().device_id));
  chain_staged<U><<<1, 32, 0, stream>>>(static_cast<const int64_t*>(slots.data_ptr()),
      static_cast<const int64_t*>(tokens.data_ptr()), static_cast<const int64_t*>(positions.data_ptr()),
      slots.size(0), static_cast<int64_t*>(out.data_ptr()));
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v5, run_floor_vector);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v6, run_staged<8>);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v7, run_staged<32>);
"""

SOURCE += r"""
template <int V>
void run(tvm::ffi::TensorView slots, tvm::ffi::TensorView tokens, tvm::ffi::TensorView positions,
         tvm::ffi::TensorView out) {
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(slots.device().device_type, slots.device().device_id));
  chain_kernel<V><<<1, 32, 0, stream>>>(static_cast<const int64_t*>(slots.data_ptr()),
      static_cast<const int64_t*>(tokens.data_ptr()), static_cast<const int64_t*>(positions.data_ptr()),
      slots.size(0), static_cast<int64_t*>(out.data_ptr()));
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v0, run<0>);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v1, run<1>);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v2, run<2>);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v3, run<3>);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(v4, run<4>);
"""


# The real write kernel, one build per chain walk; -D flags pick the walk (see csrc/canary_write.cuh).
KERNEL_SOURCE = r"""
#include <tvm/ffi/function.h>
#include "canary_write.cuh"
TVM_FFI_DLL_EXPORT_TYPED_FUNC(write, kvcanary::host::canary_write_step_attributed);
"""

# name -> (KVCANARY_WRITE_CHAIN_WALK, KVCANARY_WRITE_CHAIN_UNROLL, label)
KERNEL_WALKS: dict[str, tuple[int, int, str]] = {
    "shuffle": (0, 8, "shuffle + selects, full unroll (before issue 15)"),
    "staged8": (1, 8, "smem stage, unroll 8 (default)"),
    "staged32": (1, 32, "smem stage, full unroll"),
}
CHAIN_LABELS = {
    "v4": "floor: 1 thread, mix only (uniform datapath)",
    "v5": "floor: mix only, vector registers",
    "v0": "shfl, unroll 4, branch",
    "v1": "shfl, full unroll, select",
    "v2": "smem, all lanes, select",
    "v3": "smem, lane 0 walks, publishes",
    "v6": "smem stage, lane 0 parks, unroll 8",
    "v7": "smem stage, lane 0 parks, full unroll",
}


@dataclass
class WriteCase:
    """One write launch's tensors (on `device`), in the raw ABI's order, plus what the model needs."""

    canary: torch.Tensor
    offsets: torch.Tensor
    seeds: torch.Tensor
    num_valid: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    chain_assert: torch.Tensor
    ring: torch.Tensor
    index: torch.Tensor
    slot_runs: torch.Tensor
    kernel_runs: torch.Tensor
    meta: torch.Tensor | None = None
    step: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    attribution: torch.Tensor | None = None
    serials: torch.Tensor | None = None

    def fresh(self) -> WriteCase:
        return WriteCase(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()})


def make_case(device: torch.device, requests: list[tuple[list[int], list[int], list[int], int]], num_slots: int,
              chain_assert: bool, attribution: bool, seed_records: dict[int, tuple[int, int, int]]) -> WriteCase:
    """requests: (slots, tokens, positions, seed slot); seed_records: slot -> (token, position, prev_hash)."""
    from kvcanary.kernels import layout

    offsets = [0]
    for slots, _, _, _ in requests:
        offsets.append(offsets[-1] + len(slots))
    canary = torch.zeros((num_slots, layout.RECORD_BYTES), dtype=torch.uint8)
    for slot, (tok, pos, prev) in seed_records.items():
        fields = torch.tensor([tok, pos, prev, 0], dtype=torch.int64)
        canary[slot] = fields.view(torch.uint8)

    def flat(i: int) -> torch.Tensor:
        return torch.tensor([v for r in requests for v in r[i]], dtype=torch.int64, device=device)

    cap = len(requests)
    case = WriteCase(
        canary=canary.to(device),
        offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        seeds=torch.tensor([r[3] for r in requests], dtype=torch.int64, device=device),
        num_valid=torch.tensor([cap], dtype=torch.int32, device=device),
        tokens=flat(1), positions=flat(2), slots=flat(0),
        chain_assert=torch.tensor([1 if chain_assert else 0], dtype=torch.int32, device=device),
        ring=torch.zeros((1024, layout.VIOLATION_FIELDS), dtype=torch.int64, device=device),
        index=torch.zeros(1, dtype=torch.int32, device=device),
        slot_runs=torch.zeros(1, dtype=torch.int64, device=device),
        kernel_runs=torch.zeros(1, dtype=torch.int64, device=device),
    )
    if attribution:
        case.meta = torch.zeros((1024, layout.VIOLATION_META_FIELDS), dtype=torch.int64, device=device)
        case.step = torch.tensor([41], dtype=torch.int64, device=device)
        case.rows = torch.arange(cap, dtype=torch.int64, device=device) + 3
        case.attribution = torch.full((num_slots, layout.SLOT_ATTRIBUTION_FIELDS), -7, dtype=torch.int64,
                                      device=device)
        case.serials = torch.arange(cap + 8, dtype=torch.int64, device=device) * 100 + 5
    return case


def launch_args(c: WriteCase) -> tuple[Any, ...]:
    """canary_write_step_attributed's raw arguments for `c` (no real-KV sources)."""
    from kvcanary.kernels import layout
    from kvcanary.kernels.call import real_kv_launch_args

    bufs, params, num_sources = real_kv_launch_args((), c.canary.device)
    return (c.canary, c.offsets, c.seeds, c.num_valid, c.tokens, c.positions, c.slots, KIND_WRITE, 0, None, None,
            c.ring, c.index, c.slot_runs, c.kernel_runs, c.chain_assert, *bufs, params, num_sources,
            layout.REAL_KV_HASH_MODE_NONE, c.meta, c.step, c.rows, c.attribution, c.serials)


def launch(fn: Any, c: WriteCase) -> None:
    fn(*launch_args(c))


KIND_WRITE = 1  # kernel_kind stamped into violation rows; any value works for the comparison


def model(c: WriteCase) -> WriteCase:
    """The Python model's result for `c` (records, ring, counters; the CPU tensors of a copy)."""
    from kvcanary.kernels import write_ref

    m = c.fresh()
    m = WriteCase(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(m).items()})
    write_ref.canary_write_step(
        canary_buf=m.canary, write_offsets=m.offsets, write_seed_slot_indices=m.seeds,
        write_num_valid_reqs=m.num_valid, input_ids=m.tokens, positions=m.positions, out_cache_loc=m.slots,
        kernel_kind=KIND_WRITE, enable_write_input_assert=False, expected_input_tokens=None,
        expected_input_positions=None, violation_ring=m.ring, violation_write_index=m.index,
        slot_run_counter=m.slot_runs, kernel_run_counter=m.kernel_runs, enable_chain_position_assert=m.chain_assert,
    )
    return m


def check_against_model(name: str, got: WriteCase, want: WriteCase) -> None:
    """Records, counters and ring rows (as a multiset: requests run in parallel) equal the model's."""
    assert torch.equal(got.canary.cpu(), want.canary), f"{name}: records differ from the Python model"
    for field_name in ("index", "slot_runs", "kernel_runs"):
        assert torch.equal(getattr(got, field_name).cpu(), getattr(want, field_name)), f"{name}: {field_name}"
    n = min(int(want.index[0]), want.ring.shape[0])
    rows = sorted(map(tuple, got.ring[:n].cpu().tolist()))
    assert rows == sorted(map(tuple, want.ring[:n].tolist())), f"{name}: violation rows differ"
    if got.attribution is not None and got.serials is not None and got.rows is not None and got.step is not None:
        # Every stored record's slot gets (step, serial of the request's row); other slots keep their value.
        expected = torch.full_like(got.attribution.cpu(), -7)
        offsets, slots = want.offsets.tolist(), want.slots.tolist()
        serials, rows = got.serials.cpu().tolist(), got.rows.cpu().tolist()
        for r in range(len(offsets) - 1):
            for e in range(offsets[r], offsets[r + 1]):
                if 0 <= slots[e] < expected.shape[0]:
                    expected[slots[e]] = torch.tensor([int(got.step[0]), serials[rows[r]]])
        assert torch.equal(got.attribution.cpu(), expected), f"{name}: slot attribution differs"


def correctness_case(device: torch.device, attribution: bool) -> WriteCase:
    """Full chunks, a chunk with skips, short tails, a seeded request with a position break (chain assert),
    an out-of-range slot and seed: every path of the chain warp, in one launch."""
    gen = torch.Generator().manual_seed(15)
    num_slots = 4096
    perm = (torch.randperm(num_slots - 64, generator=gen) + 64).tolist()

    def take(k: int) -> list[int]:
        return [perm.pop() for _ in range(k)]

    def toks(k: int) -> list[int]:
        return torch.randint(-(1 << 40), 1 << 40, (k,), generator=gen).tolist()

    n0 = 32 * 9 + 5
    slots0 = take(n0)
    slots0[40] = -1  # a skip inside the second chunk
    slots0[70] = num_slots + 3  # out of range: row, not stored, chain advances
    r0 = (slots0, toks(n0), list(range(n0)), -1)
    n1 = 32 * 3
    pos1 = list(range(11, 11 + n1))
    pos1[50] += 2  # chain-position break in a full chunk
    r1 = (take(n1), toks(n1), pos1, 7)
    r2 = (take(3), toks(3), [5, 6, 7], 8)  # short request, seeded
    r3 = (take(40), toks(40), list(range(40)), num_slots + 9)  # bad seed: row, chain from the anchor
    seeds = {7: (123, 10, 0x1234567), 8: (-5, 4, -99)}
    return make_case(device, [r0, r1, r2, r3], num_slots, chain_assert=True, attribution=attribution,
                     seed_records=seeds)


def timing_case(device: torch.device, n: int, attribution: bool) -> WriteCase:
    """1 request of n tokens, unseeded, NONE, slots scattered over 2^20 slots (as bench_kernels.py)."""
    from kvcanary.kernels import layout

    gen = torch.Generator(device=device).manual_seed(0)
    slots_total = 1 << 20
    c = make_case(device, [([0], [0], [0], -1)], 1, chain_assert=False, attribution=attribution, seed_records={})
    c.canary = torch.zeros((slots_total, layout.RECORD_BYTES), dtype=torch.uint8, device=device)
    c.slots = torch.randperm(slots_total - 1, device=device, generator=gen)[:n] + 1
    c.tokens = torch.randint(0, 1 << 17, (n,), device=device, generator=gen)
    c.positions = torch.arange(n, device=device)
    c.offsets = torch.tensor([0, n], dtype=torch.int64, device=device)
    if c.attribution is not None:
        c.attribution = torch.zeros((slots_total, layout.SLOT_ATTRIBUTION_FIELDS), dtype=torch.int64, device=device)
    return c


SLEEP_CYCLES = 1_000_000  # ~0.5 ms of GPU sleep queued before each timed launch: host launch cost excluded


def time_launches(fn: Callable[[], None], reps: int) -> float:
    """Median microseconds of one launch (CUDA events around each, queued behind a GPU sleep; 3 warmups)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return statistics.median(samples)


def chain_model(tokens: list[int], positions: list[int]) -> list[int]:
    """The hash before each entry (int64), from the chain head: the Python model of the chain."""
    from kvcanary.kernels import hash_ref

    out, running = [], hash_ref.chain_head_hash()
    for t, p in zip(tokens, positions, strict=True):
        out.append(hash_ref.to_i64(running))
        running = hash_ref.chain_step(running, t, p)
    return out


def build_chain_module() -> Any:
    import tvm_ffi.cpp

    from kvcanary.kernels import jit

    return tvm_ffi.cpp.load_inline(
        "kvcanary_chain_variants",
        cuda_sources=SOURCE,
        extra_cuda_cflags=["-O3", "-std=c++17"],
        extra_include_paths=[str(jit.source_root() / "include")],
    )


def build_walk_module(name: str) -> Any:
    """The write kernel with chain walk `name` (KERNEL_WALKS); tvm-ffi caches the build by source and flags."""
    import tvm_ffi.cpp

    from kvcanary.kernels import jit

    root = jit.source_root()
    walk, unroll, _ = KERNEL_WALKS[name]
    start = time.perf_counter()
    mod = tvm_ffi.cpp.load_inline(
        f"kvcanary_write_walk_{name}",
        cuda_sources=KERNEL_SOURCE,
        extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo", f"-DKVCANARY_WRITE_CHAIN_WALK={walk}",
                           f"-DKVCANARY_WRITE_CHAIN_UNROLL={unroll}"],
        extra_include_paths=[str(root / "include"), str(root / "csrc")],
    )
    logger.info("walk %s: module ready in %.1f s", name, time.perf_counter() - start)
    return mod


def bench_chain_only(n: int, reps: int) -> dict[str, float]:
    from kvcanary.kernels import hash_ref

    mod = build_chain_module()
    dev = torch.device("cuda")
    slots = torch.randperm(n, device=dev, dtype=torch.int64) + 1
    tokens = torch.randint(0, 50000, (n,), device=dev, dtype=torch.int64)
    positions = torch.arange(n, device=dev, dtype=torch.int64)
    befores = chain_model(tokens.tolist(), positions.tolist())
    want = torch.zeros(n + 1, dtype=torch.int64)
    want[slots.cpu()] = torch.tensor(befores, dtype=torch.int64)
    floor_want = hash_ref.to_i64(hash_ref.chain_head_hash())
    for i in range(n):
        floor_want = hash_ref.to_i64(hash_ref.chain_step(floor_want, i, i))
    times = {}
    for name in CHAIN_LABELS:
        out = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        fn = getattr(mod, name)
        times[name] = time_launches(partial(fn, slots, tokens, positions, out), reps)
        got = out.cpu()
        if name in ("v4", "v5"):
            assert int(got[0]) == floor_want, f"{name}: floor chain differs from the Python model"
        else:
            assert torch.equal(got, want), f"{name}: hashes differ from the Python model"
    return times


def bench_kernel_walks(n: int, reps: int, walks: list[str], attribution: bool) -> dict[str, float]:
    dev = torch.device("cuda")
    check = correctness_case(dev, attribution=True)
    want = model(check)
    times = {}
    for name in walks:
        mod = build_walk_module(name)
        got = check.fresh()
        launch(mod.write, got)
        torch.cuda.synchronize()
        check_against_model(f"kernel {name}", got, want)
        c = timing_case(dev, n, attribution)
        times[name] = time_launches(partial(mod.write, *launch_args(c)), reps)
        torch.cuda.synchronize()
        assert int(c.index[0]) == 0, f"kernel {name}: violations on the clean timing case"
    return times


def shipped_case(n: int) -> tuple[Any, WriteCase]:
    """The kvcanary build (jit, default walk) and the 1 x n NONE timing case; checked on the mixed case first."""
    from kvcanary.kernels.jit import load_module

    mod = load_module("cuda")
    dev = torch.device("cuda")
    check = correctness_case(dev, attribution=True)
    got = check.fresh()
    launch(mod.canary_write_step_attributed, got)
    torch.cuda.synchronize()
    check_against_model("shipped build", got, model(check))
    return mod, timing_case(dev, n, attribution=False)


def time_shipped(n: int, reps: int) -> tuple[float, float]:
    """(median us of one launch, us per launch over 20 back-to-back launches) of the shipped build."""
    mod, c = shipped_case(n)
    call = partial(mod.canary_write_step_attributed, *launch_args(c))
    one = time_launches(call, reps)
    batches = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        for _ in range(20):
            call()
        b.record()
        b.synchronize()
        batches.append(a.elapsed_time(b) * 1e3 / 20)
    assert int(c.index[0]) == 0, "shipped build: violations on the clean timing case"
    return one, statistics.median(batches)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-kernel", action="store_true", help="chain-only variants (part 1) only")
    parser.add_argument("--walks", default=",".join(KERNEL_WALKS), help="kernel walks to build and time")
    parser.add_argument("--attribution", action="store_true", help="time the kernel with slot attribution on")
    parser.add_argument("--build-only", action="store_true", help="build the modules (no GPU needed) and exit")
    parser.add_argument("--shipped", action="store_true", help="also time the kvcanary build (jit.build('cuda'))")
    parser.add_argument("--profile-launches", type=int, default=0,
                        help="only launch the shipped write kernel this many times on 1 x N NONE (for ncu), then exit")
    args = parser.parse_args()
    from kvcanary.kernels import jit

    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", jit.cuda_arch())
    n = args.entries
    walks = [w.strip() for w in args.walks.split(",") if w.strip()]
    if args.build_only:  # one nvcc per module, in parallel (the builds wait on subprocesses, not the GIL)
        with ThreadPoolExecutor(max_workers=len(walks) + 1) as pool:
            jobs = [pool.submit(build_chain_module)] + [pool.submit(build_walk_module, w) for w in walks]
            for job in jobs:
                job.result()
        return
    if args.profile_launches > 0:
        mod, c = shipped_case(n)
        for _ in range(args.profile_launches):
            launch(mod.canary_write_step_attributed, c)
        torch.cuda.synchronize()
        return
    times = bench_chain_only(n, args.reps)
    floor = times["v4"]
    print(f"| chain only: variant | us ({n} entries) | ns/step | vs floor |\n|---|---|---|---|")
    for name, label in CHAIN_LABELS.items():
        print(f"| {name} {label} | {times[name]:.1f} | {times[name] * 1e3 / n:.1f} | x{times[name] / floor:.2f} |")
    print("chain-only variants: all equal to the Python chain model")
    if args.no_kernel:
        return
    ktimes = bench_kernel_walks(n, args.reps, walks, args.attribution)
    extra = ", slot attribution on" if args.attribution else ""
    print(f"\n| write kernel 1 x {n} NONE{extra}: chain walk | us | ns/step | vs floor |\n|---|---|---|---|")
    for name in walks:
        t = ktimes[name]
        print(f"| {name}: {KERNEL_WALKS[name][2]} | {t:.1f} | {t * 1e3 / n:.1f} | x{t / floor:.2f} |")
    print("kernel walks: records, rows, counters and attribution equal to the Python model on the mixed case")
    if args.shipped:
        one, back = time_shipped(n, args.reps)
        print(f"| shipped build (jit, default walk) | {one:.1f} (back to back: {back:.1f}) | {one * 1e3 / n:.1f} "
              f"| x{one / floor:.2f} |")


if __name__ == "__main__":
    main()
