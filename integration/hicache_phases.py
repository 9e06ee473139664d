"""The HiCache phases of integration/sglang_e2e.py (sglang's host-memory KV tier, issue 24): their workload, what a
phase's run folder says, the phase rows, the verdicts, the summary tables, the dry run and the test-only PR 36738
fence.

Phases (keys in sglang_e2e.HICACHE_PHASES; each one Engine with ``--enable-hierarchical-cache``, a device pool far
smaller than the workload's prefixes, so HiRadixCache backs prefixes up to the host, evicts them from the device
and loads them back into new slots many times):

* ``hicache-off`` (kvcanary off): the greedy outputs every other clean phase must reproduce;
* ``hicache-clean`` (raise, ``write_through``) and ``hicache-writeback`` (raise, ``write_back``): no violation,
  >= MIN_LOADED slots loaded back (kvcanary's own count, ``host_loaded`` of its stats line), outputs identical;
* ``hicache-faults`` (log): the three host-tier classes of kvcanary.runtime.faults, each detected on its slots with
  ``via=host_tier``, no violation on a slot no injection touched;
* ``hicache-race`` (log) and ``hicache-race-fixed`` (log, PR 36738's fence patched in, test-only): sglang 0.5.12's
  load-back H2D copy is not ordered after a forward still in flight for a request that just finished and freed
  the slots the load reuses; a late write would corrupt a restored prefix. Whatever the race phase finds, the
  fixed one must find nothing.

Nothing here imports sglang or kvcanary at module level (the driver's rule); the fence is applied in sglang's
processes by a test-only plugin (integration/driver_plugin.py). The driver side (the worker's plugin environment,
the phase rows, the dry run) imports the driver core (integration/e2e_core.py) and driver_plugin.py inside its
functions: sglang's processes load this file alone.
"""

from __future__ import annotations

import collections
import json
import random
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: sglang's processes load this file alone)
    from e2e_core import Phase

# The host-tier fault classes and their reasons: HOST_TIER_FAULTS, HOST_TIER_REASONS of integration/e2e_core.py.
VIA_HOST_TIER = "host_tier"
MIN_LOADED = 5000  # slots a clean phase must load back (issue 24's acceptance)
MIN_INJECTIONS = 5  # per host-tier class in the fault phase
HOST_TIER_RE = re.compile(r"kvcanary stats: [^\n]*? host_backed_up=(?P<backed_up>\d+) host_loaded=(?P<loaded>\d+)")

FENCE_ENV = "E2E_HICACHE_FENCE"  # "fix": the test-only plugin applies PR 36738's fence in sglang's processes
FENCE_DRIVER_ENV = "E2E_HICACHE_PHASES_FILE"
FENCE_PLUGIN = "kvcanary_e2e_hicache_fence"

# Engine arguments of every HiCache phase (a device pool of DEVICE_TOKENS; the host tier 6 times as large).
DEVICE_TOKENS = 6144
HICACHE_ENGINE: tuple[tuple[str, object], ...] = (
    ("enable_hierarchical_cache", True), ("hicache_ratio", 6.0), ("max_running_requests", 48),
)


def hicache_workload(seed: int = 0, *, conversations: int = 48, rounds: int = 8, batch: int = 48,
                     vocab: int = 2048) -> list[tuple[list[int], int]]:
    """``(input_ids, max_new_tokens)`` of a multi-turn workload, in send order, in groups of ``batch``.

    Each conversation opens with 200-500 tokens of its own and adds 30-120 tokens each round; round ``r`` of a
    conversation repeats its round ``r-1`` prompt as the prefix (a radix hit once that prompt is cached). Groups mix
    conversations at different rounds (a conversation's round r sits in group r + its offset), outputs of 4 to 40
    tokens end at different times, so requests finish and free slots while other requests' prefixes are being
    loaded back: the conditions of PR 36738's race. 48 conversations of up to ~1100 tokens, 41k tokens in all, are
    ~7x the device pool.
    """
    rng = random.Random(seed + 24)
    prompts = []
    for _ in range(conversations):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(200, 500))]
        turns = []
        for _ in range(rounds):
            turns.append(list(ids))
            ids = ids + [rng.randrange(3, vocab) for _ in range(rng.randint(30, 120))]
        prompts.append(turns)
    offsets = [c % 3 for c in range(conversations)]
    slots: dict[int, list[tuple[list[int], int]]] = collections.defaultdict(list)
    for c, turns in enumerate(prompts):
        for r, ids in enumerate(turns):
            slots[r + offsets[c]].append((ids, rng.randint(4, 40)))
    ordered = [req for g in sorted(slots) for req in rng.sample(slots[g], len(slots[g]))]
    return [ordered[i : i + batch] for i in range(0, len(ordered), batch)]


def host_tier_counts(log_text: str) -> tuple[int, int] | None:
    """(slots backed up, slots loaded back) from the last kvcanary stats line that has them (one rank: the
    counts are cumulative), or None when no line has them."""
    last = None
    for m in HOST_TIER_RE.finditer(log_text):
        last = (int(m["backed_up"]), int(m["loaded"]))
    return last


def outputs_digest(outputs: list[list[int]] | None) -> str | None:
    if outputs is None:
        return None
    import hashlib

    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def verdict(kind: str, s: dict, off_outputs: list | None, match=None) -> list[str]:
    """Why a HiCache phase fails (empty: PASS). ``kind``: off, clean, faults, race, race-fixed."""
    why = []
    if s["status"] not in ("OK",):
        why.append(f"status {s['status']}")
    if s["requests_ok"] != s["requests_sent"] or not s["requests_sent"]:
        why.append(f"{s['requests_ok']}/{s['requests_sent']} requests completed")
    if kind == "off":
        return why
    if s.get("host_loaded") is None:
        why.append("no host_loaded in kvcanary's stats line (HiCache not followed?)")
    elif kind in ("clean", "race-fixed") and s["host_loaded"] < MIN_LOADED:
        why.append(f"host_loaded {s['host_loaded']} < {MIN_LOADED}")
    for k in ("lost", "health_errors", "kvcanary_errors"):
        if s.get(k):
            why.append(f"{k}={s[k]}")
    if kind in ("clean", "race-fixed") and s["violations"]:
        why.append(f"violations={s['violations']}")
    if kind == "clean":
        if off_outputs is None:
            why.append("no outputs of hicache-off to compare with")
        elif s.get("outputs_digest") != outputs_digest(off_outputs):
            why.append(f"greedy outputs differ from hicache-off in {s.get('outputs_differ', '?')} requests")
    if kind == "faults" and match is not None:
        from e2e_core import HOST_TIER_FAULTS, fault_class_gaps  # (driver side only: sglang loads this file alone)

        why += fault_class_gaps(match, HOST_TIER_FAULTS, MIN_INJECTIONS)
        if s.get("violations_not_via_host_tier"):
            why.append(f"{s['violations_not_via_host_tier']} violation(s) without via=host_tier")
    return why


def render_faults(rows: list[dict]) -> list[str]:
    """The fault phase's host-tier classes (injections, detected, latency) and the race phases' violations."""
    from e2e_core import HOST_TIER_FAULTS  # (driver side only: sglang's processes load this file alone)

    lines: list[str] = []
    for row in rows:
        f = row.get("faults")
        if f:
            lines += ["", "| host-tier fault class | injections | detected | latency (steps) |", "|---|---|---|---|"]
            for c in HOST_TIER_FAULTS:
                lat = f["latency"].get(c) or []
                lines.append(f"| {c} | {f['injections'].get(c, 0)} | {f['detected'].get(c, 0)} | "
                             f"{f'{min(lat)}..{max(lat)}' if lat else '-'} |")
            lines.append(f"| violations on untouched slots | {f['unexplained']} | | |")
        for v in row.get("violation_examples") or []:
            if row["phase"].split()[1].startswith("hicache-race"):
                lines.append(f"- {row['phase']}: step={v.get('step')} slot={v.get('slot')} "
                             f"position={v.get('position')} reasons={'+'.join(v.get('reasons', []))} "
                             f"via={v.get('via')}")
    return lines


def render(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["", "| HiCache phase | write policy | requests ok/sent | radix cached tok | forwards | entries verified | "
               "slots backed up | slots loaded back | violations (via host tier) | outputs = off | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        loaded = r.get("host_loaded")
        out.append(f"| {r['phase']} | {r.get('write_policy', '-')} | {r['requests_ok']}/{r['requests_sent']} | "
                   f"{r['cached_tokens']} | {r['forwards'] if r['forwards'] is not None else '-'} | "
                   f"{r['entries_verified'] if r['entries_verified'] is not None else '-'} | "
                   f"{r.get('host_backed_up', '-')} | {'-' if loaded is None else loaded} | "
                   f"{r['violations']} ({r.get('violations_via_host_tier', 0)}) | {r.get('outputs_equal', '-')} | "
                   f"{r.get('verdict', '-')} |")
    return out


# ------------------------------------------------------------------------------------------- PR 36738's fence
def install_hicache_fence(value: str) -> None:
    """Test-only, in every sglang process (the plugin calls it when FENCE_ENV is set): PR 36738's fix on 0.5.12.
    ``HiCacheController.start_loading`` makes its load stream wait for the overlap scheduler's forward stream before
    the load's copies, so a forward still writing slots that a load-back reuses finishes first."""
    if value != "fix":
        return
    import sglang.srt.managers.cache_controller as cc
    import sglang.srt.managers.scheduler as sched

    if getattr(cc.HiCacheController.start_loading, "_e2e_fenced", False):
        return
    start_loading = cc.HiCacheController.start_loading
    init_cache = sched.Scheduler.init_cache_with_memory_pool

    def fenced_start_loading(self):
        stream = getattr(self, "_e2e_fence_stream", None)
        if stream is not None and self.load_queue:
            self.load_stream.wait_stream(stream)
        return start_loading(self)

    def init_cache_with_fence(self, *args, **kwargs):
        out = init_cache(self, *args, **kwargs)
        controller = getattr(getattr(self, "tree_cache", None), "cache_controller", None)
        if controller is not None and getattr(self, "enable_overlap", False):
            controller._e2e_fence_stream = self.forward_stream
            print("[e2e-hicache] PR 36738 fence: load stream waits for the forward stream", flush=True)
        return out

    fenced_start_loading._e2e_fenced = True  # type: ignore[attr-defined]
    cc.HiCacheController.start_loading = fenced_start_loading
    sched.Scheduler.init_cache_with_memory_pool = init_cache_with_fence


# ------------------------------------------------------------------------------------------ driver side
# sglang_e2e.HICACHE_PHASES' keys: what each phase is judged as (``verdict``'s kind)
HICACHE_KIND = {"9": "off", "10": "clean", "11": "clean", "12": "faults", "13": "race", "14": "race-fixed"}


def hicache_env(env: dict, phase: Phase, pdir: str) -> dict:
    """A phase with the PR 36738 fence: the test-only plugin on PYTHONPATH, and where it finds hicache_phases.py."""
    import os

    from driver_plugin import with_test_plugin  # (driver side only: sglang's processes load this file alone)

    if dict(phase.env).get(FENCE_ENV) is None:
        return env
    return with_test_plugin(env, os.path.join(pdir, "fence-plugin"), FENCE_PLUGIN,
                            about="integration/hicache_phases.py, PR 36738's fence", gate_env=FENCE_ENV,
                            file_env=FENCE_DRIVER_ENV, module="_kvcanary_e2e_hicache",
                            function="install_hicache_fence", driver_file=__file__)


def summarize_hicache(phase: Phase, pdir: str, res: dict, results: dict) -> dict:
    """A HiCache phase's row: the clean-phase counts plus the host tier's (kvcanary's stats line), the outputs
    against hicache-off's, the fault match, and the verdict."""
    import glob
    import os

    from e2e_core import VIOLATION_SCHEMA, match_injections, read_jsonl, read_text, summarize_phase

    log_text = read_text(os.path.join(pdir, "worker.log"))
    rows = read_jsonl(sorted(glob.glob(os.path.join(pdir, "kvc-*.jsonl"))))
    s = summarize_phase(phase, res, log_text, rows)
    counts = host_tier_counts(log_text)
    if counts is not None:
        s["host_backed_up"], s["host_loaded"] = counts
    else:
        s["host_loaded"] = None
    s["write_policy"] = dict(phase.engine).get("hicache_write_policy")
    vio = [r for r in rows if r.get("schema") == VIOLATION_SCHEMA]
    s["violations_via_host_tier"] = sum(r.get("via") == VIA_HOST_TIER for r in vio)
    s["violations_not_via_host_tier"] = len(vio) - s["violations_via_host_tier"]
    s["violation_examples"] = vio[:5]
    off = results.get("9", {}).get("outputs")
    mine = res.get("outputs")
    s["outputs_digest"] = outputs_digest(mine)
    if off is not None and mine is not None and phase.key != "9":
        differ = sum(a != b for a, b in zip(off, mine, strict=False)) + abs(len(off) - len(mine))
        s["outputs_differ"], s["outputs_equal"] = differ, "yes" if differ == 0 else f"no ({differ})"
    kind = HICACHE_KIND[phase.key]
    match = match_injections(rows) if kind == "faults" else None
    if match is not None:
        s["faults"] = {"injections": dict(match.injections), "detected": dict(match.detected),
                       "latency": {k: sorted(v) for k, v in match.latency.items()},
                       "unexplained": len(match.unexplained), "missed": match.missed}
    why = verdict(kind, s, off, match)
    s["verdict"], s["why"] = ("PASS" if not why else "FAIL"), why
    if kind == "race" and not why:  # a finding either way: what the race phase saw is reported, not judged
        s["verdict"] = "REPORTED"
    return s


def dry_run_hicache(phase: Phase, pdir: str, base: dict, rng: random.Random) -> dict:
    """A HiCache phase's worker output, synthesized: stats lines with the host tier's counts (none with kvcanary
    off), the same outputs in every phase, and in the fault phase injections each detected via the host tier."""
    import os

    from e2e_core import HOST_TIER_FAULTS, INJECTION_SCHEMA, VIOLATION_SCHEMA  # (driver side only)

    kind = HICACHE_KIND[phase.key]
    with open(os.path.join(pdir, "worker.log"), "w") as f:
        f.write("[dry-run]\n")
        if kind != "off":
            f.write("kvcanary stats: step=900 forwards=900 tokens_written=200000 entries_verified=2500000 "
                    "entries_swept=90000 violations=0 lost=0 host_backed_up=31000 host_loaded=24000\n")
    if kind == "faults":
        with open(os.path.join(pdir, "kvc-0.jsonl"), "w") as f:
            step = 20
            for c in HOST_TIER_FAULTS * 8:
                slots = [rng.randrange(1, 6000) for _ in range(2)]
                f.write(json.dumps({"schema": INJECTION_SCHEMA, "fault": c, "step": step, "slots": slots,
                                    "detail": "dry-run", "rank": {"tp_rank": 0}}) + "\n")
                f.write(json.dumps({"schema": VIOLATION_SCHEMA, "step": step + 1, "tag": "verify",
                                    "reasons": ["verify_real_kv_hash"], "slot": slots[0], "via": "host_tier",
                                    "rank": {"tp_rank": 0}}) + "\n")
                step += 6
    n = base["requests_sent"]
    return dict(base, outputs=[[7] * 4 for _ in range(n)])
