#!/usr/bin/env python3
"""kvcanary's CUDA kernels side by side with SGLang's built-in canary kernels (issue 6), plus the floors.

SGLang's kernels are compiled at run time from the ``.cuh`` sources its wheel ships
(``sglang/kernels/jit/csrc/kv_canary/`` and the ``sgl_kernel`` headers): a one-file tvm-ffi wrapper
includes them and exports their host functions, built with ``-std=c++20 -O3`` into
``$KVCANARY_CACHE_DIR/bench`` (default ``/tmp/kvcanary-bench``). sglang itself is never imported (its
runtime dependencies need not be installed); its files are found through the package metadata
(``importlib.metadata``), ``sys.path`` or ``--sglang-root``. Nothing of SGLang is copied into this repo.

Order of a run:
  1. build ours, the floor kernels (bench_kernels.py) and SGLang's kernels;
  2. correctness: both write and verify on the same small inputs (two real-KV sources, NONE/PARTIAL/ALL,
     seeded requests, skipped entries, input and chain-position asserts, planted corruptions, expected-token
     checks, slot-0 / prev-0 entries, a padded plan, a disabled launch) must give identical canary bytes,
     counters, violation write index and violation rows (as multisets). A difference exits 1 before any
     timing (``--time-anyway`` times anyway, still exiting 1);
  3. floors: device copy bandwidth, the serial mix3 chain, and per verify case a plain read of the same
     bytes;
  4. the issue's cases, each timed eagerly (CUDA events around one launch queued behind a GPU sleep,
     median of >= 20 repetitions, inputs rotated over >= 3 copies) and per launch inside a CUDA graph
     (20-100 captured launches, replayed, divided). Both kernels run on identical inputs; verify runs on
     the same pre-written canary buffer, with 0 violations asserted for both.

Without sglang (or with ``--no-sglang``) it says so and benchmarks kvcanary alone (exit 0 when ours pass).

Usage (repository root, a CUDA machine):
    PYTHONPATH=plugin python3 benchmarks/compare_upstream.py [--quick] [--json out.json] [--sglang-root DIR]
    PYTHONPATH=plugin python3 benchmarks/compare_upstream.py --build-only   # compile SGLang's kernels only (no GPU)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import random
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels as bk  # noqa: E402  (also puts plugin/ on sys.path when kvcanary is not installed)
import torch  # noqa: E402
from bench_kernels import (  # noqa: E402
    GIB,
    KIND_VERIFY,
    KIND_WRITE,
    Bench,
    Sinks,
    Timing,
    VerifyPlan,
    WriteInputs,
    call_verify,
    call_write,
    make_config,
    make_plan,
    random_bytes,
    time_cuda,
    write_inputs,
)

from kvcanary.kernels import call, jit, layout  # noqa: E402
from kvcanary.kernels.real_kv import RealKvSource  # noqa: E402
from kvcanary.kernels.verify import canary_verify_step  # noqa: E402
from kvcanary.kernels.write import canary_write_step  # noqa: E402

NONE = layout.REAL_KV_HASH_MODE_NONE
PARTIAL = layout.REAL_KV_HASH_MODE_PARTIAL
ALL = layout.REAL_KV_HASH_MODE_ALL
MODE_NAMES = {NONE: "NONE", PARTIAL: "PARTIAL", ALL: "ALL"}
VERIFY_TARGET_VS_READ = 1.15

# --------------------------------------------------------------------------------------------------
# SGLang's kernels: locate the installed sources, build through tvm-ffi, call with our tensors
# --------------------------------------------------------------------------------------------------

SGL_WRAPPER = r"""
// Compiles SGLang's own canary kernels (from the installed wheel) for benchmarking; exports their host
// functions unchanged. The same includes SGLang's generated wrapper unit starts with.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "kv_canary/canary_write.cuh"
#include "kv_canary/canary_verify.cuh"

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sgl_canary_write_step_cuda, (sglang::canary::canary_write_step_cuda));
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sgl_canary_verify_step_cuda_check_token,
                              (sglang::canary::CanaryVerifyKernel<true>::run));
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sgl_canary_verify_step_cuda_no_check_token,
                              (sglang::canary::CanaryVerifyKernel<false>::run));
"""
SGL_MODULE = "sglang_canary_upstream"
SGL_CANARY_FILES = ("canary_common.cuh", "canary_write.cuh", "canary_verify.cuh", "consts.cuh")


@dataclass
class SglangSources:
    jit_dir: Path  # .../sglang/kernels/jit (holds include/ and csrc/)
    version: str
    how: str

    @property
    def include_dir(self) -> Path:
        return self.jit_dir / "include"

    @property
    def csrc_dir(self) -> Path:
        return self.jit_dir / "csrc"


def _is_jit_dir(path: Path) -> bool:
    return (path / "csrc" / "kv_canary" / "canary_write.cuh").is_file() and (
        path / "include" / "sgl_kernel" / "utils.cuh"
    ).is_file()


def _version_near(path: Path) -> str | None:
    """The sglang version from a *.dist-info next to the package directory holding `path`."""
    for parent in list(path.parents)[:4]:  # .../kernels, .../sglang, the site dir, one more
        for dist in importlib.metadata.distributions(path=[str(parent)]):
            if (dist.metadata["Name"] or "").lower() == "sglang":
                return dist.version
    return None


def locate_sglang(root: str | None) -> tuple[SglangSources | None, list[str]]:
    """Find sglang/kernels/jit without importing sglang: --sglang-root, package metadata, sys.path."""
    tried: list[str] = []
    candidates: list[tuple[Path, str]] = []
    if root:
        r = Path(root).expanduser().resolve()
        for c in (r, r / "sglang" / "kernels" / "jit", r / "kernels" / "jit", r / "jit"):
            candidates.append((c, f"--sglang-root {root}"))
    else:
        try:
            dist = importlib.metadata.distribution("sglang")
            located = Path(str(dist.locate_file("sglang/kernels/jit")))
            candidates.append((located, f"importlib.metadata ({dist.version})"))
        except importlib.metadata.PackageNotFoundError:
            tried.append("importlib.metadata: no sglang distribution")
        for entry in sys.path:
            located = Path(entry or ".").resolve() / "sglang" / "kernels" / "jit"
            candidates.append((located, f"sys.path entry {entry!r}"))
    for path, how in candidates:
        if _is_jit_dir(path):
            version = _version_near(path) or "unknown"
            return SglangSources(path.resolve(), version, how), tried
        tried.append(str(path))
    return None, tried


def _sgl_digest(src: SglangSources) -> str:
    h = hashlib.sha256()
    files = [src.csrc_dir / "kv_canary" / f for f in SGL_CANARY_FILES]
    files += sorted(p for p in (src.include_dir / "sgl_kernel").iterdir() if p.is_file())
    for p in files:
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def bench_cache_dir() -> Path:
    return Path(os.environ.get(jit.CACHE_DIR_ENV) or "/tmp/kvcanary-bench").expanduser() / "bench"


def sgl_arch_define(arch: str) -> str:
    m = re.match(r"^\s*(\d+)\.(\d+)", arch)
    if not m:
        raise ValueError(f"cannot derive SGL_CUDA_ARCH from arch {arch!r}")
    return f"-DSGL_CUDA_ARCH={int(m.group(1)) * 100 + int(m.group(2)) * 10}"


def build_sglang(src: SglangSources) -> tuple[Path, float, bool]:
    """Compile SGLang's canary kernels (no load; no GPU needed). Returns (library, seconds, cached)."""
    import tvm_ffi
    import tvm_ffi.cpp

    bk._toolchain_env()  # CUDA_HOME, ninja on PATH, TVM_FFI_CUDA_ARCH_LIST = kvcanary.kernels.jit.cuda_arch()
    arch = os.environ["TVM_FFI_CUDA_ARCH_LIST"]
    if len(arch.split()) != 1:
        raise ValueError(f"one CUDA arch expected (SGL_CUDA_ARCH must equal __CUDA_ARCH__), got {arch!r}")
    flags = ["-std=c++20", "-O3", "--expt-relaxed-constexpr", sgl_arch_define(arch)]
    key = hashlib.sha256()
    for part in (SGL_WRAPPER, " ".join(flags), arch, str(getattr(tvm_ffi, "__version__", "?")), _sgl_digest(src),
                 str(src.jit_dir)):
        key.update(part.encode() + b"\0")
    directory = bench_cache_dir() / f"sglang-{src.version}-canary-sm{arch.replace('.', '')}-{key.hexdigest()[:16]}"
    library = directory / f"{SGL_MODULE}.so"
    marker = directory / ".complete"
    if marker.is_file() and library.is_file():
        return library, 0.0, True
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = tvm_ffi.cpp.build_inline(
        SGL_MODULE,
        cuda_sources=SGL_WRAPPER,
        extra_cuda_cflags=flags,
        extra_include_paths=[str(src.include_dir), str(src.csrc_dir)],
        build_directory=str(directory),
    )
    seconds = time.perf_counter() - start
    marker.write_text(f"{arch} {seconds:.1f}s\n")
    return Path(path), seconds, False


class SglKernels:
    """Calls SGLang's exported host functions with the same tensors kvcanary's wrappers get."""

    def __init__(self, module: Any) -> None:
        self.m = module

    def write(self, canary: torch.Tensor, w: WriteInputs, sinks: Sinks, sources, mode: int,
              kind: int = KIND_WRITE, expected: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        bufs, params, n = call.real_kv_launch_args(sources, canary.device)
        self.m.sgl_canary_write_step_cuda(
            canary, w.offsets, w.seeds, w.num_valid, w.tokens, w.positions, w.slots, int(kind),
            1 if expected is not None else 0,
            expected[0] if expected is not None else None,
            expected[1] if expected is not None else None,
            sinks.ring, sinks.index, sinks.slot_runs, sinks.kernel_runs, w.chain_assert,
            *bufs, params, n, int(mode),
        )

    def verify(self, canary: torch.Tensor, v: VerifyPlan, sinks: Sinks, sources, mode: int,
               kind: int = KIND_VERIFY, check_tokens: bool = True) -> None:
        bufs, params, n = call.real_kv_launch_args(sources, canary.device)
        fn = (self.m.sgl_canary_verify_step_cuda_check_token if check_tokens
              else self.m.sgl_canary_verify_step_cuda_no_check_token)
        fn(canary, v.slots, v.tokens, v.positions, v.prevs, v.num_valid, v.enable, int(kind),
           sinks.ring, sinks.index, sinks.slot_runs, sinks.kernel_runs, *bufs, params, n, int(mode))


def ours_write(canary: torch.Tensor, w: WriteInputs, sinks: Sinks, sources, mode: int,
               kind: int = KIND_WRITE, expected: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    if kind == KIND_WRITE and expected is None:
        call_write(canary, w, sinks, sources, mode)
        return
    canary_write_step(
        canary_buf=canary, write_offsets=w.offsets, write_seed_slot_indices=w.seeds,
        write_num_valid_reqs=w.num_valid, input_ids=w.tokens, positions=w.positions, out_cache_loc=w.slots,
        kernel_kind=kind, enable_write_input_assert=expected is not None,
        expected_input_tokens=expected[0] if expected is not None else None,
        expected_input_positions=expected[1] if expected is not None else None,
        violation_ring=sinks.ring, violation_write_index=sinks.index, slot_run_counter=sinks.slot_runs,
        kernel_run_counter=sinks.kernel_runs, enable_chain_position_assert=w.chain_assert,
        real_kv_sources=sources, real_kv_hash_mode=mode,
    )


def ours_verify(canary: torch.Tensor, v: VerifyPlan, sinks: Sinks, sources, mode: int,
                kind: int = KIND_VERIFY, check_tokens: bool = True) -> None:
    if kind == KIND_VERIFY and check_tokens:
        call_verify(canary, v, sinks, sources, mode)
        return
    canary_verify_step(
        canary_buf=canary, verify_slot_indices=v.slots, verify_expected_tokens=v.tokens,
        verify_expected_positions=v.positions, verify_prev_slot_indices=v.prevs, verify_num_valid=v.num_valid,
        verify_enable=v.enable, kernel_kind=kind, violation_ring=sinks.ring, violation_write_index=sinks.index,
        slot_run_counter=sinks.slot_runs, kernel_run_counter=sinks.kernel_runs, real_kv_sources=sources,
        real_kv_hash_mode=mode, check_tokens=check_tokens,
    )


# --------------------------------------------------------------------------------------------------
# small-case equality check
# --------------------------------------------------------------------------------------------------


def sink_state(s: Sinks) -> dict[str, Any]:
    n = int(s.index.item())
    rows = s.ring[: min(max(n, 0), s.ring.shape[0])].tolist()
    return {"write_index": n, "slot_runs": int(s.slot_runs.item()), "kernel_runs": int(s.kernel_runs.item()),
            "rows": Counter(tuple(r) for r in rows)}


def diff_states(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for k in ("write_index", "slot_runs", "kernel_runs"):
        if a[k] != b[k]:
            out.append(f"{k}: sglang {a[k]} vs kvcanary {b[k]}")
    if a["rows"] != b["rows"]:
        only_a = list((a["rows"] - b["rows"]).elements())[:4]
        only_b = list((b["rows"] - a["rows"]).elements())[:4]
        out.append(f"violation rows differ: only sglang {only_a}; only kvcanary {only_b}")
    return out


def diff_canary(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    if torch.equal(a, b):
        return []
    bad = (a != b).any(dim=1).nonzero().flatten()
    slot = int(bad[0].item())
    return [f"canary bytes differ in {bad.numel()} slots, first slot {slot}: sglang "
            f"{a[slot].view(torch.int64).tolist()} vs kvcanary {b[slot].view(torch.int64).tolist()}"]


@dataclass
class SmallWrite:
    """One write launch over a few requests, plus the records it stores (for the verify plan)."""

    inputs: WriteInputs
    expected: tuple[torch.Tensor, torch.Tensor] | None
    entries: list[tuple[int, int, int, int]] = field(default_factory=list)  # (slot, token, position, prev)


def build_small_case(device: torch.device, num_slots: int, rng: random.Random) -> tuple[SmallWrite, SmallWrite]:
    """(seed prefill launch, main launch). Main: 6 valid requests of a capacity-8 plan, seeded and unseeded,
    an empty request, skipped (-1) entries, a position jump (chain-position assert), planted input-assert
    mismatches, and a padding tail whose out_cache_loc points at real slots (must not be written)."""
    lens = [1, 5, 16, 40, 3, 0]
    seeded = [False, True, True, True, False, True]
    capacity = 8
    pool = rng.sample(range(1, num_slots), sum(lens) + len(lens) + 8)
    seeds = [pool.pop() if s else -1 for s in seeded]
    tok = lambda: rng.randrange(0, 1 << 31)  # noqa: E731

    # prefill: one length-1 chain-head request per seed, position 9
    seed_slots = [s for s in seeds if s >= 0]
    pre_tok = [tok() for _ in seed_slots]
    pre = SmallWrite(
        write_inputs(torch.tensor(seed_slots, device=device).view(-1, 1),
                     torch.tensor(pre_tok, device=device).view(-1, 1),
                     torch.full((len(seed_slots), 1), 9, dtype=torch.int64, device=device),
                     torch.full((len(seed_slots),), -1, dtype=torch.int64, device=device), chain_assert=False),
        None,
        [(s, t, 9, -1) for s, t in zip(seed_slots, pre_tok, strict=True)],
    )

    slots, tokens, positions, offsets, entries = [], [], [], [0], []
    for r, n in enumerate(lens):
        prev = seeds[r]
        pos = 10 if seeded[r] else 0
        for j in range(n):
            if r == 3 and j == 20:
                pos += 2  # chain-position assert fires once
            slot = pool.pop()
            if r == 2 and j in (0, 7):
                slot = -1  # skipped entry (SWA out of window / padding)
            t = tok()
            slots.append(slot)
            tokens.append(t)
            positions.append(pos)
            if slot >= 0:
                entries.append((slot, t, pos, prev))
                prev = slot
            pos += 1
        offsets.append(len(slots))
    total = len(slots)
    for _ in range(capacity - len(lens)):
        offsets.append(total)
    # padding tail of the token arrays (beyond offsets[num_valid]): real slots that must stay untouched
    for _ in range(4):
        slots.append(pool.pop())
        tokens.append(tok())
        positions.append(1000)
    exp_tok = list(tokens)
    exp_pos = list(positions)
    exp_tok[offsets[1] + 2] ^= 1  # request 1, entry 2: token mismatch
    exp_tok[offsets[3] + 5] += 7  # request 3, entry 5: token mismatch
    exp_pos[offsets[4] + 1] += 1  # request 4, entry 1: position mismatch
    t64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    main = SmallWrite(
        WriteInputs(
            offsets=t64(offsets),
            seeds=t64(seeds + [-1] * (capacity - len(lens))),
            num_valid=torch.tensor([len(lens)], dtype=torch.int32, device=device),
            tokens=t64(tokens), positions=t64(positions), slots=t64(slots),
            chain_assert=torch.tensor([1], dtype=torch.int32, device=device),
        ),
        (t64(exp_tok), t64(exp_pos)),
        entries,
    )
    return pre, main


def small_plans(device: torch.device, entries: list[tuple[int, int, int, int]], rng: random.Random,
                num_slots: int) -> tuple[VerifyPlan, VerifyPlan, VerifyPlan, list[int]]:
    """(clean plan, plan with bad expectations + special entries + padded tail, disabled plan, victims)."""
    t64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    s, t, p, q = (list(col) for col in zip(*entries, strict=True))
    clean = make_plan(t64(s), t64(t), t64(p), t64(q))
    s2, t2, p2, q2 = list(s), list(t), list(p), list(q)
    t2[3] += 1  # expected token mismatch (reported only with check_tokens)
    t2[4] = layout.NO_EXPECTED_TOKEN
    p2[6] += 5  # expected position mismatch
    # special entries: a padding slot-0 entry, a prev-0 entry (chain unchecked), a chain head that is not one
    s2 += [0, s[10], s[12]]
    t2 += [t[0], t[10], t[12]]
    p2 += [p[0], p[10], p[12]]
    q2 += [-1, 0, -1]
    n_valid = len(s2)
    # padded tail beyond num_valid: entries that would fail if read
    s2 += [s[1], s[2]]
    t2 += [123, 456]
    p2 += [-7, -8]
    q2 += [s[5], s[6]]
    odd = VerifyPlan(t64(s2), t64(t2), t64(p2), t64(q2),
                     torch.tensor([n_valid], dtype=torch.int32, device=device),
                     torch.tensor([1], dtype=torch.int32, device=device))
    disabled = make_plan(t64(s2), t64(t2), t64(p2), t64(q2))
    disabled.enable.zero_()
    victims = rng.sample(s[14:], 4)  # token / position / prev_hash / real-KV corruption targets
    return clean, odd, disabled, victims


class Compare(Bench):
    def __init__(self, cfg, device: str = "cuda") -> None:
        super().__init__(cfg, device)
        self.sgl: SglKernels | None = None
        self.rows: list[dict[str, Any]] = []
        self.results["compare"] = self.rows
        self.results["equality"] = []

    # ---------------------------------------------------------------- equality
    def _same(self, name: str, problems: list[str]) -> None:
        self.results["equality"].append({"name": name, "ok": not problems, "problems": problems})
        self.check(f"same result: {name}", not problems, "; ".join(problems))

    def equality(self) -> bool:
        assert self.sgl is not None
        dev = self.device
        rng = random.Random(4242)
        num_slots = 1024
        failures_before = len(self.failures)
        gen = torch.Generator(device=dev)
        gen.manual_seed(99)
        kv0 = random_bytes(num_slots, 2048, dev, gen)
        kv1 = random_bytes(num_slots // 4, 4 * 64, dev, gen)
        src0 = RealKvSource(kv0, page_size=1, num_bytes_per_token=2048, read_bytes=2048)
        src1 = RealKvSource(kv1, page_size=4, num_bytes_per_token=64, read_bytes=32)
        pre, main = build_small_case(dev, num_slots, rng)
        for mode in (NONE, PARTIAL, ALL):
            mname = MODE_NAMES[mode]
            sources = [src0, src1]  # present in NONE too: NONE must ignore them
            bufs, sinks = {}, {}
            for who, wfn in (("sglang", self.sgl.write), ("kvcanary", ours_write)):
                c = torch.zeros((num_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=dev)
                s = Sinks.new(dev)
                wfn(c, pre.inputs, s, sources, mode, kind=3)
                wfn(c, main.inputs, s, sources, mode, kind=3, expected=main.expected)
                torch.cuda.synchronize()
                bufs[who], sinks[who] = c, sink_state(s)
            self._same(f"write {mname}: canary bytes", diff_canary(bufs["sglang"], bufs["kvcanary"]))
            self._same(f"write {mname}: counters and violation rows", diff_states(sinks["sglang"], sinks["kvcanary"]))
            self.check(f"write {mname}: planted write violations reported", sinks["kvcanary"]["write_index"] >= 4,
                       f"write_index={sinks['kvcanary']['write_index']}")
            canary = bufs["kvcanary"]
            clean, odd, disabled, victims = small_plans(dev, pre.entries + main.entries, rng, num_slots)
            bad = canary.clone()
            bad[victims[0], 0] ^= 0x11  # token byte
            bad[victims[1], 8] ^= 0x01  # position byte
            bad[victims[2], 16] ^= 0x80  # prev_hash byte
            kv0_bad = kv0.clone()
            kv0_bad[victims[3], 5] ^= 0xFF  # first 16 real-KV bytes: PARTIAL and ALL see it
            bad_sources = [RealKvSource(kv0_bad, page_size=1, num_bytes_per_token=2048, read_bytes=2048), src1]
            runs = [
                ("clean", canary, clean, sources, 0),
                ("expectations/special entries/padded plan", canary, odd, sources, None),
                ("corrupted records and real KV", bad, odd, bad_sources, None),
                ("disabled launch", bad, disabled, bad_sources, 0),
            ]
            for label, buf, plan, srcs, want in runs:
                for check_tokens in (True, False):
                    states = {}
                    for who, vfn in (("sglang", self.sgl.verify), ("kvcanary", ours_verify)):
                        s = Sinks.new(dev)
                        vfn(buf, plan, s, srcs, mode, kind=4, check_tokens=check_tokens)
                        torch.cuda.synchronize()
                        states[who] = sink_state(s)
                    name = f"verify {mname} {label} (check_tokens={int(check_tokens)})"
                    self._same(name, diff_states(states["sglang"], states["kvcanary"]))
                    n = states["kvcanary"]["write_index"]
                    if want is not None:
                        self.check(f"{name}: {want} violations", n == want, f"write_index={n}")
                    else:
                        self.check(f"{name}: violations reported", n > 0, f"write_index={n}")
        return len(self.failures) == failures_before

    # ---------------------------------------------------------------- helpers
    def graph_time(self, fns: list[Callable[[], None]], launches: int) -> tuple[Timing, int]:
        saved = self.cfg.graph_launches
        self.cfg.graph_launches = launches
        try:
            return self._time_graph(fns)
        finally:
            self.cfg.graph_launches = saved

    @staticmethod
    def graph_launches_for(eager_ms: float) -> int:
        """>= 20 launches per graph, up to 100 while a replay stays around 5 ms."""
        return int(max(20, min(100, 5.0 / max(eager_ms, 1e-3))))

    def small_floors(self) -> None:
        """The serial mix3 chain of 1 and 16 steps (one thread), eager and per launch in a graph."""
        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.cfg.copies)]
        res = {}
        for n in (1, 16):
            fns = [lambda o=o, n=n: self.floors.serial_mix_chain(o, n) for o in out]
            eager = time_cuda(fns, self.cfg.reps, self.cfg.warmup)
            graph, _ = self.graph_time(fns, 100)
            res[n] = {"eager": eager.as_dict(), "graph": graph.as_dict()}
            print(f"floor serial mix {n} steps: {eager.median_ms * 1e3:.2f} us eager, "
                  f"{graph.median_ms * 1e3:.2f} us per launch in a graph", flush=True)
        self.results["floors"]["serial_mix_short"] = res

    def _record(self, case: str, graph: bool, theirs: Timing | None, ours: Timing, target: str,
                target_ok: bool | None, floor_ms: float | None, floor_name: str, extra: dict[str, Any]) -> None:
        row = {
            "case": case,
            "timing": "graph, per launch" if graph else "eager",
            "sglang": theirs.as_dict() if theirs else None,
            "kvcanary": ours.as_dict(),
            "ratio_ours_over_sglang": ours.median_ms / theirs.median_ms if theirs else None,
            "target": target,
            "meets_target": target_ok,
            "floor_ms": floor_ms,
            "floor": floor_name,
            "ours_vs_floor": ours.median_ms / floor_ms if floor_ms else None,
            **extra,
        }
        self.rows.append(row)
        theirs_s = f"{theirs.median_ms:.4f} ms" if theirs else "-"
        ratio = f" ratio {row['ratio_ours_over_sglang']:.3f}" if theirs else ""
        print(f"  [{row['timing']}] sglang {theirs_s}, kvcanary {ours.median_ms:.4f} ms{ratio}", flush=True)

    # ---------------------------------------------------------------- write cases
    def write_compare(self) -> None:
        cfg = self.cfg
        num_slots = cfg.write_slots
        src_tensor = random_bytes(num_slots, cfg.write_row_bytes, self.device, self.gen)
        source = RealKvSource(src_tensor, page_size=1, num_bytes_per_token=cfg.write_row_bytes,
                              read_bytes=cfg.write_row_bytes)
        mix = self.results["floors"].get("serial_mix", {})
        short = self.results["floors"].get("serial_mix_short", {})
        cases = [
            # name, reqs, len, mode, seeded, primary timing ("eager"/"graph"), target (ms or "sglang")
            ("write 1x8192 NONE", 1, 8192, NONE, False, "eager", 0.80),
            ("write 1x8192 PARTIAL (2048-B row source)", 1, 8192, PARTIAL, False, "eager", 1.00),
            ("write 1024x16 PARTIAL", 1024, 16, PARTIAL, True, "eager", 0.010),
            ("write 256x1 decode NONE", 256, 1, NONE, True, "graph", "sglang"),
            ("write 256x1 decode PARTIAL", 256, 1, PARTIAL, True, "graph", "sglang"),
        ]
        for name, reqs, length, mode, seeded, primary, target in cases:
            print(name, flush=True)
            sources = [source] if mode != NONE else []
            copies = self._write_copies(reqs, length, seeded, num_slots)
            c_ours = torch.zeros((num_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=self.device)
            s_ours = Sinks.new(self.device)
            self._prefill_seeds(c_ours, copies, s_ours, sources, mode)
            torch.cuda.synchronize()
            c_sgl = c_ours.clone()
            s_sgl = Sinks.new(self.device)
            # partial binds the arguments now: a closure would read these names at call time (the loop rebinds
            # them, and the `del` at the end of the iteration empties them)
            kinds: dict[str, tuple[torch.Tensor, Sinks, list[Callable[[], None]]]] = {
                "kvcanary": (c_ours, s_ours,
                             [partial(call_write, c_ours, w, s_ours, sources, mode) for w in copies]),
            }
            if self.sgl is not None:
                sgl = self.sgl
                kinds["sglang"] = (c_sgl, s_sgl,
                                   [partial(sgl.write, c_sgl, w, s_sgl, sources, mode) for w in copies])
            times: dict[tuple[str, str], Timing] = {}
            launches: dict[str, int] = {}
            order = [k for k in ("sglang", "kvcanary") if k in kinds]
            for who in order:
                _, sinks, fns = kinds[who]
                before = int(sinks.kernel_runs.item())
                times[(who, "eager")] = time_cuda(fns, cfg.reps, cfg.warmup)
                torch.cuda.synchronize()
                launches[who] = int(sinks.kernel_runs.item()) - before
            n_graph = self.graph_launches_for(max(times[(w, "eager")].median_ms for w in order))
            for who in order:
                _, sinks, fns = kinds[who]
                before = int(sinks.kernel_runs.item())
                times[(who, "graph")], expect = self.graph_time(fns, n_graph)
                runs = int(sinks.kernel_runs.item()) - before
                self.check(f"{name} [{who}]: kernel_run_counter", launches[who] == cfg.reps + cfg.warmup
                           and runs == expect, f"eager {launches[who]}, graph {runs} (expected {expect})")
            for who in order:
                canary, sinks, _ = kinds[who]
                self.expect_no_violations(f"{name} [{who}]", sinks)
                vs = Sinks.new(self.device)
                for w in copies:
                    call_verify(canary, w.plan, vs, sources, mode)
                torch.cuda.synchronize()
                self.expect_no_violations(f"{name} [{who}]: kvcanary verify of the written records", vs)
            if "sglang" in kinds:
                self.check(f"{name}: canary bytes identical after timing", torch.equal(c_ours, c_sgl))
            for timing in ("eager", "graph"):
                ours = times[("kvcanary", timing)]
                theirs = times.get(("sglang", timing))
                is_primary = timing == primary
                if target == "sglang":
                    tgt = "<= SGLang (same run)" if is_primary else "(info)"
                    ok = (ours.median_ms <= theirs.median_ms if theirs else None) if is_primary else None
                else:
                    tgt = f"<= {fmt_ms(target)}" if is_primary else "(info)"
                    ok = ours.median_ms <= target if is_primary else None
                if length == cfg.mix_steps and mix:
                    floor_ms, floor_name = mix["median_ms"], f"serial mix3 x{length}, 1 thread"
                elif length in (1, 16) and short:
                    floor_ms = short[length][timing]["median_ms"]
                    floor_name = f"serial mix3 x{length}, 1 thread ({timing})"
                else:
                    floor_ms, floor_name = None, "-"
                self._record(name, timing == "graph", theirs, ours, tgt, ok, floor_ms, floor_name,
                             {"requests": reqs, "tokens_per_request": length, "real_kv": MODE_NAMES[mode],
                              "graph_launches": n_graph if timing == "graph" else None})
            del kinds, c_ours, c_sgl, copies
            torch.cuda.empty_cache()
        del src_tensor, source

    # ---------------------------------------------------------------- verify cases
    def verify_compare(self) -> None:
        cfg = self.cfg
        src_tensor = random_bytes(cfg.verify_slots, cfg.verify_source_bytes, self.device, self.gen)
        source = RealKvSource(src_tensor, page_size=1, num_bytes_per_token=cfg.verify_source_bytes,
                              read_bytes=cfg.verify_source_bytes)
        dummy_kv = torch.zeros((1, 16), dtype=torch.uint8, device=self.device)
        floor_out = torch.zeros(1, dtype=torch.int64, device=self.device)
        wanted = -(-cfg.verify_entries // bk.VERIFY_THREADS_PER_BLOCK)
        blocks = max(1, min(wanted, self.sm_count * bk.VERIFY_BLOCKS_PER_SM))
        copy_gbps = self.results["floors"].get("copy", {}).get("gbps_read_plus_write")
        for order in ("chain", "random"):
            slots, tokens, positions, prevs = self._chain_layout(order)
            plans = [self._verify_plan_copy(k, slots, tokens, positions, prevs) for k in range(cfg.copies)]
            heads = torch.full((slots.shape[0],), layout.CHAIN_HEAD_SLOT, dtype=torch.int64, device=self.device)
            fill = write_inputs(slots, tokens, positions, heads, chain_assert=False)
            for mode in (NONE, PARTIAL):
                sources = [source] if mode != NONE else []
                case = f"verify {cfg.verify_entries / (1 << 20):g}M over {cfg.verify_slots / (1 << 20):g}M slots, " \
                       f"{order} order, {MODE_NAMES[mode]}"
                print(case, flush=True)
                canary = torch.zeros((cfg.verify_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=self.device)
                fill_sinks = Sinks.new(self.device)
                call_write(canary, fill, fill_sinks, sources, mode)
                torch.cuda.synchronize()
                self.expect_no_violations(f"{case}: prefill write", fill_sinks)
                if self.sgl is not None:
                    other = torch.zeros_like(canary)
                    s = Sinks.new(self.device)
                    self.sgl.write(other, fill, s, sources, mode)
                    torch.cuda.synchronize()
                    self.check(f"{case}: SGLang's prefill write gives identical bytes",
                               torch.equal(other, canary) and s.violations() == 0)
                    del other
                canaries = [canary] + [canary.clone() for _ in range(cfg.copies - 1)]
                kinds: dict[str, tuple[Sinks, list[Callable[[], None]]]] = {}
                if self.sgl is not None:
                    sgl, s_sgl = self.sgl, Sinks.new(self.device)
                    kinds["sglang"] = (s_sgl, [partial(sgl.verify, c, p, s_sgl, sources, mode)
                                               for c, p in zip(canaries, plans, strict=True)])
                s_ours = Sinks.new(self.device)
                kinds["kvcanary"] = (s_ours, [partial(call_verify, c, p, s_ours, sources, mode)
                                              for c, p in zip(canaries, plans, strict=True)])
                kv = src_tensor if sources else dummy_kv
                use_kv = 1 if sources else 0
                floor_fns = [partial(self.floors.plain_read, p.slots, p.tokens, p.positions, p.prevs, c, kv,
                                     use_kv, floor_out, blocks)
                             for c, p in zip(canaries, plans, strict=True)]
                times: dict[tuple[str, str], Timing] = {}
                for who, (_sinks, fns) in kinds.items():
                    times[(who, "eager")] = time_cuda(fns, cfg.reps, cfg.warmup)
                t_read = time_cuda(floor_fns, cfg.reps, cfg.warmup)
                n_graph = self.graph_launches_for(max(t.median_ms for t in times.values()))
                for who, (sinks, fns) in kinds.items():
                    before = int(sinks.kernel_runs.item())
                    times[(who, "graph")], expect = self.graph_time(fns, n_graph)
                    runs = int(sinks.kernel_runs.item()) - before
                    self.check(f"{case} [{who}]: kernel_run_counter (graph)", runs == expect,
                               f"advanced by {runs}, expected {expect}")
                    self.expect_no_violations(f"{case} [{who}]", sinks)
                bytes_per_entry = 96 + (16 if sources else 0)
                read_gbps = cfg.verify_entries * bytes_per_entry / (t_read.median_ms * 1e-3) / 1e9
                for timing in ("eager", "graph"):
                    ours = times[("kvcanary", timing)]
                    theirs = times.get(("sglang", timing))
                    primary = timing == "eager"
                    limit = VERIFY_TARGET_VS_READ * t_read.median_ms
                    self._record(
                        case, timing == "graph", theirs, ours,
                        f"<= {VERIFY_TARGET_VS_READ:.2f} x plain read" if primary else "(info)",
                        ours.median_ms <= limit if primary else None,
                        t_read.median_ms, f"plain read of the same bytes ({bytes_per_entry} B/entry, eager)",
                        {"order": order, "real_kv": MODE_NAMES[mode], "entries": cfg.verify_entries,
                         "num_slots": cfg.verify_slots, "bytes_per_entry": bytes_per_entry,
                         "plain_read": t_read.as_dict(), "plain_read_gbps": read_gbps,
                         "ours_effective_gbps": cfg.verify_entries * bytes_per_entry / (ours.median_ms * 1e-3) / 1e9,
                         "copy_gbps": copy_gbps, "graph_launches": n_graph if timing == "graph" else None},
                    )
                del canaries, canary, kinds
                torch.cuda.empty_cache()
            del plans, fill
            torch.cuda.empty_cache()
        del src_tensor, source

    # ---------------------------------------------------------------- report
    def table(self) -> str:
        r = self.results
        dev = r.get("device", {})
        sgl = r.get("sglang", {})
        lines = [f"### kvcanary vs SGLang built-in canary kernels ({dev.get('name', '?')}, "
                 f"{'quick' if self.cfg.quick else 'full'}; SGLang: {sgl.get('status', '?')})", ""]
        f = r["floors"]
        if "copy" in f:
            lines.append(f"- device copy (`copy_` {f['copy']['bytes'] / GIB:.2f} GiB): "
                         f"{f['copy']['gbps_read_plus_write']:.0f} GB/s read+write ({f['copy']['median_ms']:.3f} ms)")
        if "serial_mix" in f:
            m = f["serial_mix"]
            lines.append(f"- serial mix3 chain, {m['steps']} steps in one thread: {fmt_ms(m['median_ms'])} "
                         f"({m['per_step_ns']:.1f} ns/step)")
        lines += ["", "| case | SGLang built-in (measured) | kvcanary | ratio (ours/theirs) | target | floor | "
                      "ours vs floor |", "|---|---|---|---|---|---|---|"]
        for row in self.rows:
            theirs = fmt_ms(row["sglang"]["median_ms"]) if row["sglang"] else "n/a"
            ratio = f"{row['ratio_ours_over_sglang']:.2f}" if row["ratio_ours_over_sglang"] is not None else "-"
            tgt = row["target"]
            if row["meets_target"] is True:
                tgt += " ok"
            elif row["meets_target"] is False:
                tgt += " **MISSED**"
            floor = f"{fmt_ms(row['floor_ms'])} ({row['floor']})" if row["floor_ms"] else "-"
            vs = f"x{row['ours_vs_floor']:.2f}" if row["ours_vs_floor"] else "-"
            lines.append(f"| {row['case']} [{row['timing']}] | {theirs} | {fmt_ms(row['kvcanary']['median_ms'])} | "
                         f"{ratio} | {tgt} | {floor} | {vs} |")
        lines.append("")
        ok = sum(1 for c in r["checks"] if c["ok"])
        lines.append(f"checks: {ok}/{len(r['checks'])} passed"
                     + ("" if not self.failures else "; FAILED: " + "; ".join(self.failures[:10])))
        return "\n".join(lines)


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f} ms" if ms >= 0.1 else f"{ms * 1e3:.2f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (1M verify entries over 256K slots)")
    parser.add_argument("--json", type=Path, default=None, help="write all results (and the table) as JSON here")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case (>= 20)")
    parser.add_argument("--copies", type=int, default=None, help="input copies rotated between repetitions (>= 3)")
    parser.add_argument("--sglang-root", default=None,
                        help="where sglang is unpacked (a site dir holding sglang/, or .../sglang/kernels/jit)")
    parser.add_argument("--no-sglang", action="store_true", help="benchmark kvcanary alone")
    parser.add_argument("--only", choices=["write", "verify"], action="append", default=None,
                        help="run only these case groups (floors and the equality check always run)")
    parser.add_argument("--time-anyway", action="store_true",
                        help="time even when the equality check fails (the exit status stays 1)")
    parser.add_argument("--build-only", action="store_true",
                        help="only compile SGLang's kernels through tvm-ffi (no GPU needed) and exit")
    args = parser.parse_args(argv)

    src, tried = (None, ["--no-sglang"]) if args.no_sglang else locate_sglang(args.sglang_root)
    if args.build_only:
        if src is None:
            print(f"compare_upstream: sglang not found (tried: {tried})", file=sys.stderr)
            return 2
        lib, secs, cached = build_sglang(src)
        print(f"built SGLang {src.version} canary kernels from {src.jit_dir}: {lib} "
              f"({'cached' if cached else f'{secs:.1f} s'})")
        return 0
    if not torch.cuda.is_available():
        print("compare_upstream: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    cfg = make_config(args)
    if cfg.reps < 20 or cfg.copies < 3:
        print(f"compare_upstream: note: reps={cfg.reps}, copies={cfg.copies} (the issue asks >= 20 and >= 3)")
    bench = Compare(cfg)
    props = torch.cuda.get_device_properties(0)
    bench.results["device"] = {"name": props.name, "sm_count": props.multi_processor_count,
                               "total_memory_gib": round(props.total_memory / GIB, 1),
                               "capability": list(torch.cuda.get_device_capability())}
    bench.results["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "python": platform.python_version()}
    bench.results["config"] = cfg.__dict__
    groups = args.only or ["write", "verify"]
    status = 0
    try:
        bench.build()  # ours + floors
        import tvm_ffi

        bench.results["env"]["tvm_ffi"] = str(getattr(tvm_ffi, "__version__", "?"))
        if src is None:
            why = "disabled by --no-sglang" if args.no_sglang else "sglang not found"
            print(f"SGLang: {why} (tried: {', '.join(tried) or '-'}); benchmarking kvcanary alone", flush=True)
            bench.results["sglang"] = {"status": why, "tried": tried}
        else:
            try:
                lib, secs, cached = build_sglang(src)
                bench.sgl = SglKernels(tvm_ffi.load_module(str(lib)))
                bench.results["sglang"] = {"status": f"sglang {src.version}", "version": src.version,
                                           "jit_dir": str(src.jit_dir), "found_by": src.how, "library": str(lib),
                                           "build_s": round(secs, 1), "cached": cached}
                print(f"SGLang {src.version} kernels from {src.jit_dir} "
                      f"({'cached' if cached else f'built in {secs:.1f} s'})", flush=True)
            except Exception as exc:  # noqa: BLE001 - report, benchmark ours alone, exit 1
                traceback.print_exc()
                bench.failures.append(f"building SGLang's kernels failed: {type(exc).__name__}: {exc}")
                bench.results["sglang"] = {"status": "build FAILED", "error": f"{type(exc).__name__}: {exc}"}
        go = True
        if bench.sgl is not None:
            print("equality check on a small case", flush=True)
            same = bench.equality()
            if not same and not args.time_anyway:
                print("the kernels disagree: not timing (use --time-anyway to time regardless)", flush=True)
                go = False
        if go:
            bench.floor_copy()
            bench.floor_mix()
            if "write" in groups:
                bench.small_floors()
                bench.write_compare()
            if "verify" in groups:
                bench.verify_compare()
    except Exception as exc:  # noqa: BLE001 - report, write what we have, exit non-zero
        traceback.print_exc()
        bench.failures.append(f"exception: {type(exc).__name__}: {exc}")
        bench.results["exception"] = f"{type(exc).__name__}: {exc}"
    return bk.finish_run(bench.results, bench.failures, bench.table(), args.json, status)


if __name__ == "__main__":
    sys.exit(main())
