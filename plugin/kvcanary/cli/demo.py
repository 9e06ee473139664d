"""``kvcanary demo``: watch the canary catch every fault class, on any machine, without sglang or a model.

The real :class:`~kvcanary.runtime.manager.CanaryManager` and kernels (CPU, or CUDA when present) protect the serving
simulator of :mod:`kvcanary.sim.engine` (prefix sharing, eviction, slot reuse, chunked prefill, decode, mixed and
idle forwards, and a HiCache-like host KV tier: evicted pages backed up to host memory, loaded back into new slots
when a later request's prefix reaches them) exactly as the SGLang adapter drives them in an engine:
``before_forward`` / ``after_forward`` around every forward, ``step()`` after it, the token check fed by
``update_expected_tokens``, the prefix cache swept through ``set_sweep_source``, the host tier's records moved by
``backup_to_host`` / ``load_from_host``. First it serves clean traffic for a few seconds (any violation there is a false
positive); then :class:`~kvcanary.sim.injector.FaultDriver` injects each fault class of :mod:`kvcanary.runtime.faults`
in turn, repairs it once reported, and scores the reports.

Protect mode (``--mode protect``, or ``KVCANARY_MODE=protect``; issue 26): the same faults, with
:class:`~kvcanary.sim.protect.SimProtect` acting on every violation as the sglang adapter does (the request
recomputed from the tokens it keeps, the prefix-cache nodes holding bad slots dropped, the requests holding them
recomputed), by default with ``KVCANARY_PROTECT_HOLD`` behaviour (drained before a forward's tokens are appended).
The simulator's sampled tokens then depend on the K/V each request reads (``SimConfig.kv_sampling``), so a corrupted
read changes the output; every finished request's output is compared with its output over clean K/V
(:meth:`~kvcanary.sim.engine.Simulator.clean_tokens`, which needs no second run).

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

from kvcanary.kernels import jit
from kvcanary.kernels.layout import RealKvHashMode
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report.table import format_table
from kvcanary.runtime import faults
from kvcanary.runtime.config import Config
from kvcanary.runtime.protect import ACTION_LOG_PREFIX, RECOMPUTE
from kvcanary.settings import (
    ENV_CACHE_DIR,
    ENV_CUDA_ARCH,
    ENV_DRAIN_EVERY,
    ENV_HEALTH_WINDOW,
    ENV_LOG_REPEAT_WINDOW,
    ENV_MODE,
    ENV_PROTECT_HOLD,
    ENV_REAL_KV,
    ENV_REAL_KV_LAYERS,
    ENV_REPORT,
    ENV_RING_CAPACITY,
    ENV_SANITIZE,
    ENV_STATS_EVERY,
    ENV_SWEEP_INTERVAL,
    ENV_VERIFY_TOKENS,
    FAULT_ENV_VARS,
    Mode,
    check_cache_dir,
)
from kvcanary.sim.engine import Request, SimConfig, Simulator
from kvcanary.sim.injector import ClassResult, FaultDriver
from kvcanary.sim.protect import SimProtect, chain

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
NEXT_STEP_PROTECT = ("next: turn it on in sglang: KVCANARY_MODE=protect python -m sglang.launch_server --model-path "
                     "<model> (docs/sglang.md#protect-mode-kvcanary_modeprotect)")
MODES = ("log", "protect")
_MAX_SETTLE_FORWARDS = 2000  # after the faults: forwards to let the requests acted on finish

# Variables the demo honours when set (it has its own defaults for the sweep, the token check and the stats lines).
HONOURED: tuple[str, ...] = (
    ENV_REAL_KV, ENV_SWEEP_INTERVAL, ENV_VERIFY_TOKENS, ENV_DRAIN_EVERY, ENV_RING_CAPACITY, ENV_HEALTH_WINDOW,
    ENV_LOG_REPEAT_WINDOW, ENV_STATS_EVERY, ENV_CACHE_DIR, ENV_CUDA_ARCH, ENV_SANITIZE, ENV_PROTECT_HOLD,
)
# Variables the demo cannot honour, and why; when one is set, one line names it.
OVERRIDDEN: dict[str, str] = {
    ENV_MODE: "the demo runs in log or protect mode: off protects nothing and raise stops at the first injected fault",
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
    """``--faults``: ``all`` (or None) or a comma-separated list of ``kvcanary.runtime.faults.FAULT_CLASSES``."""
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
        mode=Mode.PROTECT if base.mode is Mode.PROTECT else Mode.LOG,  # (--mode overrides it)
        protect_hold=base.protect_hold if is_set(ENV_PROTECT_HOLD) else True,  # the demo's default: hold
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
                       if is_set(var) and not (var == ENV_MODE and base.mode in (Mode.LOG, Mode.PROTECT)))
    honoured = tuple(f"{var}={env[var].strip()}" for var in HONOURED if is_set(var))
    if base.mode is Mode.PROTECT:
        honoured = (f"{ENV_MODE}={env[ENV_MODE].strip()}", *honoured)
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
    mode: str = "log"  # "log" or "protect"
    hold: bool = False  # protect mode: drained and acted on before a forward's tokens are appended
    # Outputs compared with a clean run's (protect mode, or check_outputs): finished requests whose tokens equal
    # those they have over clean K/V, of all finished requests. None: not compared.
    outputs_clean: int | None = None
    outputs_total: int = 0
    # protect mode, per fault class: (outputs equal to a clean run's, finished, not finished) of the requests acted on
    class_outputs: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    protect: dict[str, int] | None = None  # protect mode's counters (kvcanary.runtime.protect.ProtectStats)
    action_line: str | None = None  # one recompute action, as the log shows it

    @property
    def passed(self) -> bool:
        ok = bool(self.faults) and all(r.all_detected for r in self.faults.values()) and self.false_positives == 0
        if self.mode == "protect":
            ok = ok and all(r.acted_on == r.injected for r in self.faults.values())
            ok = ok and self.outputs_clean == self.outputs_total
            ok = ok and not any(pending for _, _, pending in self.class_outputs.values())
        return ok

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
            **self._protect_json(),
        }

    def _protect_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.outputs_clean is not None:
            out["outputs"] = {"equal_to_clean_run": self.outputs_clean, "finished": self.outputs_total}
        if self.mode == "protect":
            out["protect"] = {
                "hold": self.hold,
                **(self.protect or {}),
                "classes": {name: {"acted_on": r.acted_on, "actions": dict(r.actions),
                                   "nodes_evicted": r.nodes_evicted,
                                   "outputs_equal_to_clean_run": self.class_outputs.get(name, (0, 0, 0))[0],
                                   "finished": self.class_outputs.get(name, (0, 0, 0))[1],
                                   "not_finished": self.class_outputs.get(name, (0, 0, 0))[2]}
                            for name, r in self.faults.items()},
                "action_line": self.action_line,
            }
        return out


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
    mode: str | None = None,
    check_outputs: bool | None = None,
) -> DemoResult:
    """Serve clean traffic for ``seconds`` under the canary, then inject ``per_class`` faults of each class.

    The clean phase runs for ``seconds`` and at least ``min_forwards`` forwards: ``seconds=0`` makes the whole run
    a function of ``seed`` and ``min_forwards`` alone (the tests' choice), whatever the machine's speed.
    ``quiet_log``: keep kvcanary's WARNING lines (one per violation and per injection) off the console while the
    demo runs; they are captured either way (one is shown in the result).
    ``settings``: default :func:`settings_from_env` (which raises ``ConfigError`` for a bad ``KVCANARY_*`` value).
    ``mode``: ``log`` or ``protect`` (default: the settings', i.e. ``KVCANARY_MODE=protect`` or log).
    ``check_outputs``: compare every finished request's output with its clean run's (default: in protect mode).
    """
    from kvcanary.runtime.manager import CanaryManager

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
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}; got {mode!r}")
        config = config.replace(mode=Mode(mode))
    protecting = config.mode is Mode.PROTECT
    compare = protecting if check_outputs is None else bool(check_outputs)
    drain, sweep = config.drain_every, config.sweep_interval
    driver = FaultDriver(fault_classes, seed=seed, per_class=per_class, warmup=1 << 62, gap=3,
                         deadline=30 + drain, grace=drain + 2, sweep_every=sweep)
    capture = _Capture(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger("kvcanary")
    saved_propagate = root.propagate
    root.addHandler(capture)
    root.propagate = not quiet_log
    try:
        protector = (SimProtect(hold=config.protect_hold, drain_every=drain, on_action=driver.note_action)
                     if protecting else None)
        sim = Simulator(SimConfig(seed=seed, page_size=1, num_pages=NUM_PAGES, host_pages=HOST_PAGES,
                                  kv_sampling=compare),
                        mgr_factory=lambda **kw: CanaryManager(config, **kw), hook=chain(protector, driver),
                        device=dev)
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
        if compare:  # the requests in flight (those acted on among them) finish, so that their outputs count
            _note(progress, "kvcanary demo: letting the requests in flight finish, then comparing every output with "
                            "a clean run's ...")
            in_flight = {r.rid for r in sim.running + sim.waiting}
            settle = sim.step_no + _MAX_SETTLE_FORWARDS
            while sim.step_no < settle and any(r.rid in in_flight for r in sim.running + sim.waiting):
                sim.step()
        mgr.flush()
        driver.score(sim)
        if protector is not None:
            protector.act(sim)  # (whatever the last flush drained)
        stats = mgr.stats
    finally:
        root.removeHandler(capture)
        root.propagate = saved_propagate

    results = driver.results()
    outputs_clean, class_outputs = None, {}
    if compare:
        outputs_clean, class_outputs = _compare_outputs(sim, results)
    notes = [f"{name}: only {r.injected} of {per_class} injections found a fitting batch"
             for name, r in results.items() if r.injected < per_class]
    # settings from the environment that blind the canary to some classes: say so next to the FAIL they cause
    if config.real_kv is RealKvHashMode.NONE:
        notes.append(f"{ENV_REAL_KV}=none: no K/V byte is fingerprinted, so a fault that changes only K/V is not seen")
    if sweep == 0 and faults.CACHED_IDLE_CORRUPTION in results:
        notes.append(f"{ENV_SWEEP_INTERVAL}=0: no sweep, so {faults.CACHED_IDLE_CORRUPTION} is not seen")
    if protecting and not config.protect_hold:
        notes.append(f"{ENV_PROTECT_HOLD}=0: protect acts when the drain reports (every {drain} forwards), so a "
                     "request can finish over bad K/V before it acts (missed); the demo's default holds")
    return DemoResult(
        device=str(dev),
        config=(f"mode={config.mode.value}"
                + (f" protect_hold={str(config.protect_hold).lower()}" if protecting else "")
                + f" real_kv={config.real_kv.name.lower()} "
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
        mode=config.mode.value,
        hold=protecting and config.protect_hold,
        outputs_clean=outputs_clean,
        outputs_total=len(sim.finished),
        class_outputs=class_outputs,
        protect=None if protector is None else _protect_counts(protector),
        action_line=_example_action(capture),
    )


def _compare_outputs(sim: Simulator, results: dict[str, ClassResult]) -> tuple[int, dict[str, tuple[int, int, int]]]:
    """Finished requests whose output equals their clean run's; per class, (equal, finished, not finished) of the
    requests acted on for it (a recomputed request counts once, as it finally finished)."""
    clean: dict[int, bool] = {id(r): sim.output_is_clean(r) for r in sim.finished}
    last: dict[str, Request] = {str(r.rid): r for r in sim.finished}
    per_class = {}
    for name, r in results.items():
        done = [last[rid] for rid in r.acted_rids if rid in last]
        per_class[name] = (sum(clean[id(q)] for q in done), len(done), len(r.acted_rids) - len(done))
    return sum(clean.values()), per_class


def _protect_counts(protector: SimProtect) -> dict[str, int]:
    st = protector.stats
    return {"recomputed": st.recomputed, "aborted": st.aborted, "missed": st.missed,
            "nodes_evicted": st.nodes_evicted, "slots_evicted": st.slots_evicted,
            "tokens_discarded": st.tokens_discarded, "tokens_sent": st.tokens_sent,
            "window_forwards_max": st.window_forwards_max, "window_tokens_max": st.window_tokens_max}


def _example_action(capture: _Capture) -> str | None:
    """The log line of the first recompute action (else of any action)."""
    lines = [(msg, line) for msg, line in capture.lines if msg.startswith(ACTION_LOG_PREFIX)]
    for msg, line in lines:
        if f" action={RECOMPUTE} " in msg:
            return line
    return lines[0][1] if lines else None


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
    if result.mode == "protect":
        return _render_protect(result, lines)
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
        why = [f"not every injection detected: {', '.join(missed)}"] if missed else []
        lines.append(_fail_line(why, result.false_positives))
    return "\n".join(lines)


def _fail_line(why: list[str], false_positives: int) -> str:
    """The FAIL line: each reason, then the false positives when there are any."""
    if false_positives:
        why = [*why, f"{false_positives} false positive(s)"]
    return "FAIL: " + "; ".join(why)


_HOLD_TEXT = "hold: drained before each forward's tokens are appended"


def _outputs_cell(cell: tuple[int, int, int] | None) -> str:
    if cell is None or not (cell[1] or cell[2]):
        return "-"
    equal, finished, pending = cell
    return f"{equal}/{finished}" + (f" ({pending} unfinished)" if pending else "")


def _render_protect(result: DemoResult, lines: list[str]) -> str:
    """Protect mode's table and verdict (after the common head)."""
    rows = [(name, str(r.injected), str(r.detected), str(r.acted_on), str(r.actions["recompute"]),
             str(r.actions["abort"]), str(r.actions["missed"]), str(r.nodes_evicted),
             _outputs_cell(result.class_outputs.get(name)), _latency(r))
            for name, r in result.faults.items()]
    lines.append(format_table(rows, ("fault class", "injected", "detected", "acted on", "recomputed", "aborted",
                                     "missed", "nodes evicted", "outputs = clean run", "latency (forwards)"),
                              right=(1, 2, 3, 4, 5, 6, 7)))
    p = result.protect or {}
    recomputed = sum(r.actions["recompute"] for r in result.faults.values())
    lines += [
        "",
        f"forwards {result.forwards} | entries verified {result.entries_verified} | entries swept "
        f"{result.entries_swept} | tokens written {result.tokens_written} | false positives {result.false_positives} "
        f"| {result.seconds:.1f} s",
        f"protect ({_HOLD_TEXT if result.hold else 'no hold'}): {p.get('recomputed', 0)} requests recomputed "
        f"({p.get('tokens_discarded', 0)} tokens over bad K/V "
        f"discarded), {p.get('aborted', 0)} aborted, {p.get('missed', 0)} missed, {p.get('nodes_evicted', 0)} "
        f"prefix-cache nodes evicted ({p.get('slots_evicted', 0)} slots)",
        f"outputs equal to a clean run: {result.outputs_clean}/{result.outputs_total} finished requests "
        f"(every request of the run, the {recomputed} recomputed included); the clean output is computed from the "
        "request's tokens, over the K/V the model writes for them",
        "acted on: injections with an action; outputs = clean run: of the requests acted on for the class, those "
        "that finished",
    ]
    if result.action_line:
        lines += ["", "one action, as the log shows it:", f"  {result.action_line}"]
    lines += [f"note: {n}" for n in result.notes]
    lines.append("")
    if result.passed:
        lines.append("PASS: every fault class detected and acted on, every output equal to a clean run's, "
                     "0 false positives")
        lines.append(NEXT_STEP_PROTECT)
    else:
        why = []
        missed = [n for n, r in result.faults.items() if not r.all_detected]
        if missed:
            why.append(f"not every injection detected: {', '.join(missed)}")
        idle = [n for n, r in result.faults.items() if r.acted_on < r.injected]
        if idle:
            why.append(f"not every injection acted on: {', '.join(idle)}")
        if result.outputs_clean != result.outputs_total:
            missed = (result.protect or {}).get("missed", 0)
            why.append(f"{result.outputs_total - (result.outputs_clean or 0)} output(s) differ from a clean run's"
                       + (f" ({missed} request(s) finished over bad K/V before protect acted: missed)"
                          if missed else ""))
        pending = sum(c[2] for c in result.class_outputs.values())
        if pending:
            why.append(f"{pending} request(s) acted on did not finish")
        lines.append(_fail_line(why, result.false_positives))
    return "\n".join(lines)
