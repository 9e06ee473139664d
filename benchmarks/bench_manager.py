"""Per-forward cost of the canary in a decode loop with CUDA graphs (issue: runtime, acceptance 5).

For decode batches of 1, 64 and 256 requests with 4096-token contexts, in one run:
  * graph replay time (CUDA events) of one decode forward without the canary (stand-in model only) and with
    it (plan + verify + model + write); the difference is the canary's device cost per forward;
  * the bare canary kernels (plan + verify + write captured alone);
  * host time of ``CanaryManager.step()`` (drain, health, stats), which runs outside the graph;
  * wall time per decode step (prepare + replay + step) with and without the canary.

    python benchmarks/bench_manager.py [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from kvcanary.runtime.config import Config
from kvcanary.settings import Mode
from kvcanary.sim.workload import DecodeRig, RigShape


def _replay_times(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median µs of one replay."""
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return statistics.median(samples)


_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
               7: "event_record"}


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (the same library its graphs live in), found through /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcudart.so" in path:
                return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")


def graph_nodes(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """Node count per node type of a captured graph (``keep_graph=True``), read with cudaGraphGetNodes."""
    rt = _cudart()
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    if rt.cudaGraphGetNodes(handle, None, ctypes.byref(count)) != 0:
        raise RuntimeError("cudaGraphGetNodes failed")
    nodes = (ctypes.c_void_p * count.value)()
    rt.cudaGraphGetNodes(handle, nodes, ctypes.byref(count))
    counts: dict[str, int] = {}
    for node in nodes:
        kind = ctypes.c_int(-1)
        rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        name = _NODE_TYPES.get(kind.value, f"type{kind.value}")
        counts[name] = counts.get(name, 0) + 1
    return counts


def _decode_loop(rig: DecodeRig, steps: int) -> tuple[float, float]:
    """(wall µs per decode step, median host µs of manager.step()) over `steps` decode steps."""
    host = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        rig.prepare_decode()
        assert rig.graph is not None
        rig.graph.replay()
        if rig.manager is not None:
            t0 = time.perf_counter()
            rig.manager.step()
            host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e6 / steps
    return wall, statistics.median(host) if host else 0.0


def bench(batch_size: int, context_len: int, steps: int, reps: int) -> dict:
    shape = RigShape(batch_size, context_len, steps + 8)
    config = Config(mode=Mode.LOG, stats_every=0)
    plain = DecodeRig(shape, None, "cuda")
    canary = DecodeRig(shape, config, "cuda")
    for rig in (plain, canary):
        rig.prefill()
        rig.prepare_decode()
        rig.capture()
    assert canary.manager is not None
    canary.manager.mark_init_finished()
    # Replay timing of the same forward (inputs unchanged between replays: a steady-state decode step).
    t_plain = _replay_times(plain.graph, reps)  # type: ignore[arg-type]
    t_canary = _replay_times(canary.graph, reps)  # type: ignore[arg-type]
    # The bare canary kernels, captured alone.
    mgr = canary.manager
    bare = torch.cuda.CUDAGraph(keep_graph=True)  # kept: its nodes are counted
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mgr.before_forward(canary.decode)
        mgr.after_forward(canary.decode)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(bare):
        mgr.before_forward(canary.decode)
        mgr.after_forward(canary.decode)
    nodes = graph_nodes(bare)
    bare.instantiate()
    t_bare = _replay_times(bare, reps)
    wall_plain, _ = _decode_loop(plain, steps)
    wall_canary, host_step = _decode_loop(canary, steps)
    mgr.flush()
    violations = len(mgr.violations)
    return {
        "batch_size": batch_size,
        "context_len": context_len,
        "verify_entries_per_forward": batch_size * (context_len - 1),
        "replay_us_plain": t_plain,
        "replay_us_canary": t_canary,
        "device_overhead_us": t_canary - t_plain,
        "bare_kernels_us": t_bare,
        "canary_graph_nodes": sum(nodes.values()),
        "canary_graph_node_types": nodes,
        "host_step_us": host_step,
        "wall_us_plain": wall_plain,
        "wall_us_canary": wall_canary,
        "violations": violations,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_manager: needs a CUDA device")
        return 2
    rows = [bench(bs, args.context, args.steps, args.reps) for bs in args.batches]
    print(f"\n### canary per-forward cost, decode with CUDA graphs ({torch.cuda.get_device_name()}, "
          f"context {args.context})\n")
    print("| batch | verify entries | replay plain µs | replay canary µs | device overhead µs | bare kernels µs "
          "| canary graph nodes | host step() µs | wall/step plain µs | wall/step canary µs | violations |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['verify_entries_per_forward']:,} | {r['replay_us_plain']:.1f} | "
              f"{r['replay_us_canary']:.1f} | {r['device_overhead_us']:.1f} | {r['bare_kernels_us']:.1f} | "
              f"{r['canary_graph_nodes']} ({', '.join(f'{k} {v}' for k, v in r['canary_graph_node_types'].items())}) | "
              f"{r['host_step_us']:.1f} | {r['wall_us_plain']:.1f} | {r['wall_us_canary']:.1f} | {r['violations']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if any(r["violations"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
