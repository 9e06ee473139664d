"""Where a forward's wall time goes in sglang's scheduler loop (test-only; ``sglang_e2e.py --loop-probe``).

kvcanary's own ``kvcanary host time`` lines count the host time of its hooks. When the off/log tokens/s ratio of
the overhead phase is lower than that accounting predicts, the rest went somewhere the hooks cannot see: host
time in sglang caused by the canary, the host waiting for the GPU (the canary's device work on the critical path
of the overlap scheduler: its write sits between the logits and the delayed sampling), or driver contention. This
probe answers which, off vs log, per scheduler-loop iteration:

* host time of each step of ``Scheduler.event_loop_overlap`` (``recv_requests`` + ``process_input_requests``,
  ``get_next_batch_to_run``, ``run_batch`` with its ``forward_batch_generation`` and ``ForwardBatch.init_new``,
  ``process_batch_result``, ``launch_batch_sample_if_needed``);
* host time blocked in ``torch.cuda.Event.synchronize`` (sglang waits there for the sampled tokens' copy) and in
  ``torch.cuda.synchronize`` / ``Stream.synchronize``, anywhere in the scheduler process;
* the GPU's time per forward on the forward stream (CUDA events recorded at ``run_batch`` entry and after the
  delayed sampling's launch, read once complete, never waited for), split into decode and prefill forwards, and the
  GPU's idle gap between forwards;
* with ``E2E_LOOP_PROBE_KVC_DEVICE=1`` (off by default: it adds two event records per launch), the device time of
  each of kvcanary's eager launches (the check before a forward, the write after it; inside a captured graph they
  are not timed).

It is a sglang plugin written into the phase folder (like the EAGLE test plugin) that patches the Scheduler class
in every sglang process when ``E2E_LOOP_PROBE=1``; it never imports kvcanary. Its cost (a few perf_counter reads,
two event records per iteration) is the same in off and log Engines. Every ``EVERY`` loop iterations the scheduler
prints one cumulative ``[e2e-probe]`` line; :func:`parse_window` takes the difference between the last line before
the measured workload and the last line of the Engine, so warm-up is excluded.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver_plugin import write_test_plugin  # noqa: E402

PROBE_ENV = "E2E_LOOP_PROBE"
PROBE_FILE_ENV = "E2E_LOOP_PROBE_FILE"  # this file: the plugin loads it in the scheduler process
PLUGIN = "kvcanary_e2e_loop_probe"
EVERY = 25  # iterations between two cumulative lines
LINE_RE = re.compile(r"\[e2e-probe\] (?P<fields>t=[\d.]+ .*)")
WINDOW_START = "[e2e-worker] measured workload t="
WINDOW_END = "[e2e-worker] measured workload ends t="

# cumulative counters of one scheduler process: *_ns host time, *_n calls
FIELDS = ("iters", "decode_n", "extend_n", "loop_ns", "recv_ns", "next_ns", "run_ns", "fbg_ns", "init_ns",
          "result_ns", "sample_ns", "evsync_ns", "evsync_n", "sync_ns", "sync_n", "gpu_ns", "gpu_n", "gap_ns",
          "replay_ns", "kvc_views_ns", "kvc_launch_ns", "kvc_before_ns", "kvc_after_ns", "kvc_step_ns",
          "kvc_drain_ns", "kvc_drain_n", "kvc_stats_ns", "kvc_metrics_ns", "kvc_account_ns", "kvc_batch_ns",
          "kvc_populate_ns", "gpu_decode_ns", "gpu_decode_n", "kvc_gpu_ns", "kvc_gpu_n",
          "unit_ns", "unit_n", "kvc_status_start_ns", "kvc_status_read_ns", "kvc_health_ns", "kvc_assign_ns",
          "kvc_sweep_ns", "kvc_sweep_source_ns", "kvc_sweep_commit_ns", "kvc_sweep_launch_ns", "kvc_sweep_walk_ns",
          "kvc_sweep_reserve_ns", "kvc_sweep_append_ns", "kvc_sweep_producer_ns", "kvc_sweep_prime_ns",
          "kvc_sweep_compact_ns", "kvc_sweep_index_prime_ns", "kvc_streams_consumer_ns", "kvc_streams_done_ns",
          "kvc_streams_hold_ns", "torch_event_record_ns",
          "torch_stream_wait_event_ns", "kvc_token_columns_ns", "kvc_token_upload_ns", "kvc_token_mail_ns",
          "tok_after_result_ns", "cuda_mallocs",
          "cuda_alloc_retries", "gc0_ns", "gc1_ns", "gc2_ns", "gc2_n")
UNIT_LAUNCHES = 5  # `x.add_(1)` launches timed every EVERY iterations: this process's cost of one torch launch
# "1": also time the device work of kvcanary's eager launches (the check before a forward, the write after it) with
# a CUDA event pair each. Off by default: the two event records per launch are host time a log Engine would not pay.
# Launches inside a captured graph are not timed (the graph replays them without calling Python).
DEVICE_ENV = "E2E_LOOP_PROBE_KVC_DEVICE"
# "1": an experiment for the token check's host cost (issue 25): build the token-check columns of each decode batch a
# second time, on a mirror of the probe's own, right after sglang's `process_batch_result_decode` (whose loop has just
# touched every request), timed as `tok_after_result_ns`, beside the batch hook's own build (`kvc_token_columns_ns`).
# Same work (one token more per row than the mirror holds), another moment: what the requests' cold caches cost. The
# second build is host time of the loop, not kvcanary's accounting; off by default.
TOKENS_AFTER_RESULT_ENV = "E2E_LOOP_PROBE_TOKENS_AFTER_RESULT"
# "0": time sglang's loop and the launch unit only, none of kvcanary's pieces (KVCANARY_PIECES, the reported ones,
# torch's event record and stream wait). Why: each piece is wrapped in a timing frame of the probe's own (two clock
# reads and a counter update, ~1-3 µs from the engine's cold caches), and the pieces nest inside kvcanary's own host
# time: host_after and step inside every forward's hooks, the token columns, their upload and the mail's post
# inside every batch hook, a dozen inside each sweep. With them on, the `kvcanary host time` line carries the
# probe's cost too (issue 25, eighteenth session); the headline figures of a target are measured with "0", the
# pieces in a run of their own.
KVC_PIECES_ENV = "E2E_LOOP_PROBE_KVC_PIECES"

# kvcanary's own pieces, timed where they are looked up at call time (so the plugins' load order does not
# matter): (module, class, method, counter). A name a version of kvcanary lacks is skipped. Pieces nest: step
# inside after, drain and stats inside step; views and launch inside the forward (eager / piecewise only).
KVCANARY_PIECES = (
    ("kvcanary.sglang.batches", "BatchConverter", "__call__", "kvc_views_ns"),
    ("kvcanary.runtime.manager", "CanaryManager", "before_forward", "kvc_launch_ns"),
    ("kvcanary.runtime.manager", "CanaryManager", "after_forward", "kvc_launch_ns"),
    ("kvcanary.runtime.faults", "FaultInjectionState", "before_forward", "kvc_before_ns"),  # KVCANARY_FAULT only
    ("kvcanary.runtime.installation", "Installation", "host_after", "kvc_after_ns"),
    ("kvcanary.runtime.manager", "CanaryManager", "step", "kvc_step_ns"),
    ("kvcanary.runtime.drain", "ViolationDrain", "drain", "kvc_drain_ns"),
    # inside drain: the status copy's start, its read, and the health check the read feeds (in-engine a drain
    # cost ~37 µs on the H200 host, 2026-12-01, against ~4 µs in bench_host: which part?)
    ("kvcanary.runtime.drain", "ViolationDrain", "_start_status", "kvc_status_start_ns"),
    ("kvcanary.runtime.drain", "ViolationDrain", "_read_status", "kvc_status_read_ns"),
    ("kvcanary.runtime.manager", "CanaryManager", "_observe_health", "kvc_health_ns"),
    # inside step: a prefix-cache sweep (issue 25: ~1 ms each in the engine, ~0.16 ms on the CPU bench: where?) =
    # its source (the RadixCache index: pending nodes, compaction, the device update on sglang's stream) + the
    # verify launch; the index's device update is its commit
    ("kvcanary.runtime.sweep", "Sweeper", "run_source", "kvc_sweep_ns"),
    ("kvcanary.sglang.radix_index", "RadixSweepIndex", "__call__", "kvc_sweep_source_ns"),
    ("kvcanary.runtime.sweep_index", "SweepIndex", "commit", "kvc_sweep_commit_ns"),
    ("kvcanary.runtime.device_state", "DeviceState", "sweep", "kvc_sweep_launch_ns"),
    # inside the source (a first sweep's one-off, ~16 ms in the engine, 2026-12-03: which part?): its walk of the
    # tree, the plan's growth (device buffers), the spans' host bookkeeping, and the update on the producer's stream
    # (the appends and the commit inside it); the priming at start-up (kvcanary.runtime.sweep.Sweeper.prime), timed
    # outside any window. A module's own function: class None.
    ("kvcanary.sglang.radix_index", None, "walk_spans", "kvc_sweep_walk_ns"),
    ("kvcanary.runtime.sweep_index", "SweepIndex", "reserve", "kvc_sweep_reserve_ns"),
    ("kvcanary.runtime.sweep_index", "SweepIndex", "append", "kvc_sweep_append_ns"),
    ("kvcanary.runtime.sweep_index", "SweepIndex", "compact", "kvc_sweep_compact_ns"),
    ("kvcanary.runtime.sweep_index", "SweepIndex", "prime", "kvc_sweep_index_prime_ns"),
    ("kvcanary.sglang.radix_index", None, "update_after_producer", "kvc_sweep_producer_ns"),
    ("kvcanary.runtime.sweep", "Sweeper", "prime", "kvc_sweep_prime_ns"),
    # inside that update: the order between the producer's stream and the sweep's (the first serving sweep spent
    # ~17 ms there outside the appends and the commit, 2026-12-03), and torch's two calls it makes (every caller's)
    ("kvcanary.runtime.streams", None, "_other_consumer", "kvc_streams_consumer_ns"),
    ("kvcanary.runtime.streams", None, "_producer_done", "kvc_streams_done_ns"),
    ("kvcanary.runtime.streams", None, "_hold_until_done", "kvc_streams_hold_ns"),
    ("torch.cuda", "Event", "record", "torch_event_record_ns"),
    ("torch.cuda", "Stream", "wait_event", "torch_stream_wait_event_ns"),
    ("kvcanary.runtime.manager", "CanaryManager", "_log_stats", "kvc_stats_ns"),
    ("kvcanary.report.metrics", "CanaryMetrics", "observe", "kvc_metrics_ns"),
    ("kvcanary.runtime.installation", "Installation", "account_forward", "kvc_account_ns"),
    ("kvcanary.runtime.manager", "CanaryManager", "assign_requests", "kvc_assign_ns"),  # inside the batch hook
    ("kvcanary.sglang.hooks", None, "expected_token_columns", "kvc_token_columns_ns"),  # the batch hook's token columns
    # ... and their upload (issue 25: the batch hook's ~4 launch units with the token check, its columns ~1.2: the
    # rest split here), inside it a decode batch's post to the token mail when it is open
    ("kvcanary.runtime.token_table", "TokenTable", "update_columns", "kvc_token_upload_ns"),
    ("kvcanary.runtime.token_table", "TokenMail", "post", "kvc_token_mail_ns"),
    # a decode graph's padded rows zeroed before its replay (inside the forward, outside the pieces above)
    ("kvcanary.sglang.hooks", "AdapterHooks", "zero_stale_padding", "kvc_populate_ns"),
)
# kvcanary's pieces whose host time kvcanary measures itself and hands to a method (module, class, method, counter):
# the probe adds the ns that method is given. The batch hook (ForwardBatch.init_new's) is one frame since issue 25,
# bound into sglang's hook registry when kvcanary registers, so a class patch made after that would never see it;
# every batch hook (the plain one, protect's) hands its time to Installation.account_batch_init.
KVCANARY_REPORTED_PIECES = (
    ("kvcanary.runtime.installation", "Installation", "account_batch_init", "kvc_batch_ns"),
)


class Probe:
    """The counters and the pending CUDA event pairs of one scheduler process."""

    def __init__(self) -> None:
        self.c = dict.fromkeys(FIELDS, 0)
        self.last_iter_t = None
        self.pending: deque = deque()  # (start event, end event) not yet complete
        self.last_end = None  # the end event of the last completed forward (for the idle gap)
        self.open_start = None  # start event of the forward whose sampling is not launched yet
        self.open_decode = False  # whether that forward is a decode batch
        self.kvc_pending: deque = deque()  # (start, end) event pairs around kvcanary's eager launches
        self.unit_tensor = None

    def add(self, key: str, ns: int) -> None:
        self.c[key] += ns

    def iteration(self) -> None:
        now = time.perf_counter_ns()
        if self.last_iter_t is not None:
            self.c["loop_ns"] += now - self.last_iter_t
        self.last_iter_t = now
        self.c["iters"] += 1
        self.collect()
        if self.c["iters"] % EVERY == 0:
            self.time_unit()
            self.print()

    def time_unit(self) -> None:
        """Host time of one small torch launch in this process (the benchmarks' unit), on the current stream."""
        import torch

        if self.unit_tensor is None:
            self.unit_tensor = torch.zeros(1, device="cuda")
            import threading

            print(f"[e2e-probe] threads pid={os.getpid()}: "
                  + ", ".join(sorted(t.name for t in threading.enumerate())), flush=True)
        x = self.unit_tensor
        t = time.perf_counter_ns()
        for _ in range(UNIT_LAUNCHES):
            x.add_(1)
        self.c["unit_ns"] += time.perf_counter_ns() - t
        self.c["unit_n"] += UNIT_LAUNCHES

    def read_allocator(self) -> None:
        """The caching allocator's device allocations (cudaMalloc) and its retries after one failed (a retry frees
        the cached blocks and synchronises the device first), cumulative: a window whose sweep or launch allocated."""
        import torch

        stats = torch.cuda.memory_stats()
        self.c["cuda_mallocs"] = int(stats.get("num_device_alloc", 0))
        self.c["cuda_alloc_retries"] = int(stats.get("num_alloc_retries", 0))

    def collect(self) -> None:
        """Read the event pairs that completed (``query``: never waits)."""
        while self.pending and self.pending[0][1].query():
            start, end, decode = self.pending.popleft()
            span = int(start.elapsed_time(end) * 1e6)
            self.c["gpu_ns"] += span
            self.c["gpu_n"] += 1
            if decode:
                self.c["gpu_decode_ns"] += span
                self.c["gpu_decode_n"] += 1
            if self.last_end is not None:
                gap = self.last_end.elapsed_time(start)
                if gap > 0:
                    self.c["gap_ns"] += int(gap * 1e6)
            self.last_end = end
        while self.kvc_pending and self.kvc_pending[0][1].query():
            start, end = self.kvc_pending.popleft()
            self.c["kvc_gpu_ns"] += int(start.elapsed_time(end) * 1e6)
            self.c["kvc_gpu_n"] += 1

    def print(self) -> None:
        self.read_allocator()
        fields = " ".join(f"{k}={v}" for k, v in self.c.items())
        print(f"[e2e-probe] t={time.time():.3f} pid={os.getpid()} {fields}", flush=True)


PROBE = Probe()


def _time_gc() -> None:
    """Python's garbage collections by generation (gc.callbacks): a full collection of a serving process can take
    milliseconds, and it lands in whatever code allocated when the threshold tripped (the first sweep's ~15 ms?)."""
    import gc

    started = [0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
            return
        gen = info.get("generation", 0)
        PROBE.add(f"gc{gen}_ns", time.perf_counter_ns() - started[0])
        if gen == 2:
            PROBE.c["gc2_n"] += 1

    gc.callbacks.append(callback)


def _timed(fn, key: str, count: str | None = None):
    def wrapper(*args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            PROBE.add(key, time.perf_counter_ns() - t)
            if count is not None:
                PROBE.c[count] += 1

    wrapper.__wrapped__ = fn
    wrapper.e2e_probe = key
    return wrapper


def _reported(fn, key: str):
    """``fn(self, ns)`` that also adds ``ns`` (host time kvcanary measured itself) to the counter ``key``."""
    def wrapper(self, ns, *args, **kwargs):
        PROBE.add(key, ns)
        return fn(self, ns, *args, **kwargs)

    wrapper.__wrapped__ = fn
    wrapper.e2e_probe = key
    return wrapper


def _stream_of(sched):
    import torch

    return getattr(sched, "forward_stream", None) or torch.cuda.current_stream()


def _close_forward(sched) -> None:
    """Record the end event of the forward whose start ``run_batch`` recorded (its GPU work is all launched)."""
    import torch

    if PROBE.open_start is None:
        return
    end = torch.cuda.Event(enable_timing=True)
    end.record(_stream_of(sched))
    PROBE.pending.append((PROBE.open_start, end, PROBE.open_decode))
    PROBE.open_start = None


def install() -> None:
    """Patch sglang's Scheduler, TpModelWorker, ForwardBatch and torch's synchronize calls (once per process)."""
    import torch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    if getattr(Scheduler.run_batch, "e2e_probe", None):
        return
    Scheduler.recv_requests = _timed(Scheduler.recv_requests, "recv_ns")
    Scheduler.process_input_requests = _timed(Scheduler.process_input_requests, "recv_ns")
    Scheduler.get_next_batch_to_run = _timed(Scheduler.get_next_batch_to_run, "next_ns")
    Scheduler.process_batch_result = _timed(Scheduler.process_batch_result, "result_ns")
    TpModelWorker.forward_batch_generation = _timed(TpModelWorker.forward_batch_generation, "fbg_ns")
    init_new = ForwardBatch.init_new.__func__
    ForwardBatch.init_new = classmethod(_timed(init_new, "init_ns"))
    run_batch = Scheduler.run_batch

    def probed_run_batch(self, batch, *args, **kwargs):
        PROBE.iteration()
        mode = getattr(getattr(batch, "forward_mode", None), "name", "")
        PROBE.c["decode_n" if mode == "DECODE" else "extend_n"] += 1
        PROBE.open_decode = mode == "DECODE"
        start = torch.cuda.Event(enable_timing=True)
        start.record(_stream_of(self))
        PROBE.open_start = start
        t = time.perf_counter_ns()
        try:
            return run_batch(self, batch, *args, **kwargs)
        finally:
            PROBE.add("run_ns", time.perf_counter_ns() - t)
            if not getattr(self, "enable_overlap", False):  # sampled inside the forward: its GPU work ends here
                _close_forward(self)

    probed_run_batch.e2e_probe = "run_ns"
    Scheduler.run_batch = probed_run_batch
    sample = Scheduler.launch_batch_sample_if_needed

    def probed_sample(self, batch_result, *args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return sample(self, batch_result, *args, **kwargs)
        finally:
            PROBE.add("sample_ns", time.perf_counter_ns() - t)
            if batch_result is not None:
                _close_forward(self)

    Scheduler.launch_batch_sample_if_needed = probed_sample
    ev_sync = torch.cuda.Event.synchronize

    def event_synchronize(self):
        t = time.perf_counter_ns()
        try:
            return ev_sync(self)
        finally:
            PROBE.add("evsync_ns", time.perf_counter_ns() - t)
            PROBE.c["evsync_n"] += 1

    torch.cuda.Event.synchronize = event_synchronize
    for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize")):
        fn = getattr(owner, name)

        def synchronize(*args, _fn=fn, **kwargs):
            t = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                PROBE.add("sync_ns", time.perf_counter_ns() - t)
                PROBE.c["sync_n"] += 1

        setattr(owner, name, synchronize)
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    CudaGraphRunner.replay = _timed(CudaGraphRunner.replay, "replay_ns")
    if os.environ.get(TOKENS_AFTER_RESULT_ENV) == "1":
        _build_tokens_after_result(Scheduler)
    _time_gc()
    patched = install_kvcanary_pieces() if os.environ.get(KVC_PIECES_ENV) != "0" else 0
    print(f"[e2e-probe] installed pid={os.getpid()} kvcanary pieces={patched}", flush=True)


def _build_tokens_after_result(scheduler_cls) -> None:
    """TOKENS_AFTER_RESULT_ENV's experiment: the token-check columns of a decode batch built again, on the probe's own
    mirror, right after sglang's ``process_batch_result_decode``."""
    from kvcanary.sglang.tokens import expected_token_columns

    mirror: dict = {}
    original = scheduler_cls.process_batch_result_decode

    def process_batch_result_decode(self, batch, result, *args, **kwargs):
        out = original(self, batch, result, *args, **kwargs)
        t = time.perf_counter_ns()
        expected_token_columns(mirror, batch.reqs)
        PROBE.add("tok_after_result_ns", time.perf_counter_ns() - t)
        return out

    process_batch_result_decode.e2e_probe = "tok_after_result_ns"
    scheduler_cls.process_batch_result_decode = process_batch_result_decode


def install_kvcanary_pieces() -> int:
    """Time kvcanary's pieces (KVCANARY_PIECES), and with DEVICE_ENV=1 its eager launches' device work, where it is
    installed; returns how many methods were patched."""
    patched = 0
    for module, cls_name, name, key in KVCANARY_PIECES:
        count = key[:-3] + "_n" if key[:-3] + "_n" in FIELDS else None
        patched += _patch(module, cls_name, name, lambda fn, key=key, count=count: _timed(fn, key, count),
                          "e2e_probe")
    for module, cls_name, name, key in KVCANARY_REPORTED_PIECES:
        patched += _patch(module, cls_name, name, lambda fn, key=key: _reported(fn, key), "e2e_probe")
    if os.environ.get(DEVICE_ENV) == "1":
        for name in ("before_forward", "after_forward"):  # outside their host timers (patched above)
            patched += _patch("kvcanary.runtime.manager", "CanaryManager", name, _device_timed, "e2e_probe_device")
    return patched


def _patch(module: str, cls_name: str | None, name: str, wrap, marker: str) -> bool:
    """Replace ``module.cls_name.name`` (``module.name`` for ``cls_name`` None: a function the module calls by its
    global name) by ``wrap(method)``, unless kvcanary lacks it or it carries ``marker`` (it is wrapped already).
    Returns whether it was replaced."""
    import importlib

    try:
        owner = importlib.import_module(module)
        cls = owner if cls_name is None else getattr(owner, cls_name)
    except (ImportError, AttributeError):
        return False
    fn = cls.__dict__.get(name)
    if fn is None or getattr(fn, marker, None):
        return False
    setattr(cls, name, wrap(fn))
    return True


def _device_timed(fn):
    def wrapper(*args, **kwargs):
        import torch

        if torch.cuda.is_current_stream_capturing():  # a capture: its replays never come back here
            return fn(*args, **kwargs)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return fn(*args, **kwargs)
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            PROBE.kvc_pending.append((start, end))

    wrapper.__wrapped__ = fn
    wrapper.e2e_probe_device = True
    wrapper.e2e_probe = getattr(fn, "e2e_probe", None)  # (still the host timer underneath)
    return wrapper


def write_plugin(root: str) -> str:
    """The sglang plugin that calls :func:`install` in every sglang process where ``E2E_LOOP_PROBE=1``
    (integration/test_plugin.py). Returns ``root``."""
    return write_test_plugin(root, PLUGIN, about="integration/loop_probe.py", gate_env=PROBE_ENV,
                             file_env=PROBE_FILE_ENV, module="_kvcanary_e2e_loop_probe", function="plugin_entry")


def plugin_entry(_gate: str) -> None:
    """What the plugin calls (with ``E2E_LOOP_PROBE``'s value)."""
    install()


def probe_env(env: dict, root: str) -> dict:
    """``env`` with the plugin on PYTHONPATH (and in SGLANG_PLUGINS when the caller restricts plugins)."""
    write_plugin(root)
    env = dict(env)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[PROBE_ENV] = "1"
    env[PROBE_FILE_ENV] = os.path.abspath(__file__)
    if env.get("SGLANG_PLUGINS"):
        env["SGLANG_PLUGINS"] += f",{PLUGIN}"
    return env


# ---------------------------------------------------------------------------------------------------- parsing
def _lines(text: str) -> list[dict]:
    out = []
    for m in LINE_RE.finditer(text):
        fields = dict(kv.split("=", 1) for kv in m.group("fields").split())
        out.append({k: float(v) if k == "t" else int(v) for k, v in fields.items()})
    return out


def _stamp(text: str, marker: str) -> float | None:
    at = text.rfind(marker)
    if at < 0:
        return None
    return float(re.match(r"[\d.]+", text[at + len(marker):]).group(0))


def parse_window(section: str) -> dict | None:
    """Counters of one Engine's measured workload (one worker-log section): the last probe line at or after the
    workload's end minus the last line before its start (per scheduler pid; tp ranks summed). None without lines."""
    lines = _lines(section)
    t0, t1 = _stamp(section, WINDOW_START), _stamp(section, WINDOW_END)
    if not lines or t0 is None:
        return None
    total = dict.fromkeys(FIELDS, 0)
    for pid in sorted({ln["pid"] for ln in lines}):
        mine = [ln for ln in lines if ln["pid"] == pid]
        before = [ln for ln in mine if ln["t"] <= t0]
        after = [ln for ln in mine if t1 is None or ln["t"] <= t1 + 0.5] or mine
        base, last = (before[-1] if before else dict.fromkeys(FIELDS, 0)), after[-1]
        for k in FIELDS:
            total[k] += last.get(k, 0) - base.get(k, 0)
    return total


def per_iteration(c: dict) -> dict:
    """µs per loop iteration (forward) of each host piece, the GPU's µs per forward and idle gap per forward."""
    n = max(c["iters"], 1)
    per_event = ("gpu_ns", "gap_ns", "gpu_decode_ns", "kvc_gpu_ns")  # averaged over their own counts, below
    out = {k[:-3] + "_us": c[k] / n / 1e3 for k in FIELDS if k.endswith("_ns") and k not in per_event}
    out["gpu_us"] = c["gpu_ns"] / max(c["gpu_n"], 1) / 1e3
    out["gap_us"] = c["gap_ns"] / max(c["gpu_n"], 1) / 1e3
    decode_ns, decode_n = c.get("gpu_decode_ns", 0), c.get("gpu_decode_n", 0)
    out["gpu_decode_us"] = decode_ns / max(decode_n, 1) / 1e3
    out["gpu_extend_us"] = (c["gpu_ns"] - decode_ns) / max(c["gpu_n"] - decode_n, 1) / 1e3
    out["kvc_gpu_us"] = c.get("kvc_gpu_ns", 0) / max(c.get("kvc_gpu_n", 0), 1) / 1e3  # per eager canary launch
    out["unit_us"] = c.get("unit_ns", 0) / max(c.get("unit_n", 0), 1) / 1e3
    out.update(iters=c["iters"], decode_n=c["decode_n"], extend_n=c["extend_n"], evsync_n=c["evsync_n"],
               sync_n=c["sync_n"], kvc_drain_n=c.get("kvc_drain_n", 0))
    return out


COLUMNS = (("loop_us", "loop"), ("recv_us", "recv"), ("next_us", "next batch"), ("run_us", "run_batch"),
           ("fbg_us", "of it forward"), ("init_us", "of it init_new"), ("replay_us", "of it graph replay"),
           ("result_us", "process result"), ("evsync_us", "of it event wait"), ("sample_us", "sample launch"),
           ("sync_us", "other syncs"), ("gpu_us", "GPU span per forward"), ("gpu_decode_us", "of a decode"),
           ("gpu_extend_us", "of a prefill"), ("gap_us", "GPU idle gap"), ("unit_us", "one torch launch"))
# kvcanary's pieces per iteration (log Engines; nested as KVCANARY_PIECES says)
KVC_COLUMNS = (("kvc_batch_us", "batch hook"), ("kvc_assign_us", "of it assign_requests"), ("kvc_views_us", "views"),
               ("kvc_launch_us", "launches"), ("kvc_before_us", "fault injection"), ("kvc_after_us", "host_after"),
               ("kvc_step_us", "of it step"), ("kvc_drain_us", "of it drain"),
               ("kvc_status_start_us", "of that status copy start"), ("kvc_status_read_us", "status read"),
               ("kvc_health_us", "of that health"), ("kvc_stats_us", "of step stats"),
               ("kvc_sweep_us", "of step sweep"), ("kvc_sweep_source_us", "of that source"),
               ("kvc_sweep_commit_us", "of that commit"), ("kvc_sweep_walk_us", "of that walk"),
               ("kvc_sweep_reserve_us", "of that plan growth"), ("kvc_sweep_append_us", "of that appends"),
               ("kvc_sweep_producer_us", "of that update on the producer's stream"),
               ("kvc_sweep_launch_us", "of the sweep launch"),
               ("kvc_metrics_us", "metrics"),
               ("kvc_account_us", "account_forward"), ("kvc_populate_us", "graph padding"),
               ("kvc_gpu_us", f"device µs per eager launch ({DEVICE_ENV}=1)"))


# The loop's steps kvcanary never runs in (without EAGLE): receiving requests, scheduling the next batch,
# processing the last batch's results, launching the delayed sampling.
CANARY_FREE = ("recv_us", "next_us", "result_us", "sample_us")


def normalized_pair(off: dict, log: dict) -> dict:
    """One off/log pair with the Engines' own host speed divided out.

    Two identical Engines differ by up to ±35 % in tokens/s on these machines, and a probe shows why: every step
    of the loop, also those kvcanary never runs in, is slower or faster together (the process's host speed).
    ``speed`` = the canary-free steps' time of the log Engine over the off Engine's; then ``ratio`` = the off
    loop scaled by ``speed`` over the log loop (what tokens/s log/off would be at equal host speed), and
    ``canary_us`` = what the log Engine's run_batch spends beyond the off Engine's scaled by ``speed`` (to
    compare with kvcanary's own host-time accounting). An effect of the canary on the canary-free steps (caches,
    allocator) would be divided out too: the raw ratios stay beside these."""
    free_off, free_log = sum(off[k] for k in CANARY_FREE), sum(log[k] for k in CANARY_FREE)
    speed = free_log / free_off if free_off else float("nan")
    return {"speed": speed, "ratio": off["loop_us"] * speed / log["loop_us"] if log["loop_us"] else float("nan"),
            "raw_ratio": off["loop_us"] / log["loop_us"] if log["loop_us"] else float("nan"),
            "canary_us": log["run_us"] - off["run_us"] * speed}


def pairs_of(rows: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(pair label, normalized_pair) of each ``off-i``/``log-i`` pair of rows, in order."""
    by = dict(rows)
    out = []
    i = 1
    while f"off-{i}" in by and f"log-{i}" in by:
        out.append((str(i), normalized_pair(by[f"off-{i}"], by[f"log-{i}"])))
        i += 1
    return out


def render(rows: list[tuple[str, dict]]) -> list[str]:
    """Markdown: µs per scheduler-loop iteration, one row per Engine (label, per_iteration dict); then each
    off/log pair with the Engines' host speed divided out (:func:`normalized_pair`) and their median."""
    if not rows:
        return []
    lines = ["", "| loop probe, µs per iteration | iters (decode) | " + " | ".join(h for _, h in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for label, p in rows:
        lines.append(f"| {label} | {p['iters']} ({p['decode_n']}) | "
                     + " | ".join(f"{p.get(k, 0.0):.1f}" for k, _ in COLUMNS) + " |")
    kvc = [(label, p) for label, p in rows if any(p.get(k) for k, _ in KVC_COLUMNS)]
    if kvc:
        lines += ["", "| kvcanary pieces, µs per iteration | " + " | ".join(h for _, h in KVC_COLUMNS)
                  + " | drains per 100 iterations |", "|---|" + "---|" * (len(KVC_COLUMNS) + 1)]
        for label, p in kvc:
            lines.append(f"| {label} | " + " | ".join(f"{p.get(k, 0.0):.1f}" for k, _ in KVC_COLUMNS)
                         + f" | {100.0 * p.get('kvc_drain_n', 0) / max(p['iters'], 1):.1f} |")
    pairs = pairs_of(rows)
    if pairs:
        lines += ["", "| pair | log Engine's host speed (canary-free loop steps, log/off) | loop ratio off/log, raw | "
                      "at equal host speed | canary µs per iteration in run_batch |", "|---|---|---|---|---|"]
        for label, n in pairs:
            lines.append(f"| {label} | {n['speed']:.3f} | {n['raw_ratio']:.4f} | **{n['ratio']:.4f}** | "
                         f"{n['canary_us']:.1f} |")
        ratios = sorted(n["ratio"] for _, n in pairs)
        mid = ratios[len(ratios) // 2] if len(ratios) % 2 else sum(ratios[len(ratios) // 2 - 1:][:2]) / 2
        lines.append(f"| median (min–max) | | | **{mid:.4f}** ({ratios[0]:.4f}–{ratios[-1]:.4f}) | |")
    return lines
