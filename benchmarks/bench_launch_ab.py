#!/usr/bin/env python3
"""Host µs of the manager's two per-forward launches, two builds of the kernel module side by side.

    python benchmarks/bench_launch_ab.py --old A/kvcanary_ops.so --new B/kvcanary_ops.so [--device cuda]

A csrc change to a launch's host path (what its C++ wrapper checks and extracts per call) is judged here, not
between two runs: the bound check and write of one manager (a decode forward of batch 1, the calls and arguments
the manager makes, recorded as ``bench_host.py`` records them) are bound once per build and called in a shuffled,
interleaved order, each call timed alone, either warm (back to back) or from cold caches (``--cold`` MiB of host
memory written before each call, as the engine's own work between two forwards evicts kvcanary's code and data:
the regime the engine measures, several times the warm cost). Both modules must take the same arguments (the
Python side is this checkout's). Prints one markdown table: median and quartiles per build and call, and new/old.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import tvm_ffi
from bench_host import host_case, recorded_calls


def recorded_launches(dev: torch.device) -> list[tuple[str, tuple, list[tuple]]]:
    """(bind export, its arguments, the arguments of each call of the bound function) of ``bench_host.py``'s manager
    running its decode forward."""
    calls = recorded_calls(*host_case(dev)[:2])
    return [(name, args, [c for n, c in calls if n == f"{name}()"]) for name, args in calls if name.endswith("_bind")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the baseline build's kvcanary_ops.so")
    ap.add_argument("--new", required=True, help="the changed build's kvcanary_ops.so")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=600, help="timed calls per build, call and regime")
    ap.add_argument("--cold", type=int, default=32, metavar="MB", help="host memory written before each cold call")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    binds = recorded_launches(dev)
    fns = {}  # (call, build) -> (bound function, its arguments)
    for build, path in (("old", args.old), ("new", args.new)):
        module = tvm_ffi.load_module(path)
        for name, bind_args, calls in binds:
            fns[(f"{name}()", build)] = (getattr(module, name)(*bind_args), calls[0])
    thrash = torch.zeros(args.cold << 20, dtype=torch.uint8)
    samples: dict[tuple[str, str, str], list[float]] = {}
    keys = list(fns)
    for fn, call_args in fns.values():  # warm-up: first-call costs (lazy symbol binding, the driver's first launch)
        for _ in range(50):
            fn(*call_args)
    sync()
    for regime in ("warm", "cold"):
        for i in range(args.calls):
            random.Random(i).shuffle(keys)
            for key in keys:
                fn, call_args = fns[key]
                if regime == "cold":
                    thrash.add_(1)
                elif i % 64 == 0:
                    sync()  # (back-to-back calls: keep the launch queue short)
                t0 = time.perf_counter_ns()
                fn(*call_args)
                samples.setdefault((key[0], key[1], regime), []).append((time.perf_counter_ns() - t0) / 1e3)
            if regime == "cold":
                sync()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"### bound launches, old vs new build, host µs per call ({name}, torch {torch.__version__}, "
          f"{args.calls} calls each, cold: {args.cold} MiB written before each call)\n")
    print("| call | regime | old median (p25-p75) | new median (p25-p75) | new/old |")
    print("|---|---|---|---|---|")
    for call_name in dict.fromkeys(k[0] for k in fns):
        for regime in ("warm", "cold"):
            cells = []
            for build in ("old", "new"):
                s = samples[(call_name, build, regime)]
                q = statistics.quantiles(s, n=4)
                cells.append((statistics.median(s), q[0], q[2]))
            print(f"| {call_name} | {regime} | {cells[0][0]:.2f} ({cells[0][1]:.2f}-{cells[0][2]:.2f}) | "
                  f"{cells[1][0]:.2f} ({cells[1][1]:.2f}-{cells[1][2]:.2f}) | {cells[1][0] / cells[0][0]:.2f} |")


if __name__ == "__main__":
    main()
