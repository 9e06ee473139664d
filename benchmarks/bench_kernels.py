#!/usr/bin/env python3
"""Kernel benchmarks for kvcanary's CUDA backend, next to the floors they are judged against.

Floors:
  * copy      device-to-device ``copy_`` of a >= 1 GiB buffer (GB/s counts read + write);
  * mix       one thread running N dependent ``mix3`` steps (kvcanary/hash.h, the chain's serial part);
  * read      a plain read of exactly the bytes canary_verify_step reads (4 plan arrays + the slot's and
              the predecessor's 32-byte records, + 16 real-KV bytes in PARTIAL), xor-folded, no hashing.
Kernels:
  * verify    16M entries over a 4M-slot canary buffer (stride 32), requests of 2048 tokens, slots laid
              out in chain order or scattered at random; real-KV NONE and PARTIAL ([4M, 256] uint8 source);
  * write     1 x 8192 (NONE, PARTIAL with one 2048-byte-row source), 1024 x 16 PARTIAL, and 256 x 1 decode
              (NONE, PARTIAL) timed per launch inside a CUDA graph of 100 launches.

Every time is the median over >= 20 CUDA-event-timed repetitions after warmup; each repetition is queued
behind a ``torch.cuda._sleep`` so host launch overhead is not measured, and inputs rotate over
``--copies`` (>= 3) copies so L2 (60 MB on an H200) does not flatter. Correctness checks (0 violations
after every timed run, verify catching a planted corruption, mix3 equal to a Python model) make the
script exit 1 when they fail.

Usage (repository root, a CUDA machine):
    PYTHONPATH=plugin python3 benchmarks/bench_kernels.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT / "plugin") not in sys.path:
    try:
        import kvcanary  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT / "plugin"))

import torch  # noqa: E402

from kvcanary.kernels import call, jit, layout, verify, write  # noqa: E402
from kvcanary.kernels.real_kv import RealKvSource  # noqa: E402

MASK64 = (1 << 64) - 1
GIB = 1 << 30
KIND_WRITE = 1
KIND_VERIFY = 2
SLEEP_CYCLES = 200_000  # ~100 us at H200 clocks: longer than any host-side launch path timed here

# --------------------------------------------------------------------------------------------------
# floor kernels (tvm-ffi load_inline; the same mix3 as the kernels through kvcanary/hash.h)
# --------------------------------------------------------------------------------------------------

FLOOR_CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <tvm/ffi/extra/cuda/base.h>

#include "kvcanary/hash.h"

namespace {

__global__ void serial_mix_chain_kernel(uint64_t* out, int64_t n, uint64_t seed) {
  uint64_t h = seed;
  for (int64_t i = 0; i < n; ++i) {
    h = kvcanary::mix3(h, static_cast<uint64_t>(i) ^ seed, static_cast<uint64_t>(i) + 1);
  }
  out[0] = h;
}

// Reads what canary_verify_step reads for entry e, at the same addresses and with the same 16-byte
// loads, and folds it with xor: no hashing, no compares, no violation rows.
__global__ void plain_read_kernel(const int64_t* slots, const int64_t* tokens, const int64_t* positions,
                                  const int64_t* prevs, int64_t n, const uint8_t* buf, int64_t stride,
                                  int64_t num_slots, const uint8_t* kv, int64_t kv_row_stride, uint64_t* out) {
  uint64_t acc = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t slot = slots[e];
    if (slot <= 0 || slot >= num_slots) continue;
    const int64_t prev = prevs[e];
    acc ^= static_cast<uint64_t>(tokens[e]) ^ static_cast<uint64_t>(positions[e]);
    const ulonglong2* rec = reinterpret_cast<const ulonglong2*>(buf + slot * stride);
    const ulonglong2 a = rec[0];
    const ulonglong2 b = rec[1];
    acc ^= a.x ^ a.y ^ b.x ^ b.y;
    if (prev > 0 && prev < num_slots) {
      const ulonglong2* prec = reinterpret_cast<const ulonglong2*>(buf + prev * stride);
      const ulonglong2 c = prec[0];
      const ulonglong2 d = prec[1];
      acc ^= c.x ^ c.y ^ d.x ^ d.y;
    }
    if (kv != nullptr) {
      const ulonglong2 w = __ldg(reinterpret_cast<const ulonglong2*>(kv + slot * kv_row_stride));
      acc ^= w.x ^ w.y;
    }
  }
  if (acc == 0x9E3779B97F4A7C15ull) out[0] = acc;  // practically never taken; keeps the loads alive
}

cudaStream_t stream_of(const tvm::ffi::TensorView& t) {
  const DLDevice dev = t.device();
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
}

void check_cuda_u64(const tvm::ffi::TensorView& t, const char* what, int64_t min_numel) {
  if (t.device().device_type != kDLCUDA) TVM_FFI_THROW(ValueError) << what << ": expected a CUDA tensor";
  if (t.dtype().bits != 64) TVM_FFI_THROW(TypeError) << what << ": expected a 64-bit dtype";
  if (t.numel() < min_numel) TVM_FFI_THROW(ValueError) << what << ": too small";
}

}  // namespace

void serial_mix_chain(tvm::ffi::TensorView out, int64_t n) {
  check_cuda_u64(out, "out", 1);
  serial_mix_chain_kernel<<<1, 1, 0, stream_of(out)>>>(static_cast<uint64_t*>(out.data_ptr()), n,
                                                       0x5EED5EED00000000ull ^ static_cast<uint64_t>(n));
  TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
}

void plain_read(tvm::ffi::TensorView slots, tvm::ffi::TensorView tokens, tvm::ffi::TensorView positions,
                tvm::ffi::TensorView prevs, tvm::ffi::TensorView canary_buf, tvm::ffi::TensorView kv,
                int64_t use_kv, tvm::ffi::TensorView out, int64_t blocks) {
  const int64_t n = slots.numel();
  check_cuda_u64(slots, "slots", n);
  check_cuda_u64(tokens, "tokens", n);
  check_cuda_u64(positions, "positions", n);
  check_cuda_u64(prevs, "prevs", n);
  check_cuda_u64(out, "out", 1);
  if (canary_buf.ndim() != 2 || canary_buf.device().device_type != kDLCUDA)
    TVM_FFI_THROW(ValueError) << "canary_buf: expected a 2-d CUDA tensor";
  if (kv.ndim() != 2 || kv.device().device_type != kDLCUDA)
    TVM_FFI_THROW(ValueError) << "kv: expected a 2-d CUDA tensor";
  const uint8_t* kv_ptr = use_kv ? static_cast<const uint8_t*>(kv.data_ptr()) : nullptr;
  plain_read_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream_of(slots)>>>(
      static_cast<const int64_t*>(slots.data_ptr()), static_cast<const int64_t*>(tokens.data_ptr()),
      static_cast<const int64_t*>(positions.data_ptr()), static_cast<const int64_t*>(prevs.data_ptr()), n,
      static_cast<const uint8_t*>(canary_buf.data_ptr()), canary_buf.stride(0), canary_buf.size(0), kv_ptr,
      kv.stride(0) * ((kv.dtype().bits + 7) / 8), static_cast<uint64_t*>(out.data_ptr()));
  TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
}
"""

VERIFY_THREADS_PER_BLOCK = 256  # kvcanary::kVerifyThreadsPerBlock
VERIFY_BLOCKS_PER_SM = 8  # kvcanary::kVerifyBlocksPerSm


def _toolchain_env() -> None:
    """nvcc, CUDA_HOME, ninja and the arch list for the floor module (the kvcanary loader sets its own)."""
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH") and Path("/usr/local/cuda").is_dir():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    if shutil.which("ninja") is None:
        candidates = []
        try:
            import ninja  # type: ignore[import-not-found]

            candidates.append(str(getattr(ninja, "BIN_DIR", "")))
            candidates.append(str(Path(ninja.__file__).resolve().parent.parent / "bin"))  # pip --target layout
        except ImportError:
            pass
        for c in candidates:
            if c and (Path(c) / "ninja").exists():
                os.environ["PATH"] = f"{c}{os.pathsep}{os.environ.get('PATH', '')}"
                break
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = jit.cuda_arch()


def load_floor_module() -> tuple[Any, float]:
    import tvm_ffi
    import tvm_ffi.cpp

    _toolchain_env()
    include = jit.source_root() / "include"
    arch = os.environ["TVM_FFI_CUDA_ARCH_LIST"]
    key = hashlib.sha256()
    for part in (FLOOR_CUDA_SOURCE, arch, str(getattr(tvm_ffi, "__version__", "?")), jit.source_digest()):
        key.update(part.encode())
    directory = jit.cache_root() / "bench" / f"floors-sm{arch.replace('.', '')}-{key.hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    module = tvm_ffi.cpp.load_inline(
        "kvcanary_bench_floors",
        cuda_sources=FLOOR_CUDA_SOURCE,
        functions=["serial_mix_chain", "plain_read"],
        extra_cuda_cflags=["-O3"],
        extra_include_paths=[str(include)],
        build_directory=str(directory),
    )
    return module, time.perf_counter() - start


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int

    def as_dict(self) -> dict[str, float]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms, "reps": self.reps}


def _sleep() -> None:
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
    except (AttributeError, RuntimeError):
        pass


def time_cuda(fns: list[Callable[[], None]], reps: int, warmup: int, divide: int = 1) -> Timing:
    """Median CUDA-event time of fns[i % len(fns)]() over `reps` repetitions (each behind a GPU sleep)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        _sleep()
        start.record()
        fns[i % len(fns)]()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) / divide for s, e in events)
    return Timing(statistics.median(times), times[0], times[-1], reps)


# --------------------------------------------------------------------------------------------------
# canary state helpers
# --------------------------------------------------------------------------------------------------


@dataclass
class Sinks:
    ring: torch.Tensor
    index: torch.Tensor
    slot_runs: torch.Tensor
    kernel_runs: torch.Tensor

    @staticmethod
    def new(device: torch.device, capacity: int = 1024) -> Sinks:
        return Sinks(
            torch.zeros((capacity, layout.VIOLATION_FIELDS), dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )

    def violations(self) -> int:
        return int(self.index.item())

    def reset(self) -> None:
        self.ring.zero_()
        self.index.zero_()


@dataclass
class WriteInputs:
    offsets: torch.Tensor
    seeds: torch.Tensor
    num_valid: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    chain_assert: torch.Tensor
    # verify plan covering exactly the written entries (seed as the first predecessor)
    plan: VerifyPlan | None = None


@dataclass
class VerifyPlan:
    slots: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    prevs: torch.Tensor
    num_valid: torch.Tensor
    enable: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def entries(self) -> int:
        return int(self.slots.numel())


def call_write(canary: torch.Tensor, w: WriteInputs, sinks: Sinks, sources: list[RealKvSource], mode: int) -> None:
    write.canary_write_step(
        canary_buf=canary,
        write_offsets=w.offsets,
        write_seed_slot_indices=w.seeds,
        write_num_valid_reqs=w.num_valid,
        input_ids=w.tokens,
        positions=w.positions,
        out_cache_loc=w.slots,
        kernel_kind=KIND_WRITE,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        violation_ring=sinks.ring,
        violation_write_index=sinks.index,
        slot_run_counter=sinks.slot_runs,
        kernel_run_counter=sinks.kernel_runs,
        enable_chain_position_assert=w.chain_assert,
        real_kv_sources=sources,
        real_kv_hash_mode=mode,
    )


def call_verify(canary: torch.Tensor, v: VerifyPlan, sinks: Sinks, sources: list[RealKvSource], mode: int) -> None:
    verify.canary_verify_step(
        canary_buf=canary,
        verify_slot_indices=v.slots,
        verify_expected_tokens=v.tokens,
        verify_expected_positions=v.positions,
        verify_prev_slot_indices=v.prevs,
        verify_num_valid=v.num_valid,
        verify_enable=v.enable,
        kernel_kind=KIND_VERIFY,
        violation_ring=sinks.ring,
        violation_write_index=sinks.index,
        slot_run_counter=sinks.slot_runs,
        kernel_run_counter=sinks.kernel_runs,
        real_kv_sources=sources,
        real_kv_hash_mode=mode,
        check_tokens=True,
    )


def i32(n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int32, device=device)


def write_inputs(
    slots: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    seeds: torch.Tensor,
    chain_assert: bool,
) -> WriteInputs:
    """Inputs of one write launch: `slots`/`tokens`/`positions` are [reqs, len]; requests in row order."""
    reqs, length = slots.shape
    device = slots.device
    offsets = torch.arange(reqs + 1, dtype=torch.int64, device=device) * length
    w = WriteInputs(
        offsets=offsets,
        seeds=seeds.to(torch.int64).contiguous(),
        num_valid=i32(reqs, device),
        tokens=tokens.reshape(-1).to(torch.int64).contiguous(),
        positions=positions.reshape(-1).to(torch.int64).contiguous(),
        slots=slots.reshape(-1).to(torch.int64).contiguous(),
        chain_assert=i32(1 if chain_assert else 0, device),
    )
    # The verify plan of exactly these entries: predecessor = seed (or chain head), then the previous slot.
    first_prev = seeds.to(torch.int64).view(reqs, 1)
    prevs = torch.cat([first_prev, slots[:, :-1].to(torch.int64)], dim=1)
    w.plan = make_plan(w.slots, w.tokens, w.positions, prevs.reshape(-1))
    return w


def make_plan(slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, prevs: torch.Tensor) -> VerifyPlan:
    device = slots.device
    n = int(slots.numel())
    return VerifyPlan(
        slots=slots.contiguous(),
        tokens=tokens.contiguous(),
        positions=positions.contiguous(),
        prevs=prevs.contiguous(),
        num_valid=i32(n, device),
        enable=i32(1, device),
    )


def random_tokens(shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1 << 31, shape, dtype=torch.int64, device=device, generator=gen)


def random_bytes(rows: int, cols: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device=device, generator=gen)


# --------------------------------------------------------------------------------------------------
# Python model of mix3 (SPEC §2) for the floor kernel's self-check
# --------------------------------------------------------------------------------------------------


def splitmix64(x: int) -> int:
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def mix3(a: int, b: int, c: int) -> int:
    return splitmix64(splitmix64(splitmix64(a) ^ (b & MASK64)) ^ (c & MASK64))


def serial_chain_model(n: int) -> int:
    seed = 0x5EED5EED00000000 ^ n
    h = seed
    for i in range(n):
        h = mix3(h, i ^ seed, i + 1)
    return h


# --------------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------------


@dataclass
class Config:
    quick: bool
    reps: int
    warmup: int
    copies: int
    copy_bytes: int
    verify_slots: int
    verify_entries: int
    req_len: int
    verify_source_bytes: int
    write_slots: int
    write_row_bytes: int
    mix_steps: int
    graph_launches: int


def make_config(args: argparse.Namespace) -> Config:
    if args.quick:
        cfg = Config(
            quick=True, reps=20, warmup=3, copies=3, copy_bytes=GIB // 4, verify_slots=1 << 18,
            verify_entries=1 << 20, req_len=2048, verify_source_bytes=256, write_slots=1 << 16,
            write_row_bytes=2048, mix_steps=8192, graph_launches=100,
        )
    else:
        cfg = Config(
            quick=False, reps=50, warmup=5, copies=3, copy_bytes=GIB, verify_slots=1 << 22,
            verify_entries=1 << 24, req_len=2048, verify_source_bytes=256, write_slots=1 << 20,
            write_row_bytes=2048, mix_steps=8192, graph_launches=100,
        )
    if args.reps is not None:
        cfg.reps = args.reps
    if args.copies is not None:
        cfg.copies = args.copies
    return cfg


class Bench:
    def __init__(self, cfg: Config, device: str = "cuda") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(20240607)
        self.results: dict[str, Any] = {"floors": {}, "verify": [], "write": [], "checks": []}
        self.failures: list[str] = []
        self.floors: Any = None
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        )

    # ---------------------------------------------------------------- checks
    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.results["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        status = "ok" if ok else "FAILED"
        print(f"  check {name}: {status} {detail}", flush=True)
        if not ok:
            self.failures.append(f"{name}: {detail}")

    def expect_no_violations(self, name: str, sinks: Sinks) -> None:
        n = sinks.violations()
        detail = f"violation_write_index={n}"
        if n:
            rows = sinks.ring[: min(n, 3)].tolist()
            detail += f", first rows {rows}"
        self.check(f"{name}: no violations", n == 0, detail)

    # ---------------------------------------------------------------- builds
    def build(self) -> None:
        t0 = time.perf_counter()
        call.load_module("cuda")
        info = jit.build_info("cuda")
        self.results["build"] = {
            "kvcanary_cuda_s": round(time.perf_counter() - t0, 2),
            "kvcanary_cuda_cached": bool(info.cached) if info else None,
            "arch": info.arch if info else jit.cuda_arch(),
        }
        self.floors, secs = load_floor_module()
        self.results["build"]["floor_module_s"] = round(secs, 2)
        print(f"built: {self.results['build']}", flush=True)

    # ---------------------------------------------------------------- floors
    def floor_copy(self) -> None:
        cfg = self.cfg
        n = cfg.copy_bytes
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        src.random_(0, 256, generator=self.gen)
        dst = torch.empty_like(src)
        # partial binds the tensors now: a closure would read them at call time, after the `del` below could run
        t = time_cuda([partial(dst.copy_, src)], cfg.reps, cfg.warmup)
        self.check("copy floor: dst == src", bool(torch.equal(dst[: 1 << 20], src[: 1 << 20])))
        gbps = 2 * n / (t.median_ms * 1e-3) / 1e9
        self.results["floors"]["copy"] = {"bytes": n, "gbps_read_plus_write": gbps, **t.as_dict()}
        print(f"floor copy: {n / GIB:.2f} GiB in {t.median_ms:.3f} ms = {gbps:.0f} GB/s (read+write)", flush=True)
        del src, dst
        torch.cuda.empty_cache()

    def floor_mix(self) -> None:
        cfg = self.cfg
        outs = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(cfg.copies)]
        # self-check against the Python model of SPEC §2
        for n in (0, 1, 7):
            self.floors.serial_mix_chain(outs[0], n)
            got = int(outs[0].item()) & MASK64
            self.check(f"mix floor: mix3 chain n={n} equals the Python model", got == serial_chain_model(n),
                       f"got {got:#x}")
        res = {}
        for n in (0, cfg.mix_steps):
            t = time_cuda([lambda o=o, n=n: self.floors.serial_mix_chain(o, n) for o in outs], cfg.reps, cfg.warmup)
            res[n] = t
        t0, tn = res[0], res[cfg.mix_steps]
        per_step_ns = (tn.median_ms - t0.median_ms) * 1e6 / cfg.mix_steps
        self.results["floors"]["serial_mix"] = {
            "steps": cfg.mix_steps,
            "per_step_ns": per_step_ns,
            "empty_launch": t0.as_dict(),
            **tn.as_dict(),
        }
        print(
            f"floor serial mix: {cfg.mix_steps} steps in {tn.median_ms * 1e3:.1f} us "
            f"(empty launch {t0.median_ms * 1e3:.1f} us) = {per_step_ns:.2f} ns/step",
            flush=True,
        )

    # ---------------------------------------------------------------- verify
    def _chain_layout(self, order: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """[R, L] slots/tokens/positions/prevs of R requests of L tokens over slots 1..num_slots-1."""
        cfg = self.cfg
        length = cfg.req_len
        reqs = (cfg.verify_slots - 1) // length
        total = reqs * length
        if order == "chain":
            flat = torch.arange(1, total + 1, dtype=torch.int64, device=self.device)
        elif order == "random":
            flat = torch.randperm(cfg.verify_slots - 1, device=self.device, generator=self.gen)[:total] + 1
        else:
            raise ValueError(order)
        slots = flat.view(reqs, length)
        tokens = random_tokens((reqs, length), self.device, self.gen)
        positions = torch.arange(length, dtype=torch.int64, device=self.device).expand(reqs, length).contiguous()
        prevs = torch.cat(
            [torch.full((reqs, 1), layout.CHAIN_HEAD_SLOT, dtype=torch.int64, device=self.device), slots[:, :-1]],
            dim=1,
        )
        return slots, tokens, positions, prevs

    def _verify_plan_copy(self, k: int, slots, tokens, positions, prevs) -> VerifyPlan:
        """Copy k: the requests in a rotated order, repeated/truncated to verify_entries entries."""
        reqs = slots.shape[0]
        order = torch.roll(torch.arange(reqs, device=self.device), shifts=k * max(1, reqs // self.cfg.copies))
        reps = math.ceil(self.cfg.verify_entries / (reqs * slots.shape[1]))

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t[order].reshape(-1).repeat(reps)[: self.cfg.verify_entries].contiguous()

        return make_plan(flat(slots), flat(tokens), flat(positions), flat(prevs))

    def verify_cases(self) -> None:
        cfg = self.cfg
        src_tensor = random_bytes(cfg.verify_slots, cfg.verify_source_bytes, self.device, self.gen)
        source = RealKvSource(src_tensor, page_size=1, num_bytes_per_token=cfg.verify_source_bytes,
                              read_bytes=cfg.verify_source_bytes)
        dummy_kv = torch.zeros((1, 16), dtype=torch.uint8, device=self.device)
        floor_out = torch.zeros(1, dtype=torch.int64, device=self.device)
        wanted = math.ceil(cfg.verify_entries / VERIFY_THREADS_PER_BLOCK)
        blocks = max(1, min(wanted, self.sm_count * VERIFY_BLOCKS_PER_SM))
        copy_gbps = self.results["floors"].get("copy", {}).get("gbps_read_plus_write")
        for order in ("chain", "random"):
            slots, tokens, positions, prevs = self._chain_layout(order)
            plans = [self._verify_plan_copy(k, slots, tokens, positions, prevs) for k in range(cfg.copies)]
            fill = write_inputs(slots, tokens, positions,
                                torch.full((slots.shape[0],), layout.CHAIN_HEAD_SLOT, dtype=torch.int64,
                                           device=self.device), chain_assert=False)
            for mode_name, mode in (("NONE", layout.REAL_KV_HASH_MODE_NONE),
                                    ("PARTIAL", layout.REAL_KV_HASH_MODE_PARTIAL)):
                sources = [source] if mode != layout.REAL_KV_HASH_MODE_NONE else []
                case = f"verify {order} {mode_name}"
                print(f"{case}: {cfg.verify_entries} entries over {cfg.verify_slots} slots", flush=True)
                sinks = Sinks.new(self.device)
                canary = torch.zeros((cfg.verify_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=self.device)
                call_write(canary, fill, sinks, sources, mode)
                torch.cuda.synchronize()
                self.expect_no_violations(f"{case}: prefill write", sinks)
                canaries = [canary] + [canary.clone() for _ in range(cfg.copies - 1)]
                runs_before = int(sinks.kernel_runs.item())
                t = time_cuda(
                    [partial(call_verify, c, p, sinks, sources, mode) for c, p in zip(canaries, plans, strict=True)],
                    cfg.reps, cfg.warmup,
                )
                self.expect_no_violations(case, sinks)
                runs = int(sinks.kernel_runs.item()) - runs_before
                self.check(f"{case}: kernel_run_counter", runs == cfg.reps + cfg.warmup,
                           f"advanced by {runs}, expected {cfg.reps + cfg.warmup}")
                kv = src_tensor if sources else dummy_kv
                use_kv = 1 if sources else 0
                tf = time_cuda(
                    [partial(self.floors.plain_read, p.slots, p.tokens, p.positions, p.prevs, c, kv, use_kv,
                             floor_out, blocks)
                     for c, p in zip(canaries, plans, strict=True)],
                    cfg.reps, cfg.warmup,
                )
                bytes_per_entry = 96 + (16 if sources else 0)
                n = cfg.verify_entries
                gbps = n * bytes_per_entry / (t.median_ms * 1e-3) / 1e9
                row = {
                    "case": case,
                    "order": order,
                    "real_kv": mode_name,
                    "entries": n,
                    "num_slots": cfg.verify_slots,
                    "bytes_per_entry": bytes_per_entry,
                    "entries_per_s": n / (t.median_ms * 1e-3),
                    "effective_gbps": gbps,
                    "vs_copy_bw": gbps / copy_gbps if copy_gbps else None,
                    "plain_read_floor": tf.as_dict(),
                    "vs_plain_read": t.median_ms / tf.median_ms,
                    **t.as_dict(),
                }
                self.results["verify"].append(row)
                print(f"  {t.median_ms:.3f} ms, {gbps:.0f} GB/s effective, plain read {tf.median_ms:.3f} ms "
                      f"(x{row['vs_plain_read']:.2f})", flush=True)
                if order == "chain" and mode == layout.REAL_KV_HASH_MODE_NONE:
                    self._negative_verify(canaries[0], plans[0], sources, mode)
                del canaries, canary
                torch.cuda.empty_cache()
            del plans, fill
            torch.cuda.empty_cache()
        del src_tensor, source

    def _negative_verify(self, canary: torch.Tensor, plan: VerifyPlan, sources, mode) -> None:
        """Sanity: a flipped token byte in one record is reported (verify really reads the records)."""
        scratch = canary.clone()
        victim = int(plan.slots[plan.entries // 2].item())
        scratch[victim, 0] ^= 0x5A
        sinks = Sinks.new(self.device)
        call_verify(scratch, plan, sinks, sources, mode)
        torch.cuda.synchronize()
        n = sinks.violations()
        slots_hit = set(sinks.ring[: min(n, sinks.ring.shape[0]), layout.VIOLATION_COL_SLOT].tolist())
        self.check("verify reports a planted corruption", n > 0 and victim in slots_hit,
                   f"{n} violations, victim slot {victim} {'found' if victim in slots_hit else 'missing'}")
        del scratch

    # ---------------------------------------------------------------- write
    def _distinct_slots(self, count: int, num_slots: int) -> torch.Tensor:
        if count > num_slots - 1:
            raise ValueError(f"need {count} distinct slots, have {num_slots - 1}")
        return torch.randperm(num_slots - 1, device=self.device, generator=self.gen)[:count] + 1

    def _write_copies(self, reqs: int, length: int, seeded: bool, num_slots: int) -> list[WriteInputs]:
        """`copies` write launches over disjoint random slots; seeded ones continue a 1-token history."""
        copies = self.cfg.copies
        per_copy = reqs * length + (reqs if seeded else 0)
        all_slots = self._distinct_slots(per_copy * copies, num_slots).view(copies, per_copy)
        out = []
        for k in range(copies):
            slots = all_slots[k, : reqs * length].view(reqs, length)
            tokens = random_tokens((reqs, length), self.device, self.gen)
            base = 100 if seeded else 0
            positions = (torch.arange(length, dtype=torch.int64, device=self.device) + base).expand(reqs, length)
            if seeded:
                seeds = all_slots[k, reqs * length:]
            else:
                seeds = torch.full((reqs,), layout.CHAIN_HEAD_SLOT, dtype=torch.int64, device=self.device)
            w = write_inputs(slots, tokens, positions.contiguous(), seeds, chain_assert=seeded)
            w.plan.extra["seed_slots"] = seeds if seeded else None
            out.append(w)
        return out

    def _prefill_seeds(self, canary: torch.Tensor, copies: list[WriteInputs], sinks: Sinks, sources, mode) -> None:
        """Store the seeds' records (position 99, chain head) so seeded writes pass the chain assert."""
        for w in copies:
            seeds = w.plan.extra.get("seed_slots")
            if seeds is None:
                continue
            n = seeds.numel()
            pre = write_inputs(seeds.view(n, 1), random_tokens((n, 1), self.device, self.gen),
                               torch.full((n, 1), 99, dtype=torch.int64, device=self.device),
                               torch.full((n,), layout.CHAIN_HEAD_SLOT, dtype=torch.int64, device=self.device),
                               chain_assert=False)
            call_write(canary, pre, sinks, sources, mode)

    def write_cases(self) -> None:
        cfg = self.cfg
        num_slots = cfg.write_slots
        src_tensor = random_bytes(num_slots, cfg.write_row_bytes, self.device, self.gen)
        source = RealKvSource(src_tensor, page_size=1, num_bytes_per_token=cfg.write_row_bytes,
                              read_bytes=cfg.write_row_bytes)
        mix = self.results["floors"].get("serial_mix", {})
        cases = [
            # name, reqs, len, mode, seeded, graph
            ("write 1x8192 NONE", 1, 8192, layout.REAL_KV_HASH_MODE_NONE, False, False),
            ("write 1x8192 PARTIAL", 1, 8192, layout.REAL_KV_HASH_MODE_PARTIAL, False, False),
            ("write 1024x16 PARTIAL", 1024, 16, layout.REAL_KV_HASH_MODE_PARTIAL, True, False),
            ("write 256x1 decode NONE (graph)", 256, 1, layout.REAL_KV_HASH_MODE_NONE, True, True),
            ("write 256x1 decode PARTIAL (graph)", 256, 1, layout.REAL_KV_HASH_MODE_PARTIAL, True, True),
        ]
        for name, reqs, length, mode, seeded, graph in cases:
            print(f"{name}", flush=True)
            sources = [source] if mode != layout.REAL_KV_HASH_MODE_NONE else []
            canary = torch.zeros((num_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=self.device)
            sinks = Sinks.new(self.device)
            copies = self._write_copies(reqs, length, seeded, num_slots)
            self._prefill_seeds(canary, copies, sinks, sources, mode)
            fns = [partial(call_write, canary, w, sinks, sources, mode) for w in copies]
            runs_before = int(sinks.kernel_runs.item())
            if graph:
                t, launches = self._time_graph(fns)
            else:
                t = time_cuda(fns, cfg.reps, cfg.warmup)
                launches = cfg.reps + cfg.warmup
            runs = int(sinks.kernel_runs.item()) - runs_before
            self.check(f"{name}: kernel_run_counter", runs == launches, f"advanced by {runs}, expected {launches}")
            self.expect_no_violations(name, sinks)
            # The written records form valid chains: verify exactly the written entries.
            vs = Sinks.new(self.device)
            for w in copies:
                call_verify(canary, w.plan, vs, sources, mode)
            torch.cuda.synchronize()
            self.expect_no_violations(f"{name}: verify of the written records", vs)
            row: dict[str, Any] = {
                "case": name,
                "requests": reqs,
                "tokens_per_request": length,
                "real_kv": "PARTIAL" if sources else "NONE",
                "graph": graph,
                "tokens_per_s": reqs * length / (t.median_ms * 1e-3),
                **t.as_dict(),
            }
            if reqs == 1 and length == cfg.mix_steps and mix:
                row["serial_mix_floor_ms"] = mix["median_ms"]
                row["vs_serial_mix"] = t.median_ms / mix["median_ms"]
                row["target_vs_serial_mix"] = 1.5
                row["meets_target"] = row["vs_serial_mix"] <= 1.5
            self.results["write"].append(row)
            extra = f" (x{row['vs_serial_mix']:.2f} serial-mix floor)" if "vs_serial_mix" in row else ""
            print(f"  {t.median_ms * 1e3:.2f} us per launch{extra}", flush=True)
            del canary, copies, fns
            torch.cuda.empty_cache()
        del src_tensor, source

    def _time_graph(self, fns: list[Callable[[], None]]) -> tuple[Timing, int]:
        """Capture graph_launches launches (rotating inputs) into one CUDA graph; time replays per launch."""
        cfg = self.cfg
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(cfg.warmup):
                fns[i % len(fns)]()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(cfg.graph_launches):
                fns[i % len(fns)]()
        replay_warmup = 2
        t = time_cuda([graph.replay], cfg.reps, replay_warmup, divide=cfg.graph_launches)
        launches = cfg.warmup + cfg.graph_launches * (cfg.reps + replay_warmup)
        del graph
        return t, launches

    # ---------------------------------------------------------------- report
    def markdown(self) -> str:
        r = self.results
        lines = []
        dev = r.get("device", {})
        size = "quick" if self.cfg.quick else "full"
        lines.append(f"### kvcanary kernel benchmarks ({dev.get('name', '?')}, {size})")
        lines.append("")
        lines.append("| floor | median | detail |")
        lines.append("|---|---|---|")
        f = r["floors"]
        if "copy" in f:
            c = f["copy"]
            lines.append(f"| D2D copy `copy_` {c['bytes'] / GIB:.2f} GiB | {c['median_ms']:.3f} ms | "
                         f"{c['gbps_read_plus_write']:.0f} GB/s (read+write) |")
        if "serial_mix" in f:
            m = f["serial_mix"]
            empty_us = m["empty_launch"]["median_ms"] * 1e3
            lines.append(f"| serial mix3 chain, {m['steps']} steps, 1 thread | {m['median_ms'] * 1e3:.1f} us | "
                         f"{m['per_step_ns']:.2f} ns/step (empty launch {empty_us:.1f} us) |")
        lines.append("")
        if r["verify"]:
            lines.append("| verify | entries | median ms | entries/s | eff. GB/s | vs copy BW | plain-read floor ms | "
                         "vs floor |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for v in r["verify"]:
                vs_copy = f"{v['vs_copy_bw']:.2f}" if v.get("vs_copy_bw") else "-"
                lines.append(
                    f"| {v['order']} / {v['real_kv']} ({v['bytes_per_entry']} B/entry) | {v['entries']:,} | "
                    f"{v['median_ms']:.3f} | {v['entries_per_s'] / 1e9:.2f} G | {v['effective_gbps']:.0f} | "
                    f"{vs_copy} | "
                    f"{v['plain_read_floor']['median_ms']:.3f} | x{v['vs_plain_read']:.2f} |"
                )
            lines.append("")
        if r["write"]:
            lines.append("| write | median per launch | tokens/s | vs serial-mix floor (target <= 1.5) |")
            lines.append("|---|---|---|---|")
            for w in r["write"]:
                ratio = "-"
                if "vs_serial_mix" in w:
                    ratio = f"x{w['vs_serial_mix']:.2f} {'ok' if w['meets_target'] else 'ABOVE TARGET'}"
                lines.append(f"| {w['case']} | {w['median_ms'] * 1e3:.2f} us | {w['tokens_per_s'] / 1e6:.1f} M | "
                             f"{ratio} |")
            lines.append("")
        ok = sum(1 for c in r["checks"] if c["ok"])
        lines.append(f"correctness checks: {ok}/{len(r['checks'])} passed"
                     + ("" if not self.failures else "; FAILED: " + "; ".join(self.failures)))
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (1M verify entries, 256 MiB copy)")
    parser.add_argument("--json", type=Path, default=None, help="write all results as JSON here")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case (>= 20 recommended)")
    parser.add_argument("--copies", type=int, default=None, help="input copies rotated between repetitions (>= 3)")
    parser.add_argument("--only", choices=["floors", "verify", "write"], action="append", default=None,
                        help="run only these groups (floors always run first when verify/write need them)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    cfg = make_config(args)
    if cfg.copies < 1:
        parser.error("--copies must be >= 1")
    bench = Bench(cfg)
    props = torch.cuda.get_device_properties(0)
    bench.results["device"] = {
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "total_memory_gib": round(props.total_memory / GIB, 1),
        "capability": list(torch.cuda.get_device_capability()),
    }
    bench.results["env"] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    bench.results["config"] = cfg.__dict__
    groups = args.only or ["floors", "verify", "write"]
    status = 0
    try:
        bench.build()
        try:
            import tvm_ffi

            bench.results["env"]["tvm_ffi"] = str(getattr(tvm_ffi, "__version__", "?"))
        except ImportError:
            pass
        bench.floor_copy()
        bench.floor_mix()
        if "verify" in groups:
            bench.verify_cases()
        if "write" in groups:
            bench.write_cases()
    except Exception as exc:  # noqa: BLE001 - report, write what we have, exit non-zero
        traceback.print_exc()
        bench.failures.append(f"exception: {type(exc).__name__}: {exc}")
        bench.results["exception"] = f"{type(exc).__name__}: {exc}"
        status = 1
    return finish_run(bench.results, bench.failures, bench.markdown(), args.json, status)


def finish_run(results: dict, failures: list[str], table: str, json_path: Path | None, status: int) -> int:
    """Print the table, keep it and the failures in ``results`` (written to ``json_path`` when given); the exit
    status: ``status``, or 1 when anything failed."""
    results["failures"] = failures
    results["markdown"] = table
    print()
    print(table)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2, default=str))
        print(f"\nwrote {json_path}")
    return 1 if failures else status


if __name__ == "__main__":
    sys.exit(main())
