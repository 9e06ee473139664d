#!/usr/bin/env python3
"""What writer attribution and violation metadata (kvcanary+) cost the write and verify kernels, side by side.

Each case runs the same launch twice: the seed call (``canary_write_step`` / ``canary_verify_step`` without the
new arguments) and the attributed call (``violation_meta``, ``forward_step``, request rows, ``slot_attribution``
and, for write, ``row_serials``: what CanaryManager passes). Write stores 16 more bytes per record (the slot's
attribution) and reads one serial per request; verify reads the request row and the slot's attribution only for
failing entries, so its clean path should cost nothing. ``verify dirty`` corrupts 1 % of the records to show the
failure path.

Timing: the two variants of a case alternate, repetition by repetition, so both see the same machine. On CUDA,
20 launches captured in one CUDA graph, replayed behind a ``torch.cuda._sleep`` and timed with CUDA events (device
time per launch, no host overhead), median of the repetitions; on the CPU, ``time.perf_counter`` around each
launch, minimum of the repetitions (the least disturbed run: CPU machines running other work make medians
noisy). ``host`` rows time the Python wrapper of a one-entry launch (the per-forward host cost an engine pays).

Usage (repository root):
    PYTHONPATH=plugin python3 benchmarks/bench_attribution.py [--device cpu|cuda] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT / "plugin") not in sys.path:
    try:
        import kvcanary  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT / "plugin"))

import torch  # noqa: E402

from kvcanary.kernels import call, layout, verify  # noqa: E402
from kvcanary.kernels.real_kv import RealKvSource  # noqa: E402
from kvcanary.kernels.write import canary_write_step  # noqa: E402

SLEEP_CYCLES = 200_000  # ~100 us on an H200: longer than queueing a graph replay
KV_ROW_BYTES = 256


@dataclass
class Row:
    kernel: str
    case: str
    seed_us: float
    attributed_us: float

    @property
    def overhead_pct(self) -> float:
        return 100.0 * (self.attributed_us / self.seed_us - 1.0) if self.seed_us > 0 else float("nan")


@dataclass
class Shape:
    requests: int
    tokens_per_request: int
    num_slots: int


def i32(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=device)


def sinks(capacity: int, num_slots: int, device: torch.device) -> dict[str, torch.Tensor]:
    i64 = {"dtype": torch.int64, "device": device}
    return {
        "violation_ring": torch.zeros((capacity, layout.VIOLATION_FIELDS), **i64),
        "violation_write_index": torch.zeros(1, dtype=torch.int32, device=device),
        "slot_run_counter": torch.zeros(1, **i64),
        "kernel_run_counter": torch.zeros(1, **i64),
    }


def attribution(capacity: int, num_slots: int, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    i64 = {"dtype": torch.int64, "device": device}
    return {
        "violation_meta": torch.zeros((capacity, layout.VIOLATION_META_FIELDS), **i64),
        "forward_step": torch.ones(1, **i64),
        "slot_attribution": torch.full((num_slots, layout.SLOT_ATTRIBUTION_FIELDS), -1, **i64),
        "_rows": torch.arange(rows, **i64) + 1,
        "_serials": torch.arange(rows + 1, **i64) + 100,
    }


def write_launch(shape: Shape, device: torch.device, gen: torch.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """(seed kwargs, attributed extra kwargs) for one write of requests x tokens_per_request fresh slots."""
    n = shape.requests * shape.tokens_per_request
    i64 = {"dtype": torch.int64, "device": device}
    slots = (torch.randperm(shape.num_slots - 1, generator=gen)[:n] + 1).to(device)
    kv = torch.randint(0, 256, (shape.num_slots, KV_ROW_BYTES), dtype=torch.uint8, generator=gen).to(device)
    seed = {
        "canary_buf": torch.zeros((shape.num_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=device),
        "write_offsets": torch.arange(shape.requests + 1, **i64) * shape.tokens_per_request,
        "write_seed_slot_indices": torch.full((shape.requests,), -1, **i64),
        "write_num_valid_reqs": i32(shape.requests, device),
        "input_ids": torch.randint(0, 50000, (n,), generator=gen).to(device),
        "positions": torch.arange(shape.tokens_per_request, **i64).repeat(shape.requests),
        "out_cache_loc": slots.to(torch.int64),
        "kernel_kind": 1,
        "enable_write_input_assert": False,
        "expected_input_tokens": None,
        "expected_input_positions": None,
        "enable_chain_position_assert": i32(0, device),
        "real_kv_sources": call.prepare_real_kv([RealKvSource(kv, 1, KV_ROW_BYTES, KV_ROW_BYTES)], device),
        "real_kv_hash_mode": layout.REAL_KV_HASH_MODE_PARTIAL,
        **sinks(1024, shape.num_slots, device),
    }
    extra = attribution(1024, shape.num_slots, shape.requests, device)
    extra["write_request_rows"] = extra.pop("_rows")
    extra["row_serials"] = extra.pop("_serials")
    return seed, extra


def verify_launch(shape: Shape, device: torch.device, gen: torch.Generator,
                  dirty_fraction: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """A written buffer (one write of the same shape) and the verify plan of every written entry."""
    write, _ = write_launch(shape, device, gen)
    canary_write_step(**write)
    n = shape.requests * shape.tokens_per_request
    slots = write["out_cache_loc"]
    prevs = torch.cat([torch.full((shape.requests, 1), -1, dtype=torch.int64, device=device),
                       slots.view(shape.requests, -1)[:, :-1]], dim=1).reshape(-1)
    if dirty_fraction > 0:
        victims = slots[torch.randperm(n, generator=gen)[: max(1, int(n * dirty_fraction))].to(device)]
        write["canary_buf"][victims, 24] ^= 1  # real_kv_hash byte: a verify_real_kv_hash row each
    capacity = max(1024, int(n * dirty_fraction) + 16)
    seed = {
        "canary_buf": write["canary_buf"],
        "verify_slot_indices": slots,
        "verify_expected_tokens": torch.full((n,), -1, dtype=torch.int64, device=device),
        "verify_expected_positions": write["positions"],
        "verify_prev_slot_indices": prevs,
        "verify_num_valid": i32(n, device),
        "verify_enable": i32(1, device),
        "kernel_kind": 0,
        "real_kv_sources": write["real_kv_sources"],
        "real_kv_hash_mode": layout.REAL_KV_HASH_MODE_PARTIAL,
        "check_tokens": False,
        **sinks(capacity, shape.num_slots, device),
    }
    extra = attribution(capacity, shape.num_slots, n, device)
    extra["verify_request_rows"] = extra.pop("_rows")
    del extra["_serials"]
    return seed, extra


def _launcher(fn: Callable[..., None], kwargs: dict[str, Any], device: torch.device,
              launches: int) -> Callable[[], float]:
    """A callable that runs the launch (``launches`` of them in a CUDA graph on CUDA) and returns us per launch."""
    index = kwargs["violation_write_index"]
    if device.type == "cpu":
        def once() -> float:
            index.zero_()
            t0 = time.perf_counter()
            fn(**kwargs)
            return (time.perf_counter() - t0) * 1e6
        return once
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn(**kwargs)  # warm up (and build) outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn(**kwargs)

    def replay() -> float:
        index.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / launches
    return replay


def time_pair(fn: Callable[..., None], seed: dict[str, Any], attributed: dict[str, Any], device: torch.device,
              reps: int, launches: int) -> tuple[float, float]:
    """(seed, attributed) us per launch, the two alternating; min on the CPU, median on CUDA."""
    a, b = _launcher(fn, seed, device, launches), _launcher(fn, attributed, device, launches)
    a(), b()  # warm
    sa, sb = [], []
    for _ in range(reps):
        sa.append(a())
        sb.append(b())
    pick = min if device.type == "cpu" else statistics.median
    return pick(sa), pick(sb)


def time_host_pair(fn: Callable[..., None], seed: dict[str, Any], attributed: dict[str, Any],
                   reps: int) -> tuple[float, float]:
    """(seed, attributed) median host us of one wrapper call (the launch included on CUDA, not the kernel)."""
    sa, sb = [], []
    for _ in range(reps):
        for kwargs, out in ((seed, sa), (attributed, sb)):
            t0 = time.perf_counter()
            fn(**kwargs)
            out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(sa), statistics.median(sb)


def run(device: torch.device, quick: bool) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    big = device.type == "cuda" and not quick
    reps = 7 if quick else 25
    launches = 20 if big else 1
    write_shapes = {
        "decode 256 x 1": Shape(256, 1, 1 << 16),
        "prefill 1 x 8192": Shape(1, 8192, 1 << 16),
        "extend 1024 x 16": Shape(1024, 16, 1 << 16),
    }
    verify_shapes = [Shape(64, 2048, 1 << 18), Shape(512, 128, 1 << 17)] if big else [
        Shape(16, 512, 1 << 14), Shape(64, 128, 1 << 14)]
    rows: list[Row] = []
    for name, shape in write_shapes.items():
        seed, extra = write_launch(shape, device, gen)
        rows.append(Row("write", name, *time_pair(canary_write_step, seed, {**seed, **extra}, device, reps,
                                                  launches)))
    for shape in verify_shapes:
        for dirty in (0.0, 0.01):
            seed, extra = verify_launch(shape, device, gen, dirty)
            label = f"{'dirty 1%' if dirty else 'clean'} {shape.requests} x {shape.tokens_per_request}"
            rows.append(Row("verify", label, *time_pair(verify.canary_verify_step, seed, {**seed, **extra}, device,
                                                        reps, launches)))
    seed, extra = write_launch(Shape(1, 1, 64), device, gen)
    rows.append(Row("write", "host: one-entry wrapper call",
                    *time_host_pair(canary_write_step, seed, {**seed, **extra}, 500)))
    seed, extra = verify_launch(Shape(1, 1, 64), device, gen, 0.0)
    rows.append(Row("verify", "host: one-entry wrapper call",
                    *time_host_pair(verify.canary_verify_step, seed, {**seed, **extra}, 500)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repetitions")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rows = run(device, args.quick)
    unit = "device us/launch" if device.type == "cuda" else "us/launch"
    print(f"kvcanary attribution cost on {device} ({'quick' if args.quick else 'full'}; host rows: us/call)")
    print(f"| kernel | case | seed ({unit}) | attributed | overhead |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.kernel} | {r.case} | {r.seed_us:.2f} | {r.attributed_us:.2f} | {r.overhead_pct:+.1f} % |")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "quick": args.quick,
                                         "rows": [{**asdict(r), "overhead_pct": r.overhead_pct} for r in rows]},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
