#!/usr/bin/env python3
"""What a user pays for kvcanary on a Llama-3.1-8B-shaped model: kvcanary off vs everything on (issue 28).

    python benchmarks/bench_real_shape.py --pairs 3                          # every shape, ./bench_real_shape_out
    python benchmarks/bench_real_shape.py --traffic decode-64 --pairs 3 --budget 540 --out /tmp/brs-d64
    python benchmarks/bench_real_shape.py --summarize /tmp/brs-a /tmp/brs-b  # one table from several runs' folders
    python benchmarks/bench_real_shape.py --dry-run --out /tmp/brs           # no sglang, no GPU: statistics and tables
    python benchmarks/bench_real_shape.py --traffic ttft-1,decode-1 --arm nosweep:KVCANARY_SWEEP_INTERVAL=0 \
        --loop-probe --out /tmp/brs-arms                                     # an extra arm, the loop probe

Needs sglang 0.5.12 with a CUDA GPU and kvcanary installed (its ``sglang.srt.plugins`` entry point); this script
never imports kvcanary. The model is ``integration/models/llama-8b-shape`` (a config written by hand, dummy
weights, no download). Engines alternate off, on, off, on, ... (``--pairs``), each a fresh ``Engine`` in its own
subprocess (``--worker``), because kvcanary reads its mode from the environment when the plugin loads:

* off: ``KVCANARY_MODE=off``;
* on: ``KVCANARY_MODE=raise``, ``KVCANARY_REAL_KV=partial``, ``KVCANARY_VERIFY_TOKENS=1``,
  ``KVCANARY_SWEEP_INTERVAL=10``; both with ``KVCANARY_STATS_EVERY=100`` (the ``kvcanary host time`` lines);
* each ``--arm NAME:KVCANARY_KEY=VALUE[,...]``: on with these settings on top, one more Engine per round (off, on,
  then the arms in the given order), tabled against off like on (``decode-1 (NAME)``).

Engine arguments: ``load_format="dummy"``, ``skip_tokenizer_init=True``, ``random_seed=0`` and sglang's defaults
otherwise (decode and piecewise CUDA graphs, radix cache, overlap scheduler; ``--engine-arg`` adds one). Each
Engine first runs one round of every selected traffic shape from a differently seeded workload (same lengths,
outputs capped at 64 tokens), unmeasured, so that its JIT and compile caches are warm; then each shape's rounds,
measured. Requests are ``input_ids`` (ids < 32000) with ``ignore_eos``, greedy, all of a round sent in one
streamed ``generate`` call (the round's concurrency).

TTFT and inter-token latency are timed from the stream (``engine.generate(..., stream=True)``): sglang 0.5.12
puts no first-token time in ``meta_info`` under its defaults (``e2e_latency``, ``completion_tokens``,
``cached_tokens`` only; ``request_received_ts``, ``prefill_finished_time`` and a per-request mean
``decode_throughput`` come only with ``enable_metrics``, which is not a default, and give no per-token ITL). TTFT
= the request's first chunk with a token minus the round's submission; ITL = the gap between a request's
chunks, divided by the tokens the later chunk added (once per token, as sglang's own ITL histogram counts them).
Each shape's result also has its ITL tail: the longest sample and the stalls (samples above 2x that Engine's ITL
p50). ``ttft-1`` (32 single requests of 8 tokens) measures TTFT alone; it runs only when ``--traffic`` names it.
``--loop-probe`` loads ``integration/loop_probe.py``'s plugin into every Engine and tables, per shape and arm, where
a scheduler-loop iteration's time goes over the shape's measured rounds.

Every Engine's folder (``<out>/engine-NN-ARM/``, ARM = off, on or an arm's name) keeps its log (``worker.log``),
its last 80 lines (``log-tail.txt``), its result (``result.json``: arm and its settings, start-up times, per-shape
figures) and kvcanary's report. The start-up table says for each Engine whether it finished start-up, how long
``import sglang`` and ``Engine()`` took, and sglang's own figures from the log (weights, decode graph capture and
piecewise graph capture, with the number of sizes captured), so an Engine that does not start (issue 28: an off
Engine once did not within 150 s) can be explained from the run. ``--start-timeout`` ends an Engine still
starting; ``--engine-timeout`` any Engine.

Exit status 0 when every Engine started and served its traffic; the targets (output tokens/s >= 0.99 of off,
TTFT and ITL p50/p99 within 2 %) are printed as met / not met, not asserted.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))
import e2e_core  # noqa: E402  (integration/e2e_core.py: the log and report parsers every e2e phase reads with)
import loop_probe  # noqa: E402  (integration/loop_probe.py: --loop-probe's plugin and its log lines)
import sglang_e2e as e2e  # noqa: E402  (the e2e driver: env, Engine kwargs, log and report parsing; no sglang import)

MODEL = REPO / "integration" / "models" / "llama-8b-shape"
ID_LIMIT = 32000  # request token ids stay below this (any Llama vocabulary has them)
WARM_OUTPUT = 64  # output tokens of a warm-up request (decode shapes and their batch sizes are what warms)
TAIL_LINES = 80
TOKENS_TARGET = 0.99  # on/off output tokens/s at least this
LATENCY_TARGET = 1.02  # on/off TTFT and ITL percentiles at most this
STALL_FACTOR = 2.0  # an ITL sample above this many times its Engine's ITL p50 (for that shape) is a stall


# ---------------------------------------------------------------------------------------------------- traffic
@dataclass(frozen=True)
class Traffic:
    name: str
    concurrency: int  # requests per round, sent in one generate call
    rounds: int  # measured rounds per Engine
    prompt: tuple[int, int]  # prompt length range, tokens (shared prefix included)
    output: int  # max_new_tokens (ignore_eos: every request decodes all of them)
    prefixes: int = 0  # shared prefixes the prompts start with (radix cache hits)
    prefix_len: int = 0


TRAFFIC: dict[str, Traffic] = {t.name: t for t in (
    Traffic("decode-1", 1, 4, (96, 160), 512),
    Traffic("decode-64", 64, 2, (96, 160), 512),
    Traffic("decode-256", 256, 1, (96, 160), 512),
    # 16 prefixes of 1536 tokens, each prompt one of them + 512-2464 tokens of its own
    Traffic("prefill", 64, 3, (2048, 4000), 16, prefixes=16, prefix_len=1536),
    # TTFT alone: decode-1 gives 4 first tokens per Engine, too few for its p50 (off Engines ranged 17-27 ms)
    Traffic("ttft-1", 1, 32, (96, 160), 8),
)}
# what --traffic defaults to: the shapes of the recorded runs (ttft-1 only when named), so runs stay comparable
DEFAULT_TRAFFIC = ("decode-1", "decode-64", "decode-256", "prefill")


def make_rounds(t: Traffic, seed: int) -> list[list[list[int]]]:
    """The prompts of ``t``'s rounds (``[round][request] -> token ids``), seeded: the same for every Engine."""
    rng = random.Random(f"{t.name}/{seed}")
    prefixes = [[rng.randrange(5, ID_LIMIT) for _ in range(t.prefix_len)] for _ in range(t.prefixes)]
    rounds = []
    for _ in range(t.rounds):
        reqs = []
        for _ in range(t.concurrency):
            n = rng.randint(*t.prompt)
            head = rng.choice(prefixes) if prefixes else []
            reqs.append(head + [rng.randrange(5, ID_LIMIT) for _ in range(n - len(head))])
        rounds.append(reqs)
    return rounds


def parse_traffic(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in TRAFFIC]
    if bad or not names:
        raise SystemExit(f"--traffic: unknown {bad or text!r}; known: {','.join(TRAFFIC)}")
    return names


# ---------------------------------------------------------------------------------------------------- arms
@dataclass(frozen=True)
class Arm:
    """An extra kvcanary-on Engine kind (``--arm``): the on mode's settings, then ``env`` on top."""
    name: str
    env: dict[str, str]


ARM_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # it names the Engine's folder


def parse_arms(items: list[str]) -> list[Arm]:
    """``--arm NAME:KVCANARY_KEY=VALUE[,KVCANARY_KEY=VALUE...]`` items, in the given order."""
    arms: list[Arm] = []
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or not rest:
            raise SystemExit(f"--arm: expected NAME:KVCANARY_KEY=VALUE[,KVCANARY_KEY=VALUE...], got {item!r}")
        if name in ("off", "on"):
            raise SystemExit(f"--arm: {name!r} is a built-in Engine kind; give the arm another name")
        if not ARM_NAME_RE.fullmatch(name):
            raise SystemExit(f"--arm: name {name!r} must be letters, digits, '_', '.', '-' (it names a folder)")
        if any(a.name == name for a in arms):
            raise SystemExit(f"--arm: {name!r} given twice")
        env: dict[str, str] = {}
        for pair in rest.split(","):
            key, eq, value = pair.strip().partition("=")
            if not eq or not key.startswith("KVCANARY_"):
                raise SystemExit(f"--arm {name}: expected KVCANARY_KEY=VALUE, got {pair!r}")
            if key in e2e.KVCANARY_ENV_FIXED:  # phase_env sets these after the overrides: they would be ignored
                raise SystemExit(f"--arm {name}: {key} is set per Engine by the bench; any other KVCANARY_* works")
            env[key] = value
        arms.append(Arm(name, env))
    return arms


def engine_order(first: str, arms: list[str], pairs: int) -> list[str]:
    """Every Engine's kind in start order: each round off and on (``first`` of them first), then the arms."""
    return ([first, "on" if first == "off" else "off"] + arms) * pairs


# ---------------------------------------------------------------------------------------------------- statistics
def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def min_max(xs: list[float]) -> tuple[float, float] | None:
    return (min(xs), max(xs)) if xs else None


def ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------------------- timing
def time_stream(chunks, n: int, t0: float, clock=time.perf_counter) -> dict:
    """Consume a streamed batch ``generate`` (chunks with ``index`` and ``meta_info.completion_tokens``, which is
    cumulative) sent at ``t0``; returns the round's TTFTs and per-token ITLs (seconds), tokens, cached tokens."""
    first: list[float | None] = [None] * n
    last = [0.0] * n
    count = [0] * n
    cached = [0] * n
    itl: list[float] = []
    for chunk in chunks:
        t = clock()
        i = int(chunk.get("index", 0))
        meta = chunk.get("meta_info") or {}
        done = int(meta.get("completion_tokens") or len(chunk.get("output_ids") or []))
        cached[i] = int(meta.get("cached_tokens") or cached[i])
        new = done - count[i]
        if new <= 0:
            continue
        if first[i] is None:
            first[i] = t
        else:
            itl.extend([(t - last[i]) / new] * new)
        last[i], count[i] = t, done
    wall = clock() - t0
    return {"ttft": [f - t0 for f in first if f is not None], "itl": itl, "tokens": count, "cached": sum(cached),
            "wall": wall}


def shape_result(t: Traffic, rounds: list[dict]) -> dict:
    """One Engine's figures for one traffic shape from its measured rounds (``time_stream``'s dicts)."""
    ttft = [x for r in rounds for x in r["ttft"]]
    itl = [x for r in rounds for x in r["itl"]]
    tokens = [n for r in rounds for n in r["tokens"]]
    wall = sum(r["wall"] for r in rounds)
    out = sum(tokens)
    ms = 1e3
    return {
        "requests": len(tokens), "requests_ok": sum(1 for n in tokens if n == t.output), "output_tokens": out,
        "cached_tokens": sum(r["cached"] for r in rounds), "wall_s": round(wall, 3),
        "tokens_per_s": round(out / wall, 1) if wall else None,
        "ttft_p50_ms": _r(percentile(ttft, 50), ms), "ttft_p99_ms": _r(percentile(ttft, 99), ms),
        "itl_p50_ms": _r(percentile(itl, 50), ms), "itl_p99_ms": _r(percentile(itl, 99), ms),
        "itl_samples": len(itl), **itl_tails(itl),
        # every request's TTFT in submission order (round by round): the percentiles of 4 requests (decode-1) say
        # little, and on/off TTFT differences are read request by request
        "ttft_ms": [_r(x, ms, 2) for x in ttft],
    }


def itl_tails(itl: list[float]) -> dict:
    """The ITL tail of one shape on one Engine (seconds in, ms out): its longest sample and how many samples were
    stalls (above STALL_FACTOR x that Engine's ITL p50). p99 alone cannot tell a few long stalls from a wider
    spread; on decode shapes ITL p99 on/off was 1.10-1.13 with p50 at +1 %."""
    p50 = percentile(itl, 50)
    return {"itl_max_ms": _r(max(itl) if itl else None, 1e3),
            "itl_stalls": sum(1 for x in itl if x > STALL_FACTOR * p50) if itl else 0}


def _r(x: float | None, scale: float = 1.0, nd: int = 3) -> float | None:
    return None if x is None else round(x * scale, nd)


# ---------------------------------------------------------------------------------------------------- worker
BEGIN = "[brs-worker] measured begin: "
END = "[brs-worker] measured end: "


def _generate(engine, prompts: list[list[int]], output: int) -> dict:
    sps = [dict(temperature=0.0, max_new_tokens=output, ignore_eos=True) for _ in prompts]
    t0 = time.perf_counter()
    return time_stream(engine.generate(input_ids=prompts, sampling_params=sps, stream=True), len(prompts), t0)


def worker_main(spec_path: str) -> int:
    """One Engine in this process: import sglang, start it, warm every shape, measure every shape."""
    with open(spec_path) as f:
        spec = json.load(f)
    res_path = spec["result"]
    res = {"status": "IMPORTING", "mode": spec["mode"], "arm": spec["arm"], "env": spec["env"], "shapes": {},
           "errors": []}
    e2e.write_json(res_path, res)
    t = time.perf_counter()
    try:
        from sglang.srt.entrypoints.engine import Engine
    except BaseException as exc:
        res.update(status="IMPORT_ERROR", errors=[f"{type(exc).__name__}: {str(exc)[:2000]}"])
        e2e.write_json(res_path, res)
        raise
    res.update(status="STARTING", import_s=round(time.perf_counter() - t, 2))
    e2e.write_json(res_path, res)
    print(f"[brs-worker] import sglang: {res['import_s']} s; KVCANARY_MODE={os.environ.get('KVCANARY_MODE')}",
          flush=True)
    kw = e2e.version_engine_kwargs(dict(spec["engine"]), e2e.installed_sglang_version())
    print(f"[brs-worker] Engine kwargs: {kw}", flush=True)
    t = time.perf_counter()
    try:
        engine = Engine(**kw)
    except BaseException as exc:
        res.update(status="START_ERROR", errors=[f"{type(exc).__name__}: {str(exc)[:2000]}"],
                   engine_start_s=round(time.perf_counter() - t, 2))
        e2e.write_json(res_path, res)
        raise
    res.update(status="RUNNING", engine_start_s=round(time.perf_counter() - t, 2))
    e2e.write_json(res_path, res)
    print(f"[brs-worker] Engine start: {res['engine_start_s']} s", flush=True)
    rc = 0
    try:
        t = time.perf_counter()
        for name in spec["traffic"]:  # warm-up: each shape's first round, other prompts, outputs capped
            tr = TRAFFIC[name]
            _generate(engine, make_rounds(tr, spec["seed"] + 1)[0], min(tr.output, WARM_OUTPUT))
        res["warmup_s"] = round(time.perf_counter() - t, 2)
        print(f"[brs-worker] warm-up: {res['warmup_s']} s", flush=True)
        for name in spec["traffic"]:
            if time.time() > spec["deadline"]:
                res["status"] = "TRUNCATED"
                res["errors"].append(f"deadline reached before {name}")
                break
            tr = TRAFFIC[name]
            print(f"{BEGIN}{name}", flush=True)  # (BEGIN also cuts the log into one section per shape)
            if spec["loop_probe"]:
                print(f"{loop_probe.WINDOW_START}{time.time():.3f}", flush=True)
            rounds = [_generate(engine, prompts, tr.output) for prompts in make_rounds(tr, spec["seed"])]
            if spec["loop_probe"]:
                print(f"{loop_probe.WINDOW_END}{time.time():.3f}", flush=True)
            print(f"{END}{name}", flush=True)
            res["shapes"][name] = shape_result(tr, rounds)
            e2e.write_json(res_path, res)
            print(f"[brs-worker] {name}: {json.dumps(res['shapes'][name])}", flush=True)
        if res["status"] == "RUNNING":
            res["status"] = "OK"
    except BaseException as exc:
        res["status"] = "ERROR"
        res["errors"].append(f"{type(exc).__name__}: {str(exc)[:2000]}")
        rc = 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            e2e.shutdown_engine(engine, res)
        finally:
            e2e.write_json(res_path, res)
    return rc


# ---------------------------------------------------------------------------------------------------- parent
MODES = {  # the e2e driver's Phase carries what phase_env needs: the mode and the KVCANARY_* settings
    "off": e2e.Phase("rs-off", "real-shape off", "off", True, 0, 0, 0, (("KVCANARY_STATS_EVERY", "100"),)),
    "on": e2e.Phase("rs-on", "real-shape on", "raise", True, 0, 0, 0, (
        ("KVCANARY_REAL_KV", "partial"), ("KVCANARY_VERIFY_TOKENS", "1"), ("KVCANARY_SWEEP_INTERVAL", "10"),
        ("KVCANARY_STATS_EVERY", "100"))),
}


def engine_kwargs(model: str, extra: dict) -> dict:
    """sglang's defaults but for what a dummy-weight, token-id benchmark needs (``--engine-arg`` adds more).
    ``log_level="info"`` is the server's default; the offline Engine's own ("error") would hide sglang's start-up
    figures and kvcanary's stats and host-time lines, which the tables read (2026-12-02: the first H200 run's
    tables had no host column and an on Engine that "verified nothing")."""
    kw = dict(model_path=model, load_format="dummy", skip_tokenizer_init=True, random_seed=0, log_level="info")
    kw.update(extra)
    return kw


def _status(result_path: str) -> str | None:
    res = e2e.load_result(result_path)
    return res.get("status") if res else None


def run_engine_worker(cmd: list[str], env: dict, log_path: str, result_path: str, start_timeout: float,
                      timeout: float, poll: float = 0.5) -> dict:
    """Start one worker (its own process group), wait for it; end it (the driver's ``kill_group``) when it is still
    importing or starting after ``start_timeout`` s, or running after ``timeout`` s. Returns ``{"rc", "killed",
    "worker_s"}``, killed = None | "start-up" | "timeout"."""
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            log.write(f"cannot start worker: {exc}\n".encode())
            return {"rc": 127, "killed": None, "worker_s": 0.0}
        killed = None
        while (rc := proc.poll()) is None:
            el = time.monotonic() - t0
            if el > timeout:
                killed = "timeout"
            elif el > start_timeout and _status(result_path) in (None, "IMPORTING", "STARTING"):
                killed = "start-up"
            if killed:
                e2e.kill_group(proc)
                log.write(f"\n[brs] worker ended after {el:.0f} s ({killed})\n".encode())
                rc = 124
                break
            time.sleep(poll)
    return {"rc": rc, "killed": killed, "worker_s": round(time.monotonic() - t0, 2)}


def write_tail(engine_dir: str) -> None:
    text = e2e.read_text(os.path.join(engine_dir, "worker.log"))
    with open(os.path.join(engine_dir, "log-tail.txt"), "w") as f:
        f.write("".join(text.splitlines(True)[-TAIL_LINES:]))


ENGINE_DIR_RE = re.compile(r"engine-(\d+)-([A-Za-z0-9][A-Za-z0-9_.-]*)")  # engine-NN-ARM (off, on, an --arm)


def next_index(out: str) -> int:
    """Engines already in ``out`` (a run into the same folder adds after them)."""
    found = [int(m.group(1)) for d in os.listdir(out) if (m := ENGINE_DIR_RE.fullmatch(d))]
    return max(found, default=-1) + 1


def run_parent(args, runner=run_engine_worker) -> int:
    """Run the alternating Engines (off, on, the arms, per round) under the budget, then summarize ``args.out``.
    ``runner`` is ``run_engine_worker``'s signature (the dry run passes one that writes synthetic results)."""
    t_end = time.time() + args.budget
    os.makedirs(args.out, exist_ok=True)
    first = next_index(args.out)
    engine = engine_kwargs(args.model, e2e.parse_engine_args(args.engine_arg or []))
    overrides = e2e.parse_kvcanary_env(args.kvcanary_env or [])
    arm_env = {"off": {}, "on": {}} | {a.name: a.env for a in args.arms}
    for k, arm in enumerate(engine_order(args.first, [a.name for a in args.arms], args.pairs)):
        mode = "off" if arm == "off" else "on"  # an arm is the on mode with its own settings on top
        edir = os.path.abspath(os.path.join(args.out, f"engine-{first + k:02d}-{arm}"))
        os.makedirs(edir, exist_ok=True)
        result_path = os.path.join(edir, "result.json")
        left = t_end - time.time()
        if left < args.engine_min_s:
            why = f"{left:.0f} s of --budget left, fewer than --engine-min-s {args.engine_min_s:.0f}"
            e2e.write_json(result_path, {"status": "SKIPPED", "mode": mode, "arm": arm, "env": arm_env[arm],
                                         "shapes": {}, "errors": [why]})
            continue
        timeout = min(args.engine_timeout, left)
        spec = {"mode": mode, "arm": arm, "env": arm_env[arm], "engine": engine, "traffic": args.traffic,
                "seed": args.seed, "result": result_path, "deadline": time.time() + timeout - 30,
                "loop_probe": args.loop_probe}
        spec_path = os.path.join(edir, "spec.json")
        e2e.write_json(spec_path, spec)
        env = e2e.phase_env(MODES[mode], edir, overrides=overrides | arm_env[arm])
        if args.loop_probe:
            env = loop_probe.probe_env(env, os.path.join(edir, "loop-probe-plugin"))
        log_path = os.path.join(edir, "worker.log")
        print(f"[brs] engine {first + k} ({arm}): starting, {left:.0f} s of budget left", flush=True)
        ran = runner([sys.executable, os.path.abspath(__file__), "--worker", spec_path], env, log_path, result_path,
                     args.start_timeout, timeout)
        res = e2e.load_result(result_path) or {"status": "NO_RESULT", "mode": mode, "shapes": {}, "errors": []}
        res.update(arm=arm, env=arm_env[arm], worker_rc=ran["rc"], worker_s=ran["worker_s"])
        if ran["killed"]:
            res["status"] = "START_TIMEOUT" if ran["killed"] == "start-up" else "TIMEOUT"
            res["killed_after_s"] = ran["worker_s"]
        elif res.get("status") == "OK" and ran["rc"] != 0:
            res["status"] = "ERROR"
            res.setdefault("errors", []).append(f"worker exit status {ran['rc']}")
        e2e.write_json(result_path, res)
        write_tail(edir)
        print(f"[brs] engine {first + k} ({arm}): {res['status']}, start {res.get('engine_start_s', '-')} s, "
              f"worker {ran['worker_s']:.0f} s", flush=True)
    return summarize([args.out], args.out)


# ---------------------------------------------------------------------------------------------------- log facts
LOAD_RE = re.compile(r"Load weight end\. elapsed=(?P<s>[\d.]+) s")
DECODE_CAPTURE_RE = re.compile(r"Capture cuda graph end\. Time elapsed: (?P<s>[\d.]+) s")
DECODE_SIZES_RE = re.compile(r"Capture cuda graph bs \[(?P<sizes>[^\]]*)\]")
PCG_SIZES_RE = re.compile(r"Capture cuda graph num tokens \[(?P<sizes>[^\]]*)\]")
BACKEND_RE = re.compile(r"attention_backend='(?P<backend>[\w-]+)'")


def _last(pattern: re.Pattern, text: str, group: str) -> str | None:
    found = [m.group(group) for m in pattern.finditer(text)]
    return found[-1] if found else None


def _sizes(pattern: re.Pattern, text: str) -> int | None:
    sizes = _last(pattern, text, "sizes")
    return None if sizes is None else len([s for s in sizes.split(",") if s.strip()])


def startup_facts(log_text: str) -> dict:
    """sglang's own start-up figures from an Engine's log (None where the line never came)."""
    num = lambda s: None if s is None else float(s)  # noqa: E731
    pcg = e2e_core.piecewise_capture_seconds(log_text)
    return {
        "weights_s": num(_last(LOAD_RE, log_text, "s")),
        "decode_capture_s": num(_last(DECODE_CAPTURE_RE, log_text, "s")), "decode_sizes": _sizes(DECODE_SIZES_RE,
                                                                                                  log_text),
        "piecewise_capture_s": pcg[-1] if pcg else None, "piecewise_sizes": _sizes(PCG_SIZES_RE, log_text),
        "attention_backend": _last(BACKEND_RE, log_text, "backend"),
    }


def host_window(log_text: str, name: str) -> dict | None:
    """kvcanary's host µs per forward over shape ``name``'s measured window: the forwards between the last
    ``kvcanary host time`` line before its begin marker (or the Engine's start: the counters start at 0 after graph
    capture) and the last one before its end marker. The lines are cumulative and come every KVCANARY_STATS_EVERY
    forwards, so the window is the shape's forwards to within that many at each end (and their averages are
    rounded to 0.1 µs: the window's figure to 0.1 µs x later forwards / window forwards). None without two lines."""
    b = log_text.find(BEGIN + name)
    e = log_text.find(END + name, b)
    if b < 0 or e < 0:
        return None
    host_re = e2e_core.HOST_RE
    lines = [(m.start(), e2e_core.last_match_fields(host_re, m.group(0))) for m in host_re.finditer(log_text)]
    before = [f for p, f in lines if p < b]
    upto = [f for p, f in lines if p < e]
    a = before[-1] if before else {"forwards": 0, "canary_us": 0.0, "forward_us": 0.0}
    z = upto[-1] if upto else None
    if z is None or z["forwards"] <= a["forwards"]:
        return None
    n = z["forwards"] - a["forwards"]

    def per_forward(key: str) -> float | None:  # the window's mean of a per-forward figure of the cumulative lines
        if key not in z:
            return None
        return (z["forwards"] * z[key] - a["forwards"] * a.get(key, 0.0)) / n

    inside = [f for p, f in lines if b < p < e and "max_forward_us" in f]
    return {"forwards": n, "canary_us": per_forward("canary_us"), "forward_us": per_forward("forward_us"),
            "batch_init_us": per_forward("batch_init_us"),
            # the tails (lines since issue 28): forwards of >= 1 ms in the window, the longest forward of its lines
            "slow_forwards": z["slow_forwards"] - a.get("slow_forwards", 0) if "slow_forwards" in z else None,
            "max_forward_ms": max(f["max_forward_us"] for f in inside) / 1e3 if inside else None}


def probe_windows(log_text: str) -> dict[str, dict]:
    """--loop-probe: each shape's loop-probe figures (``loop_probe.per_iteration``) over its measured rounds. The
    shape's section of the log runs from the log's start (the last probe line before its window is the window's
    base) to the next shape's begin marker, so that ``parse_window``'s last WINDOW_START in it is this shape's; a
    shape whose section has no window of its own (no probe) is left out."""
    begins = [(m.start(), m.group(1)) for m in re.finditer(rf"^{re.escape(BEGIN)}(\S+)$", log_text, re.M)]
    out = {}
    for i, (at, name) in enumerate(begins):
        cut = begins[i + 1][0] if i + 1 < len(begins) else len(log_text)
        section = log_text[:cut]
        if section.rfind(loop_probe.WINDOW_START) < at:
            continue
        window = loop_probe.parse_window(section)
        if window and window["iters"]:
            out[name] = loop_probe.per_iteration(window)
    return out


def load_engines(dirs: list[str]) -> list[dict]:
    """Every Engine folder of ``dirs`` in run order: its result, log facts, report counts, per-shape host time and
    loop-probe figures. ``arm`` is the Engine's kind (off, on, an --arm; a folder from before --arm: its mode),
    ``mode`` whether kvcanary was off or on."""
    engines = []
    for run, d in enumerate(dirs):
        for edir in sorted(glob.glob(os.path.join(d, "engine-*-*"))):
            m = ENGINE_DIR_RE.fullmatch(os.path.basename(edir))
            if not m:
                continue
            res = e2e.load_result(os.path.join(edir, "result.json")) or {"status": "NO_RESULT", "shapes": {}}
            log = e2e.read_text(os.path.join(edir, "worker.log"))
            rows = e2e.read_jsonl(sorted(glob.glob(os.path.join(edir, "kvc-*.jsonl"))))
            stats = e2e_core.parse_stats(log) or {}
            arm = res.get("arm") or m.group(2)
            probes = probe_windows(log)
            eng = {"run": run, "dir": edir, "index": int(m.group(1)), "arm": arm,
                   "mode": "off" if arm == "off" else "on", "result": res,
                   "startup": startup_facts(log), "entries_verified": stats.get("entries_verified"),
                   "violations": sum(1 for r in rows if r.get("schema") == e2e.VIOLATION_SCHEMA),
                   "health_errors": sum(1 for r in rows if r.get("schema") == e2e_core.HEALTH_SCHEMA),
                   "host": e2e_core.parse_host_time(log), "shapes": {}}
            for name, s in (res.get("shapes") or {}).items():
                s = dict(s)
                host = host_window(log, name) if eng["mode"] == "on" else None
                if host and s.get("wall_s"):
                    # the canary's host time over the window, as a share of the shape's wall time per forward
                    host["share_pct"] = 100.0 * host["canary_us"] * host["forwards"] / (s["wall_s"] * 1e6)
                s["host"] = host
                s["probe"] = probes.get(name)
                eng["shapes"][name] = s
            engines.append(eng)
    return engines


# ---------------------------------------------------------------------------------------------------- tables
METRICS = (  # (row, key, on/off target, higher is better)
    ("output tokens/s", "tokens_per_s", TOKENS_TARGET, True),
    ("TTFT p50 (ms)", "ttft_p50_ms", LATENCY_TARGET, False),
    ("TTFT p99 (ms)", "ttft_p99_ms", LATENCY_TARGET, False),
    ("ITL p50 (ms)", "itl_p50_ms", LATENCY_TARGET, False),
    ("ITL p99 (ms)", "itl_p99_ms", LATENCY_TARGET, False),
)


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _cell(xs: list[float], nd: int = 1) -> str:
    if not xs:
        return "-"
    lo, hi = min_max(xs)
    return f"{_f(median(xs), nd)} ({_f(lo, nd)}–{_f(hi, nd)})"


def _nd(key: str, xs: list[float]) -> int:
    return 0 if key == "tokens_per_s" and xs and median(xs) >= 100 else (1 if key == "tokens_per_s" else 2)


TAILS = (  # (row, key): shown where the results have them (runs since ITL tails were recorded); no target
    ("ITL max (ms)", "itl_max_ms"),
    (f"ITL stalls (> {STALL_FACTOR:g}× the Engine's ITL p50)", "itl_stalls"),
)


def served(name: str, engines: list[dict], arm: str) -> list[dict]:
    """Shape ``name``'s figures of every ``arm`` Engine that served it."""
    return [e["shapes"][name] for e in engines if e["arm"] == arm and name in e["shapes"]
            and e["result"].get("status") in ("OK", "TRUNCATED")]


def shape_label(name: str, arm: str) -> str:
    """A shape's label against off: the shape for the on arm (as before --arm), ``shape (arm)`` for an --arm."""
    return name if arm == "on" else f"{name} ({arm})"


def shape_table(name: str, engines: list[dict], arm: str = "on") -> tuple[list[str], dict]:
    """One traffic shape's table for one kvcanary-on arm: off and arm medians (min–max over the Engines that served
    it), arm/off ratio of the medians against its target, the ITL tails, then kvcanary's host µs per forward and
    share. Returns (lines, verdicts)."""
    off, on = served(name, engines, "off"), served(name, engines, arm)
    t = TRAFFIC.get(name)
    what = (f"{t.concurrency} concurrent, {t.rounds} round(s), prompts {t.prompt[0]}-{t.prompt[1]} tokens"
            f"{f' ({t.prefixes} shared prefixes of {t.prefix_len})' if t.prefixes else ''}, {t.output} out"
            if t else "")
    lines = [f"### {shape_label(name, arm)}: {what}", "",
             f"{len(off)} off / {len(on)} {arm} Engines; median (min–max) over them.", "",
             f"| metric | off | {arm} | {arm}/off | target | met |", "|---|---|---|---|---|---|"]
    verdicts = {}
    for label, key, target, higher in METRICS:
        a, b = _values(off, key), _values(on, key)
        r = ratio(median(b), median(a))
        met = None if r is None else (r >= target if higher else r <= target)
        verdicts[key] = met
        said = "-" if met is None else ("met" if met else "NOT met")
        lines.append(f"| {label} | {_cell(a, _nd(key, a))} | {_cell(b, _nd(key, b))} | {_f(r, 3)} | "
                     f"{'≥' if higher else '≤'} {target:.2f} | {said} |")
    for label, key in TAILS:
        a, b = _values(off, key), _values(on, key)
        if a or b:
            nd = 0 if key == "itl_stalls" else 2
            lines.append(f"| {label} | {_cell(a, nd)} | {_cell(b, nd)} | {_f(ratio(median(b), median(a)), 3)} | | |")
    hosts = [s["host"] for s in on if s.get("host")]
    fwds = [h["forwards"] for h in hosts]
    lines.append(f"| kvcanary host µs per forward | - | {_cell([h['canary_us'] for h in hosts])} | | | |")
    batch = [h["batch_init_us"] for h in hosts if h.get("batch_init_us") is not None]
    lines.append(f"| of it, the batch hook (token check, writer attribution) | - | {_cell(batch)} | | | |")
    shares = [h["share_pct"] for h in hosts if "share_pct" in h]
    lines.append(f"| kvcanary host share of wall (%) | - | {_cell(shares, 2)} | | | |")
    slow = [h["slow_forwards"] for h in hosts if h.get("slow_forwards") is not None]
    lines.append(f"| forwards with ≥ 1 ms of kvcanary host time | - | {_cell(slow, 0)} | | | |")
    longest = [h["max_forward_ms"] for h in hosts if h.get("max_forward_ms") is not None]
    lines.append(f"| a forward's most kvcanary host time (ms) | - | {_cell(longest, 2)} | | | |")
    pairs = pair_ratios(name, engines, arm)
    lines += ["", f"Host window: {min(fwds) if fwds else 0}–{max(fwds) if fwds else 0} forwards per Engine. "
              f"Tokens/s {arm}/off per pair: {', '.join(_f(x, 3) for x in pairs) or '-'}."]
    return lines, verdicts


def _values(shapes: list[dict], key: str) -> list[float]:
    return [s[key] for s in shapes if s.get(key) is not None]


def pair_ratios(name: str, engines: list[dict], arm: str = "on") -> list[float]:
    """arm/off output tokens/s of each pair: the k-th off and k-th ``arm`` Engine of each run, both served."""
    out = []
    for run in sorted({e["run"] for e in engines}):
        offs = [e for e in engines if e["run"] == run and e["arm"] == "off"]
        ons = [e for e in engines if e["run"] == run and e["arm"] == arm]
        for off, on in zip(offs, ons, strict=False):
            a, b = (off["shapes"].get(name, {}).get("tokens_per_s"), on["shapes"].get(name, {}).get("tokens_per_s"))
            if a and b:
                out.append(b / a)
    return out


PROBE_COLUMNS = (  # (loop_probe.per_iteration key, header): µs per scheduler-loop iteration unless said
    ("loop_us", "loop"), ("gpu_decode_us", "GPU span of a decode forward"),
    ("evsync_us", "host blocked on the GPU (event sync)"), ("sync_us", "other syncs"), ("run_us", "run_batch"),
    ("kvc_batch_us", "kvcanary batch hook"), ("kvc_after_us", "kvcanary host_after"),
    ("kvc_sweep_us", "kvcanary sweep"), ("unit_us", "one torch launch"),
)


def probe_table(names: list[str], arms: list[str], engines: list[dict]) -> list[str]:
    """--loop-probe: per shape and arm (off first), the medians over its Engines of the loop probe's figures over
    the shape's measured rounds, and the arm's loop µs over off's. Empty when no Engine has probe figures."""
    if not any(s.get("probe") for e in engines for s in e["shapes"].values()):
        return []
    lines = ["### Loop probe: sglang's scheduler loop per shape (integration/loop_probe.py)", "",
             "µs per loop iteration (the GPU span: per decode forward), median over the arm's Engines.", "",
             "| shape (arm) | Engines | iterations | " + " | ".join(h for _, h in PROBE_COLUMNS) + " | loop arm/off |",
             "|---|---|---|" + "---|" * (len(PROBE_COLUMNS) + 1)]
    for name in names:
        off_loop = None
        for arm in ["off"] + arms:
            probes = [s["probe"] for s in served(name, engines, arm) if s.get("probe")]
            if not probes:
                continue
            mid = {k: median([p.get(k, 0) for p in probes]) for k, _ in PROBE_COLUMNS + (("iters", ""),)}
            if arm == "off":
                off_loop = mid["loop_us"]
            lines.append(f"| {name} ({arm}) | {len(probes)} | {mid['iters']:.0f} | "
                         + " | ".join(_f(mid[k]) for k, _ in PROBE_COLUMNS)
                         + f" | {'-' if arm == 'off' else _f(ratio(mid['loop_us'], off_loop), 3)} |")
    return lines + [""]


def startup_table(engines: list[dict]) -> list[str]:
    lines = ["### Engines: start-up and status", "",
             "| engine | mode | status | import s | Engine() s | start-up finished | weights s | decode graphs s "
             "(sizes) | piecewise graphs s (sizes) | attention | entries verified | violations | folder |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in engines:
        r, s = e["result"], e["startup"]
        started = r.get("engine_start_s") is not None and r.get("status") not in ("START_ERROR",)
        if started:
            start, fin = _f(r["engine_start_s"]), "yes"
        elif r.get("status") == "START_TIMEOUT":
            start, fin = f"> {_f(r['killed_after_s'] - (r.get('import_s') or 0))}", "no (killed)"
        else:
            start, fin = _f(r.get("engine_start_s")), "no"
        tag = f"{e['run']}/{e['index']}" if e["run"] else str(e["index"])
        lines.append(
            f"| {tag} | {e['arm']} | {r.get('status')} | {_f(r.get('import_s'))} | {start} | {fin} | "
            f"{_f(s['weights_s'])} | {_f(s['decode_capture_s'])} ({s['decode_sizes'] or '-'}) | "
            f"{_f(s['piecewise_capture_s'])} ({s['piecewise_sizes'] or '-'}) | {s['attention_backend'] or '-'} | "
            f"{e['entries_verified'] if e['entries_verified'] is not None else '-'} | "
            f"{e['violations'] if e['mode'] == 'on' else '-'} | `{os.path.basename(e['dir'])}` |")
    return lines


def extra_arms(engines: list[dict]) -> list[str]:
    """The --arm names of ``engines`` in their first Engine's order."""
    return list(dict.fromkeys(e["arm"] for e in engines if e["arm"] not in ("off", "on")))


def render(engines: list[dict], dirs: list[str]) -> tuple[str, dict]:
    names = [n for n in TRAFFIC if any(n in e["shapes"] for e in engines)]
    names += sorted({n for e in engines for n in e["shapes"]} - set(names))
    extra = extra_arms(engines)
    lines = ["## kvcanary on a Llama-3.1-8B shape: off vs on (raise, PARTIAL, token check, sweep 10)", "",
             f"Runs: {', '.join(dirs)}. Targets: output tokens/s on/off ≥ {TOKENS_TARGET}, TTFT and ITL p50/p99 "
             f"on/off ≤ {LATENCY_TARGET} (printed, not asserted).", ""]
    if extra:
        envs = {e["arm"]: e["result"].get("env") or {} for e in engines if e["arm"] in extra}
        lines += ["Arms (on with these settings on top): " + "; ".join(
            f"{a}: {', '.join(f'{k}={v}' for k, v in envs[a].items()) or '?'}" for a in extra) + ".", ""]
    if any(e["result"].get("dry_run") for e in engines):
        lines += ["DRY RUN: synthetic Engines (no sglang, no GPU); the figures below are made up.", ""]
    verdicts = {}
    for name in names:
        for arm in ["on"] + extra:
            table, verdicts[shape_label(name, arm)] = shape_table(name, engines, arm)
            lines += table + [""]
    lines += probe_table(names, ["on"] + extra, engines)
    lines += startup_table(engines)
    bad = [e for e in engines if e["result"].get("status") != "OK"]
    on_idle = [e for e in engines if e["mode"] == "on" and e["result"].get("status") == "OK"
               and not e["entries_verified"]]
    lines.append("")
    if on_idle:
        lines.append(f"WARNING: on Engine(s) {[e['index'] for e in on_idle]} verified nothing (kvcanary not loaded?)")
    lines.append("every Engine ran" if engines and not bad else
                 f"Engines that did not run to the end: {[(e['index'], e['result'].get('status')) for e in bad]}"
                 if engines else "no Engines found")
    return "\n".join(lines) + "\n", {"verdicts": verdicts, "ok": bool(engines) and not bad}


def summarize(dirs: list[str], out: str) -> int:
    engines = load_engines(dirs)
    md, facts = render(engines, dirs)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    e2e.write_json(os.path.join(out, "summary.json"), {"engines": engines, **facts})
    print(md, flush=True)
    return 0 if facts["ok"] else 1


# ---------------------------------------------------------------------------------------------------- dry run
DRY_BASE = {  # name: (output tokens/s of an off Engine, TTFT ms, ITL ms), plausible for an H200
    "decode-1": (150.0, 30.0, 6.6), "decode-64": (6400.0, 140.0, 9.8), "decode-256": (13500.0, 450.0, 18.5),
    "prefill": (900.0, 2400.0, 14.0), "ttft-1": (105.0, 30.0, 6.6),
}
DRY_STALL_P = 0.002  # a synthetic ITL sample is a 3x stall with this probability (the tails have something to count)


def dry_runner(cmd: list[str], env: dict, log_path: str, result_path: str, start_timeout: float,
               timeout: float) -> dict:
    """Stands in for ``run_engine_worker`` without sglang: writes what a worker and its Engine would (result with
    per-shape figures from synthetic per-request samples, a log with sglang's start-up lines, kvcanary's host-time
    and stats lines, the measure markers and, with --loop-probe, the probe's window markers and cumulative
    ``[e2e-probe]`` lines, an empty report) with engine-to-engine noise."""
    with open(cmd[-1]) as f:
        spec = json.load(f)
    on = env.get("KVCANARY_MODE") != "off"
    sweeping = on and env.get("KVCANARY_SWEEP_INTERVAL") != "0"
    edir = os.path.dirname(result_path)
    rng = random.Random(edir)
    eng = rng.gauss(1.0, 0.01)  # this Engine's speed
    cost = 0.99 if on else 1.0
    canary = rng.gauss(1.0, 0.04)  # this Engine's host speed for kvcanary's own work
    first = os.path.basename(edir).startswith("engine-00-")  # the machine's first Engine: cold JIT caches
    res = {"status": "OK", "mode": spec["mode"], "arm": spec["arm"], "env": spec["env"], "dry_run": True,
           "shapes": {}, "errors": [], "import_s": round(rng.gauss(24, 1), 2),
           "engine_start_s": round(rng.gauss(48, 3) + (40 if first else 0), 2), "warmup_s": round(rng.gauss(9, 1), 2)}
    log = [f"[brs-worker] import sglang: {res['import_s']} s; KVCANARY_MODE={env.get('KVCANARY_MODE')}",
           "server_args=ServerArgs(model_path='integration/models/llama-8b-shape', attention_backend='fa3', ...)",
           f"Load weight end. elapsed={rng.gauss(6, 0.5):.2f} s, type=LlamaForCausalLM, avail mem=120.0 GB",
           f"Capture cuda graph bs {[1, 2, 4, 8, 12, 16, 24, 32] + list(range(40, 257, 8))}",
           f"Capture cuda graph end. Time elapsed: {rng.gauss(14, 1):.2f} s. mem usage=2.1 GB.",
           f"Capture cuda graph num tokens {[4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]}",
           f"Capture piecewise CUDA graph end. Time elapsed: {rng.gauss(22, 2) + (30 if first else 0):.2f} s. "
           f"mem usage=1.0 GB.", f"[brs-worker] Engine start: {res['engine_start_s']} s"]
    host = {"forwards": 0, "canary": 0.0, "forward": 0.0}
    probe = dict.fromkeys(loop_probe.FIELDS, 0)  # the synthetic scheduler's cumulative loop-probe counters
    clock = [time.time()]  # the synthetic scheduler's wall clock (the probe lines' and window markers' t=)

    def forwards(n: int, us: float, forward_ms: float, decode: bool = True) -> None:
        """n forwards of ``forward_ms`` each, kvcanary's host time ``us`` per forward: a host-time line every 100,
        with --loop-probe a probe line every loop_probe.EVERY."""
        for _ in range(n):
            kvc = us * canary * rng.gauss(1, 0.05) if on else 0.0
            host["forwards"] += 1
            host["canary"] += kvc
            host["forward"] += 900.0
            clock[0] += forward_ms / 1e3
            if spec["loop_probe"]:
                probe_forward(forward_ms * 1e3, kvc, decode)
            if on and host["forwards"] % 100 == 0:
                f = host["forwards"]
                log.append(f"kvcanary host time: step={f} forwards={f} eager={f // 20} "
                           f"canary_us_per_forward={host['canary'] / f:.1f} hooks_us=20.0 "
                           f"launch_us_per_eager_forward=30.0 forward_us={host['forward'] / f:.1f} piecewise=0 "
                           f"launch_us_per_piecewise_forward=0.0 canary_us_per_piecewise_forward=0.0 "
                           f"batch_init_us=6.0 max_forward_us={rng.uniform(150, 1400):.1f} slow_forwards={f // 700}")
                log.append(f"kvcanary stats: step={f} forwards={f} tokens_written={f * 40} entries_verified={f * 9000} "
                           f"entries_swept={f * 300} violations=0 lost=0")

    def probe_forward(loop_us: float, kvc_us: float, decode: bool) -> None:
        ns = {"loop_ns": loop_us, "run_ns": 250.0 + kvc_us, "evsync_ns": 0.35 * loop_us, "sync_ns": 1.5,
              "gpu_ns": 0.9 * loop_us, "kvc_batch_ns": 0.6 * kvc_us, "kvc_after_ns": 0.3 * kvc_us,
              "kvc_sweep_ns": 0.08 * kvc_us if sweeping else 0.0}
        if decode:
            ns["gpu_decode_ns"] = ns["gpu_ns"]
            probe["gpu_decode_n"] += 1
        for k, v in ns.items():
            probe[k] += int(v * 1e3 * rng.gauss(1, 0.02))
        for k in ("iters", "decode_n" if decode else "extend_n", "evsync_n", "sync_n", "gpu_n"):
            probe[k] += 1
        if probe["iters"] % loop_probe.EVERY == 0:
            probe["unit_ns"] += int(loop_probe.UNIT_LAUNCHES * 4000 * rng.gauss(1, 0.05))
            probe["unit_n"] += loop_probe.UNIT_LAUNCHES
            log.append(f"[e2e-probe] t={clock[0]:.3f} pid=4242 " + " ".join(f"{k}={v}" for k, v in probe.items()))

    for name in spec["traffic"]:  # the warm-up rounds
        forwards(min(TRAFFIC[name].output, WARM_OUTPUT) + 3, 45.0, 7.0)
    for name in spec["traffic"]:
        t = TRAFFIC[name]
        tps, ttft_ms, itl_ms = DRY_BASE[name]
        log.append(f"{BEGIN}{name}")
        if spec["loop_probe"]:
            log.append(f"{loop_probe.WINDOW_START}{clock[0]:.3f}")
        rounds = []
        for _ in range(t.rounds):
            speed = eng * cost * rng.gauss(1.0, 0.005)
            wall = t.concurrency * t.output / (tps * speed)
            rounds.append({
                "ttft": [rng.lognormvariate(math.log(ttft_ms / speed), 0.25) / 1e3
                         for _ in range(t.concurrency)],
                "itl": [rng.lognormvariate(math.log(itl_ms / speed), 0.08) / 1e3
                        * (3.0 if rng.random() < DRY_STALL_P else 1.0)
                        for _ in range(t.concurrency * (t.output - 1))],
                "tokens": [t.output] * t.concurrency, "cached": t.concurrency * t.prefix_len if t.prefixes else 0,
                "wall": wall})
            if t.prefixes:
                forwards(8, 40.0 + 0.1 * t.concurrency, ttft_ms / speed / 8, decode=False)
            else:
                forwards(1, 40.0 + 0.1 * t.concurrency, ttft_ms / speed, decode=False)
            forwards(t.output, 40.0 + 0.1 * t.concurrency, itl_ms / speed)
        if spec["loop_probe"]:
            log.append(f"{loop_probe.WINDOW_END}{clock[0]:.3f}")
        log.append(f"{END}{name}")
        res["shapes"][name] = shape_result(t, rounds)
    with open(log_path, "a") as f:
        f.write("\n".join(log) + "\n")
    with open(os.path.join(edir, "kvc-0.jsonl"), "w"):
        pass
    e2e.write_json(result_path, res)
    return {"rc": 0, "killed": None, "worker_s": round(res["import_s"] + res["engine_start_s"] + 60, 2)}


# ---------------------------------------------------------------------------------------------------- cli
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3,
                    help="rounds of Engines: off, on, then each --arm (off, on, off, on, ... without arms)")
    ap.add_argument("--first", choices=("off", "on"), default="off",
                    help="the mode of each pair's first Engine (on: a fresh machine's cold caches go to an on Engine)")
    ap.add_argument("--traffic", type=parse_traffic, default=list(DEFAULT_TRAFFIC),
                    help=f"comma-separated traffic shapes every Engine serves, of {','.join(TRAFFIC)} (default "
                         f"{','.join(DEFAULT_TRAFFIC)})")
    ap.add_argument("--out", default="bench_real_shape_out", help="folder for the Engines' folders and the summary")
    ap.add_argument("--model", default=str(MODEL), help="a model folder (a config.json is enough: dummy weights)")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for the whole run (no Engine starts after)")
    ap.add_argument("--engine-min-s", type=float, default=150.0,
                    help="start another Engine only with this many seconds of --budget left")
    ap.add_argument("--start-timeout", type=float, default=300.0,
                    help="end an Engine not started (import sglang + Engine()) after this many seconds")
    ap.add_argument("--engine-timeout", type=float, default=420.0, help="end any Engine after this many seconds")
    ap.add_argument("--seed", type=int, default=0, help="the measured workload's seed (the warm-up uses seed + 1)")
    ap.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                    help="an extra Engine argument (VALUE as JSON, else a string), e.g. attention_backend=triton")
    ap.add_argument("--kvcanary-env", action="append", metavar="KVCANARY_NAME=VALUE",
                    help="a kvcanary setting both modes' Engines get after their own (not KVCANARY_MODE)")
    ap.add_argument("--arm", action="append", metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                    help="one more Engine per round: on with these KVCANARY_* settings on top (repeatable), e.g. "
                         "nosweep:KVCANARY_SWEEP_INTERVAL=0")
    ap.add_argument("--loop-probe", action="store_true",
                    help="time sglang's scheduler loop per shape in every Engine (integration/loop_probe.py)")
    ap.add_argument("--dry-run", action="store_true", help="no sglang, no GPU: synthetic Engines, real tables")
    ap.add_argument("--summarize", nargs="+", metavar="DIR", help="only render the tables of these runs' folders")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    args.arms = parse_arms(args.arm or [])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.summarize:
        return summarize(args.summarize, args.out)
    return run_parent(args, dry_runner if args.dry_run else run_engine_worker)


if __name__ == "__main__":
    sys.exit(main())
