"""The EAGLE phases of integration/sglang_e2e.py (speculative decoding, phases 5-8 and 15-16): the draft model, the
Engine arguments and the test-only plugin of each phase, the workloads, what a phase's run folder says, the matching
of violations to the chunk tails the plugin printed, the verdicts, the tables and the dry run.

EAGLE with one draft per step (topk 1, sglang 0.5.12's spec-v2 path), a one-layer dummy draft beside the tiny Llama.
kvcanary shadows the target and the draft KV pool, each with its own manager; its lines and records carry
``pool=target`` / ``pool=draft``. Phases (keys in sglang_e2e.EAGLE_PHASES and EAGLE_RETRACT_PHASES):

* ``eagle-bug`` (sglang 0.5.12 as shipped), ``eagle-fixed`` (upstream's fix patched in), ``eagle-soak`` (raise,
  320 requests) and ``eagle-faults`` (faults into the target pool);
* ``eagle-retract`` and ``eagle-retract-fixed``: EAGLE after retraction (sglang PR 28254).

sglang issue 26329 (fixed upstream by PR 26800): 0.5.12's ``EagleDraftWorker._draft_extend_for_prefill`` ends
every prefill segment's draft input with the sampled token, also for a chunk that is not the request's last,
where the next prompt token belongs; the draft KV at each chunk boundary is built from the wrong token. The
driver carries a small test-only sglang plugin (written into the phase folder, put on the worker's PYTHONPATH)
that loads this file in every sglang process and replaces that method with the corrected one
(``E2E_EAGLE_TAIL=fix``), or with one that behaves exactly as 0.5.12's and prints every non-final chunk tail it
feeds (``observe``): the ground truth the violations are matched against. Nothing in kvcanary patches sglang.

Nothing here imports sglang or kvcanary at module level (the driver's rule).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (the test plugin loads this file alone)
from driver_plugin import plugin_env, write_test_plugin  # noqa: E402
from e2e_core import (  # noqa: E402
    ENDED_GRACE,
    EXPECTED_REASONS,
    INJECTION_SCHEMA,
    VIOLATION_SCHEMA,
    Phase,
    Request,
    fmt,
    make_workload,
    match_injections,
    pool_of,
    read_jsonl,
    read_text,
    summarize_phase,
)

# The one-layer dummy draft beside the driver's tiny Llama (``--draft-model`` for another).
TINY_EAGLE = {
    "architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
# Fault classes the EAGLE fault phase injects into the target pool. token_swap is left out: it needs a plain
# DECODE forward, and under EAGLE the target only runs extends and target-verify forwards, whose CUDA-graph inputs
# sglang copies before ModelRunner.forward (replay_prepare in prepare_for_v2_verify), out of the injector's reach.
EAGLE_FAULTS: tuple[str, ...] = ("req_to_token_redirect", "real_kv_flip", "cached_idle_corruption", "position_skew")
EAGLE_TAIL_ENV = "E2E_EAGLE_TAIL"  # observe | fix | fix_prompt: what the test plugin does to _draft_extend_for_prefill
EAGLE_DRIVER_ENV = "E2E_EAGLE_DRIVER"  # this file, which the test plugin loads in the scheduler process
EAGLE_PLUGIN = "kvcanary_e2e_eagle"
EAGLE_CHUNK = 64
EAGLE_TAIL_RE = re.compile(r"\[e2e-eagle\] draft tail: mode=(?P<mode>\w+) position=(?P<position>\d+) "
                           r"fed=(?P<fed>-?\d+) next=(?P<next>-?\d+) sampled=(?P<sampled>-?\d+)"
                           r"(?: region=(?P<region>\w+))?")
EAGLE_PATCHED_RE = re.compile(r"\[e2e-eagle\] EagleDraftWorker\._draft_extend_for_prefill replaced: mode=(\w+)")
SPEC_STATS_RE = re.compile(r"kvcanary spec stats:((?: [a-z_][a-z0-9_]*=\S+)+)")


# ---------------------------------------------------------------------------------------------------- phases
def is_eagle(phase: Phase) -> bool:
    """An EAGLE phase: the EAGLE phases' workloads, or a phase whose Engine runs EAGLE (hunt-spec-abort)."""
    return phase.workload.startswith("eagle") or dict(phase.engine).get("speculative_algorithm") == "EAGLE"


def make_eagle_workload(kind: str, *, seed: int = 0, max_new: tuple[int, int] = (16, 32),
                        vocab: int = 2048) -> list[list[Request]]:
    """The workload of an EAGLE phase.

    ``eagle-chunked``: 16 distinct random prompts of 140-300 tokens (3-5 prefill chunks of 64 each, no shared
    prefix), in groups of 4; ``eagle-soak``: 320 requests of ``make_workload`` (shared prefixes, exact repeats) with
    prompts of at most 400 tokens; ``eagle-faults``: the same with 640 requests; ``eagle-retract``: 32 distinct
    random prompts of 40-120 tokens (some longer than a chunk: prompt-region tails too) with ``max_new`` tokens each,
    in 2 groups of 16 (the KV pressure that makes decode retract).
    """
    if kind == "eagle-chunked":
        rng = random.Random(seed + 26329)
        reqs = [Request([rng.randrange(3, vocab) for _ in range(rng.randint(2 * EAGLE_CHUNK + 12, 300))],
                        rng.randint(*max_new), -1) for _ in range(16)]
        return [reqs[i : i + 4] for i in range(0, len(reqs), 4)]
    if kind == "eagle-retract":
        rng = random.Random(seed + 28254)
        reqs = [Request([rng.randrange(3, vocab) for _ in range(rng.randint(40, 120))], rng.randint(*max_new), -1)
                for _ in range(32)]
        return [reqs[i : i + 16] for i in range(0, len(reqs), 16)]
    n = {"eagle-soak": 320, "eagle-faults": 640}.get(kind)
    if n is None:
        raise ValueError(f"unknown EAGLE workload {kind!r}")
    return make_workload(n, seed=seed, batch=64, max_len=400, max_new=max_new, vocab=vocab)


def ensure_draft_model(args) -> str:
    """The EAGLE draft model folder (``--draft-model``, or the one-layer dummy draft written into --out)."""
    if getattr(args, "draft_model", None):
        return args.draft_model
    path = os.path.join(args.out, "tiny-eagle")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_EAGLE, f, indent=1)
    return path


def eagle_engine_kwargs(kw: dict, phase: Phase, args) -> dict:
    """An EAGLE phase's Engine: the draft model, and piecewise CUDA graphs off (also with --piecewise: the EAGLE
    phases measure the setup sglang issue 26329 was found in)."""
    if is_eagle(phase):
        kw["speculative_draft_model_path"] = ensure_draft_model(args)
        kw["disable_piecewise_cuda_graph"] = True
    return kw


def write_eagle_plugin(root: str) -> str:
    """The test-only sglang plugin that applies ``install_eagle_tail_patch`` of this file in every sglang process
    where ``E2E_EAGLE_TAIL`` is set (integration/driver_plugin.py). Returns ``root``."""
    return write_test_plugin(root, EAGLE_PLUGIN, about="integration/eagle_phases.py, EAGLE phases",
                             gate_env=EAGLE_TAIL_ENV, file_env=EAGLE_DRIVER_ENV, module="_kvcanary_e2e_eagle",
                             function="install_eagle_tail_patch")


def eagle_env(env: dict, phase: Phase, pdir: str) -> dict:
    """An EAGLE phase's worker environment: the test plugin on PYTHONPATH (and in SGLANG_PLUGINS if the caller
    restricts plugins), and where it finds this file."""
    if not is_eagle(phase):
        return env
    root = write_eagle_plugin(os.path.join(pdir, "eagle-plugin"))
    return plugin_env(env, root, EAGLE_PLUGIN, file_env=EAGLE_DRIVER_ENV, driver_file=__file__)


# ------------------------------------------------------------------------------------------------ in sglang (test-only)
def prefill_tails(extend_prefix_lens, extend_seq_lens, seqs) -> list[tuple[int, int, int]]:
    """``(row, position, next token)`` of every batch row whose prefill segment ends before its sequence does (a
    chunk that is not the request's last): the draft's input at ``position`` must be that next token (PR 26800;
    the sequence is ``origin_input_ids + output_ids``, as PR 28254 corrects for resumed requests)."""
    out = []
    for i, (prefix, extend, seq) in enumerate(zip(extend_prefix_lens, extend_seq_lens, seqs, strict=True)):
        end = int(prefix) + int(extend)
        if int(extend) > 0 and end < len(seq):
            out.append((i, end - 1, int(seq[end])))
    return out


def make_draft_extend_for_prefill(mode: str):
    """sglang 0.5.12's ``EagleDraftWorker._draft_extend_for_prefill``, line for line, with the tail token of each
    non-final chunk printed (``observe``: still the sampled token, as 0.5.12 feeds it) or corrected to the
    request's next token (``fix``: PR 26800's correction with PR 28254's ``origin_input_ids + output_ids``, so also
    a resumed request's output region), or corrected only where the next token is a prompt token (``fix_prompt``:
    PR 26800 alone, which indexes ``origin_input_ids``; past the prompt it falls back to the sampled token, the
    path PR 28254 fixes). Only the draft's input rotation changes; the draft input's bonus tokens stay the sampled
    ones, as upstream. A tail whose next token is an output token (a request resumed after retraction) is printed
    with ``region=output``."""
    if mode not in ("observe", "fix", "fix_prompt"):
        raise ValueError(f"{EAGLE_TAIL_ENV}: expected observe or fix (or fix_prompt: PR 26800 alone), got {mode!r}")

    def _draft_extend_for_prefill(self, batch, target_hidden_states, next_token_ids, mm_input_embeds=None):
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.spec_utils import maybe_detect_nan
        from sglang.srt.utils.common import fast_topk

        if not batch.forward_mode.is_idle():
            tails = next_token_ids
            seqs = [list(r.origin_input_ids) + list(r.output_ids) for r in batch.reqs]
            found = prefill_tails(batch.extend_prefix_lens, batch.extend_seq_lens, seqs)
            if found:
                sampled = next_token_ids.tolist()  # a host sync per chunked prefill: this is a test driver
                fixed = {i for i, pos, _ in found if mode == "fix" or (
                    mode == "fix_prompt" and pos + 1 < len(batch.reqs[i].origin_input_ids))}
                if fixed:
                    tails = next_token_ids.clone()
                    for i, _, nxt in found:
                        if i in fixed:
                            tails[i] = nxt
                for i, pos, nxt in found:
                    fed = nxt if i in fixed else sampled[i]
                    region = " region=output" if pos + 1 >= len(batch.reqs[i].origin_input_ids) else ""
                    print(f"[e2e-eagle] draft tail: mode={mode} position={pos} fed={fed} next={nxt} "
                          f"sampled={sampled[i]}{region} rid={batch.reqs[i].rid}", flush=True)
            pt = 0
            for i, extend_len in enumerate(batch.extend_seq_lens):
                input_ids = batch.input_ids[pt : pt + extend_len]
                batch.input_ids[pt : pt + extend_len] = torch.cat((input_ids[1:], tails[i].reshape(1)))
                pt += extend_len

        next_draft_input = EagleDraftInput(
            hidden_states=target_hidden_states,
            bonus_tokens=next_token_ids,
            new_seq_lens=batch.seq_lens,
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )
        batch.spec_info = next_draft_input
        forward_batch = ForwardBatch.init_new(batch, self.draft_runner)
        forward_batch.return_logprob = False
        if mm_input_embeds is not None:
            forward_batch.mm_input_embeds = mm_input_embeds
        logits_output = self.draft_runner.forward(forward_batch).logits_output
        maybe_detect_nan(logits_output.next_token_logits, "draft_extend_for_prefill")
        probs = torch.softmax(logits_output.next_token_logits, dim=-1)
        next_draft_input.topk_p, next_draft_input.topk_index = fast_topk(probs, self.topk, dim=-1)
        next_draft_input.hidden_states = logits_output.hidden_states
        return next_draft_input

    _draft_extend_for_prefill.e2e_eagle_tail = mode  # type: ignore[attr-defined]
    return _draft_extend_for_prefill


def install_eagle_tail_patch(mode: str) -> None:
    """Replace ``EagleDraftWorker._draft_extend_for_prefill`` in this process (test plugin, once per mode)."""
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    if getattr(EagleDraftWorker._draft_extend_for_prefill, "e2e_eagle_tail", None) == mode:
        return
    EagleDraftWorker._draft_extend_for_prefill = make_draft_extend_for_prefill(mode)
    print(f"[e2e-eagle] EagleDraftWorker._draft_extend_for_prefill replaced: mode={mode} pid={os.getpid()}",
          flush=True)


# ---------------------------------------------------------------------------------------------------- summary
def parse_spec_stats(log_text: str) -> dict[str, dict]:
    """The last ``kvcanary spec stats:`` line of each pool (``target``, ``draft``): its fields, numbers as ints."""
    pools: dict[str, dict] = {}
    for m in SPEC_STATS_RE.finditer(log_text):
        fields = dict(pair.split("=", 1) for pair in m.group(1).split())
        pools[fields.get("pool", "?")] = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in fields.items()}
    return pools


def parse_tails(log_text: str) -> list[dict]:
    """The tails the test plugin printed: mode, position, fed, next, sampled, and ``region: "output"`` for a tail
    in a resumed request's output region (no region key: a prompt tail)."""
    return [{k: (v if k in ("mode", "region") else int(v)) for k, v in m.groupdict().items() if v is not None}
            for m in EAGLE_TAIL_RE.finditer(log_text)]


@dataclass
class EagleMatch:
    """Draft-pool violations against the chunk tails the test plugin printed (phase eagle-bug / eagle-fixed)."""

    tails: list = field(default_factory=list)  # wrong tails: fed != next
    detected: int = 0  # wrong tails with a matching draft-pool verify_token violation
    missed: list = field(default_factory=list)
    unexplained: list = field(default_factory=list)  # draft-pool violations no wrong tail explains
    target: list = field(default_factory=list)  # violations in the target pool
    # distinct violations: (pool, reasons, slot, position, stored, expected, rows, explained by a wrong tail)
    groups: list = field(default_factory=list)
    chunked_requests: int = 0  # measured requests longer than a chunk
    requests_with_tail: int = 0  # of those, with at least one tail the plugin printed (observed or fixed)
    requests_detected: int = 0  # of those, with at least one wrong tail that a violation matched


def match_eagle(rows: list[dict], tails: list[dict], groups: list[list[Request]],
                chunk: int = EAGLE_CHUNK) -> EagleMatch:
    """Match ``kvcanary.violation/1`` rows to the chunk tails: a wrong tail (position p, fed f, next t) is detected by
    a draft-pool violation with ``verify_token`` at position p, stored token f and expected token t (the draft
    record at p holds the token it was fed; the token check expects token p + 1 of the request)."""
    res = EagleMatch()
    vio = [r for r in rows if r.get("schema") == VIOLATION_SCHEMA]
    res.target = [v for v in vio if pool_of(v) != "draft"]
    wrong = {(t["position"], t["fed"], t["next"]): t for t in tails if t["fed"] != t["next"]}
    res.tails = list(wrong.values())
    hit_keys = set()
    distinct: dict[tuple, list] = {}
    for v in vio:
        key = (int(v["position"]), int(v.get("stored_token", -1)), int(v.get("expected_token", -1)))
        gkey = (pool_of(v), "+".join(v["reasons"]), int(v["slot"])) + key
        distinct.setdefault(gkey, []).append(v)
        if pool_of(v) != "draft":
            continue
        if key in wrong and "verify_token" in v["reasons"]:
            hit_keys.add(key)
        else:
            res.unexplained.append(v)
    res.detected = len(hit_keys)
    res.missed = [t for k, t in wrong.items() if k not in hit_keys]
    res.groups = [(p, r, s, pos, st, ex, len(vs), (pos, st, ex) in wrong)
                  for (p, r, s, pos, st, ex), vs in sorted(distinct.items(), key=lambda kv: (kv[0][0], kv[0][3]))]
    for req in (r for g in groups for r in g):
        ids = req.input_ids
        if len(ids) <= chunk:
            continue
        res.chunked_requests += 1
        mine = [t for t in tails if t["position"] + 1 < len(ids) and ids[t["position"] + 1] == t["next"]]
        res.requests_with_tail += bool(mine)
        res.requests_detected += any((t["position"], t["fed"], t["next"]) in hit_keys for t in mine)
    return res


@dataclass
class RetractMatch:
    """Violations against the chunk tails of requests resumed after retraction (phases eagle-retract, -fixed)."""

    output_tails: int = 0  # tails printed in the output region (resumed requests)
    wrong: list = field(default_factory=list)  # output-region tails fed a token other than the request's
    prompt_tails: int = 0
    prompt_wrong: list = field(default_factory=list)  # prompt-region tails fed wrong (PR 26800's fix missing)
    detected: int = 0  # wrong output-region tails with a matching draft-pool verify_token violation
    missed: list = field(default_factory=list)
    unexplained: list = field(default_factory=list)  # draft-pool violations no wrong output-region tail explains
    target: list = field(default_factory=list)  # violations in the target pool
    pools: dict = field(default_factory=dict)  # pool -> {"rows", "slots", "verify_token", "other"}
    # position -> {"tails", "wrong", "violations" (distinct draft-pool ones), "detected"}
    positions: dict = field(default_factory=dict)


def match_eagle_retract(rows: list[dict], tails: list[dict]) -> RetractMatch:
    """A wrong output-region tail (position p, fed f, next t: the request's own output token at p + 1) is detected by
    a draft-pool ``verify_token`` violation at position p with stored token f and expected token t. Every draft-pool
    violation must be such a one; the target pool must have none."""
    res = RetractMatch()
    vio = [r for r in rows if r.get("schema") == VIOLATION_SCHEMA]
    out = [t for t in tails if t.get("region") == "output"]
    prompt = [t for t in tails if t.get("region") != "output"]
    res.output_tails, res.prompt_tails = len(out), len(prompt)
    res.prompt_wrong = [t for t in prompt if t["fed"] != t["next"]]
    wrong = {(t["position"], t["fed"], t["next"]): t for t in out if t["fed"] != t["next"]}
    res.wrong = list(wrong.values())
    res.target = [v for v in vio if pool_of(v) != "draft"]
    hit, distinct = set(), set()
    for v in vio:
        pool = pool_of(v)
        p = res.pools.setdefault(pool, {"rows": 0, "slots": set(), "verify_token": 0, "other": 0})
        p["rows"] += 1
        p["slots"].add(int(v["slot"]))
        p["verify_token" if v["reasons"] == ["verify_token"] else "other"] += 1
        if pool != "draft":
            continue
        key = (int(v["position"]), int(v.get("stored_token", -1)), int(v.get("expected_token", -1)))
        distinct.add((int(v["slot"]),) + key)
        if key in wrong and v["reasons"] == ["verify_token"]:
            hit.add(key)
        else:
            res.unexplained.append(v)
    for p in res.pools.values():
        p["slots"] = len(p["slots"])
    res.detected = len(hit)
    res.missed = [t for k, t in wrong.items() if k not in hit]
    for t in out:
        d = res.positions.setdefault(t["position"], {"tails": 0, "wrong": 0, "violations": 0, "detected": 0})
        d["tails"] += 1
    for pos, _, _ in wrong:
        res.positions[pos]["wrong"] += 1
    for pos, _, _ in hit:
        res.positions[pos]["detected"] += 1
    for _, pos, _, _ in distinct:
        res.positions.setdefault(pos, {"tails": 0, "wrong": 0, "violations": 0, "detected": 0})["violations"] += 1
    res.positions = dict(sorted(res.positions.items()))
    return res


def verdict_eagle_retract(m: RetractMatch, mode: str | None, retractions: int, violations: int) -> list[str]:
    """Why an eagle-retract (``fix_prompt``) or eagle-retract-fixed (``fix``) phase fails (empty: it passes)."""
    why = []
    if not retractions:
        why.append("no retraction happened (shrink max_total_tokens)")
    if not m.output_tails:
        why.append("no chunk tail in a resumed request's output region (PR 28254's path not exercised)")
    if m.prompt_wrong:
        why.append(f"{len(m.prompt_wrong)} prompt-region tail(s) fed wrong (PR 26800's fix not applied?)")
    if m.target:
        why.append(f"{len(m.target)} violation(s) in the target pool")
    if mode == "fix_prompt":
        if not m.wrong:
            why.append("no wrong output-region tail observed (sampling greedy, or sglang fixed already?)")
        if m.missed:
            why.append(f"{len(m.missed)}/{len(m.wrong)} wrong output-region tails not detected")
        if m.unexplained:
            why.append(f"{len(m.unexplained)} draft-pool violation(s) no wrong output-region tail explains")
    elif violations or m.wrong:
        why.append(f"violations={violations}, wrong output-region tails fed={len(m.wrong)} (expected 0 with the fix)")
    return why


def summarize_eagle(phase: Phase, pdir: str, res: dict, seed: int = 0) -> tuple[dict, dict]:
    """One EAGLE phase: the summary row (with its verdict) and the details for the EAGLE tables."""
    log_text = read_text(os.path.join(pdir, "worker.log"))
    rows = read_jsonl(sorted(glob.glob(os.path.join(pdir, "kvc-*.jsonl"))))
    s = summarize_phase(phase, res, log_text, rows)
    pools = parse_spec_stats(log_text)
    tgt = pools.get("target", {})
    for key in ("forwards", "entries_verified", "tokens_written"):  # the target pool's (the stats line has no pool)
        s[key] = tgt.get(key, s[key])
    tails = parse_tails(log_text)
    groups = make_eagle_workload(phase.workload, seed=seed, max_new=phase.max_new)
    detail = {"phase": s["phase"], "pools": pools, "patched": EAGLE_PATCHED_RE.findall(log_text)}
    why = []
    if s["status"] != "OK":
        why.append(f"status {s['status']}")
    if s["requests_ok"] != s["requests_sent"] or not s["requests_sent"]:
        why.append(f"{s['requests_ok']}/{s['requests_sent']} requests completed")
    for k in ("lost", "health_errors"):
        if s[k]:
            why.append(f"{k}={s[k]}")
    for pool in ("target", "draft"):
        p = pools.get(pool)
        if not p:
            why.append(f"no kvcanary spec stats line for the {pool} pool (EAGLE not covered?)")
        elif not p.get("entries_verified"):
            why.append(f"{pool} pool verified nothing")
    if pools.get("target") and not pools["target"].get("verify_forwards"):
        why.append("no target verify forward counted")
    if pools.get("draft") and not pools["draft"].get("drafts_written"):
        why.append("no draft written in the draft pool")
    mode = dict(phase.env).get(EAGLE_TAIL_ENV)
    if mode and mode not in detail["patched"]:
        why.append(f"the test plugin did not replace _draft_extend_for_prefill ({mode})")
    if phase.workload == "eagle-chunked":
        m = match_eagle(rows, tails, groups)
        detail["match"] = m
        if m.target:
            why.append(f"{len(m.target)} violation(s) in the target pool")
        if m.unexplained:
            why.append(f"{len(m.unexplained)} draft-pool violation(s) no wrong chunk tail explains")
        if m.chunked_requests == 0 or m.requests_with_tail != m.chunked_requests:
            why.append(f"{m.requests_with_tail}/{m.chunked_requests} chunked requests had a chunk tail printed")
        if mode == "observe":
            if not m.tails:
                why.append("no wrong chunk tail observed (sglang fixed already?)")
            if m.missed:
                why.append(f"{len(m.missed)}/{len(m.tails)} wrong chunk tails not detected")
            if m.requests_detected != m.chunked_requests:
                why.append(f"{m.requests_detected}/{m.chunked_requests} chunked requests with a detected wrong tail")
        elif s["violations"] or m.tails:
            why.append(f"violations={s['violations']}, wrong tails fed={len(m.tails)} (expected 0 with the fix)")
    elif phase.workload == "eagle-retract":
        m = match_eagle_retract(rows, tails)
        detail["retract"], detail["retractions"] = m, s["retractions"]
        why += verdict_eagle_retract(m, mode, s["retractions"], s["violations"])
    elif phase.workload == "eagle-faults":
        m = match_injections(rows)
        detail["faults"] = m
        for c in EAGLE_FAULTS:
            n, d = m.injections.get(c, 0), m.detected.get(c, 0)
            if n < 20:
                why.append(f"{c}: {n} injections < 20")
            if d != n:
                why.append(f"{c}: {d}/{n} detected")
        if m.unexplained:
            why.append(f"{len(m.unexplained)} violation(s) on slots no injection touched (pool "
                       f"{sorted({pool_of(v) for v in m.unexplained})})")
    else:  # clean soak
        for k in ("violations", "kvcanary_errors"):
            if s[k]:
                why.append(f"{k}={s[k]}")
        if s["requests_sent"] < 300:
            why.append(f"{s['requests_sent']} requests < 300")
        if not s["cached_tokens"]:
            why.append("no radix-cache hit (prefix sharing not exercised)")
    if s["status"] == "TRUNCATED" and phase.workload == "eagle-faults":
        why = [w for w in why if not w.startswith("status") and "requests completed" not in w]
    s["verdict"], s["why"] = ("PASS" if not why else "FAIL"), why
    return s, detail


def render_eagle(details: list[dict]) -> list[str]:
    """The EAGLE tables: per pool speculative counters, the draft-tail matching, the fault classes."""
    if not details:
        return []
    lines = ["", "| EAGLE phase | pool | forwards | verify fwd | draft decode fwd | draft extend fwd | "
                 "drafts written | accepted | rejected | rolled back | entries verified | violations |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in details:
        for pool in ("target", "draft"):
            p = d["pools"].get(pool) or {}
            lines.append(f"| {d['phase']} | {pool} | " + " | ".join(fmt(p.get(k)) for k in (
                "forwards", "verify_forwards", "draft_decode_forwards", "draft_extend_forwards", "drafts_written",
                "drafts_accepted", "drafts_rejected", "rolled_back", "entries_verified", "violations")) + " |")
    for d in details:
        m = d.get("match")
        if m is not None:
            lines += ["", f"{d['phase']}: {m.chunked_requests} chunked requests, {m.requests_with_tail} with a "
                          f"chunk tail printed, {m.requests_detected} with a detected wrong tail; wrong tails fed to "
                          f"the draft {len(m.tails)}, detected {m.detected}; draft-pool violations no wrong tail "
                          f"explains {len(m.unexplained)}; target-pool violations {len(m.target)}"]
            if m.groups:
                lines += ["", "| pool | reasons | slot | position | stored token | expected token | rows | "
                              "a wrong chunk tail (fed, next prompt token) |", "|---|---|---|---|---|---|---|---|"]
                for p, r, s, pos, st, ex, n, hit in m.groups[:40]:
                    lines.append(f"| {p} | {r} | {s} | {pos} | {st} | {ex} | {n} | {'yes' if hit else 'no'} |")
                if len(m.groups) > 40:
                    lines.append(f"| … {len(m.groups) - 40} more | | | | | | | |")
        lines += render_eagle_retract(d)
        f = d.get("faults")
        if f is not None:
            lines += ["", f"| {d['phase']}: fault class (target pool) | injections | detected | rate | reasons | "
                          "tags |",
                      "|---|---|---|---|---|---|"]
            for c in EAGLE_FAULTS:
                n, k = f.injections.get(c, 0), f.detected.get(c, 0)
                reasons = ", ".join(f"{a}×{b}" for a, b in sorted(f.reasons.get(c, {}).items())) or "-"
                tags = ", ".join(f"{a}×{b}" for a, b in sorted(f.tags.get(c, {}).items())) or "-"
                lines.append(f"| {c} | {n} | {k} | {f'{100.0 * k / n:.0f} %' if n else '-'} | {reasons} | {tags} |")
            lines.append(f"| violations on untouched slots (any pool) | {len(f.unexplained)} | | | | |")
            if f.ended:
                lines.append(f"| set apart: injected in its pool's last {ENDED_GRACE} forwards, not read before the "
                             "run ended | " + ", ".join(f"{i['fault']}@{i['step']}" for i in f.ended) + " | | | | |")
    return lines


def render_eagle_retract(d: dict) -> list[str]:
    """An eagle-retract phase's tables: retractions and tails, violations per pool, per position."""
    m = d.get("retract")
    if m is None:
        return []
    lines = ["", f"{d['phase']}: retractions {d.get('retractions')}; chunk tails in resumed requests' output region "
                 f"{m.output_tails}, fed a wrong token {len(m.wrong)}, detected {m.detected}; prompt-region tails "
                 f"{m.prompt_tails} (fed wrong {len(m.prompt_wrong)}); draft-pool violations no wrong tail explains "
                 f"{len(m.unexplained)}; target-pool violations {len(m.target)}",
             "", f"| {d['phase']}: pool | violation rows | distinct slots | verify_token only | other reasons |",
             "|---|---|---|---|---|"]
    for pool in ("target", "draft"):
        p = m.pools.get(pool) or {}
        lines.append(f"| {pool} | {p.get('rows', 0)} | {p.get('slots', 0)} | {p.get('verify_token', 0)} | "
                     f"{p.get('other', 0)} |")
    if m.positions:
        lines += ["", f"| {d['phase']}: position | output-region tails | wrong tails | draft-pool violations "
                      "(distinct) | wrong tails detected |", "|---|---|---|---|---|"]
        for pos, c in list(m.positions.items())[:40]:
            lines.append(f"| {pos} | {c['tails']} | {c['wrong']} | {c['violations']} | {c['detected']} |")
        if len(m.positions) > 40:
            lines.append(f"| … {len(m.positions) - 40} more | | | | |")
    return lines


# ---------------------------------------------------------------------------------------------------- dry run
def dry_run_eagle(phase: Phase, pdir: str, base: dict, seed: int = 0) -> dict:
    """What an EAGLE phase's worker would leave (no sglang): tails, spec stats lines, a report that passes."""
    groups = make_eagle_workload(phase.workload, seed=seed, max_new=phase.max_new)
    reqs = [r for g in groups for r in g]
    mode = dict(phase.env).get(EAGLE_TAIL_ENV, "")
    log = [f"[e2e-eagle] EagleDraftWorker._draft_extend_for_prefill replaced: mode={mode} pid=1"]
    report = []
    rank_t, rank_d = {"tp_rank": 0, "pool": "target"}, {"tp_rank": 0, "pool": "draft"}
    slot, step = 100, 20
    if phase.workload == "eagle-chunked":
        for r in reqs:
            for end in range(EAGLE_CHUNK, len(r.input_ids), EAGLE_CHUNK):
                nxt = r.input_ids[end]
                fed = nxt if mode == "fix" else (nxt + 1) % 2048
                log.append(f"[e2e-eagle] draft tail: mode={mode} position={end - 1} fed={fed} next={nxt} "
                           f"sampled={(nxt + 1) % 2048} rid=x")
                if mode == "observe":
                    for rep in range(2):
                        report.append({"schema": VIOLATION_SCHEMA, "step": step + rep, "tag": "verify",
                                       "reasons": ["verify_token"], "slot": slot + end - 1, "position": end - 1,
                                       "stored_token": fed, "expected_token": nxt, "rank": rank_d})
            slot += 400
    retractions = 0
    if phase.workload == "eagle-retract":  # 3 requests retracted after 100-140 output tokens, resumed in chunks
        rng = random.Random(seed)
        for j, r in enumerate(reqs[:3]):
            log.append("KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_token_ratio: 0.35 -> 0.9")
            retractions += 1
            seq = r.input_ids + [rng.randrange(3, 2048) for _ in range(100 + 20 * j)]
            # the resumed prefill shares the 64-token budget with other requests: its first chunk is shorter
            for end in range(EAGLE_CHUNK - 8 * j, len(seq), EAGLE_CHUNK):
                nxt, output = seq[end], end >= len(r.input_ids)
                sampled = (nxt + 1) % 2048
                fed = sampled if output and mode == "fix_prompt" else nxt
                log.append(f"[e2e-eagle] draft tail: mode={mode} position={end - 1} fed={fed} next={nxt} "
                           f"sampled={sampled}{' region=output' if output else ''} rid=x{j}")
                if fed != nxt:
                    for rep in range(2):
                        report.append({"schema": VIOLATION_SCHEMA, "step": step + rep, "tag": "verify",
                                       "reasons": ["verify_token"], "slot": slot + end - 1, "position": end - 1,
                                       "stored_token": fed, "expected_token": nxt, "rank": rank_d})
            slot += 600
    if phase.workload == "eagle-faults":
        rng = random.Random(seed)
        for c in EAGLE_FAULTS * 22:
            slots = [rng.randrange(1, 6000) for _ in range(3 if c == "req_to_token_redirect" else 1)]
            report.append({"schema": INJECTION_SCHEMA, "fault": c, "step": step, "slots": slots, "detail": "dry-run",
                           "rank": rank_t})
            report.append({"schema": VIOLATION_SCHEMA, "step": step + 1, "reasons": [EXPECTED_REASONS[c][0]],
                           "tag": "sweep" if c == "cached_idle_corruption" else "verify", "slot": slots[0],
                           "rank": rank_t})
            step += 4
    nvio = sum(r["schema"] == VIOLATION_SCHEMA and pool_of(r) == "draft" for r in report)
    for pool in ("target", "draft"):
        log.append(f"kvcanary spec stats: step=400 pool={pool} verify_forwards={300 if pool == 'target' else 0} "
                   f"draft_decode_forwards={0 if pool == 'target' else 300} draft_extend_forwards="
                   f"{0 if pool == 'target' else 340} drafts_written=600 drafts_accepted=12 drafts_rejected=588 "
                   f"rolled_back=588 forwards=400 tokens_written=30000 entries_verified=900000 "
                   f"violations={nvio if pool == 'draft' else 0} tp_rank=0")
    with open(os.path.join(pdir, "worker.log"), "w") as f:
        f.write("[dry-run]\n" + "\n".join(log) + "\n")
    with open(os.path.join(pdir, "kvc-0.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in report))
    return dict(base, requests_sent=len(reqs), requests_ok=len(reqs), cached_tokens=4321, retractions=retractions)
