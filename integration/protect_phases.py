"""The protect phases of integration/sglang_e2e.py (``KVCANARY_MODE=protect``, issue 26's GPU acceptance item 2):
their workload loop, what a phase's run folder says, the phase rows, the verdicts and the tables.

Phases (keys in sglang_e2e.PROTECT_PHASES; each one Engine with sglang's defaults: overlap scheduler, radix cache,
decode CUDA graphs; the driver's mixed workload of phase 3, greedy, ``ignore_eos``):

* ``protect-clean`` (protect, no fault): the greedy outputs the fault phases are compared with; protect must not act
  (0 violations, 0 action records);
* ``protect`` (protect, phase 3's faults: the same ``KVCANARY_FAULT`` classes, one due every 4 forwards, sweep every
  3): every injected class detected and acted on (``kvcanary.action/1`` records naming its slots), 0 engine and
  health errors, every request completes (normally, or aborted with kvcanary's named reason); counts the requests
  that finished over corrupted KV before protect acted (``missed`` records, outputs that differ from
  protect-clean's) and the measured detection window (``window_forwards`` and ``tokens_over_bad_kv`` of the
  action records);
* ``protect-hold`` (the same with ``KVCANARY_PROTECT_HOLD=1``, the window closed): additionally no request finishes
  normally with an output that differs from protect-clean's (recomputed to the clean output, or aborted by name).

Every request goes through ``Engine.async_generate`` on its own (a group's requests concurrently, the groups one
after another, as ``Engine.generate`` sends them): sglang turns a request's abort with status 500 into an exception
of that request, which in a batch ``generate`` call would lose the whole group's outputs. Each request's id is
``<tag>-<index>``, so the action records' ``request_id`` names the request.

Nothing here imports sglang or kvcanary at module level (the driver's rule). The phase rows (``summarize_protect``)
import the driver core (integration/e2e_core.py) inside the function, as the other families' driver sides do.
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only)
    from e2e_core import Phase

ACTION_SCHEMA = "kvcanary.action/1"  # = kvcanary.runtime.protect.ACTION_SCHEMA (tests/integration checks it)
ABORT_PREFIX = "kvcanary: KV cache integrity violation"  # = kvcanary.runtime.protect.ABORT_MESSAGE_PREFIX
REQUEST_ACTIONS = ("recompute", "abort", "missed")
EVICT = "evict"
# The last cumulative protect line of a runner (kvcanary.runtime.protect.ProtectStats.line).
PROTECT_RE = re.compile(
    r"kvcanary protect: step=(?P<step>\d+) recomputed=(?P<recomputed>\d+) aborted=(?P<aborted>\d+) "
    r"missed=(?P<missed>\d+) nodes_evicted=(?P<nodes_evicted>\d+) slots_evicted=(?P<slots_evicted>\d+) "
    r"nodes_deferred=(?P<nodes_deferred>\d+) tokens_discarded=(?P<tokens_discarded>\d+) "
    r"tokens_sent=(?P<tokens_sent>\d+) window_forwards_max=(?P<window_forwards_max>\d+) "
    r"window_tokens_max=(?P<window_tokens_max>\d+)"
)
MIN_INJECTIONS = 10  # per class in a fault phase (phase 3 asks 20 of its longer run)
# An action record acts on an injection when it names one of the injection's slots, at or after the injection, for a
# violation found no later than this many forwards after it (the fault match's window plus a drain; a token swap is
# seen when its row's next forward verifies it); its violation_step may be earlier (one action per request: the
# request's first violation, with the slots of every violation drained until protect acted).
ACT_WINDOW = {"token_swap": 256}
DEFAULT_ACT_WINDOW = 24
# Classes whose violation names a request (the request must be acted on); cached_idle_corruption is caught by the
# sweep on a node no request holds: acted on by an ``evict`` record, unless sglang evicted the node first.
REQUEST_CLASSES = ("req_to_token_redirect", "real_kv_flip", "token_swap", "position_skew")
CLEAN_KEY = "21"  # sglang_e2e.PROTECT_PHASES: the phase whose outputs are the reference


# ------------------------------------------------------------------------------------------------ worker
def run_workload(engine, groups, spec: dict, res: dict, save) -> None:
    """The worker's measured workload for a protect phase (instead of the driver's ``generate`` loop): each group's
    requests through ``engine.async_generate`` concurrently, one group after another; fills ``res`` with the
    per-request records (``protect_requests``: index, rid, output ids, finish type, error) and the counts."""
    import asyncio

    tag = f"pr{int(time.time() * 1000) % 10**8}"
    records: list[dict] = []
    temp = spec.get("temperature", 0.0)

    async def one(index: int, r) -> dict:
        rid = f"{tag}-{index}"
        rec = {"index": index, "rid": rid, "max_new": r.max_new_tokens, "prompt_len": len(r.input_ids)}
        try:
            out = await engine.async_generate(
                input_ids=r.input_ids, rid=rid,
                sampling_params=dict(temperature=temp, max_new_tokens=r.max_new_tokens, ignore_eos=True))
        except Exception as exc:  # sglang raises a request's abort (status 500: kvcanary's) as an exception
            detail = getattr(exc, "detail", None) or str(exc)
            rec.update(output_ids=[], output_len=0, cached_tokens=0, finish="error",
                       error=f"{type(exc).__name__}: {str(detail)[:300]}")
            return rec
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        fin = meta.get("finish_reason")
        rec.update(output_ids=list(out.get("output_ids") or []), cached_tokens=int(meta.get("cached_tokens") or 0),
                   finish=fin.get("type") if isinstance(fin, dict) else fin,
                   finish_message=(fin.get("message") if isinstance(fin, dict) else None))
        rec["output_len"] = int(meta.get("completion_tokens") or len(rec["output_ids"]))
        return rec

    t = time.perf_counter()
    index = 0
    for gi, group in enumerate(groups):
        if time.time() > spec["deadline"]:
            res["status"] = "TRUNCATED"
            res["note"] = f"deadline reached after {gi} of {len(groups)} groups"
            break

        async def send(first=index, group=group):
            return await asyncio.gather(*(one(first + i, r) for i, r in enumerate(group)))

        records += engine.loop.run_until_complete(send())
        index += len(group)
        summarize_requests(records, res)
        res["workload_s"] = round(time.perf_counter() - t, 3)
        save()
        print(f"[e2e-worker] protect group {gi}: {len(group)} req, {res['workload_s']:.2f} s so far, "
              f"named aborts {res['named_aborts']}, errors {len(res['errors'])}", flush=True)
    wall = time.perf_counter() - t
    summarize_requests(records, res)
    res["workload_s"] = round(wall, 3)
    res["tokens_per_s"] = round(res["output_tokens"] / wall, 1) if wall else None
    save()


def is_named_abort(rec: dict) -> bool:
    """A request that ended with kvcanary's abort (the exception's detail, or an abort finish reason's message)."""
    return ABORT_PREFIX in (rec.get("error") or "") or ABORT_PREFIX in (rec.get("finish_message") or "")


def summarize_requests(records: list[dict], res: dict) -> None:
    """The worker's counts from the per-request records (also used by the dry run): ``requests_ok`` (finished
    normally with every token), ``named_aborts``, ``errors`` (any other ending), and ``outputs`` (output ids by
    index; [] for a request that did not finish normally)."""
    records = sorted(records, key=lambda r: r["index"])
    res["protect_requests"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in records]
    res["requests_sent"] = len(records)
    res["requests_ok"] = sum(not r.get("error") and r.get("output_len") == r["max_new"] for r in records)
    res["named_aborts"] = sum(is_named_abort(r) for r in records)
    res["errors"] = [f"request {r['index']}: {r.get('output_len')}/{r['max_new']} tokens, finish={r.get('finish')}"
                     + (f" {r['error']}" if r.get("error") else "")
                     for r in records if not is_named_abort(r)
                     and (r.get("error") or r.get("output_len") != r["max_new"])][:20]
    res["output_tokens"] = sum(r.get("output_len") or 0 for r in records)
    res["cached_tokens"] = sum(r.get("cached_tokens") or 0 for r in records)
    res["outputs"] = [list(r.get("output_ids") or []) for r in records]
    res["rids"] = [r["rid"] for r in records]


# ------------------------------------------------------------------------------------------------ summary
def parse_protect_line(log_text: str) -> dict | None:
    """The last ``kvcanary protect:`` line of a log (cumulative for its runner), as ints, or None."""
    last = None
    for m in PROTECT_RE.finditer(log_text):
        last = m
    return None if last is None else {k: int(v) for k, v in last.groupdict().items()}


def acted_on(injections: list[dict], actions: list[dict]) -> dict[int, dict]:
    """``id(injection) -> the first action record acting on it`` (module constants: its slots, at or after it,
    within the class's window; same rank)."""
    rank_key = lambda r: json.dumps(r.get("rank"), sort_keys=True)  # noqa: E731
    by_slot: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for a in actions:
        for s in a.get("slots") or []:
            by_slot[(rank_key(a), int(s))].append(a)
    out = {}
    for i in injections:
        window = ACT_WINDOW.get(i.get("fault"), DEFAULT_ACT_WINDOW)
        for s in i.get("slots") or []:
            for a in by_slot.get((rank_key(i), int(s)), []):
                vs = a.get("violation_step")
                if a["step"] < i["step"]:
                    continue
                # (no lower bound on the violation step: a request condemned by an earlier violation and hit again
                # before protect acted gets one action, whose violation_step is its first, naming both slots)
                if vs is not None and vs > i["step"] + window:
                    continue
                if vs is None and a["step"] > i["step"] + window:
                    continue
                out.setdefault(id(i), a)
                break
            if id(i) in out:
                break
    return out


def summarize(kind: str, s: dict, rows: list[dict], res: dict, clean: dict | None, match, fault_classes,
              log_text: str) -> dict:
    """Fill a protect phase's summary row ``s`` (e2e_core.summarize_phase's counts) with the action records'
    counts, the per-class acted-on counts, the outputs against protect-clean's, and the detection window.
    ``kind``: clean, protect, hold. ``match``: e2e_core.match_injections of the rows (None for clean)."""
    actions = [r for r in rows if r.get("schema") == ACTION_SCHEMA]
    s["kind"] = kind
    s["hold"] = kind == "hold"
    s["named_aborts"] = res.get("named_aborts", 0)
    s["actions"] = dict(collections.Counter(a.get("action") for a in actions))
    s["nodes_evicted"] = sum(int(a.get("nodes_evicted") or 0) for a in actions)
    s["protect_line"] = parse_protect_line(log_text)
    acted_rows = [a for a in actions if a.get("action") in REQUEST_ACTIONS]
    windows = [int(a["window_forwards"]) for a in acted_rows if a.get("window_forwards") is not None]
    tokens = [int(a.get("tokens_over_bad_kv") or 0) for a in acted_rows]
    s["window_forwards"] = _spread(windows)
    s["window_tokens"] = _spread(tokens)
    s["tokens_sent_over_bad_kv"] = sum(int(a.get("tokens_sent") or 0) for a in acted_rows)
    # requests by index (the rid's tail)
    rid_index = {rid: i for i, rid in enumerate(res.get("rids") or [])}
    by_action: dict[str, set[int]] = collections.defaultdict(set)
    for a in acted_rows:
        i = rid_index.get(a.get("request_id"))
        if i is not None:
            by_action[a["action"]].add(i)
    s["requests_recomputed"] = len(by_action["recompute"])
    s["requests_missed"] = sorted(by_action["missed"])
    # outputs against protect-clean's
    mine, ref = res.get("outputs"), (clean or {}).get("outputs")
    reqs = res.get("protect_requests") or []
    s["outputs_compared"] = ref is not None and mine is not None
    differ_acted, differ_untouched = [], []
    if s["outputs_compared"]:
        acted_idx = set().union(*by_action.values()) if by_action else set()
        for i, r in enumerate(reqs):
            normal = not r.get("error") and r.get("output_len") == r.get("max_new")
            if not normal or i >= len(ref) or i >= len(mine) or not ref[i]:
                continue
            if mine[i] != ref[i]:
                (differ_acted if i in acted_idx else differ_untouched).append(i)
    s["differ_acted"], s["differ_untouched"] = differ_acted, differ_untouched
    # requests that finished over corrupted KV before protect acted (no hold: the window)
    s["finished_over_bad_kv"] = sorted(set(s["requests_missed"]) | set(differ_acted) | set(differ_untouched))
    if match is not None:
        inj = [r for r in rows if r.get("schema") == "kvcanary.injection/1"]
        firsts = acted_on(inj, actions)
        per = {}
        for c in fault_classes:
            mine_c = [i for i in inj if i.get("fault") == c]
            how = collections.Counter(firsts[id(i)]["action"] for i in mine_c if id(i) in firsts)
            per[c] = {"injections": match.injections.get(c, 0), "detected": match.detected.get(c, 0),
                      "acted": sum(how.values()), "how": dict(how)}
        s["classes"] = per
        s["unexplained"] = len(match.unexplained)
        s["ended"] = [(i["fault"], i["step"]) for i in match.ended]
    return s


def _spread(values: list[int]) -> dict | None:
    if not values:
        return None
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def verdict(kind: str, s: dict, clean_ok: bool) -> list[str]:
    """Why a protect phase fails (empty: PASS). ``clean_ok``: protect-clean's outputs are there to compare with."""
    why = []
    if s["status"] not in ("OK",):
        why.append(f"status {s['status']}")
    done = s["requests_ok"] + s.get("named_aborts", 0)
    if done != s["requests_sent"] or not s["requests_sent"]:
        why.append(f"{s['requests_ok']}/{s['requests_sent']} requests completed "
                   f"({s.get('named_aborts', 0)} aborted by kvcanary's name)")
    if s.get("errors"):
        why.append(f"engine errors={len(s['errors'])}")
    for k in ("lost", "health_errors", "kvcanary_errors"):
        if s.get(k):
            why.append(f"{k}={s[k]}")
    if s.get("entries_verified") in (None, 0):
        why.append("no kvcanary stats line (plugin not active?)")
    if kind == "clean":
        if s["violations"]:
            why.append(f"violations={s['violations']} without a fault")
        if s.get("actions"):
            why.append(f"protect acted without a fault: {s['actions']}")
        return why
    for c, r in (s.get("classes") or {}).items():
        if r["injections"] < MIN_INJECTIONS:
            why.append(f"{c}: {r['injections']} injections < {MIN_INJECTIONS}")
        if r["detected"] != r["injections"]:
            why.append(f"{c}: {r['detected']}/{r['injections']} detected")
        if not r["acted"]:
            why.append(f"{c}: no action record names its slots")
        elif c in REQUEST_CLASSES and r["acted"] != r["detected"]:
            why.append(f"{c}: {r['acted']}/{r['detected']} detected injections acted on")
    if s.get("unexplained"):
        why.append(f"{s['unexplained']} violation(s) on slots no injection touched")
    if not clean_ok:
        why.append("no outputs of protect-clean to compare with")
    if kind == "hold":
        if s.get("differ_acted"):
            why.append(f"{len(s['differ_acted'])} recomputed request(s) finished with an output that differs from "
                       f"protect-clean's")
        if s.get("differ_untouched"):
            why.append(f"{len(s['differ_untouched'])} request(s) protect never acted on finished with an output that "
                       "differs from protect-clean's (a corruption missed, or the engine's own nondeterminism across "
                       "schedules: see integration/README.md)")
        if s.get("requests_missed"):
            why.append(f"{len(s['requests_missed'])} request(s) finished before protect acted (missed) with the "
                       "window closed")
    return why


def _cell(d: dict | None) -> str:
    if not d:
        return "-"
    return f"{d['min']}..{d['max']} (median {d['median']:g}, n={d['n']})"


def render(rows: list[dict], fault_classes) -> list[str]:
    if not rows:
        return []
    out = ["", "| protect phase | hold | requests ok/sent | aborted by name | violations | actions | nodes evicted | "
               "window forwards | tokens over bad KV per request | finished over bad KV | outputs = clean | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acts = ", ".join(f"{k}×{v}" for k, v in sorted((r.get("actions") or {}).items())) or "0"
        if not r.get("outputs_compared"):
            same = "-"
        elif r["kind"] == "clean":
            same = "(reference)"
        else:
            n = len(r.get("differ_acted") or []) + len(r.get("differ_untouched") or [])
            same = "yes" if not n else (f"no: {len(r['differ_acted'])} acted on, "
                                        f"{len(r['differ_untouched'])} never acted on")
        fin = "-" if r["kind"] == "clean" else (f"{len(r['finished_over_bad_kv'])} "
                                                f"({len(r.get('requests_missed') or [])} missed)")
        out.append(f"| {r['phase']} | {'yes' if r.get('hold') else 'no'} | {r['requests_ok']}/{r['requests_sent']} | "
                   f"{r.get('named_aborts', 0)} | {r['violations']} | {acts} | {r.get('nodes_evicted', 0)} | "
                   f"{_cell(r.get('window_forwards'))} | {_cell(r.get('window_tokens'))} | {fin} | {same} | "
                   f"{r.get('verdict', '-')} |")
    for r in rows:
        classes = r.get("classes")
        if not classes:
            continue
        out += ["", f"| {r['phase']}: fault class | injections | detected | acted on | how |", "|---|---|---|---|---|"]
        for c in fault_classes:
            x = classes.get(c) or {"injections": 0, "detected": 0, "acted": 0, "how": {}}
            how = ", ".join(f"{k}×{v}" for k, v in sorted(x["how"].items())) or "-"
            out.append(f"| {c} | {x['injections']} | {x['detected']} | {x['acted']} | {how} |")
    for r in rows:
        line = r.get("protect_line")
        if line:
            out.append(f"- {r['phase']}: last `kvcanary protect:` line: " + " ".join(
                f"{k}={v}" for k, v in line.items()))
        if r.get("ended"):
            out.append(f"- {r['phase']}: {len(r['ended'])} injection(s) in the run's last forwards, not read by a "
                       "verify or sweep before the workload ended (not judged): "
                       + ", ".join(f"{c}@{step}" for c, step in r["ended"]))
    return out


# ------------------------------------------------------------------------------------------------ dry run
def dry_run(kind: str, pdir: str, base: dict, groups, fault_classes, expected_reasons) -> dict:
    """A protect phase's worker output, synthesized: every request completes with the reference outputs; in the
    fault phases each injection is detected and acted on (a recompute, with the hold phase's window 0; the
    cached-idle class an eviction), and without hold two requests finish over bad KV (missed)."""
    import os

    reqs = [r for g in groups for r in g]
    records = []
    for i, r in enumerate(reqs):
        n = r.max_new_tokens
        records.append({"index": i, "rid": f"dry-{i}", "max_new": n, "prompt_len": len(r.input_ids),
                        "output_ids": [(7 * i + k) % 2048 for k in range(n)], "output_len": n,
                        "cached_tokens": 0, "finish": "length"})
    rows, log = [], "[dry-run]\n"
    if kind != "clean":
        step, victim, missed = 12, 0, 0
        for c in tuple(fault_classes) * 12:
            slots = [1000 + step, 2000 + step] if c == "req_to_token_redirect" else [1000 + step]
            rows.append({"schema": "kvcanary.injection/1", "fault": c, "step": step, "slots": slots,
                         "detail": "dry-run", "rank": {"tp_rank": 0}})
            vstep = step + 1
            rows.append({"schema": "kvcanary.violation/1", "step": vstep, "slot": slots[0],
                         "tag": "sweep" if c == "cached_idle_corruption" else "verify",
                         "reasons": [expected_reasons[c][0]], "rank": {"tp_rank": 0}})
            if c == "cached_idle_corruption":
                rows.append({"schema": ACTION_SCHEMA, "action": EVICT, "step": vstep + 2, "request_id": None,
                             "violation_step": None, "window_forwards": None, "slots": slots, "nodes_evicted": 1,
                             "slots_evicted": 4, "tokens_over_bad_kv": 0, "tokens_sent": 0, "rank": {"tp_rank": 0}})
            else:
                hold = kind == "hold"
                action = "missed" if not hold and missed < 2 and c == "real_kv_flip" else "recompute"
                missed += action == "missed"
                window = 0 if hold else 3 + step % 6
                rows.append({"schema": ACTION_SCHEMA, "action": action, "step": vstep + window,
                             "request_id": f"dry-{victim}", "violation_step": vstep, "window_forwards": window,
                             "slots": slots[:1], "nodes_evicted": 0, "slots_evicted": 0,
                             "tokens_over_bad_kv": 0 if hold else window,
                             "tokens_sent": window if action == "missed" else 0, "rank": {"tp_rank": 0}})
                if action == "missed":  # it finished over bad KV: its output differs
                    records[victim]["output_ids"] = [1] * records[victim]["max_new"]
                victim = (victim + 5) % len(records)
            step += 4
        log += ("kvcanary protect: step=900 recomputed=48 aborted=0 missed=2 nodes_evicted=12 slots_evicted=48 "
                "nodes_deferred=0 tokens_discarded=120 tokens_sent=8 window_forwards_max=8 window_tokens_max=8\n")
    violations = sum(r["schema"] == "kvcanary.violation/1" for r in rows)
    log += ("kvcanary stats: step=1200 forwards=1200 tokens_written=300000 entries_verified=2500000 "
            f"entries_swept=90000 violations={violations} lost=0\n")
    with open(os.path.join(pdir, "worker.log"), "w") as f:
        f.write(log)
    with open(os.path.join(pdir, "kvc-0.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    res = dict(base)
    summarize_requests(records, res)
    return res


# ------------------------------------------------------------------------------------------ driver side
# sglang_e2e.PROTECT_PHASES' keys: what each phase is judged as (``summarize``'s and ``verdict``'s kind)
PROTECT_KIND = {CLEAN_KEY: "clean", "22": "protect", "23": "hold"}


def summarize_protect(phase: Phase, pdir: str, res: dict, results: dict) -> dict:
    """A protect phase's row: the clean-phase counts, the fault match (phase 3's), the action records per class,
    the outputs against protect-clean's, the detection window, the verdict."""
    import glob
    import os

    from e2e_core import E2E_FAULTS, match_injections, read_jsonl, read_text, summarize_phase

    kind = PROTECT_KIND[phase.key]
    log_text = read_text(os.path.join(pdir, "worker.log"))
    rows = read_jsonl(sorted(glob.glob(os.path.join(pdir, "kvc-*.jsonl"))))
    s = summarize_phase(phase, res, log_text, rows)
    clean = results.get(CLEAN_KEY)
    match = match_injections(rows) if kind != "clean" else None
    summarize(kind, s, rows, res, clean, match, E2E_FAULTS, log_text)
    why = verdict(kind, s, kind == "clean" or bool((clean or {}).get("outputs")))
    s["verdict"], s["why"] = ("PASS" if not why else "FAIL"), why
    return s
