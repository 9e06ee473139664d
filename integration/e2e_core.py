"""The driver core of integration/sglang_e2e.py: what every phase family reads and judges the same way.

kvcanary's facts as the driver sees them from outside (the fault classes and their reasons, the report schemas, the
log lines it prints), the phase and request records, the mixed serving workload, the readers of a phase's run folder
(its worker log and JSONL reports), the fault matcher, one phase's summary row and the clean and fault verdicts.

The driver (integration/sglang_e2e.py) and its phase families (``eagle_phases.py``, ``pool_phases.py``, ...) import
this file; it imports none of them. Like the driver it never imports kvcanary or sglang.
"""

from __future__ import annotations

import collections
import json
import random
import re
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------------- facts
# The fault classes a live engine can take through KVCANARY_FAULT, and the reason names kvcanary reports for
# each (must equal kvcanary.runtime.faults.EXPECTED_REASONS; tests/integration checks it, this file does not import it).
E2E_FAULTS: tuple[str, ...] = (
    "req_to_token_redirect",
    "real_kv_flip",
    "cached_idle_corruption",
    "token_swap",
    "position_skew",
)
# kvcanary.runtime.faults.HOST_TIER_CLASSES and their expected reasons: the HiCache fault phase's classes
# (tests/integration checks them against kvcanary)
HOST_TIER_FAULTS: tuple[str, ...] = ("host_tier_flip", "load_wrong_slots", "load_before_backup")
HOST_TIER_REASONS: dict[str, tuple[str, ...]] = {c: ("verify_real_kv_hash",) for c in HOST_TIER_FAULTS}
EXPECTED_REASONS: dict[str, tuple[str, ...]] = {
    "req_to_token_redirect": ("verify_chain_hash",),
    "real_kv_flip": ("verify_real_kv_hash",),
    "cached_idle_corruption": ("verify_real_kv_hash",),
    "token_swap": ("write_token", "verify_token"),
    "position_skew": ("write_position", "verify_position"),
    **HOST_TIER_REASONS,  # the HiCache fault phase's classes
}
# Forwards after the injection within which a detection counts (the violation's step is the forward count when
# kvcanary drained it: > the injection's step). A token swap is seen when its row's next forward verifies it.
DETECT_WINDOW: dict[str, int] = {"token_swap": 256}
DEFAULT_DETECT_WINDOW = 8

INJECTION_SCHEMA = "kvcanary.injection/1"
VIOLATION_SCHEMA = "kvcanary.violation/1"
HEALTH_SCHEMA = "kvcanary.health/1"
LOST_SCHEMA = "kvcanary.lost/1"
STATS_RE = re.compile(
    r"kvcanary stats: step=(?P<step>\d+) forwards=(?P<forwards>\d+) tokens_written=(?P<tokens_written>\d+) "
    r"entries_verified=(?P<entries_verified>\d+) entries_swept=(?P<entries_swept>\d+) "
    r"violations=(?P<violations>\d+) lost=(?P<lost>\d+)"
)
HOST_RE = re.compile(
    r"kvcanary host time: step=\d+ forwards=(?P<forwards>\d+) eager=(?P<eager>\d+) "
    r"canary_us_per_forward=(?P<canary_us>[\d.]+) hooks_us=(?P<hooks_us>[\d.]+) "
    r"launch_us_per_eager_forward=(?P<launch_us>[\d.]+) forward_us=(?P<forward_us>[\d.]+)"
    # the batch hook's share (ForwardBatch.init_new), last on the line; older lines lack it (no key then)
    r"(?:[^\n]*? batch_init_us=(?P<batch_init_us>[\d.]+))?"
    r"(?:[^\n]*? sweep_us=(?P<sweep_us>[\d.]+))?"  # the sweeps' part of hooks_us (since issue 25's sweep index)
    r"(?: sweeps=(?P<sweeps>\d+) sweep_walks=(?P<sweep_walks>\d+) sweep_compactions=(?P<sweep_compactions>\d+)"
    r"(?: sweep_event_us=(?P<sweep_event_us>[\d.]+))?)?"
    # the tails (since issue 28): the longest forward's kvcanary host time since the previous line, forwards of >= 1 ms
    r"(?:[^\n]*? max_forward_us=(?P<max_forward_us>[\d.]+) slow_forwards=(?P<slow_forwards>\d+))?"
)
RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests")
SWEEP_OFF_RE = re.compile(r"kvcanary: prefix cache (?P<cls>\w+) cannot be swept")
# The manager's start-up line states its settings (Config.describe): a sweep interval of 0 means the sweep is off by
# the setting (e.g. ``--kvcanary-env KVCANARY_SWEEP_INTERVAL=0`` to measure the eager path without it)
SWEEP_INTERVAL_RE = re.compile(r"kvcanary config: .*?\bsweep_interval=(?P<n>\d+)")
# the lines of integration/pool_phases.py's test-only observers and switches (any phase: --test-pool-switch)
POOL_LINE_RE = re.compile(r"\[e2e-pool\] (?P<kind>[\w-]+): (?P<fields>[^\n]*)")
# prefill forwards served by sglang's piecewise CUDA graphs (--piecewise), and sglang's time to build them
PIECEWISE_RE = re.compile(
    r"kvcanary host time: step=\d+ forwards=(?P<forwards>\d+) .*?piecewise=(?P<piecewise>\d+) "
    r"launch_us_per_piecewise_forward=(?P<launch_us>[\d.]+) canary_us_per_piecewise_forward=(?P<canary_us>[\d.]+)"
)
PCG_CAPTURE_RE = re.compile(r"Capture piecewise CUDA graph end\. Time elapsed: (?P<s>[\d.]+) s")


# ---------------------------------------------------------------------------------------------------- phases
@dataclass(frozen=True)
class Phase:
    key: str  # "1" .. "4"
    name: str
    mode: str  # KVCANARY_MODE
    graphs: bool  # decode CUDA graphs
    max_total_tokens: int  # KV pool (tokens)
    cap_s: int  # most seconds this phase may take
    min_s: int  # fewer seconds left than this: skipped
    env: tuple[tuple[str, str], ...] = ()
    engine: tuple[tuple[str, object], ...] = ()
    max_new: tuple[int, int] = (8, 96)  # max_new_tokens range of the workload
    workload: str = "mixed"  # make_workload's mixed serving workload, or an EAGLE phase's (make_eagle_workload)
    temperature: float = 0.0  # of the measured requests (the Engine's random_seed seeds the sampling)


COMMON_ENV = (("KVCANARY_STATS_EVERY", "20"), ("KVCANARY_SWEEP_INTERVAL", "10"), ("KVCANARY_VERIFY_TOKENS", "1"))


# ---------------------------------------------------------------------------------------------------- workload
@dataclass
class Request:
    input_ids: list[int]
    max_new_tokens: int
    family: int  # shared-prefix family, -1 for none
    repeat_of: int = -1  # index of the earlier request this one repeats exactly


def make_workload(n: int = 640, *, seed: int = 0, batch: int = 64, min_len: int = 8, max_len: int = 1500,
                  max_new: tuple[int, int] = (8, 96), vocab: int = 2048) -> list[list[Request]]:
    """``n`` requests in groups of at most ``batch`` (one Engine.generate call each).

    About 65 % extend one of 12 shared prefixes (16 to 1100 tokens: radix hits, and long prompts that chunked
    prefill splits), 10 % repeat an earlier prompt exactly (a full hit), the rest are fresh; every prompt has
    ``min_len``..``max_len`` tokens (ids 3..vocab-1), some exactly ``min_len`` and ``max_len``.
    """
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    families = [toks(rng.choice([16, 32, 64, 128, 256, 384, 512, 640, 768, 900, 1024, 1100])) for _ in range(12)]
    reqs: list[Request] = []
    for i in range(n):
        r = rng.random()
        new = rng.randint(*max_new)
        if i == 0:
            ids, fam = toks(min_len), -1
        elif i == 1:
            ids, fam = toks(max_len), -1
        elif r < 0.10 and reqs:
            j = rng.randrange(len(reqs))
            reqs.append(Request(list(reqs[j].input_ids), new, reqs[j].family, j))
            continue
        elif r < 0.75:
            fam = rng.randrange(len(families))
            tail = rng.randint(min_len, max(min_len, min(400, max_len - len(families[fam]))))
            ids = (families[fam] + toks(tail))[:max_len]
        else:
            ids, fam = toks(int(min_len * (max_len / min_len) ** rng.random())), -1
        reqs.append(Request(ids, new, fam))
    return [reqs[i : i + batch] for i in range(0, len(reqs), batch)]


def workload_stats(groups: list[list[Request]], chunk: int) -> dict:
    reqs = [r for g in groups for r in g]
    lens = [len(r.input_ids) for r in reqs]
    return {
        "requests": len(reqs),
        "groups": len(groups),
        "max_group": max(len(g) for g in groups),
        "prompt_len_min": min(lens),
        "prompt_len_max": max(lens),
        "prompt_tokens": sum(lens),
        "shared_prefix_requests": sum(r.family >= 0 for r in reqs),
        "exact_repeats": sum(r.repeat_of >= 0 for r in reqs),
        "longer_than_chunk": sum(n > chunk for n in lens),
        "max_new_tokens_sum": sum(r.max_new_tokens for r in reqs),
    }


# ---------------------------------------------------------------------------------------------------- reports
def read_text(path: str) -> str:
    """A log file's text (bad bytes replaced), or "" when it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def read_jsonl(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        rows.append({"schema": "unparsable", "line": line[:200]})
    return rows


def last_match_fields(pattern: re.Pattern, log_text: str) -> dict | None:
    """The named groups of ``pattern``'s last match in a log, as ints (floats where the value has a '.'), or None.
    kvcanary's stats and host-time lines are cumulative, so the last one says it all. An optional group that did
    not match (a field an older line lacks) is left out."""
    last = None
    for m in pattern.finditer(log_text):
        last = m
    if last is None:
        return None
    return {k: (float(v) if "." in v else int(v)) for k, v in last.groupdict().items() if v is not None}


POOL_LABEL_RE = re.compile(r" pool=(?P<pool>[a-z]+)")


def parse_stats(log_text: str) -> dict | None:
    """The cumulative counters of a log's last ``kvcanary stats:`` step, or None.

    A pool of several KV groups (an SWAKVPool: full and swa) has a manager per group, each printing its line at the
    same step: their counters are summed (before 2026-12-02 the swa group's line alone was read). An EAGLE engine has
    a canary per pool, each counting its own steps and ending its line with ``pool=target`` / ``pool=draft`` (since
    2026-12-02): each pool's last step is read, the entry and violation counters are summed over the pools, and
    ``step``, ``forwards`` and ``tokens_written`` are the target pool's (the engine's forwards); ``by_pool`` keeps each
    pool's own counters. (Before, the draft pool's line, the log's last, stood for the engine.)"""
    by_pool: dict[str, list[dict]] = {}
    for m in STATS_RE.finditer(log_text):
        end = log_text.find("\n", m.end())
        label = POOL_LABEL_RE.search(log_text, m.end(), end if end >= 0 else len(log_text))
        by_pool.setdefault(label["pool"] if label else "", []).append({k: int(v) for k, v in m.groupdict().items()})
    if not by_pool:
        return None
    counters = {pool: _last_step_summed(lines) for pool, lines in by_pool.items()}
    engine_pool = "target" if "target" in counters else next(iter(counters))
    out = dict(counters[engine_pool])
    for k in ("entries_verified", "entries_swept", "violations", "lost"):
        out[k] = sum(c[k] for c in counters.values())
    if len(counters) > 1:
        out["by_pool"] = counters
    return out


def _last_step_summed(lines: list[dict]) -> dict:
    """One canary's (one pool's) counters at its last step: the lines printed at that step, one per KV group, summed
    (every group records the same tokens and counts the same forwards)."""
    last_step = lines[-1]["step"]
    out = dict(lines[-1])
    tail = []
    for line in reversed(lines):  # the last step's lines, one per group (they are printed together)
        if line["step"] != last_step:
            break
        tail.append(line)
    for k in out:
        if k not in ("step", "forwards", "tokens_written"):
            out[k] = sum(line[k] for line in tail)
    return out


def parse_host_time(log_text: str) -> dict | None:
    """The last ``kvcanary host time:`` line of a log (host time the canary adds per forward), or None."""
    return last_match_fields(HOST_RE, log_text)


def parse_piecewise(log_text: str) -> dict | None:
    """Prefill forwards the piecewise CUDA graph runner served, from the last ``kvcanary host time:`` line that
    counts them: ``{"forwards", "piecewise", "launch_us", "canary_us"}`` (canary host µs per such forward: its
    launches around the replay, and hooks + launches); None without such a line."""
    return last_match_fields(PIECEWISE_RE, log_text)


def piecewise_capture_seconds(log_text: str) -> list[float]:
    """sglang's own time for building the piecewise graphs, one entry per Engine (scheduler process) started."""
    return [float(m.group("s")) for m in PCG_CAPTURE_RE.finditer(log_text)]


def sweep_off(log_text: str) -> str | None:
    """Why kvcanary does not sweep, as it said so in the log, or None: the prefix cache it cannot sweep (e.g.
    SWARadixCache), or ``"sweep_interval=0"`` when every manager started with the sweep off by the setting."""
    m = SWEEP_OFF_RE.search(log_text)
    if m:
        return m["cls"]
    intervals = {int(m["n"]) for m in SWEEP_INTERVAL_RE.finditer(log_text)}
    return "sweep_interval=0" if intervals == {0} else None


def switch_tallies(log_text: str) -> dict[str, dict]:
    """Each test-only switch's last running tally in a worker log (a phase run with ``--test-pool-switch``)."""
    return {kind: lines[-1] for kind, lines in parse_pool_lines(log_text).items() if lines}


def parse_pool_lines(log_text: str) -> dict[str, list[dict]]:
    """The ``[e2e-pool]`` lines of a worker log by kind: ``{kind: [{field: value}]}``."""
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for m in POOL_LINE_RE.finditer(log_text):
        out[m["kind"]].append(kv_fields(m["fields"]))
    return dict(out)


def kv_fields(text: str) -> dict:
    """``k=v`` pairs of an observer line as a dict (values as ints where they are; other words left out)."""
    fields = {}
    for pair in text.split():
        k, sep, v = pair.partition("=")
        if sep:
            fields[k] = int(v) if re.fullmatch(r"-?\d+", v) else v
    return fields


# ---------------------------------------------------------------------------------------------------- fault matching
@dataclass
class FaultMatch:
    injections: dict = field(default_factory=lambda: collections.Counter())
    detected: dict = field(default_factory=lambda: collections.Counter())
    reasons: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    tags: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    missed: list = field(default_factory=list)  # injections with no detection (first few)
    unexplained: list = field(default_factory=list)  # violations on a slot no earlier injection touched
    late: int = 0  # violations on touched slots, outside every window (e.g. a swapped record read again later)
    latency: dict = field(default_factory=lambda: collections.defaultdict(list))
    ended: list = field(default_factory=list)  # undetected, in the run's last ENDED_GRACE forwards: not judged
    echoes: int = 0  # a window group's violations with a full-group twin (SWAKVPool: the same damage, seen twice)


# An SWAKVPool's managers: the full group (``group=full``, or no group key: a one-group pool) and the window group
# (``group=swa``), which numbers its own slots. The injector acts on the full group only; damage it does there that
# the window group also reads (a swapped token, a redirected row) is reported by both, at the same step, row and
# position: the window group's line is that detection seen again, judged by its full-group twin.
WINDOW_GROUP = "swa"


def group_of(r: dict) -> str | None:
    """A row's KV group (``full``, ``swa``), or None for a one-group pool."""
    return (r.get("rank") or {}).get("group")


def _rank_key(r: dict) -> str:
    """A row's rank without its group (injections carry none: the injector acts on the full group)."""
    return json.dumps({k: v for k, v in (r.get("rank") or {}).items() if k != "group"}, sort_keys=True)


def pool_of(row: dict) -> str:
    """A row's KV pool: an EAGLE engine's ``target`` or ``draft`` (``target`` where the row names none)."""
    return (row.get("rank") or {}).get("pool", "target")


# An injection in the last forwards of a run may not have been read by a verify or a sweep yet when the workload
# ended (H200 phase 22, 2026-12-02: a cached-idle corruption at the run's last forward, the sweep due 3 later): left
# undetected there, it is counted apart (``FaultMatch.ended``), neither detected nor missed. The sweep interval of
# the fault phases is at most 10.
ENDED_GRACE = 10


def match_injections(rows: list[dict]) -> FaultMatch:
    """Match ``kvcanary.violation/1`` rows to ``kvcanary.injection/1`` rows (same rank) by slot and step.

    An injection is detected when a violation with one of its class's expected reasons names one of its slots
    within (step, step + window]; an undetected one in the run's last ``ENDED_GRACE`` forwards (the last step any
    row names) is set apart (``ended``) and taken off ``injections``. A violation is unexplained when no injection
    at an earlier step touched its slot: that is a false positive (or collateral damage of an injector), and must not
    happen.
    """
    res = FaultMatch()
    inj = [r for r in rows if r.get("schema") == INJECTION_SCHEMA]
    vio = [r for r in rows if r.get("schema") == VIOLATION_SCHEMA and group_of(r) != WINDOW_GROUP]
    rank_key = _rank_key
    twin = lambda r: (rank_key(r), r["step"], r.get("request_row"), r.get("position"), tuple(r["reasons"]))  # noqa: E731
    full_seen = {twin(v) for v in vio}
    for v in (r for r in rows if r.get("schema") == VIOLATION_SCHEMA and group_of(r) == WINDOW_GROUP):
        if twin(v) in full_seen:
            res.echoes += 1
        else:
            res.unexplained.append(v)  # the window group alone saw it: no injection explains that
    by_slot: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for i in inj:
        res.injections[i["fault"]] += 1
        for s in i["slots"]:
            by_slot[(rank_key(i), int(s))].append(i)
    for lst in by_slot.values():
        lst.sort(key=lambda i: i["step"])
    detected_ids = set()
    for v in vio:
        cands = [i for i in by_slot.get((rank_key(v), int(v["slot"])), []) if i["step"] < v["step"]]
        if not cands:
            res.unexplained.append(v)
            continue
        hit = False
        for i in cands:
            window = DETECT_WINDOW.get(i["fault"], DEFAULT_DETECT_WINDOW)
            if v["step"] > i["step"] + window:
                continue
            hit = True
            if set(v["reasons"]) & set(EXPECTED_REASONS.get(i["fault"], ())):
                if id(i) not in detected_ids:
                    detected_ids.add(id(i))
                    res.detected[i["fault"]] += 1
                    res.latency[i["fault"]].append(v["step"] - i["step"])
                res.reasons[i["fault"]]["+".join(v["reasons"])] += 1
                res.tags[i["fault"]][v.get("tag", "?")] += 1
        if not hit:
            res.late += 1
    # the run's last step in the injection's own pool (every TP rank counts the same forwards; an EAGLE draft pool
    # counts its own, more: H200 eagle-faults on pages of 16, 2026-12-02, a cached-idle corruption at the target's
    # last forward, 1583, was judged missed against the draft pool's step 2080)
    last_step: dict[str, int] = collections.defaultdict(int)
    for r in rows:
        last_step[pool_of(r)] = max(last_step[pool_of(r)], int(r.get("step") or 0))
    undetected = [i for i in inj if id(i) not in detected_ids]
    res.ended = [i for i in undetected if i["step"] > last_step[pool_of(i)] - ENDED_GRACE]
    for i in res.ended:
        res.injections[i["fault"]] -= 1
    res.missed = [i for i in undetected if i["step"] <= last_step[pool_of(i)] - ENDED_GRACE][:20]
    return res


# ---------------------------------------------------------------------------------------------------- summary row
def summarize_phase(phase: Phase, result: dict, log_text: str, report_rows: list[dict]) -> dict:
    """One row of the summary: what the worker measured + what kvcanary reported."""
    stats = parse_stats(log_text)
    schemas = collections.Counter(r.get("schema") for r in report_rows)
    s = {
        "phase": f"{phase.key} {phase.name}",
        "status": result.get("status", "MISSING"),
        "rc": result.get("rc"),
        "engine_start_s": result.get("engine_start_s"),
        "requests_sent": result.get("requests_sent", 0),
        "requests_ok": result.get("requests_ok", 0),
        "cached_tokens": result.get("cached_tokens", 0),
        "retractions": max(result.get("retractions", 0), len(RETRACT_RE.findall(log_text))),
        "output_tokens": result.get("output_tokens", 0),
        "tokens_per_s": result.get("tokens_per_s"),
        "forwards": stats["forwards"] if stats else None,
        "entries_verified": stats["entries_verified"] if stats else None,
        "entries_swept": stats["entries_swept"] if stats else None,
        "tokens_written": stats["tokens_written"] if stats else None,
        "violations": schemas.get(VIOLATION_SCHEMA, 0),
        "lost": sum(int(r.get("count", 0)) for r in report_rows if r.get("schema") == LOST_SCHEMA),
        "health_errors": schemas.get(HEALTH_SCHEMA, 0),
        "injections": schemas.get(INJECTION_SCHEMA, 0),
        "errors": result.get("errors", []),
        "kvcanary_errors": len(re.findall(r"CanaryViolationError|CanaryHealthError|kvcanary refused", log_text)),
        "host": parse_host_time(log_text),
        "piecewise": parse_piecewise(log_text),  # prefill forwards the piecewise runner served (None: no line)
        "pcg_capture_s": piecewise_capture_seconds(log_text),  # sglang's piecewise graph capture, per Engine
        "piecewise_requested": bool(result.get("piecewise")),
        "sweep_off": sweep_off(log_text),  # why kvcanary does not sweep (SWARadixCache; sweep_interval=0)
        "pool_switches": switch_tallies(log_text),  # test-only switches' tallies (--test-pool-switch)
    }
    return s


def verdict_clean(s: dict) -> tuple[bool, list[str]]:
    why = []
    if s["status"] != "OK":
        why.append(f"status {s['status']}")
    if s["requests_ok"] != s["requests_sent"] or not s["requests_sent"]:
        why.append(f"{s['requests_ok']}/{s['requests_sent']} requests completed")
    for k in ("violations", "lost", "health_errors", "kvcanary_errors"):
        if s[k]:
            why.append(f"{k}={s[k]}")
    if s["errors"]:
        why.append(f"errors={len(s['errors'])}")
    if s["entries_verified"] is None:
        why.append("no kvcanary stats line (plugin not active?)")
    elif s["entries_verified"] < 1_000_000:
        why.append(f"entries_verified {s['entries_verified']} < 1e6")
    if not s["entries_swept"] and not s.get("sweep_off"):  # (kvcanary said why it is off: not judged here)
        why.append("sweep never ran")
    return not why, why


def verdict_faults(s: dict, m: FaultMatch, min_per_class: int = 20,
                   classes: tuple[str, ...] | None = None) -> tuple[bool, list[str]]:
    why = []
    if s["status"] not in ("OK", "TRUNCATED"):
        why.append(f"status {s['status']}")
    why += fault_class_gaps(m, classes or E2E_FAULTS, min_per_class)
    return not why, why


def fault_class_gaps(m: FaultMatch, classes: tuple[str, ...], min_per_class: int) -> list[str]:
    """Why a fault phase's matching fails for ``classes`` (empty: it passes): a class with fewer than
    ``min_per_class`` injections or one not every injection of which was detected, and violations on slots no
    injection touched. The fault verdicts of every family (this one, HiCache's host-tier classes) read it."""
    why = []
    for c in classes:
        n, d = m.injections.get(c, 0), m.detected.get(c, 0)
        if n < min_per_class:
            why.append(f"{c}: {n} injections < {min_per_class}")
        if d != n:
            why.append(f"{c}: {d}/{n} detected")
    if m.unexplained:
        why.append(f"{len(m.unexplained)} violation(s) on slots no injection touched")
    return why


def fmt(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)
