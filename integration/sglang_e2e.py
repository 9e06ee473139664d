#!/usr/bin/env python3
"""kvcanary inside the real sglang 0.5.12 offline Engine: clean soak, injected faults, overhead (one command).

    python integration/sglang_e2e.py                       # all phases, tiny dummy-weight Llama, ./sglang_e2e_out
    python integration/sglang_e2e.py --phases 1,3 --budget 300 --out /tmp/e2e
    python integration/sglang_e2e.py --dry-run             # no sglang, no GPU: workload + report parsing + table

Needs sglang 0.5.12 with a CUDA GPU and kvcanary installed (its ``sglang.srt.plugins`` entry point). This driver
never imports kvcanary: the plugin comes in through the entry point and is configured per phase through
``KVCANARY_*`` variables only, exactly as a user gets it. Each phase runs in its own subprocess with a fresh
Engine (``--worker``), then the parent reads kvcanary's JSONL report(s) and the Engine log and prints one
summary (also written to ``<out>/summary.md`` and ``<out>/summary.json``).

Phases (``--phases``, default ``1,2,3,4``):

1. ``clean``: ``KVCANARY_MODE=raise``, no CUDA graph, token check and sweep on, a KV pool so tight (and the
   scheduler so optimistic) that the prefix cache evicts, slots are reused and decode retracts requests.
2. ``graph``: the same with decode CUDA graphs (batch sizes up to 64).
3. ``faults``: ``KVCANARY_MODE=log`` with decode graphs, every fault class of SPEC §7 that a live engine can
   take injected through ``KVCANARY_FAULT*`` (req_to_token redirect, real-KV flip on a live slot,
   cached-but-idle corruption caught by the sweep, token swap, position skew), one every few forwards;
   kvcanary writes each injection to the report (``kvcanary.injection/1``) and the driver matches the
   violations to them by slot and step window.
4. ``overhead``: the same workload with the plugin off and with ``log`` + PARTIAL real-KV, Engines started in
   turn in one subprocess (``--overhead-split``: one each): off, log, off, log (``--overhead-rounds``, default 2).
   Decode CUDA graphs on; ``--overhead-eager`` runs every forward eagerly (``disable_cuda_graph``).
   Each Engine first runs 3 groups of a differently seeded workload, unmeasured; the first pair also absorbs what
   a fresh machine compiles on first use. The ratio is the last pair's (tokens/s and wall time per forward); the
   earlier pairs' ratios are shown beside it. ``--overhead-arms A,B`` (default ``off,log``) compares two other
   arms the same way, e.g. ``log,protect``: A is the baseline, B/A the ratio (arms: off, log, raise, protect,
   protect-hold = protect with ``KVCANARY_PROTECT_HOLD=1`` for that Engine only); see integration/overhead_phases.py.

5-8. EAGLE speculative decoding (topk 1, chunked prefill of 64): ``eagle-bug`` (sglang 0.5.12 as shipped: kvcanary's
   draft pool reports every wrong chunk tail of sglang issue 26329, matched to the tails a test-only plugin prints),
   ``eagle-fixed`` (upstream's fix patched in by that plugin: nothing reported), ``eagle-soak`` (raise, 320
   requests) and ``eagle-faults`` (faults into the target pool); see integration/eagle_phases.py.

15-16. EAGLE after retraction (sglang PR 28254, open upstream): ``eagle-retract`` (temperature 1.0, a KV pool small
   enough that decode retracts requests, PR 26800's fix patched in so that only the resumed requests' output-region
   chunk tails stay wrong: kvcanary's draft pool reports each) and ``eagle-retract-fixed`` (both fixes: nothing).

Time: ``--budget`` (default 570 s) caps the whole run; a phase gets at most what is left (and its own cap);
a phase that cannot start in time is reported SKIPPED, a worker near its deadline stops sending requests and
reports what it finished (TRUNCATED).

Prefill graphs: by default the Engines run with ``disable_piecewise_cuda_graph=True`` (eager prefill, the setup
of the first H200 runs). ``--piecewise`` leaves sglang 0.5.12's default instead: piecewise CUDA graphs serve
the prefill forwards (kvcanary runs its launches around each replay); each phase then also needs kvcanary's
``kvcanary host time:`` lines to show prefill forwards served by the piecewise runner, and the overhead phase
runs 3 off/log pairs (median and range of their ratios); integration/overhead_phases.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eagle_phases  # noqa: E402  (integration/eagle_phases.py: the EAGLE phases 5-8, 15-16)
import hicache_phases  # noqa: E402  (integration/hicache_phases.py: the HiCache phases 9-14)
import hunt_phases  # noqa: E402  (integration/hunt_phases.py: the hunt phases 17-20, issue 27)
import loop_probe  # noqa: E402  (integration/loop_probe.py: --loop-probe)
import pool_phases  # noqa: E402  (integration/pool_phases.py: phases 24-30, issues 29/30)
import protect_phases  # noqa: E402  (integration/protect_phases.py: the protect phases 21-23, issue 26)
from e2e_core import (  # noqa: E402  (integration/e2e_core.py: what every phase family reads and judges alike)
    COMMON_ENV,
    E2E_FAULTS,
    ENDED_GRACE,
    EXPECTED_REASONS,
    HOST_TIER_FAULTS,
    INJECTION_SCHEMA,
    VIOLATION_SCHEMA,
    Phase,
    Request,
    fmt,
    make_workload,
    match_injections,
    read_jsonl,
    read_text,
    summarize_phase,
    verdict_clean,
    verdict_faults,
    workload_stats,
)
from overhead_phases import (  # noqa: E402  (integration/overhead_phases.py: phase 4 and --piecewise)
    DEFAULT_OVERHEAD_ARMS,
    MEASURED_MARKER,
    OVERHEAD_ARMS,
    PIECEWISE_OVERHEAD_ROUNDS,
    dry_run_overhead,
    dry_run_piecewise_log,
    overhead_arms_in,
    overhead_engine_env,
    overhead_engine_marker,
    overhead_pairs,
    overhead_rows,
    overhead_subs,
    parse_overhead_arms,
    phase_limits,
    piecewise_engine_kwargs,
    piecewise_start_allowance,
    render_overhead,
    render_piecewise,
    verdict_piecewise,
)

# ---------------------------------------------------------------------------------------------------- facts
KVCANARY_KEEP = ("KVCANARY_CUDA_ARCH", "KVCANARY_CACHE_DIR", "KVCANARY_SANITIZE")  # build settings pass through

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


# ---------------------------------------------------------------------------------------------------- phases
PHASES: dict[str, Phase] = {
    # Eager decode is the slowest phase (~10k forwards): a pool of 8192 keeps ~10 requests decoding at once, and an
    # optimistic scheduler (it expects 5 % of max_new_tokens) over-admits so that decode must retract.
    "1": Phase("1", "clean", "raise", False, 8192, 280, 120, COMMON_ENV,
               (("schedule_conservativeness", 0.05),), max_new=(16, 192)),
    "2": Phase("2", "graph", "raise", True, 12288, 150, 70, COMMON_ENV),
    # Sweep every 3 forwards so that a cached-idle corruption (injected only before a sweeping forward) always
    # finds one before the next fault falls due (every 4).
    "3": Phase("3", "faults", "log", True, 12288, 260, 70, COMMON_ENV + (
        ("KVCANARY_SWEEP_INTERVAL", "3"), ("KVCANARY_FAULT", ",".join(E2E_FAULTS)), ("KVCANARY_FAULT_EVERY", "4"),
        ("KVCANARY_FAULT_WARMUP", "10"), ("KVCANARY_FAULT_SEED", "5"))),
    # Stats and host-time lines every 100 forwards (the default is 1000): at 20, as before 2026-11-30, the two
    # INFO lines cost the log Engine ~10 µs per forward (the loop probe's account_forward + stats), which a user
    # does not pay; the measured workload's forward count is read to within 100 (of ~2200).
    "4": Phase("4", "overhead", "log", True, 12288, 300, 100, (("KVCANARY_STATS_EVERY", "100"),
                                                               ("KVCANARY_REAL_KV", "partial"))),
}
PHASE_NAMES = {p.name: k for k, p in PHASES.items()}
OVERHEAD_WITH_GRAPHS = PHASES["4"]  # --overhead-eager runs phase 4 with graphs=False


def parse_phases(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        key = PHASE_NAMES.get(part, part)
        if key not in PHASES:
            raise SystemExit(f"--phases: unknown phase {part!r}; expected 1-{len(PHASES)} or {', '.join(PHASE_NAMES)}")
        if key not in out:
            out.append(key)
    return out


# ---------------------------------------------------------------------------------------------------- workload
def phase_workload(spec: dict) -> list[list[Request]]:
    """The workload a worker runs: the phase's own for EAGLE phases, else ``make_workload``."""
    kind = spec.get("workload", "mixed")
    if kind == "hicache":
        return [[Request(ids, new, -1) for ids, new in group]
                for group in hicache_phases.hicache_workload(spec["seed"])]
    if kind.startswith("hunt-"):
        return []  # hunt_phases.run_workload sends its own schedule
    if kind.startswith("eagle"):
        return eagle_phases.make_eagle_workload(kind, seed=spec["seed"], max_new=tuple(spec["max_new"]))
    return make_workload(spec["requests"], seed=spec["seed"], max_new=tuple(spec["max_new"]))


# ---------------------------------------------------------------------------------------------------- summary
def _host_cell(host: dict | None) -> str:
    """The summary table's canary host µs per forward, with the batch hook's share when the line has it."""
    if not host:
        return "-"
    cell = fmt(host.get("canary_us"))
    parts = [f"{name} {fmt(host[key])}" for key, name in (("batch_init_us", "batch-init"), ("sweep_us", "sweep"))
             if key in host]
    if "sweep_walks" in host:  # of how many sweeps, how many walked the cache and how many compacted the plan
        parts.append(f"{host['sweeps']} sweeps: {host['sweep_walks']} walked, {host['sweep_compactions']} compacted")
    if "sweep_event_us" in host:  # the sweep source following the cache's changes, inside sglang's tree operations
        parts.append(f"tree events {fmt(host['sweep_event_us'])}")
    return f"{cell} ({', '.join(parts)})" if parts else cell


def render(summary: dict) -> str:
    """The one summary table (markdown) plus the fault and overhead tables."""
    lines = ["## kvcanary in sglang 0.5.12: end-to-end summary", ""]
    env = summary.get("env") or {}
    if env:
        lines.append("- " + "; ".join(f"{k}: {v}" for k, v in env.items()))
    lines.append(f"- workload: {json.dumps(summary.get('workload', {}))}")
    lines.append(f"- total {summary.get('total_s', 0):.0f} s of budget {summary.get('budget_s')} s")
    lines.append("")
    lines.append("| phase | status | start s | requests ok/sent | radix cached tok | retractions | forwards | "
                 "entries verified | entries swept | violations | lost | health err | injections | tok/s | "
                 "canary host µs/fwd | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary["phases"]:
        lines.append(
            f"| {s['phase']} | {s['status']} | {fmt(s['engine_start_s'])} | {s['requests_ok']}/{s['requests_sent']} | "
            f"{s['cached_tokens']} | {s['retractions']} | {fmt(s['forwards'])} | {fmt(s['entries_verified'])} | "
            f"{fmt(s['entries_swept'])} | {s['violations']} | {s['lost']} | {s['health_errors']} | "
            f"{s['injections']} | "
            f"{fmt(s['tokens_per_s'])} | {_host_cell(s.get('host'))} | {s.get('verdict', '-')} |"
        )
    for s in summary["phases"]:
        for kind, tally in sorted((s.get("pool_switches") or {}).items()):
            lines.append(f"- phase {s['phase']}: test-only switch `{kind}`: "
                         + " ".join(f"{k}={v}" for k, v in sorted(tally.items())))
    faults = summary.get("faults")
    if faults:
        lines += ["", "| fault class | injections | detected | rate | reasons (matched violations) | tags | "
                      "latency (steps) |", "|---|---|---|---|---|---|---|"]
        for c in E2E_FAULTS:
            n, d = faults["injections"].get(c, 0), faults["detected"].get(c, 0)
            rate = f"{100.0 * d / n:.0f} %" if n else "-"
            reasons = ", ".join(f"{k}×{v}" for k, v in sorted(faults["reasons"].get(c, {}).items())) or "-"
            tags = ", ".join(f"{k}×{v}" for k, v in sorted(faults["tags"].get(c, {}).items())) or "-"
            lat = faults["latency"].get(c) or []
            lat_s = f"{min(lat)}..{max(lat)}" if lat else "-"
            lines.append(f"| {c} | {n} | {d} | {rate} | {reasons} | {tags} | {lat_s} |")
        lines.append(f"| violations on untouched slots | {faults['unexplained']} | | | | | |")
        lines.append(f"| late violations on touched slots (outside window) | {faults['late']} | | | | | |")
        if faults.get("ended"):
            lines.append(f"| set apart: injected in the run's last {ENDED_GRACE} forwards, not read before it ended | "
                         + ", ".join(f"{c}@{st}" for c, st in faults["ended"]) + " | | | | | |")
        if faults.get("echoes"):
            lines.append(f"| the window group's (`group=swa`) lines of those detections (same step, row, position) | "
                         f"{faults['echoes']} | | | | | |")
        if faults.get("missed"):
            lines.append("")
            lines.append("missed injections: " + "; ".join(
                f"{i['fault']}@{i['step']} slots={i['slots']} ({i['detail']})" for i in faults["missed"][:5]))
        if faults.get("unexplained_examples"):
            lines.append("unexplained: " + "; ".join(
                f"step={v['step']} tag={v.get('tag')} reasons={'+'.join(v['reasons'])} slot={v['slot']}"
                for v in faults["unexplained_examples"][:5]))
    ov = summary.get("overhead")
    lines += render_overhead(ov)
    lines += eagle_phases.render_eagle(summary.get("eagle") or [])
    lines += hicache_phases.render(summary.get("hicache") or [])
    lines += hunt_phases.render(summary.get("hunt") or [])
    lines += pool_phases.render(summary.get("pool") or [])
    lines += protect_phases.render(summary.get("protect") or [], E2E_FAULTS)
    lines += hicache_phases.render_faults(summary.get("hicache") or [])
    lines += render_piecewise(summary)
    lines += loop_probe.render([tuple(r) for r in (ov or {}).get("probe") or []])
    notes = [f"{s['phase']}: {w}" for s in summary["phases"] for w in s.get("why", [])]
    if notes:
        lines += ["", "notes: " + "; ".join(notes)]
    lines += ["", f"RESULT: {'PASS' if summary.get('pass') else 'FAIL'}"]
    return "\n".join(lines)


def build_summary(out: str, phases: list[str], results: dict, budget: float, total_s: float,
                  workload: dict, env: dict | None = None, overhead_arms: tuple[str, str] | None = None) -> dict:
    """The summary of a run from the workers' results and the phase folders. ``overhead_arms``: phase 4's
    (baseline, measured) arms (``--overhead-arms``; None: read from the results' keys, e.g. ``--summarize``)."""
    summary = {"phases": [], "budget_s": budget, "total_s": total_s, "workload": workload, "env": env or {}}
    ok_all = True
    for key in phases:
        phase = PHASES[key]
        pdir = os.path.join(out, f"phase{key}-{phase.name}")
        if key == "4":
            arms = overhead_arms or overhead_arms_in(results)
            summary["phases"] += overhead_rows(phase, pdir, results, summary, arms)
            ok_all &= summary.get("overhead", {}).get("ratio") is not None
            ok_all &= overhead_pairs(summary, pdir, results)
            continue
        res = results.get(key, {"status": "SKIPPED"})
        if key in POOL_PHASES:
            s = pool_phases.summarize_pool(phase, pdir, res, results)
            summary.setdefault("pool", []).append(s)
            ok_all &= s["verdict"] in ("PASS",) + HUNT_OK
            summary["phases"].append(s)
            continue
        if key in PROTECT_PHASES:
            s = protect_phases.summarize_protect(phase, pdir, res, results)
            summary.setdefault("protect", []).append(s)
            ok_all &= s["verdict"] == "PASS"
            summary["phases"].append(s)
            continue
        if key in HUNT_PHASES:
            s = hunt_phases.summarize_hunt(phase, pdir, res)
            summary.setdefault("hunt", []).append(s)
            ok_all &= s["verdict"] in HUNT_OK
            summary["phases"].append(s)
            continue
        if key in HICACHE_PHASES:
            s = hicache_phases.summarize_hicache(phase, pdir, res, results)
            summary.setdefault("hicache", []).append(s)
            ok_all &= s["verdict"] in ("PASS", "REPORTED")
            summary["phases"].append(s)
            continue
        if key in EAGLE_PHASES or key in EAGLE_RETRACT_PHASES:
            s, detail = eagle_phases.summarize_eagle(phase, pdir, res, seed=res.get("seed", 0))
            summary.setdefault("eagle", []).append(detail)
            ok_all &= s["verdict"] == "PASS"
            summary["phases"].append(s)
            continue
        log_text = read_text(os.path.join(pdir, "worker.log"))
        rows = read_jsonl(sorted(glob.glob(os.path.join(pdir, "kvc-*.jsonl"))))
        s = summarize_phase(phase, res, log_text, rows)
        if key == "3":
            m = match_injections(rows)
            ok, why = verdict_faults(s, m, classes=fault_classes((env or {}).get("kvcanary-env", "")))
            summary["faults"] = {
                "injections": dict(m.injections), "detected": dict(m.detected),
                "reasons": {k: dict(v) for k, v in m.reasons.items()}, "tags": {k: dict(v) for k, v in m.tags.items()},
                "latency": {k: sorted(v) for k, v in m.latency.items()}, "unexplained": len(m.unexplained),
                "unexplained_examples": m.unexplained[:10], "late": m.late, "missed": m.missed,
                "ended": [(i["fault"], i["step"]) for i in m.ended], "echoes": m.echoes,
            }
        else:
            ok, why = verdict_clean(s)
            if key == "1" and not s["retractions"] and s["status"] == "OK":
                ok, why = False, why + ["no decode retraction happened (tighten max_total_tokens)"]
        pw_why = verdict_piecewise(s)
        ok, why = ok and not pw_why, why + pw_why
        s["verdict"], s["why"] = ("PASS" if ok else "FAIL"), why
        ok_all &= ok
        summary["phases"].append(s)
    summary["pass"] = bool(ok_all and summary["phases"])
    return summary


# ---------------------------------------------------------------------------------------------------- EAGLE
# integration/eagle_phases.py: speculative decoding, EAGLE with one draft per step (topk 1) and a one-layer dummy
# draft; sglang issue 26329's chunk tails (5-8) and PR 28254's after retraction (15-16), each seen against the tails
# a test-only plugin prints.
_EA = eagle_phases
# Engine arguments of every EAGLE phase (sglang 0.5.12 clamps num_draft_tokens to num_steps + 1 for topk 1).
EAGLE_ENGINE: tuple[tuple[str, object], ...] = (
    ("speculative_algorithm", "EAGLE"), ("speculative_num_steps", 2), ("speculative_eagle_topk", 1),
    ("speculative_num_draft_tokens", 3), ("chunked_prefill_size", _EA.EAGLE_CHUNK), ("max_running_requests", 32),
)
# Caps of 190 s: a warm machine needs ~150 s per phase (Engine start ~80 s with three sets of CUDA graphs), the first
# Engine on a fresh machine also sglang's and kvcanary's first-use builds.
EAGLE_PHASES: dict[str, Phase] = {
    # sglang 0.5.12 as shipped (the observer changes nothing): violations in the draft pool at every wrong chunk
    # tail, none in the target pool.
    "5": Phase("5", "eagle-bug", "log", True, 12288, 190, 110,
               COMMON_ENV + ((_EA.EAGLE_TAIL_ENV, "observe"),), EAGLE_ENGINE + (("cuda_graph_max_bs", 16),),
               max_new=(16, 32), workload="eagle-chunked"),
    # The same workload with the upstream fix patched in: nothing to report.
    "6": Phase("6", "eagle-fixed", "log", True, 12288, 190, 110,
               COMMON_ENV + ((_EA.EAGLE_TAIL_ENV, "fix"),), EAGLE_ENGINE + (("cuda_graph_max_bs", 16),),
               max_new=(16, 32), workload="eagle-chunked"),
    # Clean soak in raise mode: 320 requests, shared prefixes and exact repeats (radix hits), chunked prefill.
    "7": Phase("7", "eagle-soak", "raise", True, 12288, 190, 110,
               COMMON_ENV + ((_EA.EAGLE_TAIL_ENV, "fix"),), EAGLE_ENGINE + (("cuda_graph_max_bs", 32),),
               max_new=(8, 32), workload="eagle-soak"),
    # Faults into the target pool (the draft pool must stay clean), matched like phase 3.
    "8": Phase("8", "eagle-faults", "log", True, 12288, 190, 110, COMMON_ENV + (
        ("KVCANARY_SWEEP_INTERVAL", "3"), ("KVCANARY_FAULT", ",".join(_EA.EAGLE_FAULTS)), ("KVCANARY_FAULT_EVERY", "4"),
        ("KVCANARY_FAULT_WARMUP", "10"), ("KVCANARY_FAULT_SEED", "5"), (_EA.EAGLE_TAIL_ENV, "fix")),
        EAGLE_ENGINE + (("cuda_graph_max_bs", 32),), max_new=(8, 24), workload="eagle-faults"),
}
# sglang PR 28254 (open upstream; the code is unchanged in 0.5.23): a request retracted under KV pressure is
# re-prefilled from ``origin_input_ids + output_ids`` in chunks; PR 26800's correction indexes ``origin_input_ids``
# only, so a chunk tail in the output region still feeds the draft the freshly sampled token. Greedy re-sampling
# reproduces the request's own token there (invisible); at temperature 1.0 it does not. A pool of 3,072 tokens and
# an optimistic scheduler (it expects 5 % of max_new_tokens) admit 16 requests of up to 440 tokens each at once, so
# decode retracts. The Engine's random_seed (0) seeds the sampling; no per-request sampling_seed: with one, sglang
# samples as a function of (seed, position), which is not what a user's temperature-1.0 request gets.
EAGLE_RETRACT_ENGINE = EAGLE_ENGINE + (("cuda_graph_max_bs", 32), ("schedule_conservativeness", 0.05))
# A wrong draft slot stays in its request's context: every later draft forward of that request finds it again, one
# violation row each (2026-12-02 H200: 4,409 rows on 28 slots, and 1,643 more the default ring of 1,024 rows could
# not keep, as the ring is emptied only at a forward that adds no row). A ring of 65,536 rows keeps them all, so
# every row can be matched against a wrong tail.
EAGLE_RETRACT_ENV = COMMON_ENV  # (the default ring keeps every row since 802b3cc: 6,052 rows, 0 lost on the H200)
EAGLE_RETRACT_PHASES: dict[str, Phase] = {
    # PR 26800's fix only (fix_prompt): draft-pool verify_token at exactly the wrong output-region tails.
    "15": Phase("15", "eagle-retract", "log", True, 3072, 190, 110,
                EAGLE_RETRACT_ENV + ((_EA.EAGLE_TAIL_ENV, "fix_prompt"),), EAGLE_RETRACT_ENGINE, max_new=(200, 320),
                workload="eagle-retract", temperature=1.0),
    # PR 26800's and PR 28254's fixes (fix): the same workload, nothing to report.
    "16": Phase("16", "eagle-retract-fixed", "log", True, 3072, 190, 110,
                EAGLE_RETRACT_ENV + ((_EA.EAGLE_TAIL_ENV, "fix"),), EAGLE_RETRACT_ENGINE, max_new=(200, 320),
                workload="eagle-retract", temperature=1.0),
}
PHASES.update(EAGLE_PHASES)
PHASE_NAMES.update({p.name: k for k, p in EAGLE_PHASES.items()})
PHASES.update(EAGLE_RETRACT_PHASES)
PHASE_NAMES.update({p.name: k for k, p in EAGLE_RETRACT_PHASES.items()})

# ---------------------------------------------------------------------------------------------------- HiCache
# integration/hicache_phases.py: sglang's host KV tier with a device pool ~7x smaller than the workload's prefixes.
# Engines start in ~30-55 s warm; the workload's 384 requests take ~20-60 s.
_HC = hicache_phases
_HC_ENV = COMMON_ENV + (("KVCANARY_STATS_EVERY", "50"),)


def _hicache_phase(key: str, name: str, mode: str, policy: str, env: tuple = ()) -> Phase:
    return Phase(key, name, mode, True, _HC.DEVICE_TOKENS, 170, 90, _HC_ENV + env,
                 _HC.HICACHE_ENGINE + (("hicache_write_policy", policy),), max_new=(4, 40), workload="hicache")


HICACHE_PHASES: dict[str, Phase] = {
    "9": _hicache_phase("9", "hicache-off", "off", "write_through"),
    "10": _hicache_phase("10", "hicache-clean", "raise", "write_through"),
    "11": _hicache_phase("11", "hicache-writeback", "raise", "write_back"),
    "12": _hicache_phase("12", "hicache-faults", "log", "write_through", (
        ("KVCANARY_FAULT", ",".join(HOST_TIER_FAULTS)), ("KVCANARY_FAULT_EVERY", "6"),
        ("KVCANARY_FAULT_WARMUP", "20"), ("KVCANARY_FAULT_SEED", "5"))),
    "13": _hicache_phase("13", "hicache-race", "log", "write_through"),
    "14": _hicache_phase("14", "hicache-race-fixed", "log", "write_through", ((_HC.FENCE_ENV, "fix"),)),
}
PHASES.update(HICACHE_PHASES)
PHASE_NAMES.update({p.name: k for k, p in HICACHE_PHASES.items()})


# ---------------------------------------------------------------------------------------------------- hunt
# integration/hunt_phases.py: kvcanary under the triggers of open upstream sglang bugs (issue 27, item 5).
_HU = hunt_phases


def _hunt_phase(key: str, kind: str, cap_s: int, min_s: int, env: tuple = ()) -> Phase:
    return Phase(key, f"hunt-{kind}", "log", True, _HU.HUNT_POOL[kind], cap_s, min_s,
                 COMMON_ENV + ((_HU.HUNT_ENV, kind),) + env, _HU.HUNT_ENGINE[kind], max_new=(8, 96),
                 workload=f"hunt-{kind}")


HUNT_PHASES: dict[str, Phase] = {
    "17": _hunt_phase("17", "overlap-cached", 110, 60),
    # the 26329 chunk-tail fix patched in (test-only): that known bug stays out of the hunt
    "18": _hunt_phase("18", "spec-abort", 150, 90, ((eagle_phases.EAGLE_TAIL_ENV, "fix"),)),
    "19": _hunt_phase("19", "determ-radix", 110, 60),
    "20": _hunt_phase("20", "hicache-hostfree", 150, 80),
}
PHASES.update(HUNT_PHASES)
PHASE_NAMES.update({p.name: k for k, p in HUNT_PHASES.items()})
HUNT_OK = ("CLEAN", "CAUGHT", "NOT TRIGGERED")  # a finding either way; FAIL and FALSE POSITIVE fail the run


# ---------------------------------------------------------------------------------------------------- protect
# integration/protect_phases.py: KVCANARY_MODE=protect under phase 3's faults (issue 26, GPU acceptance item 2).
# sglang's defaults (overlap scheduler, radix cache, decode graphs), phase 3's workload; ~80 s a phase warm.
_PR = protect_phases
_PROTECT_FAULT_ENV = tuple(kv for kv in PHASES["3"].env if kv[0] != "KVCANARY_MODE")  # phase 3's faults, cadence


def _protect_phase(key: str, name: str, env: tuple) -> Phase:
    return Phase(key, name, "protect", True, PHASES["3"].max_total_tokens, 140, 80, env, workload="protect")


PROTECT_PHASES: dict[str, Phase] = {
    _PR.CLEAN_KEY: _protect_phase(_PR.CLEAN_KEY, "protect-clean", COMMON_ENV),  # the reference outputs
    "22": _protect_phase("22", "protect", _PROTECT_FAULT_ENV),
    "23": _protect_phase("23", "protect-hold", _PROTECT_FAULT_ENV + (("KVCANARY_PROTECT_HOLD", "1"),)),
}
PHASES.update(PROTECT_PHASES)
PHASE_NAMES.update({p.name: k for k, p in PROTECT_PHASES.items()})


# ---------------------------------------------------------------------------------------------------- pool kinds
# integration/pool_phases.py (issues 29/30): greedy outputs with kvcanary off and on (24, 25), PR 35401's stale page
# tails (26: page 16, retraction) and PR 26380's SWA mapping race (27 observed, 28 with the fix patched in; run them
# with the SWA config).
# 24/25 serve one request at a time, first come first served: every forward's shapes, and so every kernel's result,
# then follow from the workload alone, not from how the scheduler batched it (H200 2026-12-02: under
# --enable-deterministic-inference the tiny gpt-oss and DeepSeek-V2 Engines sat after their first prefill until the
# phase cap, with and without kvcanary). What kvcanary could change is what a forward computes, which batching does
# not hide; run them with --requests 128 (one request at a time: ~30 s of serving).
_PP = pool_phases
_IDENT_ENGINE = (("max_running_requests", 1), ("schedule_policy", "fcfs"))
_RETRACT = (("schedule_conservativeness", 0.05),)
POOL_PHASES: dict[str, Phase] = {
    _PP.IDENT_OFF: Phase(_PP.IDENT_OFF, "ident-off", "off", True, 12288, 150, 70, COMMON_ENV, _IDENT_ENGINE),
    _PP.IDENT_ON: Phase(_PP.IDENT_ON, "ident-on", "raise", True, 12288, 150, 70, COMMON_ENV, _IDENT_ENGINE),
    "26": Phase("26", "hunt-page-tail", "log", True, 8192, 180, 80, COMMON_ENV + ((_PP.POOL_ENV, "page-tail"),),
                (("page_size", 16),) + _RETRACT, max_new=(16, 192)),
    "27": Phase("27", "hunt-swa-race", "log", True, 4096, 180, 80, COMMON_ENV + ((_PP.POOL_ENV, "swa-race"),),
                _RETRACT, max_new=(16, 192)),
    "28": Phase("28", "hunt-swa-race-fixed", "log", True, 4096, 180, 80,
                COMMON_ENV + ((_PP.POOL_ENV, "swa-race-fix"),), _RETRACT, max_new=(16, 192)),
    # phase 2's workload on the SWA config (no retraction: a retracted lock holder frees only past its protected
    # prefix, so the fix's left-allocated slots would then leak); 29 may be a machine's first gpt-oss Engine, whose
    # MoE kernels compile cold (phase 2 on a fresh machine, 2026-12-02: not serving within 150 s)
    "29": Phase("29", "hunt-swa-lock", "log", True, 12288, 290, 70, COMMON_ENV + ((_PP.POOL_ENV, "swa-lock"),)),
    "30": Phase("30", "hunt-swa-lock-fixed", "log", True, 12288, 200, 70,
                COMMON_ENV + ((_PP.POOL_ENV, "swa-lock-fix"),)),
}
PHASES.update(POOL_PHASES)
PHASE_NAMES.update({p.name: k for k, p in POOL_PHASES.items()})


def fault_classes(kvcanary_env: str) -> tuple[str, ...] | None:
    """The fault classes a ``--kvcanary-env KVCANARY_FAULT=...`` override chose (phase 3 then judges those), e.g.
    without cached_idle_corruption under a prefix cache kvcanary cannot sweep."""
    for item in kvcanary_env.split():
        key, _, value = item.partition("=")
        if key == "KVCANARY_FAULT":
            return tuple(c for c in value.split(",") if c)
    return None


# ---------------------------------------------------------------------------------------------------- parent
def phase_env(phase: Phase, report_dir: str, base: dict | None = None, mode: str | None = None,
              fault_rank: int | None = None, overrides: dict[str, str] | None = None) -> dict:
    """The environment of one phase's worker: the caller's, minus its KVCANARY_* run settings, plus the phase's, then
    ``overrides`` (``--kvcanary-env``: e.g. KVCANARY_REAL_KV=none in phase 4, to bisect what costs)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("KVCANARY_") or k in KVCANARY_KEEP}
    env.update(dict(phase.env))
    env.update(overrides or {})
    env["KVCANARY_MODE"] = mode or phase.mode
    env["KVCANARY_REPORT"] = os.path.join(report_dir, "kvc-{rank}.jsonl")
    if fault_rank is not None and "KVCANARY_FAULT" in env:
        env["KVCANARY_FAULT_RANK"] = str(fault_rank)  # inject on that rank only (the others must stay clean)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def engine_kwargs(phase: Phase, model: str, args) -> dict:
    kw = dict(
        model_path=model, load_format=args.load_format, skip_tokenizer_init=True,
        attention_backend=args.attention_backend, sampling_backend="pytorch", mem_fraction_static=args.mem_fraction,
        max_total_tokens=phase.max_total_tokens, chunked_prefill_size=args.chunk, dtype="bfloat16", random_seed=0,
        log_level="info", decode_log_interval=1000, disable_piecewise_cuda_graph=True,
    )
    if phase.graphs:
        kw.update(cuda_graph_max_bs=64)
    else:
        kw.update(disable_cuda_graph=True)
    kw.update(max_running_requests=64)
    if getattr(args, "tp_size", 1) > 1:
        kw.update(tp_size=args.tp_size)  # one kvcanary manager per TP rank, reports kvc-<rank>.jsonl
    kw.update(dict(phase.engine))
    kw.update(parse_engine_args(getattr(args, "engine_arg", None) or []))
    kw = piecewise_engine_kwargs(kw, getattr(args, "piecewise", False))
    return eagle_phases.eagle_engine_kwargs(kw, phase, args)


# Set by the driver per phase and Engine: an override would silently not apply (or break the phase's checks).
KVCANARY_ENV_FIXED = ("KVCANARY_MODE", "KVCANARY_REPORT", "KVCANARY_FAULT_RANK")


def parse_kvcanary_env(items: list[str]) -> dict[str, str]:
    """``--kvcanary-env KEY=VALUE`` items: KVCANARY_* settings every phase's worker gets after the phase's own."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("KVCANARY_"):
            raise SystemExit(f"--kvcanary-env: expected KVCANARY_NAME=VALUE, got {item!r}")
        if key in KVCANARY_ENV_FIXED:
            raise SystemExit(f"--kvcanary-env: {key} is set by the driver per phase and Engine; "
                             f"settable: any other KVCANARY_* setting")
        out[key] = value
    return out


def parse_engine_args(items: list[str]) -> dict:
    """``--engine-arg KEY=VALUE`` items as Engine kwargs: VALUE read as JSON (true, 8, 0.5, "x"), else a string."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def ensure_model(args) -> str:
    if args.model:
        return args.model
    path = os.path.join(args.out, "tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f, indent=1)
    return path


def run_worker(cmd: list[str], env: dict, log_path: str, timeout: float) -> int:
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            log.write(f"cannot start worker: {exc}\n".encode())
            return 127
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            log.write(f"\n[e2e] worker killed after {timeout:.0f} s\n".encode())
            return 124


def kill_group(proc: subprocess.Popen) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def load_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def run_phases(args, runner=run_worker) -> dict:
    """Run the selected phases under the budget; returns {result key: worker result} (keys "1".."3", "4off",
    "4log", "4off-1" ...: "4" + each of overhead_subs). ``runner(cmd, env, log_path, timeout) -> rc`` starts one
    worker (tests pass a fake)."""
    t0 = time.monotonic()
    model = ensure_model(args)
    results: dict[str, dict] = {}

    def launch(key: str, subs: list[str], timeout: float) -> int:
        phase = PHASES[key]
        pdir = os.path.join(args.out, f"phase{key}-{phase.name}")
        spec = {"phase": key, "subs": subs, "model": model, "engine": engine_kwargs(phase, model, args),
                "requests": args.requests, "seed": args.seed, "chunk": args.chunk, "out": pdir,
                "deadline": time.time() + timeout - 25,  # the worker stops sending requests then, and shuts down
                "max_new": list(phase.max_new), "warm_groups": 3 if key == "4" else 0, "workload": phase.workload,
                "temperature": phase.temperature, "hunt": hunt_phases.hunt_kind(phase),
                "keep_outputs": key in HICACHE_PHASES or key in pool_phases.IDENT_PHASES,
                "protect": key in PROTECT_PHASES}
        spec_path = os.path.join(pdir, f"spec{'-' + '-'.join(s for s in subs if s)}.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f, indent=1)
        cmd = [args.python, os.path.abspath(__file__), "--worker", spec_path]
        label = f"{key} {phase.name}" + (f" ({'+'.join(subs)})" if any(subs) else "")
        print(f"[e2e] phase {label}: timeout {timeout:.0f} s", flush=True)
        t = time.monotonic()
        env = phase_env(phase, pdir, fault_rank=getattr(args, "fault_rank", None),
                        overrides=parse_kvcanary_env(getattr(args, "kvcanary_env", None) or []))
        env = eagle_phases.eagle_env(env, phase, pdir)
        env = hicache_phases.hicache_env(env, phase, pdir)
        env = hunt_phases.hunt_env(env, phase, pdir)
        env = pool_phases.pool_env(env, phase, pdir, pool_phases.run_pool_switches(args))
        if getattr(args, "loop_probe", False):
            env = loop_probe.probe_env(env, os.path.join(pdir, "loop-probe-plugin"))
        rc = runner(cmd, env, os.path.join(pdir, "worker.log"), timeout)
        for sub in subs:
            res = load_result(os.path.join(pdir, f"result{sub and '-' + sub}.json")) or {"status": "NO_RESULT"}
            res["rc"] = rc
            res["piecewise"] = bool(getattr(args, "piecewise", False))  # the Engine kept piecewise CUDA graphs
            res["seed"] = args.seed  # the workload's (the EAGLE summary rebuilds it)
            if rc != 0 and res.get("status") == "OK":
                res["status"] = f"OK_EXIT_{rc}"
            elif rc in (124, 137) and res.get("status") in ("RUNNING", "STARTING"):
                res["status"] = "TIMEOUT"
            results[key + sub] = res
        print(f"[e2e] phase {label}: rc={rc} in {time.monotonic() - t:.0f} s: "
              + ", ".join(f"{key + s}={results[key + s].get('status')}" for s in subs), flush=True)
        return rc

    cold_s = float(getattr(args, "cold_start_s", 0.0) or 0.0)  # the first worker's Engine compiles cold
    for key in args.phase_list:
        phase = PHASES[key]
        pdir = os.path.join(args.out, f"phase{key}-{phase.name}")
        shutil.rmtree(pdir, ignore_errors=True)
        os.makedirs(pdir)
        arms = tuple(getattr(args, "overhead_arms", DEFAULT_OVERHEAD_ARMS))
        subs = overhead_subs(getattr(args, "overhead_rounds", 2), arms) if key == "4" else [""]
        batches = [subs] if key != "4" or not args.overhead_split else [[s] for s in subs]
        for batch in batches:
            left = args.budget - (time.monotonic() - t0)
            cap_s, min_s = phase_limits(phase, args, len(batch), len(subs))
            if left < min_s:
                for sub in batch:
                    results[key + sub] = {"status": "SKIPPED", "note": f"{left:.0f} s left"}
                print(f"[e2e] phase {key} {phase.name} {'+'.join(batch)}: SKIPPED ({left:.0f} s left)", flush=True)
                continue
            launch(key, batch, min(cap_s + cold_s, left - 3))
            cold_s = 0.0
        if key == "4" and results.get(f"4{arms[0]}", {}).get("status") == "OK" and \
                results.get(f"4{arms[1]}", {}).get("status") not in ("OK", "TRUNCATED"):
            left = args.budget - (time.monotonic() - t0)  # the second Engine failed in the shared process: retry alone
            cap_s, min_s = phase_limits(phase, args, 1, len(subs))
            if left >= phase.min_s / 2 + piecewise_start_allowance(args):
                launch(key, [arms[1]], min(cap_s, left - 3))
    return results


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (the ``taskset -c`` list form); raises ``ArgumentTypeError``
    naming the bad part."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if sep else lo
        except ValueError:
            raise argparse.ArgumentTypeError(f"--cpus: expected a list like 0-15 or 0,2,4-7; got {part!r}") from None
        if lo < 0 or hi < lo:
            raise argparse.ArgumentTypeError(f"--cpus: expected first <= last, both >= 0; got {part!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def pin_cpus(cpus: frozenset[int] | None) -> str | None:
    """Pin this process (and so every process it starts) to ``cpus``; the list as set, for the summary, or None.
    Raises SystemExit naming --cpus when the host refuses (e.g. a CPU it does not have)."""
    if cpus is None:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise SystemExit(f"--cpus: cannot pin to {sorted(cpus)}: {exc}") from None
    got = sorted(os.sched_getaffinity(0))
    print(f"[e2e] pinned to CPUs {got}", flush=True)
    if len(got) > 1 and got == list(range(got[0], got[-1] + 1)):
        return f"{got[0]}-{got[-1]}"
    return ",".join(map(str, got))


def main_parent(args) -> int:
    t0 = time.monotonic()
    pinned = pin_cpus(getattr(args, "cpus", None))
    os.makedirs(args.out, exist_ok=True)
    if args.phase_list and all(k in HICACHE_PHASES for k in args.phase_list):  # (their own workload)
        groups = phase_workload({"workload": "hicache", "seed": args.seed})
    else:
        groups = make_workload(args.requests, seed=args.seed)
    wl = workload_stats(groups, args.chunk)
    print(f"[e2e] workload: {json.dumps(wl)}", flush=True)
    if args.dry_run:
        results = dry_run_reports(args, groups)
    else:
        results = run_phases(args)
    arms = tuple(getattr(args, "overhead_arms", DEFAULT_OVERHEAD_ARMS))
    summary = build_summary(args.out, args.phase_list, results, args.budget, time.monotonic() - t0, wl,
                            env={"mode": "dry-run" if args.dry_run else "engine", "python": sys.version.split()[0],
                                 **({"kvcanary-env": " ".join(args.kvcanary_env)} if getattr(args, "kvcanary_env", None)
                                    else {}),
                                 **({"cpus": pinned} if pinned else {}),
                                 **({"overhead-arms": ",".join(arms)} if "4" in args.phase_list
                                    and arms != DEFAULT_OVERHEAD_ARMS else {})},
                            overhead_arms=arms)
    text = render(summary)
    for s in summary["phases"]:  # the end of a failed phase's log, before the table (which is printed last)
        if s.get("verdict") == "FAIL" and not args.dry_run:
            key = s["phase"].split()[0]
            log = read_text(os.path.join(args.out, f"phase{key}-{PHASES[key].name}", "worker.log"))
            print(f"----- {s['phase']}: last lines of worker.log -----\n" + "\n".join(log.splitlines()[-15:]))
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"summary": summary, "results": results}, f, indent=1, default=str)
    print(text, flush=True)
    return 0 if summary["pass"] else 1


# ---------------------------------------------------------------------------------------------------- dry run
def dry_run_reports(args, groups: list[list[Request]]) -> dict:
    """What the workers would leave, synthesized (no sglang): results, a log with stats lines and a JSONL report
    whose injections are all detected, so the parsing, matching and table run end to end."""
    rng = random.Random(args.seed)
    results = {}
    n_req = sum(len(g) for g in groups)
    out_tok = sum(r.max_new_tokens for g in groups for r in g)
    for key in args.phase_list:
        phase = PHASES[key]
        pdir = os.path.join(args.out, f"phase{key}-{phase.name}")
        shutil.rmtree(pdir, ignore_errors=True)
        os.makedirs(pdir)
        base = {"status": "OK", "rc": 0, "engine_start_s": 0.0, "requests_sent": n_req, "requests_ok": n_req,
                "cached_tokens": 12345, "retractions": 3 if key == "1" else 0, "output_tokens": out_tok,
                "workload_s": 10.0, "tokens_per_s": out_tok / 10.0, "total_tokens_per_s": 2 * out_tok / 10.0,
                "errors": []}
        stats = "kvcanary stats: step=1200 forwards=1200 tokens_written=300000 entries_verified=2500000 " \
                "entries_swept=90000 violations=0 lost=0\n" \
                "kvcanary host time: step=1200 forwards=1200 eager=240 canary_us_per_forward=64.7 hooks_us=40.2 " \
                "launch_us_per_eager_forward=106.5 forward_us=2210.0 piecewise=0 launch_us_per_piecewise_forward=0.0 " \
                "canary_us_per_piecewise_forward=0.0 batch_init_us=3.2\n"
        if key in EAGLE_PHASES or key in EAGLE_RETRACT_PHASES:
            results[key] = eagle_phases.dry_run_eagle(phase, pdir, dict(base, seed=args.seed), args.seed)
            continue
        if key in HICACHE_PHASES:
            results[key] = hicache_phases.dry_run_hicache(phase, pdir, base, rng)
            continue
        if key in HUNT_PHASES:
            results[key] = hunt_phases.dry_run_hunt(phase, pdir, base, args.seed)
            continue
        if key in POOL_PHASES:
            results[key] = pool_phases.dry_run_pool(phase, pdir, base, n_req)
            continue
        if key in PROTECT_PHASES:
            results[key] = protect_phases.dry_run(protect_phases.PROTECT_KIND[key], pdir, base, groups,
                                                   E2E_FAULTS, EXPECTED_REASONS)
            continue
        if args.piecewise:
            stats = dry_run_piecewise_log()
            base["piecewise"] = True
        if key == "4":
            results.update(dry_run_overhead(args, pdir, base, stats))
            continue
        with open(os.path.join(pdir, "worker.log"), "w") as f:
            f.write("[dry-run]\n" + stats)
        if key == "3":
            with open(os.path.join(pdir, "kvc-0.jsonl"), "w") as f:
                step = 10
                for c in E2E_FAULTS * 24:
                    slots = [rng.randrange(1, 6000) for _ in range(3 if c == "req_to_token_redirect" else 1)]
                    f.write(json.dumps({"schema": INJECTION_SCHEMA, "fault": c, "step": step, "slots": slots,
                                        "detail": "dry-run", "rank": {"tp_rank": 0}}) + "\n")
                    f.write(json.dumps({"schema": VIOLATION_SCHEMA, "step": step + 1,
                                        "tag": "sweep" if c == "cached_idle_corruption" else "verify",
                                        "reasons": [EXPECTED_REASONS[c][0]], "slot": slots[0],
                                        "rank": {"tp_rank": 0}}) + "\n")
                    step += 3
        results[key] = base
    return results


# ---------------------------------------------------------------------------------------------------- worker
def worker_main(spec_path: str) -> int:
    """One phase (or the overhead pair) in this process: import sglang, start the Engine(s), run the workload."""
    with open(spec_path) as f:
        spec = json.load(f)
    out = spec["out"]
    t = time.perf_counter()
    try:
        from sglang.srt.entrypoints.engine import Engine
    except BaseException as exc:
        for sub in spec["subs"]:
            write_json(os.path.join(out, f"result{sub and '-' + sub}.json"),
                       {"status": "IMPORT_ERROR", "errors": [f"{type(exc).__name__}: {str(exc)[:2000]}"]})
        raise
    import_s = time.perf_counter() - t
    print(f"[e2e-worker] import sglang: {import_s:.1f} s", flush=True)
    groups = phase_workload(spec)
    rc = 0
    for sub in spec["subs"]:
        res_path = os.path.join(out, f"result{sub and '-' + sub}.json")
        res = {"status": "STARTING", "import_s": round(import_s, 2), "requests_sent": 0, "requests_ok": 0,
               "errors": []}
        env_backup = {}
        if sub:  # overhead pair: the plugin settings of the Engine started next (its scheduler process reads them)
            sdir = os.path.join(out, sub)
            os.makedirs(sdir, exist_ok=True)
            engine_env = overhead_engine_env(sub, sdir)
            for k, v in engine_env.items():
                env_backup[k] = os.environ.get(k)
                os.environ[k] = v
            print(overhead_engine_marker(sub, engine_env), flush=True)
        try:
            run_engine(Engine, spec, groups, res, res_path)
        except BaseException as exc:  # keep what was measured; the parent reads the status
            res["status"] = "ERROR"
            res["errors"].append(f"{type(exc).__name__}: {str(exc)[:2000]}")
            rc = 1
            import traceback

            traceback.print_exc()
        finally:
            write_json(res_path, res)
            for k, v in env_backup.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return rc


def write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------- sglang version
# The Engine arguments above use sglang 0.5.12's names. sglang 0.5.23's ServerArgs refuses two of them: it has no
# --disable-piecewise-cuda-graph (prefill graphs are --cuda-graph-backend-prefill full|breakable|disabled, breakable
# by default on CUDA) and --cuda-graph-max-bs became --cuda-graph-max-bs-decode. The worker translates them for the
# sglang it imports (kvcanary picks its own version module; the driver itself never loads kvcanary).
def installed_sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def version_engine_kwargs(kw: dict, sglang_version: str) -> dict:
    """``kw`` (0.5.12 names) as the installed sglang's Engine takes them (unchanged before 0.5.23)."""
    parts = re.match(r"(\d+)\.(\d+)\.(\d+)", sglang_version)
    if parts is None or tuple(int(x) for x in parts.groups()) < (0, 5, 23):
        return kw
    kw = dict(kw)
    if kw.pop("disable_piecewise_cuda_graph", False):
        kw["cuda_graph_backend_prefill"] = "disabled"
    if "cuda_graph_max_bs" in kw:
        kw["cuda_graph_max_bs_decode"] = kw.pop("cuda_graph_max_bs")
    return kw


def run_engine(Engine, spec: dict, groups: list[list[Request]], res: dict, res_path: str) -> None:
    kw = version_engine_kwargs(dict(spec["engine"]), installed_sglang_version())
    print(f"[e2e-worker] Engine kwargs: {kw}", flush=True)
    t = time.perf_counter()
    engine = Engine(**kw)
    res["engine_start_s"] = round(time.perf_counter() - t, 2)
    print(f"[e2e-worker] Engine start: {res['engine_start_s']} s", flush=True)
    res["status"] = "RUNNING"
    try:
        # Warm-up outside the measurement: the first forwards of an Engine carry one-time JIT/autotune costs.
        t = time.perf_counter()
        engine.generate(input_ids=[[5 + i] * (8 + 40 * i) for i in range(4)],
                        sampling_params=dict(temperature=0.0, max_new_tokens=8, ignore_eos=True))
        if spec.get("warm_groups"):  # overhead phase: the workload's shapes once, unmeasured (JIT, allocator)
            warm = make_workload(spec["requests"], seed=spec["seed"] + 1, max_new=tuple(spec["max_new"]))
            for group in warm[: spec["warm_groups"]]:
                engine.generate(input_ids=[r.input_ids for r in group], sampling_params=[
                    dict(temperature=0.0, max_new_tokens=r.max_new_tokens, ignore_eos=True) for r in group])
        res["warmup_s"] = round(time.perf_counter() - t, 2)
        out_tok = in_tok = cached = retract = 0
        wall = 0.0
        print(MEASURED_MARKER, flush=True)  # the parent counts the canary's forwards from here
        print(f"{loop_probe.WINDOW_START}{time.time():.3f}", flush=True)  # --loop-probe's window
        if spec.get("hunt"):  # a hunt phase: its own timed schedule (waves, aborts, retries)
            hunt_phases.run_workload(engine, spec, res, lambda: write_json(res_path, res))
            groups = []
        if spec.get("protect"):  # a protect phase: per-request outputs and endings (an abort raises per request)
            protect_phases.run_workload(engine, groups, spec, res, lambda: write_json(res_path, res))
            groups = []
        for gi, group in enumerate(groups):
            if time.time() > spec["deadline"]:
                res["status"] = "TRUNCATED"
                res["note"] = f"deadline reached after {gi} of {len(groups)} groups"
                break
            sps = [dict(temperature=spec.get("temperature", 0.0), max_new_tokens=r.max_new_tokens, ignore_eos=True)
                   for r in group]
            res["requests_sent"] += len(group)
            t = time.perf_counter()
            outs = engine.generate(input_ids=[r.input_ids for r in group], sampling_params=sps)
            wall += time.perf_counter() - t
            for r, o in zip(group, outs, strict=False):
                meta = o.get("meta_info", {}) if isinstance(o, dict) else {}
                n = meta.get("completion_tokens") or len(o.get("output_ids") or [])
                if spec.get("keep_outputs"):  # (HiCache phases: greedy outputs compared across Engines)
                    res.setdefault("outputs", []).append(list(o.get("output_ids") or []))
                if n == r.max_new_tokens:
                    res["requests_ok"] += 1
                else:
                    res["errors"].append(
                        f"group {gi}: {n}/{r.max_new_tokens} tokens, finish={meta.get('finish_reason')}")
                out_tok += n
                in_tok += len(r.input_ids)
                cached += int(meta.get("cached_tokens") or 0)
                retract += int(meta.get("num_retractions") or 0)
            res.update(output_tokens=out_tok, prompt_tokens=in_tok, cached_tokens=cached, retractions=retract,
                       workload_s=round(wall, 3), tokens_per_s=round(out_tok / wall, 1) if wall else None,
                       total_tokens_per_s=round((out_tok + in_tok - cached) / wall, 1) if wall else None)
            write_json(res_path, res)  # partial results survive a kill
            print(f"[e2e-worker] group {gi}: {len(group)} req, {wall:.2f} s so far, cached={cached} "
                  f"retractions={retract}", flush=True)
        print(f"{loop_probe.WINDOW_END}{time.time():.3f}", flush=True)
        if res["status"] == "RUNNING":
            res["status"] = "OK"
    finally:
        shutdown_engine(engine, res)


def shutdown_engine(engine, res: dict) -> None:
    """Shut an Engine down, its time in ``res["shutdown_s"]`` (also when shutdown raises), then give the scheduler
    process a second to flush its last log lines (the parent parses them)."""
    t = time.perf_counter()
    try:
        engine.shutdown()
    finally:
        res["shutdown_s"] = round(time.perf_counter() - t, 2)
        time.sleep(1.0)


# ---------------------------------------------------------------------------------------------------- cli
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="1,2,3,4", help="comma-separated: 1 clean, 2 graph, 3 faults, 4 overhead, "
                    "5 eagle-bug, 6 eagle-fixed, 7 eagle-soak, 8 eagle-faults, 9 hicache-off, 10 hicache-clean, "
                    "11 hicache-writeback, 12 hicache-faults, 13 hicache-race, 14 hicache-race-fixed, "
                    "15 eagle-retract, 16 eagle-retract-fixed, 17 hunt-overlap-cached, 18 hunt-spec-abort, "
                    "19 hunt-determ-radix, 20 hunt-hicache-hostfree, 21 protect-clean, 22 protect, 23 protect-hold, "
                    "24 ident-off, 25 ident-on, 26 hunt-page-tail, 27 hunt-swa-race, 28 hunt-swa-race-fixed")
    ap.add_argument("--draft-model", default=None, help="EAGLE draft model path (default: a one-layer "
                    "LlamaForCausalLMEagle config, dummy weights)")
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run (default 570)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "sglang_e2e_out", help="output folder ($OUT)")
    ap.add_argument("--model", default=None, help="model path (default: a tiny Llama config, dummy weights)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--mem-fraction", type=float, default=0.05)
    ap.add_argument("--chunk", type=int, default=512, help="chunked_prefill_size (< the longest prompts)")
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--python", default=sys.executable, help="interpreter of the workers")
    ap.add_argument("--overhead-split", action="store_true", help="phase 4: one subprocess per Engine")
    ap.add_argument("--overhead-rounds", type=int, default=None,
                    help="phase 4: off/log Engine pairs, in turn; the last pair is measured (default 2; 3 with "
                    "--piecewise, which reports the median and range of every pair's ratio)")
    ap.add_argument("--overhead-arms", default=",".join(DEFAULT_OVERHEAD_ARMS), metavar="A,B",
                    help="phase 4: the two arms of each Engine pair, A the baseline and B measured against it (B/A "
                    f"tok/s); from {', '.join(OVERHEAD_ARMS)} (protect-hold: protect with KVCANARY_PROTECT_HOLD=1 "
                    "for that Engine only); default off,log, e.g. log,protect for what protect costs over log")
    ap.add_argument("--overhead-eager", action="store_true",
                    help="phase 4 with every forward eager (disable_cuda_graph): what a prefill-heavy or graph-less "
                    "deployment pays per forward")
    ap.add_argument("--piecewise", action="store_true",
                    help="keep sglang's default piecewise CUDA graphs for prefill (no disable_piecewise_cuda_graph)")
    ap.add_argument("--loop-probe", action="store_true",
                    help="time sglang's scheduler loop per iteration, off vs log (integration/loop_probe.py)")
    ap.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                    help="an extra Engine kwarg for every phase (VALUE as JSON, else a string); repeatable, e.g. "
                    "--engine-arg disable_overlap_schedule=true")
    ap.add_argument("--kvcanary-env", action="append", metavar="KVCANARY_NAME=VALUE",
                    help="a kvcanary setting for every phase's worker, after the phase's own (repeatable), e.g. "
                    "--kvcanary-env KVCANARY_REAL_KV=none to see what the real-KV fingerprint costs in phase 4")
    ap.add_argument("--cpus", type=parse_cpu_list, default=None, metavar="LIST",
                    help="pin the driver, its workers and every sglang process they start to these host CPUs (e.g. "
                    "0-15; inherited by child processes): two runs side by side on one machine then never share a "
                    "core, and an Engine's host speed varies less between Engines (the overhead phase's pairs)")
    ap.add_argument("--test-lift-kv-dtype", action="store_true",
                    help="TEST ONLY (issue 29's fp8 proof): lift kvcanary's start-up refusal of --kv-cache-dtype "
                    "fp8_* in every phase's sglang processes (integration/pool_phases.py, printed in the log)")
    ap.add_argument("--test-pool-switch", action="append", default=[], choices=pool_phases.SWITCHES, metavar="NAME",
                    help="TEST ONLY: a switch of integration/pool_phases.py in every phase's sglang processes "
                    "(repeatable), e.g. swa-lock-fix to run the clean, fault and identical-output phases on the SWA "
                    "config with the fix for the SWARadixCache bug kvcanary found patched in; "
                    f"one of {', '.join(pool_phases.SWITCHES)}")
    ap.add_argument("--cold-start-s", type=float, default=0.0, metavar="S",
                    help="seconds added to the first phase's cap: the first Engine of a model on a fresh machine "
                    "compiles its kernels cold (gpt-oss's MoE, MLA: ~100 s on the H200)")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor parallel ranks (one canary per rank)")
    ap.add_argument("--fault-rank", type=int, default=None, help="phase 3: inject on this rank only")
    ap.add_argument("--dry-run", action="store_true", help="no sglang/GPU: synthesize reports, parse, print")
    ap.add_argument("--summarize", metavar="DIR", help="re-render the summary of an earlier run's --out folder "
                    "from its logs and reports (no Engine)")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is None:
        args.phase_list = parse_phases(args.phases)
        args.out = os.path.abspath(args.out)
    if args.overhead_rounds is None:
        args.overhead_rounds = PIECEWISE_OVERHEAD_ROUNDS if args.piecewise else 2
    args.overhead_arms = parse_overhead_arms(args.overhead_arms)
    if any(a.startswith("protect") for a in args.overhead_arms) and any(
            str(item).startswith("KVCANARY_PROTECT_HOLD=") for item in args.kvcanary_env or []):
        raise SystemExit("--overhead-arms: the protect arms set KVCANARY_PROTECT_HOLD per Engine (protect: 0, "
                         "protect-hold: 1); drop --kvcanary-env KVCANARY_PROTECT_HOLD=...")
    # Engine kwargs are built from PHASES in this (parent) process, so the worker gets disable_cuda_graph
    PHASES["4"] = dataclasses.replace(OVERHEAD_WITH_GRAPHS, graphs=False) if args.overhead_eager \
        else OVERHEAD_WITH_GRAPHS
    return args


def summarize_only(out: str) -> int:
    """The summary of a finished run, rebuilt from its folder (logs, reports, the workers' results)."""
    with open(os.path.join(out, "summary.json")) as f:
        saved = json.load(f)
    old = saved["summary"]
    phases = [k for k in PHASES if os.path.isdir(os.path.join(out, f"phase{k}-{PHASES[k].name}"))]
    summary = build_summary(out, phases, saved["results"], old.get("budget_s"), old.get("total_s", 0.0),
                            old.get("workload", {}), env=old.get("env"))
    text = render(summary)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return 0 if summary["pass"] else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.summarize:
        return summarize_only(os.path.abspath(args.summarize))
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
