"""The HiCache phases of integration/sglang_e2e.py (sglang's host-memory KV tier, issue 24): their workload, what a
phase's run folder says, the verdicts, the summary table, and the test-only PR 36738 fence.

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
processes by a test-only plugin (integration/driver_plugin.py).
"""

from __future__ import annotations

import collections
import json
import random
import re

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
        from e2e_core import HOST_TIER_FAULTS  # (driver side only: sglang's processes load this file alone)

        for c in HOST_TIER_FAULTS:
            n, d = match.injections.get(c, 0), match.detected.get(c, 0)
            if n < MIN_INJECTIONS:
                why.append(f"{c}: {n} injections < {MIN_INJECTIONS}")
            if d != n:
                why.append(f"{c}: {d}/{n} detected")
        if match.unexplained:
            why.append(f"{len(match.unexplained)} violation(s) on slots no injection touched")
        if s.get("violations_not_via_host_tier"):
            why.append(f"{s['violations_not_via_host_tier']} violation(s) without via=host_tier")
    return why


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
