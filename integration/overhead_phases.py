"""Phase 4 of integration/sglang_e2e.py (the overhead phase) and ``--piecewise``: what each is, read and judged.

Phase 4 starts its Engines in turn, warm-up pairs first (``off-1``, ``log-1`` ... then the measured ``off``, ``log``;
``--overhead-arms A,B`` names two other arms); the worker sets each Engine's kvcanary settings
(``overhead_engine_env``) and prints ``ENGINE_MARKER`` before it and ``MEASURED_MARKER`` before its timed workload,
so that the parent splits the shared log per Engine (``engine_sections``) and counts the canary's forwards of the
timed workload alone (``measured_forwards``). Here: the arms, the phase's summary rows and table (``overhead_rows``,
``overhead_pairs``, ``render_overhead``), ``--piecewise``'s Engine argument, budget and verdict
(``piecewise_engine_kwargs``, ``phase_limits``, ``verdict_piecewise``, ``render_piecewise``) and the dry run's phase 4.

Imports the driver core (integration/e2e_core.py) and loop_probe.py; the driver imports this file, nothing else
does. Nothing here imports sglang or kvcanary (the driver's rule).
"""

from __future__ import annotations

import collections
import glob
import os
import statistics

import loop_probe
from e2e_core import (
    PCG_CAPTURE_RE,
    Phase,
    fmt,
    parse_piecewise,
    parse_stats,
    piecewise_capture_seconds,
    read_jsonl,
    read_text,
    summarize_phase,
)

# ---------------------------------------------------------------------------------------------------- facts
MEASURED_MARKER = "[e2e-worker] measured workload starts"
ENGINE_MARKER = "[e2e-worker] overhead engine: KVCANARY_MODE="


# ---------------------------------------------------------------------------------------------------- arms
# Phase 4's arms (--overhead-arms A,B): the kvcanary setting of an Engine, by the name its subs and rows carry. A is
# the baseline, B the measured arm (the ratio is B/A); protect-hold is protect with KVCANARY_PROTECT_HOLD=1.
OVERHEAD_ARMS = ("off", "log", "raise", "protect", "protect-hold")
DEFAULT_OVERHEAD_ARMS = ("off", "log")


def parse_overhead_arms(text: str) -> tuple[str, str]:
    """``--overhead-arms A,B``: two distinct arm names; anything else is refused naming the option and the arms."""
    arms = tuple(a.strip().lower() for a in str(text).split(","))
    if len(arms) != 2 or arms[0] == arms[1] or not all(a in OVERHEAD_ARMS for a in arms):
        raise SystemExit(f"--overhead-arms: expected two distinct arms A,B (A the baseline, B measured against it) "
                         f"from {', '.join(OVERHEAD_ARMS)}; got {text!r}")
    return arms


def overhead_arm(sub: str) -> str:
    """The arm of one of phase 4's Engines: ``off-1`` -> off, ``protect-hold`` -> protect-hold."""
    if sub in OVERHEAD_ARMS:
        return sub
    arm, _, r = sub.rpartition("-")
    if arm in OVERHEAD_ARMS and r.isdigit():
        return arm
    raise ValueError(f"not a phase-4 Engine: {sub!r}")


def overhead_engine_env(sub: str, sdir: str) -> dict[str, str]:
    """The kvcanary settings the worker sets for one of phase 4's Engines (and restores after it): the arm's mode,
    the Engine's report folder, and for the protect arms whether protect holds (``KVCANARY_PROTECT_HOLD``)."""
    arm = overhead_arm(sub)
    env = {"KVCANARY_MODE": "protect" if arm == "protect-hold" else arm,
           "KVCANARY_REPORT": os.path.join(sdir, "kvc-{rank}.jsonl")}
    if arm.startswith("protect"):
        env["KVCANARY_PROTECT_HOLD"] = "1" if arm == "protect-hold" else "0"
    return env


def overhead_engine_marker(sub: str, env: dict[str, str] | None = None) -> str:
    """The worker's line before one of phase 4's Engines starts (``engine_sections`` splits the log at it):
    ``ENGINE_MARKER`` + mode, then the hold setting and ``arm=`` where the mode alone does not name the arm."""
    arm = overhead_arm(sub)
    env = env or overhead_engine_env(sub, "")
    line = ENGINE_MARKER + env["KVCANARY_MODE"]
    if "KVCANARY_PROTECT_HOLD" in env:
        line += f" KVCANARY_PROTECT_HOLD={env['KVCANARY_PROTECT_HOLD']}"
    return line + (f" arm={arm}" if arm != env["KVCANARY_MODE"] else "")


def overhead_arms_in(results: dict) -> tuple[str, str]:
    """Phase 4's (baseline, measured) arms from the results' keys (``4<arm>``, in start order); the default
    ``off,log`` when they name no two arms."""
    arms = [k[1:] for k in results if k.startswith("4") and k[1:] in OVERHEAD_ARMS]
    return tuple(arms[:2]) if len(arms) >= 2 else DEFAULT_OVERHEAD_ARMS


def overhead_arms_of(ov: dict) -> tuple[str, str]:
    """The (baseline, measured) arms of ``summary["overhead"]`` (kept there only when not the default)."""
    return tuple(ov.get("arms") or DEFAULT_OVERHEAD_ARMS)


def overhead_host_arm(arms: tuple[str, str]) -> str:
    """The arm whose ``kvcanary host time:`` line the overhead table breaks down: B, or A when B is off."""
    return arms[1] if arms[1] != "off" else arms[0]


def overhead_subs(rounds: int, arms: tuple[str, str] = DEFAULT_OVERHEAD_ARMS) -> list[str]:
    """Phase 4's Engines in start order: warm-up pairs ``off-1``, ``log-1`` ... then the measured ``off``, ``log``
    (with ``--overhead-arms A,B``: ``A-1``, ``B-1`` ... ``A``, ``B``)."""
    subs = [f"{arm}-{r}" for r in range(1, max(rounds, 1)) for arm in arms]
    return subs + list(arms)


def overhead_arm_text(log_text: str, arm: str, arms: tuple[str, str]) -> str:
    """The part of phase 4's log an arm's row reads: all of it without the other arm's Engines when that arm runs
    kvcanary too (its stats lines would be taken for this arm's); all of it when the other arm is off (as before)."""
    other = arms[1] if arm == arms[0] else arms[0]
    if other == "off" or ENGINE_MARKER not in log_text:
        return log_text
    head, *parts = log_text.split(ENGINE_MARKER)
    return head + "".join(ENGINE_MARKER + p for p in parts if _section_arm(p) != other)


def overhead_rows(phase: Phase, pdir: str, results: dict, summary: dict,
                   arms: tuple[str, str] = DEFAULT_OVERHEAD_ARMS) -> list[dict]:
    base, arm = arms
    rows, ov = [], {}
    warm = []
    r = 1
    while f"4{base}-{r}" in results or f"4{arm}-{r}" in results:
        a, b = results.get(f"4{base}-{r}", {}), results.get(f"4{arm}-{r}", {})
        ratio = b["tokens_per_s"] / a["tokens_per_s"] if a.get("tokens_per_s") and b.get("tokens_per_s") else None
        warm.append({"round": r, base: a.get("tokens_per_s"), arm: b.get("tokens_per_s"), "ratio": ratio})
        r += 1
    shared = read_text(os.path.join(pdir, "worker.log"))
    for sub in arms:
        res = results.get(f"4{sub}", {"status": "SKIPPED"})
        sdir = os.path.join(pdir, sub)
        log_text = overhead_arm_text(shared, sub, arms) + read_text(os.path.join(sdir, "worker.log"))
        rep = read_jsonl(sorted(glob.glob(os.path.join(sdir, "kvc-*.jsonl"))))
        s = summarize_phase(phase, res, log_text if sub != "off" else "", rep)
        s["phase"] = f"4 overhead-{sub}"
        ok = s["status"] == "OK" and s["requests_ok"] == s["requests_sent"] > 0 and not s["violations"]
        s["verdict"], s["why"] = ("PASS" if ok else "FAIL"), ([] if ok else [f"status {s['status']}"])
        ov[sub] = {"tokens_per_s": res.get("tokens_per_s"), "total_tokens_per_s": res.get("total_tokens_per_s"),
                   "workload_s": res.get("workload_s"), "forwards": s["forwards"]}
        if sub == overhead_host_arm(arms):
            ov["host"] = s.get("host")
        rows.append(s)
    # forwards of each arm's measured workload; an off arm's are the other arm's (same workload, same schedule: the
    # plugin off counts nothing)
    fws = {sub: measured_forwards(overhead_arm_text(shared, sub, arms), sub) or ov[sub].get("forwards")
           for sub in arms if sub != "off"}
    for sub in arms:
        fw = fws.get(sub) if sub != "off" else fws.get(arm if sub == base else base)
        if fw:
            ov[sub]["forwards"] = fw
    for sub in arms:
        r = ov[sub]
        ok = r.get("workload_s") and r.get("forwards")
        r["ms_per_forward"] = 1000.0 * r["workload_s"] / r["forwards"] if ok else None
    if ov[base].get("tokens_per_s") and ov[arm].get("tokens_per_s"):
        ov["ratio"] = ov[arm]["tokens_per_s"] / ov[base]["tokens_per_s"]
        if ov[base]["ms_per_forward"] and ov[arm]["ms_per_forward"]:
            ov["ms_per_forward_delta"] = ov[arm]["ms_per_forward"] - ov[base]["ms_per_forward"]
    else:
        ov["ratio"] = None
    ov["warmup_rounds"] = warm
    if tuple(arms) != DEFAULT_OVERHEAD_ARMS:
        ov["arms"] = list(arms)
    summary["overhead"] = ov
    return rows


# ---------------------------------------------------------------------------------------------------- summary
def measured_forwards(log_text: str, mode: str = "log") -> int | None:
    """Forwards the canary counted during the measured workload of the last Engine of arm ``mode`` of an overhead
    log: its last stats count minus the last one before the measured-workload marker (the unmeasured warm-up's),
    to within ``KVCANARY_STATS_EVERY``. None without stats lines or marker."""
    mine = [sec for arm, sec in engine_sections(log_text) if arm == mode]
    if not mine or MEASURED_MARKER not in mine[-1]:
        return None
    before, after = mine[-1].split(MEASURED_MARKER, 1)
    start, end = parse_stats(before), parse_stats(before + after)
    if end is None:
        return None
    return end["forwards"] - (start["forwards"] if start else 0)

def render_overhead(ov: dict | None) -> list[str]:
    """Phase 4's table: each arm's timed workload, where the canary's host time goes, the warm-up pairs' and the
    measured pair's ratio (none without ``summary["overhead"]``)."""
    lines: list[str] = []
    if ov:
        base, arm = overhead_arms_of(ov)
        # forwards: the timed workload's only (the phase row above also counts the unmeasured warm-up groups)
        lines += ["", "| overhead | output tok/s | total tok/s | workload s | timed forwards | ms/forward |",
                  "|---|---|---|---|---|---|"]
        for k in (base, arm):
            r = ov.get(k) or {}
            lines.append(f"| {k} | {fmt(r.get('tokens_per_s'))} | {fmt(r.get('total_tokens_per_s'))} | "
                         f"{fmt(r.get('workload_s'), 2)} | {fmt(r.get('forwards'))} | "
                         f"{fmt(r.get('ms_per_forward'), 3)} |")
        host, host_arm = ov.get("host"), overhead_host_arm((base, arm))
        if host:
            lines.append(
                f"| where the canary's time goes ({host_arm}) | {host['canary_us']:.1f} µs host per forward: "
                f"{host['hooks_us']:.1f} in the forward hooks (drain, health, stats) + "
                + (f"{host['batch_init_us']:.1f} in the batch hook (ForwardBatch.init_new: writer attribution, "
                   "token uploads) + " if "batch_init_us" in host else "")
                + f"{host['launch_us']:.1f} per eager forward ({host['eager']} of {host['forwards']}) launching "
                f"plan/verify/write; a forward's own host time {host['forward_us']:.1f} µs"
                + (f"; = {host['canary_us'] / (10 * ov[host_arm]['ms_per_forward']):.1f} % of the measured forward "
                   "period" if (ov.get(host_arm) or {}).get("ms_per_forward") else "") + " | | | | |")
        for w in ov.get("warmup_rounds") or []:
            lines.append(f"| warm-up pair {w['round']} (first Engines on this machine), {arm}/{base} | "
                         f"{fmt(w['ratio'], 4)} ({arm} {fmt(w[arm])} vs {base} {fmt(w[base])} tok/s) | | | | |")
        if ov.get("ratio") is not None:
            r = ov["ratio"]
            what = (f"{100 * (1 - r):.2f} % fewer tok/s" if r < 1 else
                    f"no slowdown measurable: {100 * (r - 1):.2f} % more tok/s, within Engine-to-Engine noise")
            lines.append(f"| {arm}/{base} | {r:.4f} ({what}) | | | | {fmt(ov.get('ms_per_forward_delta'), 3)} ms per "
                         f"forward, {arm} - {base} |")
    return lines


# ---------------------------------------------------------------------------------------------------- piecewise
# sglang 0.5.12 serves extend forwards of up to piecewise_cuda_graph_max_tokens tokens (= chunked_prefill_size,
# capped by max_total_tokens) from piecewise CUDA graphs unless disable_piecewise_cuda_graph is passed. Building them
# costs every Engine start: torch.compile (dynamo, the "eager" compiler: no codegen) traces the model's layer stack
# once, then each capture size (4..512 tokens with this driver's chunk of 512: 30 sizes) runs once to compile and
# twice to capture one graph per piece (pieces split at attention: layers + 1 of them). Estimated 15-40 s for the
# tiny 2-layer model on an H200 host; the summary prints what sglang measured ("Capture piecewise CUDA graph end").
PIECEWISE_START_S = 40  # budget allowance per Engine start with piecewise graphs
PIECEWISE_OVERHEAD_ROUNDS = 3  # phase 4 with --piecewise: off/log pairs (median and range of the ratios)
# Phases whose prefill the piecewise runner must serve with --piecewise. The EAGLE phases' target extends ask for
# hidden states (CaptureHiddenMode.FULL), which 0.5.12's PiecewiseCudaGraphRunner.can_run declines: shown, not required.
PIECEWISE_SERVES = ("1", "2", "3", "4")


def piecewise_engine_kwargs(kw: dict, piecewise: bool) -> dict:
    """``--piecewise``: sglang's own default for prefill graphs (the argument is left out, as a user leaves it)."""
    if piecewise:
        kw.pop("disable_piecewise_cuda_graph", None)
    return kw


def piecewise_start_allowance(args) -> float:
    return PIECEWISE_START_S if getattr(args, "piecewise", False) else 0.0


def phase_limits(phase: Phase, args, engines: int, total_engines: int) -> tuple[float, float]:
    """(cap, minimum) seconds of one worker that starts ``engines`` of the phase's ``total_engines`` Engines.

    The phase's own cap and minimum (the minimum shared out over the Engines); phase 4 with more than the default
    2 pairs in one worker gets its cap scaled per Engine; ``--piecewise`` adds PIECEWISE_START_S per Engine started
    to the cap, and once to the minimum."""
    cap = float(phase.cap_s)
    if phase.key == "4" and engines > 4:
        cap = phase.cap_s * engines / 4
    least = phase.min_s * engines / max(total_engines, 1)
    extra = piecewise_start_allowance(args)
    return cap + extra * engines, least + extra


def verdict_piecewise(s: dict) -> list[str]:
    """With --piecewise a phase passes only if the piecewise runner was built and served prefill forwards that
    kvcanary planned, verified and wrote (its host-time line counts them)."""
    if not s.get("piecewise_requested") or s.get("status") in ("SKIPPED", None):
        return []
    why = []
    if not s.get("pcg_capture_s"):
        why.append("no piecewise CUDA graph was built (sglang disabled it for this setup?)")
    pw = s.get("piecewise")
    if (not pw or not pw["piecewise"]) and str(s.get("phase", "")).split(" ", 1)[0] in PIECEWISE_SERVES:
        why.append("no prefill forward served by the piecewise runner in kvcanary's host-time lines")
    return why


def _section_arm(part: str) -> str:
    """The arm of one Engine's part of phase 4's log (the text after ``ENGINE_MARKER``): its ``arm=`` where the
    marker line has one, else the mode (the line's first word)."""
    if not part.strip():
        return "?"
    first = part.split("\n", 1)[0].split()
    named = [w[len("arm="):] for w in first if w.startswith("arm=")]
    return named[-1] if named else first[0] if first else part.split(None, 1)[0]


def engine_sections(log_text: str) -> list[tuple[str, str]]:
    """Phase 4's worker log split per Engine: ``(arm, text)`` in start order (the arm is the mode for the arms
    named after theirs: off, log, raise, protect)."""
    parts = log_text.split(ENGINE_MARKER)[1:]
    return [(_section_arm(p), p) for p in parts]


def overhead_pairs(summary: dict, pdir: str, results: dict) -> bool:
    """Every off/log pair's tokens/s ratio (log/off; with --overhead-arms A,B: B/A), their median and range, into
    ``summary["overhead"]["pairs"]``; with --piecewise also that every Engine built piecewise graphs and every
    Engine with kvcanary on (log, or an arm other than off) served prefill forwards from them (the failing rows get
    the reason). Returns False when --piecewise's requirements fail."""
    ov = summary.setdefault("overhead", {})
    arms = overhead_arms_of(ov)
    ratios = [w["ratio"] for w in ov.get("warmup_rounds") or [] if w.get("ratio")]
    if ov.get("ratio"):
        ratios.append(ov["ratio"])
    ov["pairs"] = {"ratios": ratios, "median": statistics.median(ratios) if ratios else None,
                   "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None}
    ov["probe"] = probe_rows(pdir)
    requested = any(r.get("piecewise") for k, r in results.items() if k.startswith("4"))
    if not requested:
        return True
    log_text = read_text(os.path.join(pdir, "worker.log"))
    for sub in arms:
        log_text += read_text(os.path.join(pdir, sub, "worker.log"))
    sections = engine_sections(log_text)
    ov["pcg_engines"] = {"built": sum(bool(PCG_CAPTURE_RE.search(t)) for _, t in sections), "engines": len(sections),
                         "capture_s": piecewise_capture_seconds(log_text)}
    served = {arm: [c["piecewise"] if c else 0 for c in (parse_piecewise(t) for m, t in sections if m == arm)]
              for arm in arms if arm != "off"}  # prefill forwards the piecewise runner served, per Engine of the arm
    if "log" in served:
        ov["piecewise_per_log_engine"] = served["log"]
    if tuple(arms) != DEFAULT_OVERHEAD_ARMS:
        ov["piecewise_per_engine"] = served
    ok = True
    for row in summary["phases"]:
        if not row["phase"].startswith("4 overhead-"):
            continue
        row["piecewise_requested"] = True
        arm = row["phase"][len("4 overhead-"):]
        row["pcg_capture_s"] = [c for m, t in sections if m == arm for c in piecewise_capture_seconds(t)]
        why = []
        if sections and ov["pcg_engines"]["built"] < len(sections):
            why.append(f"piecewise graphs built by {ov['pcg_engines']['built']} of {len(sections)} Engines")
        if arm in served and (not served[arm] or not all(served[arm])):
            why.append(f"a {arm} Engine served no prefill forward from the piecewise runner")
        if why:
            row["verdict"], row["why"] = "FAIL", row.get("why", []) + why
            ok = False
    if len(ratios) < PIECEWISE_OVERHEAD_ROUNDS:
        ok = False
        for row in summary["phases"]:
            if row["phase"] == f"4 overhead-{arms[1]}":
                row["verdict"] = "FAIL"
                row["why"] = row.get("why", []) + [f"{len(ratios)} {arms[0]}/{arms[1]} pair(s) measured, "
                                                   f"< {PIECEWISE_OVERHEAD_ROUNDS}"]
    return ok


def probe_rows(pdir: str) -> list[tuple[str, dict]]:
    """--loop-probe: each overhead Engine's µs per scheduler-loop iteration in its measured workload, in start
    order, labelled ``off-1``, ``log-1`` ... (by arm: ``log-1``, ``protect-1`` ...; empty without probe lines)."""
    log_text = read_text(os.path.join(pdir, "worker.log"))
    for sub in os.listdir(pdir) if os.path.isdir(pdir) else []:
        log_text += read_text(os.path.join(pdir, sub, "worker.log"))
    rows, seen = [], collections.Counter()
    for mode, text in engine_sections(log_text):
        window = loop_probe.parse_window(text)
        if window is None or not window["iters"]:
            continue
        seen[mode] += 1
        rows.append((f"{mode}-{seen[mode]}", loop_probe.per_iteration(window)))
    return rows


def render_piecewise(summary: dict) -> list[str]:
    """The piecewise table: per phase, prefill forwards the piecewise runner served and the canary's host time on
    them; the overhead pairs' median and range."""
    # a phase without --piecewise still parses piecewise=0 from its host-time lines: no table for it
    rows = [s for s in summary["phases"]
            if s.get("piecewise_requested") or (s.get("piecewise") or {}).get("piecewise")]
    lines: list[str] = []
    if rows:
        lines += ["", "| phase (piecewise CUDA graphs on) | prefill forwards served by the piecewise runner | "
                      "of forwards | canary host µs per piecewise forward (of it launches) | piecewise graph build s |",
                  "|---|---|---|---|---|"]
        for s in rows:
            pw = s.get("piecewise") or {}
            cap = s.get("pcg_capture_s") or []
            lines.append(f"| {s['phase']} | {fmt(pw.get('piecewise'))} | {fmt(pw.get('forwards'))} | "
                         f"{fmt(pw.get('canary_us'))} ({fmt(pw.get('launch_us'))}) | "
                         f"{', '.join(f'{c:.1f}' for c in cap) or '-'} |")
    pairs = (summary.get("overhead") or {}).get("pairs") or {}
    if len(pairs.get("ratios") or []) > 1:
        ov = summary["overhead"]
        base, arm = overhead_arms_of(ov)
        built = ov.get("pcg_engines")
        served = ov.get("piecewise_per_engine") or {"log": ov.get("piecewise_per_log_engine")}
        lines += ["", f"overhead, {arm}/{base} tok/s over {len(pairs['ratios'])} pairs: median {pairs['median']:.4f}, "
                      f"min {pairs['min']:.4f}, max {pairs['max']:.4f} (pairs in start order: "
                      + ", ".join(f"{r:.4f}" for r in pairs["ratios"]) + ")"
                  + (f"; piecewise graphs built by {built['built']} of {built['engines']} Engines, prefill "
                     f"forwards served " + ", ".join(f"per {a} Engine: {n}" for a, n in served.items())
                     if built else "")]
    return lines


# ---------------------------------------------------------------------------------------------------- dry run
def dry_run_piecewise_log() -> str:
    """A worker log of one Engine with piecewise graphs: sglang's capture line and kvcanary's lines."""
    return ("Capture piecewise CUDA graph end. Time elapsed: 21.4 s. mem usage=0.12 GB. avail mem=120.00 GB.\n"
            "kvcanary stats: step=1200 forwards=1200 tokens_written=300000 entries_verified=2500000 "
            "entries_swept=90000 violations=0 lost=0\n"
            "kvcanary host time: step=1200 forwards=1200 eager=0 canary_us_per_forward=64.7 hooks_us=40.2 "
            "launch_us_per_eager_forward=0.0 forward_us=2210.0 piecewise=240 launch_us_per_piecewise_forward=106.5 "
            "canary_us_per_piecewise_forward=146.7 batch_init_us=3.2\n")


def dry_run_piecewise_overhead(args, pdir: str, base: dict, log_engine: str) -> dict:
    """Phase 4 with --piecewise: every Engine of every pair in one worker log, as the shared worker writes it."""
    results, text = {}, ""
    arms = tuple(getattr(args, "overhead_arms", DEFAULT_OVERHEAD_ARMS))
    for i, sub in enumerate(overhead_subs(args.overhead_rounds, arms)):
        arm = overhead_arm(sub)
        tps = 1000.0 if arm == arms[0] else 975.0 + 10.0 * i
        os.makedirs(os.path.join(pdir, sub), exist_ok=True)
        results["4" + sub] = dict(base, tokens_per_s=tps, workload_s=base["output_tokens"] / tps)
        capture, *canary = log_engine.splitlines(True)
        text += overhead_engine_marker(sub) + "\n" + capture + MEASURED_MARKER + "\n"
        text += "".join(canary) if arm != "off" else ""
    with open(os.path.join(pdir, "worker.log"), "w") as f:
        f.write(text)
    return results

def dry_run_overhead(args, pdir: str, base: dict, log_engine: str) -> dict:
    """Phase 4's worker output, synthesized: with --piecewise every pair in one worker log
    (``dry_run_piecewise_overhead``), else the measured pair only (A, then B 2.5 % slower), each Engine's log
    ``log_engine`` (empty for off)."""
    if args.piecewise:
        return dry_run_piecewise_overhead(args, pdir, base, log_engine)
    results = {}
    for sub, tps in zip(getattr(args, "overhead_arms", DEFAULT_OVERHEAD_ARMS), (1000.0, 975.0), strict=True):
        os.makedirs(os.path.join(pdir, sub))
        results["4" + sub] = dict(base, tokens_per_s=tps, workload_s=base["output_tokens"] / tps)
        with open(os.path.join(pdir, sub, "worker.log"), "w") as f:
            f.write(log_engine if sub != "off" else "")
    return results
