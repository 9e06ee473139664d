"""Design experiment: ways to run the serial chain of the write kernel's chain warp.

Times only the chain part (loads of slot/token/position, the serial mix3 walk, a prev_hash store
per entry) for one request of N entries, against the one-thread serial-mix floor, so the choice
made in csrc/canary_write.cuh is backed by a measurement. CUDA only.

    python benchmarks/bench_chain_variants.py [--entries 8192]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    import tvm_ffi.cpp

    from kvcanary import jit

    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", jit.cuda_arch())
    mod = tvm_ffi.cpp.load_inline(
        "kvcanary_chain_variants",
        cuda_sources=SOURCE,
        extra_cuda_cflags=["-O3", "-std=c++17", "-Xptxas", "-v"],
        extra_include_paths=[str(jit.source_root() / "include")],
    )
    n = args.entries
    dev = torch.device("cuda")
    slots = torch.randperm(n, device=dev, dtype=torch.int64) + 1
    tokens = torch.randint(0, 50000, (n,), device=dev, dtype=torch.int64)
    positions = torch.arange(n, device=dev, dtype=torch.int64)
    outs = {}
    times = {}
    for name in ("v4", "v0", "v1", "v2", "v3"):
        out = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        fn = getattr(mod, name)
        for _ in range(3):
            fn(slots, tokens, positions, out)
        samples = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(slots, tokens, positions, out)
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3)
        times[name] = statistics.median(samples)
        outs[name] = out.clone()
    for name in ("v1", "v2", "v3"):
        assert torch.equal(outs[name], outs["v0"]), f"{name} disagrees with v0"
    floor = times["v4"]
    print(f"| variant | us ({n} entries) | ns/step | vs floor |\n|---|---|---|---|")
    for name, label in (("v4", "floor: 1 thread, mix only"), ("v0", "shfl, unroll 4, branch"),
                        ("v1", "shfl, full unroll, select"), ("v2", "smem, all lanes, select"),
                        ("v3", "smem, lane 0 walks, publishes")):
        print(f"| {name} {label} | {times[name]:.1f} | {times[name] * 1e3 / n:.1f} | x{times[name] / floor:.2f} |")


if __name__ == "__main__":
    main()
