"""Host cost of kvcanary outside its own accounting, in a real sglang 0.5.12 scheduler loop on CPU (issue 15).

Runs the same decode-heavy MiniScheduler workload (tests/adapters/sgl_engine.py: a real ModelRunner, RadixCache,
ScheduleBatch -> ForwardBatch -> ModelRunner.forward -> sample) in fresh processes, kvcanary off (no hooks) and
log (``KVCANARY_MODE=log``, ``KVCANARY_REAL_KV=partial``; ``--tokens`` adds the token check, ``--sweep N`` the sweep),
and reports per forward:

* ``loop_us``: wall time of one scheduler step (batch prep, ForwardBatch, forward, sample, bookkeeping);
* ``model_us``: time inside the model's own layers (LlamaModel.forward + logits processor), the part the CPU
  spends on arithmetic; ``nonmodel_us`` = loop - model is what a CUDA-graph engine pays on the host;
* ``mr_forward_us``: around ModelRunner.forward as the scheduler calls it (kvcanary's around hook included);
* kvcanary's own HostTime (hooks, wrapper launches, batch hook) and ``unaccounted_us`` = nonmodel(log) -
  nonmodel(off) - canary_us: what the canary costs that its accounting does not see;
* GC collections per generation and their time (gc.callbacks), allocated-block growth.

``--stub-kernels`` makes kvcanary's two per-forward launches no-ops (on the CPU they run the kernels inline,
milliseconds that bury the host Python; a GPU launch is microseconds). ``--profile`` also writes a cProfile of
each mode and lists the functions whose cumulative time per forward differs most between off and log
(kvcanary's own first), and the non-kvcanary functions called a different number of times. Timings on a shared
2-core box are noisy: the driver runs ``--rounds`` off/log pairs in fresh processes and prints medians.

    python benchmarks/bench_sglang_host_gap.py --rounds 3 --batch 32 --forwards 300 [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ADAPTER_TESTS = REPO / "tests" / "adapters"


@dataclass
class GcStats:
    """Collections per generation and their total time, from gc.callbacks."""

    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    ns: list[int] = field(default_factory=lambda: [0, 0, 0])
    collected: int = 0
    _start: int = 0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            gen = info["generation"]
            self.counts[gen] += 1
            self.ns[gen] += time.perf_counter_ns() - self._start
            self.collected += info.get("collected", 0)


@dataclass
class Result:
    mode: str
    forwards: int
    decode_forwards: int
    loop_us: float
    model_us: float
    mr_forward_us: float
    nonmodel_us: float
    loop_us_median: float
    nonmodel_us_median: float
    gc_counts: list[int]
    gc_us_per_forward: list[float]
    gc_collected: int
    blocks_per_forward: float
    gen0_allocs_per_forward: float
    canary_us: float = 0.0
    hooks_us: float = 0.0
    launch_us: float = 0.0
    batch_init_us: float = 0.0
    sweep_us: float = 0.0  # the sweeps' part of hooks_us
    kvcanary_forwards: int = 0
    tracked_objects: int = 0  # GC-tracked objects after set-up (what a full collection walks)
    full_collect_ms: float = 0.0  # fastest of 3 gc.collect() after set-up: what a gen2 collection costs this heap


def _setup_sglang() -> None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ADAPTER_TESTS))
    sys.path.insert(0, str(REPO / "plugin"))
    import _sglang_cpu_shims

    _sglang_cpu_shims.apply()


def _stub_kernels(sweep: bool) -> None:
    """kvcanary's launches do nothing (the CPU kernels compute inline; a GPU launch does not): only the host Python
    stays. Before the runner is built: the device state binds ``CheckLaunch.of_batch`` when it is made."""
    from kvcanary.kernels import call, check, write

    check.CheckLaunch.__call__ = lambda self, *a, **k: None
    check.CheckLaunch.of_batch = lambda self, *a: None  # (the per-forward path's call)
    write.WriteLaunch.__call__ = lambda self, n: None
    if sweep:  # the sweep's verify export (reached through KernelSpec.run): its Python path stays timed
        real_module_for = call.module_for

        class _NoVerify:
            def __init__(self, module):
                self._module = module

            def __getattr__(self, name):
                if name.startswith("canary_verify_step"):
                    return lambda *a: None
                return getattr(self._module, name)

        call.module_for = lambda device: _NoVerify(real_module_for(device))


def worker(args) -> Result:
    """One mode in this (fresh) process."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    os.environ["KVCANARY_MODE"] = args.mode
    os.environ["KVCANARY_REAL_KV"] = "partial"
    os.environ["KVCANARY_STATS_EVERY"] = str(args.stats_every)
    for k in ("KVCANARY_VERIFY_TOKENS", "KVCANARY_SWEEP_INTERVAL", "KVCANARY_REPORT"):
        os.environ.pop(k, None)
    if args.tokens:
        os.environ["KVCANARY_VERIFY_TOKENS"] = "1"
    if args.sweep:
        os.environ["KVCANARY_SWEEP_INTERVAL"] = str(args.sweep)
    if args.report:
        os.environ["KVCANARY_REPORT"] = os.path.join(tempfile.mkdtemp(), "kvc-{rank}.jsonl")
    _setup_sglang()
    import torch

    torch.set_num_threads(1)
    import random

    import sgl_engine
    from sglang.srt.plugins.hook_registry import HookRegistry

    if args.mode != "off":
        from kvcanary.sglang import register

        register()
        HookRegistry.apply_hooks()
    if args.stub_kernels and args.mode != "off":
        _stub_kernels(bool(args.sweep))
    tmp = Path(tempfile.mkdtemp())
    sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp / "tiny-llama"), page_size=args.page_size,
                                chunked_prefill_size=4096, max_total_tokens=args.batch * (args.prompt + args.forwards
                                                                                          + 16) + 256,
                                max_running_requests=args.batch)
    mr = sgl_engine.build_runner(sa)
    tree = sgl_engine.build_tree_cache(mr, sa)
    from kvcanary.sglang import hooks

    inst = hooks.installation_of(mr)
    assert (inst is not None) == (args.mode != "off")
    # model time: the layers and the logits processor, below kvcanary's model.forward wrapper
    model_ns = [0]

    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                model_ns[0] += time.perf_counter_ns() - t
        return run

    mr.model.model.forward = timed(mr.model.model.forward)
    mr.model.logits_processor.forward = timed(mr.model.logits_processor.forward)
    mr_ns = [0]
    cls = type(mr)
    patched_forward = cls.forward

    def mr_forward(self, *a, **k):
        t = time.perf_counter_ns()
        try:
            return patched_forward(self, *a, **k)
        finally:
            mr_ns[0] += time.perf_counter_ns() - t

    cls.forward = mr_forward

    rng = random.Random(0)
    sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=4096)
    for _ in range(args.batch):
        sched.add([rng.randrange(3, 2000) for _ in range(args.prompt)], args.forwards + args.warmup)
    for _ in range(args.warmup):
        sched.step()
    collects = []
    for _ in range(3):  # the first also frees the set-up's garbage: the fastest is the heap walk
        t_collect = time.perf_counter_ns()
        gc.collect()
        collects.append(time.perf_counter_ns() - t_collect)
    full_collect_ms = min(collects) / 1e6
    tracked = len(gc.get_objects())
    gcs = GcStats()
    gc.callbacks.append(gcs.callback)
    profiler = None
    if args.profile_out:
        import cProfile

        profiler = cProfile.Profile()
    if inst is not None:
        inst.host_time = type(inst.host_time)()
        sweep0 = inst.sweep_tally()
    steps: list[int] = []
    steps_model: list[int] = []
    model_ns[0] = mr_ns[0] = 0
    blocks0 = sys.getallocatedblocks()
    gen0_allocs = 0
    if profiler:
        profiler.enable()
    for _ in range(args.forwards):
        if sched.idle:
            break
        c0 = gc.get_count()[0]
        m0 = model_ns[0]
        t = time.perf_counter_ns()
        sched.step()
        steps.append(time.perf_counter_ns() - t)
        steps_model.append(model_ns[0] - m0)
        c1 = gc.get_count()[0]
        gen0_allocs += c1 - c0 if c1 >= c0 else c1  # net container allocations (approximate across a collection)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile_out)
    blocks1 = sys.getallocatedblocks()
    gc.callbacks.remove(gcs.callback)
    n = len(steps)
    res = Result(
        mode=args.mode, forwards=n, decode_forwards=sum(1 for m in sched.forwards[-n:] if m == "DECODE"),
        loop_us=sum(steps) / n / 1e3, model_us=model_ns[0] / n / 1e3, mr_forward_us=mr_ns[0] / n / 1e3,
        nonmodel_us=(sum(steps) - model_ns[0]) / n / 1e3,
        loop_us_median=statistics.median(steps) / 1e3,
        nonmodel_us_median=statistics.median(s - m for s, m in zip(steps, steps_model, strict=True)) / 1e3,
        gc_counts=gcs.counts, gc_us_per_forward=[x / n / 1e3 for x in gcs.ns], gc_collected=gcs.collected,
        blocks_per_forward=(blocks1 - blocks0) / n, gen0_allocs_per_forward=gen0_allocs / n,
        tracked_objects=tracked, full_collect_ms=full_collect_ms,
    )
    if inst is not None:
        h = inst.host_time
        f = max(h.forwards, 1)
        res.kvcanary_forwards = h.forwards
        res.hooks_us = h.hook_ns / f / 1e3
        res.launch_us = h.in_forward_ns / f / 1e3
        res.batch_init_us = h.batch_init_ns / f / 1e3
        res.sweep_us = (inst.sweep_tally() - sweep0).host_ns / f / 1e3
        res.canary_us = res.hooks_us + res.launch_us + res.batch_init_us
    return res


def _run_worker(mode: str, args, profile_out: str | None) -> Result:
    cmd = [sys.executable, __file__, "--worker", mode, "--batch", str(args.batch), "--forwards", str(args.forwards),
           "--warmup", str(args.warmup), "--prompt", str(args.prompt), "--page-size", str(args.page_size),
           "--stats-every", str(args.stats_every), "--sweep", str(args.sweep)]
    if args.tokens:
        cmd.append("--tokens")
    if args.report:
        cmd.append("--report")
    if args.stub_kernels:
        cmd.append("--stub-kernels")
    if profile_out:
        cmd += ["--profile-out", profile_out]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return Result(**json.loads(line[len("RESULT "):]))


def _fmt_table(results: dict[str, list[Result]]) -> str:
    def med(mode, key, idx=None):
        vals = [getattr(r, key) if idx is None else getattr(r, key)[idx] for r in results[mode]]
        return statistics.median(vals)

    rows = [
        ("loop_us (mean)", "loop_us", None), ("loop_us (median step)", "loop_us_median", None),
        ("model_us (layers+logits)", "model_us", None), ("ModelRunner.forward_us", "mr_forward_us", None),
        ("loop - model (mean)", "nonmodel_us", None), ("loop - model (median step)", "nonmodel_us_median", None),
        ("gen0 collections", "gc_counts", 0), ("gen1 collections", "gc_counts", 1),
        ("gen2 collections", "gc_counts", 2),
        ("gc0 us/forward", "gc_us_per_forward", 0), ("gc1 us/forward", "gc_us_per_forward", 1),
        ("gc2 us/forward", "gc_us_per_forward", 2), ("gen0 net allocs/forward", "gen0_allocs_per_forward", None),
        ("alloc blocks growth/forward", "blocks_per_forward", None),
        ("GC-tracked objects (heap)", "tracked_objects", None), ("full gc.collect() ms", "full_collect_ms", None),
        ("kvcanary canary_us", "canary_us", None), ("  hooks_us", "hooks_us", None),
        ("  launch_us (wrapper)", "launch_us", None), ("  batch_init_us", "batch_init_us", None),
        ("  sweep_us (in hooks_us)", "sweep_us", None),
    ]
    lines = [f"{'per forward (median of rounds)':32s} {'off':>10s} {'log':>10s} {'log-off':>10s}"]
    for label, key, idx in rows:
        a, b = med("off", key, idx), med("log", key, idx)
        lines.append(f"{label:32s} {a:10.1f} {b:10.1f} {b - a:10.1f}")
    d_nonmodel = [lg.nonmodel_us - of.nonmodel_us for of, lg in zip(results["off"], results["log"], strict=True)]
    unacc = [d - lg.canary_us for d, lg in zip(d_nonmodel, results["log"], strict=True)]
    d_med = [lg.nonmodel_us_median - of.nonmodel_us_median
             for of, lg in zip(results["off"], results["log"], strict=True)]
    lines.append(f"rounds: nonmodel log-off (mean) {[round(x, 1) for x in d_nonmodel]}, (median step) "
                 f"{[round(x, 1) for x in d_med]}; minus canary_us {[round(x, 1) for x in unacc]}")
    return "\n".join(lines)


def _profile_diff(off_path: str, log_path: str, forwards: int, top: int) -> str:
    def cum(path):
        st = pstats.Stats(path)
        out = {}
        for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():
            out[f"{Path(file).name}:{line}({name})"] = (nc, tt, ct, file)
        return out

    off, log = cum(off_path), cum(log_path)
    lines = ["kvcanary functions in the log profile (per forward: calls, tottime us, cumtime us):"]
    kv = sorted(((k, v) for k, v in log.items() if "kvcanary" in v[3]), key=lambda kv: -kv[1][2])
    for k, (nc, tt, ct, _f) in kv[:top]:
        lines.append(f"  {k:70s} {nc / forwards:6.2f} {tt / forwards * 1e6:8.1f} {ct / forwards * 1e6:8.1f}")
    lines.append("largest tottime differences log - off, non-kvcanary (per forward: calls off/log, "
                 "tottime us off/log):")
    keys = set(off) | set(log)
    diffs = []
    for k in keys:
        if k in log and "kvcanary" in log[k][3]:
            continue
        a = off.get(k, (0, 0.0, 0.0, ""))
        b = log.get(k, (0, 0.0, 0.0, ""))
        diffs.append((b[1] - a[1], k, a, b))
    diffs.sort(key=lambda d: -abs(d[0]))
    for dt, k, a, b in diffs[:top]:
        lines.append(f"  {k:70s} {a[0] / forwards:6.2f}/{b[0] / forwards:6.2f} {a[1] / forwards * 1e6:8.1f}/"
                     f"{b[1] / forwards * 1e6:8.1f}  d={dt / forwards * 1e6:+7.1f}")
    # a hook that makes sglang do more work shows as more calls of a non-kvcanary function (timing noise does not)
    lines.append("non-kvcanary functions called a different number of times (per forward: calls off/log, "
                 "cumtime us off/log):")
    called = [(b[0] - a[0], k, a, b) for _dt, k, a, b in diffs if a[0] != b[0]]
    called.sort(key=lambda d: -abs(d[0]))
    for _dn, k, a, b in called[:top]:
        lines.append(f"  {k:70s} {a[0] / forwards:6.2f}/{b[0] / forwards:6.2f} {a[2] / forwards * 1e6:8.1f}/"
                     f"{b[2] / forwards * 1e6:8.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["off", "log"], help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3, help="off/log pairs, each in fresh processes")
    ap.add_argument("--batch", type=int, default=32, help="requests decoding together")
    ap.add_argument("--forwards", type=int, default=300, help="measured forwards (after --warmup)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--stats-every", type=int, default=20, help="KVCANARY_STATS_EVERY (phase 4 uses 20)")
    ap.add_argument("--report", action="store_true", help="set KVCANARY_REPORT (phase 4 does)")
    ap.add_argument("--tokens", action="store_true", help="log mode with the token check (KVCANARY_VERIFY_TOKENS=1)")
    ap.add_argument("--sweep", type=int, default=0, help="log mode with KVCANARY_SWEEP_INTERVAL=N (0: no sweep)")
    ap.add_argument("--stub-kernels", action="store_true",
                    help="log mode: kvcanary's check/write launches do nothing (on the CPU they compute inline, "
                         "~1-3 ms per forward, which buries the host Python this looks for)")
    ap.add_argument("--profile", action="store_true", help="one extra off/log pair under cProfile, diffed")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if args.worker:
        args.mode = args.worker
        res = worker(args)
        print("RESULT " + json.dumps(asdict(res)), flush=True)
        return
    results: dict[str, list[Result]] = {"off": [], "log": []}
    for i in range(args.rounds):
        for mode in ("off", "log") if i % 2 == 0 else ("log", "off"):
            r = _run_worker(mode, args, None)
            results[mode].append(r)
            print(f"round {i} {mode}: loop {r.loop_us:.0f} us, model {r.model_us:.0f} us, "
                  f"nonmodel {r.nonmodel_us:.0f} us (median step {r.nonmodel_us_median:.0f}), canary {r.canary_us:.0f} "
                  f"us, gc {r.gc_counts} {[round(x, 1) for x in r.gc_us_per_forward]} us/fwd", flush=True)
    print(_fmt_table(results))
    if args.profile:
        d = tempfile.mkdtemp()
        paths = {m: os.path.join(d, f"{m}.prof") for m in ("off", "log")}
        for m in ("off", "log"):
            _run_worker(m, args, paths[m])
        print(f"profiles: {paths}")
        print(_profile_diff(paths["off"], paths["log"], args.forwards, args.top))


if __name__ == "__main__":
    main()
