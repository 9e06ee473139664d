"""``kvcanary demo``: watch the canary catch every fault class, on any machine, without sglang or a model.

The real :class:`~kvcanary.manager.CanaryManager` and kernels (CPU, or CUDA when present) protect the serving
simulator of :mod:`kvcanary.sim.engine` (prefix sharing, eviction, slot reuse, chunked prefill, decode, mixed and
idle forwards, and a HiCache-like host KV tier: evicted pages backed up to host memory, loaded back into new slots
when a later request's prefix reaches them) exactly as the SGLang adapter drives them in an engine:
``before_forward`` / ``after_forward`` around every forward, ``step()`` after it, the token check fed by
``update_expected_tokens``, the prefix cache swept through ``set_sweep_source``, the host tier's records moved by
``backup_to_host`` / ``load_from_host``. First it serves clean traffic for a few seconds (any violation there is a false
positive); then :class:`~kvcanary.sim.injector.FaultDriver` injects each fault class of :mod:`kvcanary.faults` in
turn, repairs it once reported, and scores the reports.

:func:`run_demo` returns a :class:`DemoResult`; :func:`render` is its text form (the command's output).

The ``KVCANARY_*`` environment is validated as the plugin validates it (:func:`settings_from_env`: a bad value is
the same ``ConfigError`` naming the variable). The runtime settings a user may tune (real-KV mode, sweep interval,
drain, ring, health and repeat windows, token check, stats, the build variables) are honoured; the variables the
demo cannot honour are named in one line with the reason (:data:`OVERRIDDEN`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcanary import faults, jit
from kvcanary.config import (
    ENV_CACHE_DIR,
    ENV_CUDA_ARCH,
    ENV_DRAIN_EVERY,
    ENV_HEALTH_WINDOW,
    ENV_LOG_REPEAT_WINDOW,
    ENV_MODE,
    ENV_REAL_KV,
    ENV_REAL_KV_LAYERS,
    ENV_REPORT,
    ENV_RING_CAPACITY,
    ENV_SANITIZE,
    ENV_STATS_EVERY,
    ENV_SWEEP_INTERVAL,
    ENV_VERIFY_TOKENS,
    FAULT_ENV_VARS,
    Config,
    Mode,
    check_cache_dir,
)
from kvcanary.layout import RealKvHashMode
from kvcanary.sim.engine import SimConfig, Simulator
from kvcanary.sim.injector import ClassResult, FaultDriver
from kvcanary.table import format_table
from kvcanary.tags import LaunchTag

logger = logging.getLogger(__name__)

DEFAULT_SECONDS = 3.0
DEFAULT_PER_CLASS = 3
NUM_PAGES = 1024
HOST_PAGES = 2 * NUM_PAGES  # the host tier, at sglang HiCache's default ratio (twice the device pool)
# The manager as the adapter runs it (log mode, PARTIAL real-KV, drain every 8 forwards), plus the token check and
# a sweep every 8 forwards, which token swaps and cached-but-idle corruption need.
SWEEP_EVERY = 8
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # what `kvcanary -v ...` and the demo's violation line show
_MAX_FAULT_FORWARDS_PER_INJECTION = 200  # a class that finds no fitting batch for this long is reported as such
# What comes after a PASS: the README's "Use with SGLang" line.
NEXT_STEP = "next: turn it on in sglang: KVCANARY_MODE=log python -m sglang.launch_server --model-path <model>"

# Variables the demo honours when set (it has its own defaults for the sweep, the token check and the stats lines).
HONOURED: tuple[str, ...] = (
    ENV_REAL_KV, ENV_SWEEP_INTERVAL, ENV_VERIFY_TOKENS, ENV_DRAIN_EVERY, ENV_RING_CAPACITY, ENV_HEALTH_WINDOW,
    ENV_LOG_REPEAT_WINDOW, ENV_STATS_EVERY, ENV_CACHE_DIR, ENV_CUDA_ARCH, ENV_SANITIZE,
)
# Variables the demo cannot honour, and why; when one is set, one line names it.
OVERRIDDEN: dict[str, str] = {
    ENV_MODE: "the demo always runs in log mode: off protects nothing and raise stops at the first injected fault",
    ENV_REPORT: "not written: the demo's violations are simulated and do not belong in a real report",
    ENV_REAL_KV_LAYERS: "the simulated KV pool has no model layers",
    **{var: "the demo injects its own faults" for var in FAULT_ENV_VARS},
}


def default_device() -> str:
    """``cuda`` when torch sees a CUDA device, else ``cpu``."""
    try:
        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a broken driver means "no device" here
        return "cpu"


def parse_faults(text: str | None) -> tuple[str, ...]:
    """``--faults``: ``all`` (or None) or a comma-separated list of ``kvcanary.faults.FAULT_CLASSES``."""
    if text is None or text.strip().lower() in ("", "all"):
        return faults.FAULT_CLASSES
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in faults.FAULT_CLASSES]
    if bad or not names:
        raise ValueError(f"--faults: expected all or a comma-separated list of {', '.join(faults.FAULT_CLASSES)}; "
                         f"got {text!r}")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class DemoSettings:
    """The demo's manager configuration and what the environment did to it."""

    config: Config
    honoured: tuple[str, ...] = ()  # "VAR=value" of each honoured variable that is set
    overridden: tuple[str, ...] = ()  # "VAR (why)" of each variable that is set but not applied


def settings_from_env(environ: Mapping[str, str] | None = None) -> DemoSettings:
    """Validate ``KVCANARY_*`` by the plugin's rules (``Config.from_env``; a bad value raises its ``ConfigError``
    naming the variable, and so does an unusable ``KVCANARY_CACHE_DIR``) and build the demo's configuration."""
    env = os.environ if environ is None else environ
    base = Config.from_env(env)

    def is_set(var: str) -> bool:
        return bool(env.get(var, "").strip())

    if is_set(ENV_CACHE_DIR):  # Config checks it only when the mode is on; the demo builds there in any mode
        check_cache_dir(env[ENV_CACHE_DIR].strip(), raw=env[ENV_CACHE_DIR])
    config = Config(
        mode=Mode.LOG,
        real_kv=base.real_kv,
        sweep_interval=base.sweep_interval if is_set(ENV_SWEEP_INTERVAL) else SWEEP_EVERY,
        verify_tokens=base.verify_tokens if is_set(ENV_VERIFY_TOKENS) else True,
        stats_every=base.stats_every if is_set(ENV_STATS_EVERY) else 0,
        ring_capacity=base.ring_capacity,
        health_window=base.health_window,
        drain_every=base.drain_every,
        log_repeat_window=base.log_repeat_window,
        cache_dir=str(jit.cache_root()),  # the directory the kernels come from (describe() shows it under -v)
    )
    overridden = tuple(f"{var} ({why})" for var, why in OVERRIDDEN.items()
                       if is_set(var) and not (var == ENV_MODE and base.mode is Mode.LOG))
    honoured = tuple(f"{var}={env[var].strip()}" for var in HONOURED if is_set(var))
    return DemoSettings(config, honoured, overridden)


@dataclass
class DemoResult:
    """Everything ``kvcanary demo`` measured."""

    device: str
    config: str
    build: str  # how the kernels were obtained ("built in 12.0 s", "cached")
    clean_seconds: float
    clean_forwards: int
    forward_kinds: dict[str, int]  # clean phase: extend / decode / mixed / idle forwards
    workload: dict[str, int]  # clean phase: cache hits, evictions, chunked prefills, slot rewrites, sweeps, host tier
    clean_violations: int
    forwards: int
    entries_verified: int
    entries_swept: int
    tokens_written: int
    faults: dict[str, ClassResult]
    false_positives: int  # violations no injection explains, clean phase included
    violation_line: str | None  # one violation line as the log shows it
    seconds: float
    notes: list[str] = field(default_factory=list)
    drain_every: int = 8  # the manager's drain interval (bounds the latency column)

    @property
    def passed(self) -> bool:
        return bool(self.faults) and all(r.all_detected for r in self.faults.values()) and self.false_positives == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "kvcanary.demo/1",
            "passed": self.passed,
            "device": self.device,
            "config": self.config,
            "build": self.build,
            "clean": {"seconds": round(self.clean_seconds, 3), "forwards": self.clean_forwards,
                      "forward_kinds": self.forward_kinds, "workload": self.workload,
                      "violations": self.clean_violations},
            "forwards": self.forwards,
            "entries_verified": self.entries_verified,
            "entries_swept": self.entries_swept,
            "tokens_written": self.tokens_written,
            "faults": {
                name: {"injected": r.injected, "detected": r.detected, "reasons": dict(r.reasons),
                       "tags": dict(r.tags), "latency_forwards": r.latencies, "false_positives": r.false_positives,
                       "via_host_tier": r.via_host_tier}
                for name, r in self.faults.items()
            },
            "false_positives": self.false_positives,
            "violation_line": self.violation_line,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
        }


class _Capture(logging.Handler):
    """Keeps kvcanary's WARNING+ records (violation lines, injections) of the run, formatted as the log shows them."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(formatter)
        self.lines: list[tuple[str, str]] = []  # (message, formatted line)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.getMessage(), self.format(record)))


def _note(progress: Callable[[str], None] | None, text: str) -> None:
    if progress is not None:
        progress(text)


def run_demo(
    *,
    seconds: float = DEFAULT_SECONDS,
    fault_classes: Sequence[str] = faults.FAULT_CLASSES,
    device: str | None = None,
    per_class: int = DEFAULT_PER_CLASS,
    seed: int = 0,
    min_forwards: int = 50,
    quiet_log: bool = True,
    progress: Callable[[str], None] | None = None,
    settings: DemoSettings | None = None,
) -> DemoResult:
    """Serve clean traffic for ``seconds`` under the canary, then inject ``per_class`` faults of each class.

    The clean phase runs for ``seconds`` and at least ``min_forwards`` forwards: ``seconds=0`` makes the whole run
    a function of ``seed`` and ``min_forwards`` alone (the tests' choice), whatever the machine's speed.
    ``quiet_log``: keep kvcanary's WARNING lines (one per violation and per injection) off the console while the
    demo runs; they are captured either way (one is shown in the result).
    ``settings``: default :func:`settings_from_env` (which raises ``ConfigError`` for a bad ``KVCANARY_*`` value).
    """
    from kvcanary.manager import CanaryManager

    started = time.perf_counter()
    settings = settings_from_env() if settings is None else settings
    if settings.honoured:
        _note(progress, f"kvcanary demo: from the environment: {', '.join(settings.honoured)}")
    if settings.overridden:
        _note(progress, f"kvcanary demo: not applied: {'; '.join(settings.overridden)}")
    dev = torch.device(device or default_device())
    backend = "cuda" if dev.type == "cuda" else "cpu"
    will_build = not jit.is_built(backend)
    if will_build:
        _note(progress, f"kvcanary demo: building the {backend} kernels (first run, "
                        f"~{jit.TYPICAL_BUILD_SECONDS[backend]} s) ...")
    info = jit.build(backend)
    build = "cached" if info.cached else f"built in {info.seconds:.1f} s"
    if will_build:
        _note(progress, f"kvcanary demo: {build}")

    config = settings.config
    drain, sweep = config.drain_every, config.sweep_interval
    driver = FaultDriver(fault_classes, seed=seed, per_class=per_class, warmup=1 << 62, gap=3,
                         deadline=30 + drain, grace=drain + 2, sweep_every=sweep)
    capture = _Capture(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger("kvcanary")
    saved_propagate = root.propagate
    root.addHandler(capture)
    root.propagate = not quiet_log
    try:
        sim = Simulator(SimConfig(seed=seed, page_size=1, num_pages=NUM_PAGES, host_pages=HOST_PAGES),
                        mgr_factory=lambda **kw: CanaryManager(config, **kw), hook=driver, device=dev)
        mgr = sim.mgr
        mgr.mark_init_finished()

        _note(progress, f"kvcanary demo: serving clean traffic for {seconds:g} s on {dev} ...")
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds or sim.step_no < min_forwards:  # at least a warm prefix cache
            sim.step()
        mgr.flush()
        driver.score(sim)
        clean_seconds = time.perf_counter() - t0
        clean_forwards = sim.step_no
        clean_violations = len(mgr.violations)
        kinds = {k: sim.stats[f"forward_{k}"] for k in ("extend", "decode", "mixed", "idle")}
        workload = {
            "prefix_cache_hits": sim.stats["cache_hits"],
            "prefix_cache_hit_tokens": sim.stats["cache_hit_tokens"],
            "evicted_pages": sim.stats["evicted_pages"],
            "chunked_prefill_continuations": sim.stats["chunk_continuations"],
            "slot_writes_over_another_request": sim.stats["slot_rewrites_by_other_request"],
            "requests_finished": sim.stats["finished"],
            "sweeps": sim.stats["sweeps"],
            "host_pages_backed_up": sim.stats["host_backups"],
            "host_load_backs": sim.stats["load_backs"],
            "host_slots_loaded_back": sim.stats["slots_loaded_back"],
        }

        _note(progress, f"kvcanary demo: injecting {', '.join(driver.classes)} ({per_class} each) ...")
        driver.arm(sim.step_no + 1)
        # a slower drain or sweep (from the environment) waits longer for each injection's report
        per_injection = _MAX_FAULT_FORWARDS_PER_INJECTION + drain + sweep
        limit = sim.step_no + per_injection * per_class * len(driver.classes)
        while not driver.done and sim.step_no < limit:
            sim.step()
        mgr.flush()
        driver.score(sim)
        stats = mgr.stats
    finally:
        root.removeHandler(capture)
        root.propagate = saved_propagate

    results = driver.results()
    notes = [f"{name}: only {r.injected} of {per_class} injections found a fitting batch"
             for name, r in results.items() if r.injected < per_class]
    # settings from the environment that blind the canary to some classes: say so next to the FAIL they cause
    if config.real_kv is RealKvHashMode.NONE:
        notes.append(f"{ENV_REAL_KV}=none: no K/V byte is fingerprinted, so a fault that changes only K/V is not seen")
    if sweep == 0 and faults.CACHED_IDLE_CORRUPTION in results:
        notes.append(f"{ENV_SWEEP_INTERVAL}=0: no sweep, so {faults.CACHED_IDLE_CORRUPTION} is not seen")
    return DemoResult(
        device=str(dev),
        config=(f"mode=log real_kv={config.real_kv.name.lower()} "
                f"verify_tokens={str(config.verify_tokens).lower()} sweep_interval={sweep} drain_every={drain}"),
        build=build,
        clean_seconds=clean_seconds,
        clean_forwards=clean_forwards,
        forward_kinds=kinds,
        workload=workload,
        clean_violations=clean_violations,
        forwards=sim.step_no,
        entries_verified=int(stats.slot_runs[LaunchTag.VERIFY]),
        entries_swept=int(stats.slot_runs[LaunchTag.SWEEP]),
        tokens_written=int(stats.slot_runs[LaunchTag.WRITE]),
        faults=results,
        false_positives=len(driver.false_positives),
        violation_line=_example_line(driver, capture),
        seconds=time.perf_counter() - started,
        notes=notes,
        drain_every=drain,
    )


def _example_line(driver: FaultDriver, capture: _Capture) -> str | None:
    """The log line of the first detection (the first class's), else of any violation."""
    first = next((o.first_detection for o in driver.closed if o.first_detection is not None), None)
    lines = [(msg, line) for msg, line in capture.lines if msg.startswith("kvcanary violation:")]
    if first is not None:
        want = first.log_line()
        for msg, line in lines:
            if msg == want:
                return line
    return lines[0][1] if lines else None


# ------------------------------------------------------------------------------------------------ text form
def _reasons(r: ClassResult) -> str:
    """The expected reasons the class's detections carried, with the launch tags that found them."""
    expected = faults.EXPECTED_REASONS[r.fault]
    seen: Counter[str] = Counter()
    for combo, n in r.reasons.items():
        for name in combo.split("+"):
            if name in expected:
                seen[name] += n
    names = " / ".join(n for n in expected if seen[n]) or "-"
    tags = ",".join(sorted(r.tags))
    return f"{names} ({tags})" if tags else names


def _via(r: ClassResult) -> str:
    """Detections whose violation said ``via=host_tier`` (the slot's K/V came back from the host tier), of all."""
    return f"{r.via_host_tier}/{r.detected}" if r.detected else "-"


def _latency(r: ClassResult) -> str:
    if not r.latencies:
        return "-"
    lo, hi = min(r.latencies), max(r.latencies)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def render(result: DemoResult) -> str:
    """The command's text output: the setup, the clean phase, the fault table, one violation line, the verdict."""
    kinds = ", ".join(f"{k} {v}" for k, v in result.forward_kinds.items())
    w = result.workload
    lines = [
        f"kvcanary demo: the real CanaryManager and {result.device} kernels protect a simulated paged-KV server",
        f"  kernels {result.build}; manager {result.config}",
        "",
        f"clean serving, {result.clean_seconds:.1f} s: {result.clean_forwards} forwards ({kinds}),",
        f"  {w['requests_finished']} requests finished, prefix-cache hits {w['prefix_cache_hits']} "
        f"({w['prefix_cache_hit_tokens']} tokens), evicted pages {w['evicted_pages']}, chunked-prefill continuations "
        f"{w['chunked_prefill_continuations']},",
        f"  host tier ({HOST_PAGES} pages): {w['host_pages_backed_up']} pages backed up, {w['host_load_backs']} "
        f"load-backs ({w['host_slots_loaded_back']} slots loaded back),",
        f"  slots rewritten by another request {w['slot_writes_over_another_request']}, sweeps {w['sweeps']}: "
        f"{result.clean_violations} violations",
        "",
    ]
    rows = [(name, str(r.injected), str(r.detected), _reasons(r), _via(r), _latency(r), str(r.false_positives))
            for name, r in result.faults.items()]
    lines.append(format_table(rows, ("fault class", "injected", "detected", "reason reported (by)",
                                     "via=host_tier", "latency (forwards)", "false positives"), right=(1, 2, 4, 6)))
    lines += [
        "",
        f"forwards {result.forwards} | entries verified {result.entries_verified} | entries swept "
        f"{result.entries_swept} | tokens written {result.tokens_written} | false positives {result.false_positives} "
        f"| {result.seconds:.1f} s",
        f"latency: forwards from the injection until the host reported it (the drain runs every "
        f"{result.drain_every} forwards)",
    ]
    if result.violation_line:
        lines += ["", "one violation, as the log shows it:", f"  {result.violation_line}"]
    lines += [f"note: {n}" for n in result.notes]
    lines.append("")
    if result.passed:
        lines.append("PASS: every fault class detected, 0 false positives")
        lines.append(NEXT_STEP)
    else:
        missed = [n for n, r in result.faults.items() if not r.all_detected]
        why = []
        if missed:
            why.append(f"not every injection detected: {', '.join(missed)}")
        if result.false_positives:
            why.append(f"{result.false_positives} false positive(s)")
        lines.append("FAIL: " + "; ".join(why))
    return "\n".join(lines)
