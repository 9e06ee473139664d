"""The hunt phases of integration/sglang_e2e.py (issue 27, item 5): kvcanary, as shipped, under the triggers of sglang
bugs and races that are open (or were open) upstream, each phase reporting what the canary saw and evidence that the
trigger really happened.

Phases (keys in sglang_e2e.HUNT_PHASES; the tiny dummy-weight Llama, ``KVCANARY_MODE=log`` with the token check):

* ``hunt-overlap-cached`` (sglang PR 38140, open): under the overlap scheduler a prompt the radix cache holds in full
  is matched up to ``len - 1``; its last token is recomputed into a fresh slot, the request's first decode step is
  launched while ``req_to_token`` still points there, then ``cache_unfinished_req`` dedups the token against the
  tree's slot, frees the fresh slot and rewrites ``req_to_token``. Both slots hold the same token at the same
  position: this must not become a kvcanary false positive. Trigger evidence: the observer's ``rewrite`` lines
  with ``launched_decode=1`` (the batch launched just before the rewrite is a decode batch holding the request).
* ``hunt-spec-abort`` (sglang issue 23392, open): shared-prefix requests under speculative decoding, two of them
  aborted ~15 ms and ~19 ms after they were sent, retried at once, with unrelated requests arriving in the same
  window. The issue's reproduction uses NGRAM, which kvcanary refuses (its spec coverage is EAGLE, topk 1), and
  PR 24175's fix disables the radix cache under NGRAM; PR 24175's validation saw the cancellation harness diverge
  with radix on under other algorithms too, so the phase runs the same trigger under EAGLE (topk 1), the
  26329 chunk-tail fix patched in (test-only) so that known bug stays out. Trigger evidence: the observer's
  ``abort`` lines for requests the scheduler was running (their KV allocated) and retries that completed.
* ``hunt-determ-radix`` (sglang issue 22819, open): ``--enable-deterministic-inference`` with the radix cache
  (triton attention: sglang keeps radix on for it; finished requests are not inserted in this mode, only running
  ones), waves of requests sharing a 64-token prefix arriving while earlier waves still decode, plus exact
  repeats. Trigger evidence: requests whose radix hit is exactly the 64-token prefix; repeats whose greedy outputs
  differ are counted (the issue's symptom) but not judged (dummy weights).
* ``hunt-hicache-hostfree`` (sglang PR 31427, open): HiCache ``write_back`` with a host tier only twice the device
  pool, so loading a prefix back can make sglang evict device nodes, back them up to the host and evict host
  nodes while the load-back still holds its host indices (0.5.12's ``load_back`` takes no host lock: the
  re-entrant path of PR 27631 / 27444 / 31427). Trigger evidence: the observer's ``hostfree`` lines (host slots
  freed that an in-progress load-back is reading).

Verdicts (one per phase): ``CAUGHT`` (violations, with the trigger observed: the rows are listed for analysis),
``CLEAN`` (0 violations / lost / health errors, entries verified > 0, the trigger observed), ``NOT TRIGGERED``
(the canary saw nothing, but neither did the observer: no statement about the bug), ``FALSE POSITIVE`` (for
hunt-overlap-cached: any violation), ``FAIL`` (the phase did not run through).

Nothing here imports sglang or kvcanary at module level (the driver's rule); the observers run in sglang's
processes through the test-only plugin (integration/driver_plugin.py) and change nothing sglang does. The driver
side (the worker's plugin environment, the phase rows, the dry run) imports the driver core
(integration/e2e_core.py) and driver_plugin.py inside its functions: sglang's processes load this file alone.
"""

from __future__ import annotations

import collections
import random
import re
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: sglang's processes load this file alone)
    from e2e_core import Phase

HUNT_ENV = "E2E_HUNT"  # the observer to install in sglang's processes (the phase's kind)
HUNT_DRIVER_ENV = "E2E_HUNT_PHASES_FILE"
HUNT_PLUGIN = "kvcanary_e2e_hunt"
HUNT_LINE_RE = re.compile(r"\[e2e-hunt\] (?P<kind>[\w-]+): (?P<fields>[^\n]*)")
SHARED_PREFIX_DETERM = 64  # issue 22819: prefix length 64
SHARED_PREFIX_ABORT = 128  # issue 23392: prefix_len=128
ABORT_AFTER_S = (0.015, 0.019)  # issue 23392: cancels at 15 ms and 19 ms

# kind -> (upstream reference, what the trigger is, how the phase counts it)
KINDS: dict[str, tuple[str, str]] = {
    "overlap-cached": ("sglang PR 38140", "fully cached prompt's first decode launched before the radix rewrite"),
    "spec-abort": ("sglang issue 23392", "running shared-prefix requests aborted under EAGLE, retried"),
    "determ-radix": ("sglang issue 22819", "deterministic inference, radix hit of exactly the 64-token prefix"),
    "hicache-hostfree": ("sglang PR 31427", "host KV freed while a load-back reads it"),
}

HUNT_ENGINE: dict[str, tuple[tuple[str, object], ...]] = {
    # sglang's defaults otherwise: overlap scheduler on, radix cache on, decode graphs
    "overlap-cached": (("max_running_requests", 64),),
    "spec-abort": (("speculative_algorithm", "EAGLE"), ("speculative_num_steps", 2), ("speculative_eagle_topk", 1),
                   ("speculative_num_draft_tokens", 3), ("chunked_prefill_size", 64), ("max_running_requests", 32),
                   ("cuda_graph_max_bs", 32)),
    # The driver's chunk (512): under deterministic inference triton aligns a truncated prefill chunk to 4,096
    # tokens, so a request that does not fit what is left of a batch's chunk waits for the next batch instead of
    # being split; every prompt here (<= 224 tokens) fits a whole chunk. (The 2026-12-02 H200 run used
    # chunked_prefill_size=4096, i.e. larger prefill batches; integration/results/sglang_e2e_h200_hunt.md.)
    "determ-radix": (("enable_deterministic_inference", True), ("max_running_requests", 64)),
    "hicache-hostfree": (("enable_hierarchical_cache", True), ("hicache_ratio", 2.0),
                         ("hicache_write_policy", "write_back"), ("max_running_requests", 48)),
}
HUNT_POOL = {"overlap-cached": 12288, "spec-abort": 12288, "determ-radix": 12288, "hicache-hostfree": 6144}


# ------------------------------------------------------------------------------------------------ workloads
def make_schedule(kind: str, seed: int = 0, vocab: int = 2048) -> list[dict]:
    """The requests of a hunt phase in send order: ``{"name", "input_ids", "max_new", "at" (s after the start of
    its wave), "wave", "abort_after" (s after it was sent, or None), "retry_of" (name, or None)}``. A wave is sent
    when the previous one has been sent and ``gap`` seconds have passed (``wave_gap``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown hunt phase kind {kind!r}")
    rng = random.Random(seed + {"overlap-cached": 38140, "spec-abort": 23392, "determ-radix": 22819,
                                "hicache-hostfree": 31427}[kind])

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    out: list[dict] = []

    def add(name, input_ids, max_new, wave, at=0.0, abort_after=None, retry_of=None):
        out.append({"name": name, "input_ids": input_ids, "max_new": max_new, "wave": wave, "at": at,
                    "abort_after": abort_after, "retry_of": retry_of})

    if kind == "overlap-cached":
        # 32 distinct prompts, then the same prompts twice more: every prompt of waves 1-2 is cached in full
        prompts = [(ids(rng.randint(24, 300)), rng.randint(8, 24)) for _ in range(32)]
        for wave in range(3):
            for i, (p, n) in enumerate(prompts):
                add(f"w{wave}-p{i}", list(p), n, wave)
    elif kind == "spec-abort":
        prefix = ids(SHARED_PREFIX_ABORT)
        for wave in range(4):
            for i in range(8):
                abort = ABORT_AFTER_S[i] if i < len(ABORT_AFTER_S) else None
                add(f"w{wave}-s{i}", prefix + ids(rng.randint(8, 48)), 64, wave, abort_after=abort)
            for i in range(4):  # unrelated requests in the same window
                add(f"w{wave}-u{i}", ids(rng.randint(40, 200)), 48, wave, at=0.010 + 0.003 * i)
            srcs = out[-(4 + 8):-4]  # this wave's shared-prefix requests (the first ones are aborted)
            for i in range(len(ABORT_AFTER_S)):  # retries of the aborted ones, right after their abort
                src = srcs[i]
                add(f"w{wave}-s{i}-retry", list(src["input_ids"]), 64, wave, at=ABORT_AFTER_S[i] + 0.002,
                    retry_of=src["name"])
    elif kind == "determ-radix":
        prefix = ids(SHARED_PREFIX_DETERM)
        firsts: list[tuple[list[int], int]] = []
        for wave in range(6):
            for i in range(8):
                own, n = prefix + ids(rng.randint(8, 160)), rng.randint(48, 96)
                firsts.append((own, n))
                add(f"w{wave}-d{i}", own, n, wave, at=0.002 * i)
            for i in range(2):  # exact repeats of earlier prompts (deterministic: same greedy output)
                own, n = rng.choice(firsts)
                add(f"w{wave}-r{i}", list(own), n, wave, at=0.020 + 0.002 * i)
    elif kind == "hicache-hostfree":
        import hicache_phases  # the multi-turn HiCache workload (~7x the device pool, ~3.5x the host tier here)

        for g, group in enumerate(hicache_phases.hicache_workload(seed)):
            for i, (p, n) in enumerate(group):
                add(f"g{g}-{i}", p, n, g)
    else:
        raise ValueError(f"unknown hunt phase kind {kind!r}")
    return out


WAVE_GAP_S = {"overlap-cached": None, "spec-abort": 0.25, "determ-radix": 0.05, "hicache-hostfree": None}


def run_workload(engine, spec: dict, res: dict, save) -> None:
    """The worker's measured workload for a hunt phase (instead of the driver's groups): waves of ``make_schedule``
    sent through ``engine.async_generate`` with their own request ids on the Engine's event loop, aborts through the
    tokenizer manager; waves without a gap (``WAVE_GAP_S`` None) wait for the previous one to finish. Fills
    ``res["hunt_requests"]`` (name, cached tokens, output length, finish reason, aborted, output ids)."""
    import asyncio

    kind = spec["hunt"]
    sched = make_schedule(kind, spec.get("seed", 0))
    gap = WAVE_GAP_S[kind]
    records: list[dict] = []
    temp = spec.get("temperature", 0.0)
    tag = f"hunt{int(time.time() * 1000) % 10**8}"

    async def one(r: dict, t_wave: float) -> None:
        await asyncio.sleep(max(0.0, t_wave + r["at"] - time.monotonic()))
        rid = f"{tag}-{r['name']}"
        rec = {"name": r["name"], "retry_of": r["retry_of"], "max_new": r["max_new"],
               "prompt_len": len(r["input_ids"]), "abort_sent": False}
        task = asyncio.ensure_future(engine.async_generate(
            input_ids=r["input_ids"], rid=rid,
            sampling_params=dict(temperature=temp, max_new_tokens=r["max_new"], ignore_eos=True)))
        if r["abort_after"] is not None:
            await asyncio.sleep(r["abort_after"])
            if not task.done():
                engine.tokenizer_manager.abort_request(rid=rid)
                rec["abort_sent"] = True
        try:
            out = await task
        except Exception as exc:  # an aborted request may end in an error instead of a result
            rec.update(error=f"{type(exc).__name__}: {str(exc)[:200]}", output_len=0, cached_tokens=0,
                       finish=None, output_ids=[])
            records.append(rec)
            return
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        fin = meta.get("finish_reason")
        rec.update(output_ids=list(out.get("output_ids") or []), cached_tokens=int(meta.get("cached_tokens") or 0),
                   finish=fin.get("type") if isinstance(fin, dict) else fin)
        rec["output_len"] = int(meta.get("completion_tokens") or len(rec["output_ids"]))
        records.append(rec)

    async def main() -> None:
        waves = sorted({r["wave"] for r in sched})
        pending: list = []
        for w in waves:
            if time.time() > spec["deadline"]:
                res["status"] = "TRUNCATED"
                res["note"] = f"deadline reached before wave {w}"
                break
            t_wave = time.monotonic()
            tasks = [asyncio.ensure_future(one(r, t_wave)) for r in sched if r["wave"] == w]
            if gap is None:
                await asyncio.gather(*tasks)
            else:
                pending += tasks
                await asyncio.sleep(gap)
        if pending:
            await asyncio.gather(*pending)

    t = time.perf_counter()
    engine.loop.run_until_complete(main())
    wall = time.perf_counter() - t
    summarize_requests(records, res, kind, spec.get("seed", 0))
    res["workload_s"] = round(wall, 3)
    res["tokens_per_s"] = round(res["output_tokens"] / wall, 1) if wall else None
    save()


def summarize_requests(records: list[dict], res: dict, kind: str, seed: int = 0) -> None:
    """The worker's counts from the per-request records (also used by the dry run)."""
    res["hunt_requests"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in records]
    res["requests_sent"] = len(records)
    aborted = [r for r in records if r.get("abort_sent")]
    done = [r for r in records if not r.get("abort_sent")]
    res["requests_ok"] = sum(r.get("output_len") == r["max_new"] for r in done)
    res["aborts_sent"] = len(aborted)
    res["aborted_finished_abort"] = sum(r.get("finish") == "abort" or bool(r.get("error")) for r in aborted)
    res["retries_ok"] = sum(r.get("output_len") == r["max_new"] for r in done if r.get("retry_of"))
    res["errors"] = [f"{r['name']}: {r.get('output_len')}/{r['max_new']} tokens, finish={r.get('finish')}"
                     + (f" {r['error']}" if r.get("error") else "")
                     for r in done if r.get("output_len") != r["max_new"]][:20]
    res["output_tokens"] = sum(r.get("output_len") or 0 for r in records)
    res["cached_tokens"] = sum(r.get("cached_tokens") or 0 for r in records)
    res["prefix_hits_exact_64"] = sum(r.get("cached_tokens") == SHARED_PREFIX_DETERM for r in records)
    mark_repeats(kind, seed, {r["name"]: r.get("output_ids") or [] for r in records}, res)


def mark_repeats(kind: str, seed: int, outputs: dict[str, list[int]], res: dict) -> None:
    """Compare the outputs of identical prompts (the schedule rebuilt from the seed): ``repeats`` (completed
    requests whose prompt and length an earlier completed one had) and ``repeats_differ`` (of them, those whose
    output differs from that earlier one's) in ``res``."""
    ok = {r["name"] for r in res.get("hunt_requests", []) if not r.get("abort_sent")
          and r.get("output_len") == r.get("max_new")}
    first: dict[tuple, list[int]] = {}
    repeats = differ = 0
    for r in make_schedule(kind, seed):
        if r["name"] not in ok or not outputs.get(r["name"]):
            continue
        key = (tuple(r["input_ids"]), r["max_new"])
        if key in first:
            repeats += 1
            differ += outputs[r["name"]] != first[key]
        else:
            first[key] = outputs[r["name"]]
    res["repeats"], res["repeats_differ"] = repeats, differ


# ------------------------------------------------------------------------------------------------ observers
def install_hunt_observer(kind: str) -> None:
    """Test-only, in every sglang process (the plugin calls it when ``E2E_HUNT`` is set): print a line per trigger
    event. Observes only: every wrapped method does what it did."""
    if kind == "overlap-cached":
        _observe_overlap_rewrite()
    elif kind == "spec-abort":
        _observe_aborts()
    elif kind == "hicache-hostfree":
        _observe_host_free_during_load()
    elif kind != "determ-radix":  # (22819's trigger is counted from the requests' radix hits)
        raise ValueError(f"{HUNT_ENV}: unknown hunt kind {kind!r}")


_SCHED: list = []  # the scheduler of this process, once it processed a batch result


def _remember_scheduler() -> None:
    import sglang.srt.managers.scheduler as sm

    if getattr(sm.Scheduler.process_batch_result, "_e2e_hunt", False):
        return
    orig = sm.Scheduler.process_batch_result

    def process_batch_result(self, *args, **kwargs):
        if not _SCHED:
            _SCHED.append(self)
        return orig(self, *args, **kwargs)

    process_batch_result._e2e_hunt = True  # type: ignore[attr-defined]
    sm.Scheduler.process_batch_result = process_batch_result


def _observe_overlap_rewrite() -> None:
    import sglang.srt.mem_cache.radix_cache as rc

    if getattr(rc.RadixCache.cache_unfinished_req, "_e2e_hunt", False):
        return
    _remember_scheduler()
    orig = rc.RadixCache.cache_unfinished_req

    def cache_unfinished_req(self, req, *args, **kwargs):
        last = len(req.origin_input_ids) - 1
        watch = (not self.disable and req.req_pool_idx is not None and len(req.fill_ids) == last + 1
                 and req.cache_protected_len <= last)
        before = int(self.req_to_token_pool.req_to_token[req.req_pool_idx, last]) if watch else None
        out = orig(self, req, *args, **kwargs)
        if watch:
            after = int(self.req_to_token_pool.req_to_token[req.req_pool_idx, last])
            if after != before:
                sched = _SCHED[0] if _SCHED else None
                cur = getattr(sched, "cur_batch", None)
                launched = int(cur is not None and cur.forward_mode.is_decode()
                               and any(r is req for r in cur.reqs))
                overlap = int(bool(getattr(sched, "enable_overlap", False)))
                print(f"[e2e-hunt] overlap-cached: rid={req.rid} position={last} fresh_slot={before} "
                      f"tree_slot={after} launched_decode={launched} overlap={overlap}", flush=True)
        return out

    cache_unfinished_req._e2e_hunt = True  # type: ignore[attr-defined]
    rc.RadixCache.cache_unfinished_req = cache_unfinished_req
    print("[e2e-hunt] observer: RadixCache.cache_unfinished_req (PR 38140 rewrite)", flush=True)


def _observe_aborts() -> None:
    import sglang.srt.managers.scheduler as sm

    if getattr(sm.Scheduler.abort_request, "_e2e_hunt", False):
        return
    orig = sm.Scheduler.abort_request

    def abort_request(self, recv_req, *args, **kwargs):
        rid = getattr(recv_req, "rid", "") or ""
        waiting = any(r.rid.startswith(rid) for r in self.waiting_queue) if rid else False
        batches = [getattr(self, "running_batch", None), getattr(self, "cur_batch", None),
                   getattr(self, "last_batch", None)]
        running = any(b is not None and any(r.rid.startswith(rid) for r in b.reqs) for b in batches) if rid \
            else False
        chunked = bool(rid) and getattr(self, "chunked_req", None) is not None and \
            self.chunked_req.rid.startswith(rid)
        print(f"[e2e-hunt] spec-abort: rid={rid} running={int(running)} waiting={int(waiting)} "
              f"chunked={int(chunked)}", flush=True)
        return orig(self, recv_req, *args, **kwargs)

    abort_request._e2e_hunt = True  # type: ignore[attr-defined]
    sm.Scheduler.abort_request = abort_request
    print("[e2e-hunt] observer: Scheduler.abort_request (issue 23392)", flush=True)


_LOADING: list = []  # host indices of the load-back in progress in this process (a stack: load_back may nest)


def _observe_host_free_during_load() -> None:
    import sglang.srt.managers.cache_controller as cc
    import sglang.srt.mem_cache.hiradix_cache as hr
    import torch

    if getattr(hr.HiRadixCache.load_back, "_e2e_hunt", False):
        return
    orig_load_back = hr.HiRadixCache.load_back
    orig_evict_host = cc.HiCacheController.evict_host

    def load_back(self, node, *args, **kwargs):
        chain, x = [], node
        while x is not None and x.evicted and getattr(x, "host_value", None) is not None:
            chain.append(x.host_value)
            x = x.parent
        _LOADING.append(set(torch.cat(chain).tolist()) if chain else set())
        try:
            return orig_load_back(self, node, *args, **kwargs)
        finally:
            _LOADING.pop()

    def evict_host(self, host_indices, *args, **kwargs):
        if _LOADING and _LOADING[-1]:
            hit = _LOADING[-1].intersection(host_indices.tolist())
            if hit:
                print(f"[e2e-hunt] hicache-hostfree: freed={len(host_indices)} loading_freed={len(hit)} "
                      f"loading={len(_LOADING[-1])}", flush=True)
        return orig_evict_host(self, host_indices, *args, **kwargs)

    load_back._e2e_hunt = True  # type: ignore[attr-defined]
    hr.HiRadixCache.load_back = load_back
    cc.HiCacheController.evict_host = evict_host
    print("[e2e-hunt] observer: HiRadixCache.load_back + HiCacheController.evict_host (PR 31427)", flush=True)


# ------------------------------------------------------------------------------------------------ summary
def parse_hunt_lines(log_text: str) -> dict[str, list[dict]]:
    """The observer's lines by kind: ``{kind: [{field: value}]}`` (values as ints where they are)."""
    from e2e_core import kv_fields  # (driver side only: sglang's processes load this file alone)

    out: dict[str, list[dict]] = collections.defaultdict(list)
    for m in HUNT_LINE_RE.finditer(log_text):
        fields = kv_fields(m["fields"])
        if fields:
            out[m["kind"]].append(fields)
    return dict(out)


def trigger_count(kind: str, lines: dict[str, list[dict]], res: dict) -> tuple[int, str]:
    """How often the phase's trigger was observed, and the evidence in words."""
    mine = lines.get(kind, [])
    if kind == "overlap-cached":
        n = sum(1 for x in mine if x.get("launched_decode") == 1 and x.get("overlap") == 1)
        return n, (f"{len(mine)} radix rewrites of a fully cached prompt's recomputed last slot, {n} of them after "
                   f"the request's first decode was launched (overlap scheduler)")
    if kind == "spec-abort":
        running = sum(1 for x in mine if x.get("running") == 1 or x.get("chunked") == 1)
        return min(running, res.get("retries_ok", 0)), (
            f"{res.get('aborts_sent', 0)} aborts sent, {len(mine)} reached the scheduler, {running} of running "
            f"requests (KV allocated), {res.get('aborted_finished_abort', 0)} ended aborted; "
            f"{res.get('retries_ok', 0)} retries completed")
    if kind == "determ-radix":
        n = res.get("prefix_hits_exact_64", 0)
        return n, (f"{n} requests whose radix hit is exactly the {SHARED_PREFIX_DETERM}-token prefix; "
                   f"{res.get('repeats_differ', 0)} of {res.get('repeats', 0)} exact repeats gave another greedy "
                   "output")
    if kind == "hicache-hostfree":
        n = len(mine)
        freed = sum(x.get("loading_freed", 0) for x in mine)
        return n, f"{n} host evictions freed {freed} host slots a load-back in progress was reading"
    raise ValueError(kind)


def verdict(kind: str, s: dict, triggers: int) -> tuple[str, list[str]]:
    """(verdict, why) of a hunt phase from its summary row ``s`` (violations, lost, entries verified, ...)."""
    why = []
    if s["status"] not in ("OK", "TRUNCATED"):
        return "FAIL", [f"status {s['status']}"]
    if s.get("entries_verified") in (None, 0):
        return "FAIL", ["no entries verified (kvcanary not active?)"]
    if s["requests_ok"] + s.get("aborts_sent", 0) < s["requests_sent"]:
        why.append(f"{s['requests_ok']}/{s['requests_sent'] - s.get('aborts_sent', 0)} requests completed")
    for k in ("lost", "health_errors", "kvcanary_errors"):
        if s.get(k):
            why.append(f"{k}={s[k]}")
    if s["violations"]:
        return ("FALSE POSITIVE" if kind == "overlap-cached" else "CAUGHT"), why
    if why:
        return "FAIL", why
    if not triggers:
        return "NOT TRIGGERED", ["the trigger was not observed"]
    return "CLEAN", []


def render(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["", "| hunt phase | upstream | trigger observed | requests ok/sent | forwards | entries verified | "
               "violations (rows, distinct slots) | lost | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['phase']} | {r['upstream']} | {r['triggers']}: {r['evidence']} | "
                   f"{r['requests_ok']}/{r['requests_sent']} | {r['forwards'] if r['forwards'] is not None else '-'} | "
                   f"{r['entries_verified'] if r['entries_verified'] is not None else '-'} | "
                   f"{r['violations']}, {r.get('distinct_slots', 0)} | {r['lost']} | {r['verdict']} |")
    for r in rows:
        for v in r.get("violation_examples") or []:
            out.append(f"- {r['phase']}: step={v.get('step')} pool={(v.get('rank') or {}).get('pool', '-')} "
                       f"slot={v.get('slot')} position={v.get('position')} "
                       f"reasons={'+'.join(v.get('reasons', []))} via={v.get('via')}")
    return out


# ------------------------------------------------------------------------------------------ driver side
def hunt_kind(phase: Phase) -> str | None:
    return phase.workload[len("hunt-"):] if phase.workload.startswith("hunt-") else None


def hunt_env(env: dict, phase: Phase, pdir: str) -> dict:
    """A hunt phase's worker environment: the test-only observer plugin on PYTHONPATH, and where it finds
    hunt_phases.py."""
    import os

    from driver_plugin import with_test_plugin  # (driver side only: sglang's processes load this file alone)

    if hunt_kind(phase) is None:
        return env
    return with_test_plugin(env, os.path.join(pdir, "hunt-plugin"), HUNT_PLUGIN,
                            about="integration/hunt_phases.py, the hunt observers", gate_env=HUNT_ENV,
                            file_env=HUNT_DRIVER_ENV, module="_kvcanary_e2e_hunt",
                            function="install_hunt_observer", driver_file=__file__)


def summarize_hunt(phase: Phase, pdir: str, res: dict) -> dict:
    """A hunt phase's row: the clean-phase counts, the trigger the observer (or the requests) showed, the
    violations (distinct slots, examples), the verdict."""
    import glob
    import os

    from e2e_core import VIOLATION_SCHEMA, pool_of, read_jsonl, read_text, summarize_phase

    kind = hunt_kind(phase)
    log_text = read_text(os.path.join(pdir, "worker.log"))
    rows = read_jsonl(sorted(glob.glob(os.path.join(pdir, "kvc-*.jsonl"))))
    s = summarize_phase(phase, res, log_text, rows)
    for k in ("aborts_sent", "aborted_finished_abort", "retries_ok", "prefix_hits_exact_64", "repeats",
              "repeats_differ"):
        s[k] = res.get(k, 0)
    s["triggers"], s["evidence"] = trigger_count(kind, parse_hunt_lines(log_text), res)
    s["upstream"] = KINDS[kind][0]
    vio = [r for r in rows if r.get("schema") == VIOLATION_SCHEMA]
    s["distinct_slots"] = len({(pool_of(r), r.get("slot")) for r in vio})
    s["violation_examples"] = vio[:8]
    s["verdict"], s["why"] = verdict(kind, s, s["triggers"])
    return s


def dry_run_hunt(phase: Phase, pdir: str, base: dict, seed: int = 0) -> dict:
    """A hunt phase's worker output, synthesized: every request completes (aborted ones end aborted, retries
    complete), the observer printed a few trigger lines, kvcanary verified entries and found nothing."""
    import os

    kind = hunt_kind(phase)
    records = []
    for r in make_schedule(kind, seed):
        aborted = r["abort_after"] is not None
        n = 3 if aborted else r["max_new"]
        cached = (SHARED_PREFIX_DETERM if kind == "determ-radix" and r["wave"] > 0 and "-d" in r["name"]
                  else len(r["input_ids"]) - 1 if kind == "overlap-cached" and r["wave"] > 0 else 0)
        records.append({"name": r["name"], "retry_of": r["retry_of"], "max_new": r["max_new"],
                        "prompt_len": len(r["input_ids"]), "abort_sent": aborted, "output_len": n,
                        "cached_tokens": cached, "finish": "abort" if aborted else "length",
                        "output_ids": [7] * n})
    res = dict(base)
    summarize_requests(records, res, kind, seed)
    lines = {
        "overlap-cached": "[e2e-hunt] overlap-cached: rid=x position=40 fresh_slot=900 tree_slot=17 "
                          "launched_decode=1 overlap=1\n",
        "spec-abort": "[e2e-hunt] spec-abort: rid=x running=1 waiting=0 chunked=0\n",
        "determ-radix": "",
        "hicache-hostfree": "[e2e-hunt] hicache-hostfree: freed=256 loading_freed=64 loading=300\n",
    }[kind] * 8
    with open(os.path.join(pdir, "worker.log"), "w") as f:
        f.write("[dry-run]\n" + lines + "kvcanary stats: step=800 forwards=800 tokens_written=90000 "
                "entries_verified=1500000 entries_swept=40000 violations=0 lost=0\n")
    open(os.path.join(pdir, "kvc-0.jsonl"), "w").close()
    return res
