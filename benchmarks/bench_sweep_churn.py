#!/usr/bin/env python3
"""The incremental sweep under a serving engine's prefix-cache churn, on a REAL sglang 0.5.12 RadixCache (issue 25).

    PYTHONPATH=plugin python3 benchmarks/bench_sweep_churn.py [--forwards 2160] [--intervals 10,3] [--json OUT]

A scheduler loop in miniature drives the tree like the H200 driver's workload: a KV pool of 12288 slots; 300
conversations, each on a system prompt of its own (8-300 tokens), whose requests re-send the conversation so far
(30 %) or branch from the system prompt (70 %: siblings under a shared prefix, so inserts split nodes) plus a new
message (8-64 tokens), prompts at most 1500 tokens, outputs 10-60 tokens, at most 16 running; per forward a chunked
prefill of at most 512 tokens (sglang's ``cache_unfinished_req``: the chunk inserted, the prefix matched again and
locked) and one decode token per running request; a finished request inserted (``cache_finished_req``);
``evict()`` whenever the pool runs short, requests admitted only when their prompt and every running output fit in
the free and evictable slots. The tree is sglang's own (~40 nodes and ~8.7k entries at a sweep; the pool turns over
every ~40 forwards), and ``kvcanary.sglang.radix_index`` follows it as in the engine.

Every ``interval`` forwards the sweep source is called, as ``Sweeper.run_source`` calls it (no kernels: the host
work alone, which is what ``sweep_us`` of the ``kvcanary host time`` line counts apart from the verify launch).
Sources, side by side on the same seeded workload:

* ``follow``: the engine's source (:class:`kvcanary.sglang.radix_index.RadixSweepIndex`), as it is now;
* ``follow@REV``: the same source as of git revision REV (``--before``, default 96fc4c0: compaction by a walk of
  the tree, ~20 device operations per update), its two modules loaded from ``git show``;
* ``walk``: a walk of the tree on every sweep (the source before issue 25, and a HiRadixCache's today).

Per source and interval: host µs per sweep and per forward (the round with the least), the device operations per
sweep (aten operations that do device work and kvcanary kernel launches: what a GPU pays ~6-10 µs of host time for
each; counted in one more run), the walks and
why, the compactions, the plan's entries; with ``--pieces``, host µs per piece of an incremental source (its index's
methods, the pending spans, the walk, and ``_TreeWatch.emit`` per tree event: sglang's own tree operations pay that,
outside ``sweep_us``). The last plan of each incremental source is checked against a walk of the tree.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import types
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

POOL = 12288
CHUNK = 512
MAX_RUNNING = 16


def _import_sglang():
    """sglang's RadixCache; on a CPU-only box with PyPI's CUDA torchvision, through tests/adapters' import shim."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    shims = Path(__file__).resolve().parents[1] / "tests" / "adapters"
    if not torch.cuda.is_available() and (shims / "_sglang_cpu_shims.py").exists():
        sys.path.insert(0, str(shims))
        import _sglang_cpu_shims

        _sglang_cpu_shims.apply()
    from sglang.srt.mem_cache import base_prefix_cache, radix_cache

    return radix_cache, base_prefix_cache


radix_cache, base_prefix_cache = _import_sglang()
RadixCache, RadixKey = radix_cache.RadixCache, radix_cache.RadixKey
EvictParams, InsertParams = base_prefix_cache.EvictParams, base_prefix_cache.InsertParams
MatchPrefixParams = base_prefix_cache.MatchPrefixParams

from kvcanary.sglang import radix, radix_index, v0_5_12  # noqa: E402


# ------------------------------------------------------------------------------------------------ the engine
class Allocator:
    """The token-to-KV pool allocator: a free list of ``size`` slots (1..size; 0 is the padding slot)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self._free = deque(range(1, size + 1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        return [self._free.popleft() for _ in range(n)]

    def free(self, slots) -> None:
        if isinstance(slots, torch.Tensor):
            slots = slots.tolist()
        self._free.extend(slots)


@dataclass
class Request:
    prompt: list[int]
    output_len: int
    conversation: int
    slots: list[int] = field(default_factory=list)  # req_to_token of its filled tokens
    filled: int = 0  # tokens with KV
    protected: int = 0  # cache_protected_len: slots[:protected] are the tree's
    last_node: object = None
    output: list[int] = field(default_factory=list)


class Engine:
    """sglang's scheduler in miniature over a real RadixCache (see the module docstring)."""

    def __init__(self, seed: int, device: torch.device, conversations: int = 300, requests: int = 4000) -> None:
        self.rng = rng = random.Random(seed)
        self.device = device
        self.alloc = Allocator(POOL, device)
        self.tree = RadixCache.create_simulated(mock_allocator=self.alloc)
        self._next_token = 1
        self.systems = [self._tokens(rng.randrange(8, 300)) for _ in range(conversations)]
        self.history: dict[int, list[int]] = {c: s for c, s in enumerate(self.systems)}
        self.requests_left = requests
        self.waiting: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.running: list[Request] = []
        self.tree_ns = 0  # host time in the tree's own operations (insert, match, evict, lock): sglang's

    def _tokens(self, n: int) -> list[int]:
        start = self._next_token
        self._next_token += n
        return list(range(start, start + n))

    def _new_request(self) -> Request:
        """A conversation's next turn (its history so far + a new message), or, half the time, a new branch of it
        from its system prompt (siblings under one shared prefix: the tree splits)."""
        rng = self.rng
        c = rng.randrange(len(self.systems))
        message = self._tokens(rng.randrange(8, 64))
        conversation = self.history[c] if rng.random() < 0.3 else self.systems[c]
        if len(conversation) + len(message) > 1500:  # (a new conversation on the same system prompt)
            conversation = self.systems[c]
        return Request(conversation + message, rng.randrange(10, 60), c)

    def _take(self, n: int) -> list[int] | None:
        """``n`` free slots, evicting from the tree when the pool runs short; None when it cannot."""
        if self.alloc.available() < n:
            t0 = time.perf_counter_ns()
            self.tree.evict(EvictParams(num_tokens=n - self.alloc.available()))
            self.tree_ns += time.perf_counter_ns() - t0
            if self.alloc.available() < n:
                return None
        return self.alloc.alloc(n)

    def _tensor(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def forward(self) -> None:
        """One scheduler iteration: finished requests cached, a prefill chunk, a decode token per running one."""
        tree = self.tree
        t0 = time.perf_counter_ns()
        for req in [r for r in self.running if len(r.output) >= r.output_len]:
            self.running.remove(req)
            self._cache_finished(req)
        self.tree_ns += time.perf_counter_ns() - t0
        while len(self.waiting) < 4 and self.requests_left:
            self.requests_left -= 1
            self.waiting.append(self._new_request())
        req = self.prefilling
        if req is None and self.waiting and len(self.running) < MAX_RUNNING and self._admissible(self.waiting[0]):
            req = self.waiting[0]
            t0 = time.perf_counter_ns()
            match = tree.match_prefix(MatchPrefixParams(key=RadixKey(req.prompt)))
            tree.inc_lock_ref(match.last_device_node)
            self.tree_ns += time.perf_counter_ns() - t0
            req.slots = match.device_indices.tolist()
            req.filled = req.protected = len(req.slots)
            req.last_node = match.last_device_node
            if req.filled == len(req.prompt):  # (fully cached: recompute the last token, as sglang does)
                req.slots.pop()
                req.filled -= 1
            self.waiting.popleft()
            self.prefilling = req
        if req is not None:
            n = min(CHUNK, len(req.prompt) - req.filled)
            slots = self._take(n)
            if slots is not None:
                req.slots += slots
                req.filled += n
                t0 = time.perf_counter_ns()
                if req.filled < len(req.prompt):
                    self._cache_unfinished(req)
                else:
                    self.prefilling = None
                    self.running.append(req)
                self.tree_ns += time.perf_counter_ns() - t0
        for r in self.running:
            slot = self._take(1)
            if slot is None:
                continue
            r.slots += slot
            r.output.append(self._tokens(1)[0])

    def _admissible(self, req: Request) -> bool:
        """sglang's PrefillAdder in short: the prompt and every running request's remaining output fit in the free
        and evictable slots (so a running request never runs out of slots)."""
        reserved = sum(r.output_len - len(r.output) for r in self.running) + len(req.prompt) + req.output_len
        return reserved <= self.alloc.available() + self.tree.evictable_size()

    def _cache_unfinished(self, req: Request) -> None:
        tree = self.tree
        tokens = req.prompt[:req.filled]
        result = tree.insert(InsertParams(key=RadixKey(tokens), value=self._tensor(req.slots[:req.filled]),
                                          chunked=True))
        self.alloc.free(req.slots[req.protected:result.prefix_len])
        match = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        req.slots[:req.filled] = match.device_indices.tolist()
        req.protected = req.filled
        tree.dec_lock_ref(req.last_node)
        tree.inc_lock_ref(match.last_device_node)
        req.last_node = match.last_device_node

    def _cache_finished(self, req: Request) -> None:
        tree = self.tree
        tokens = req.prompt + req.output
        n = len(req.slots)  # (the last output token has no KV yet)
        result = tree.insert(InsertParams(key=RadixKey(tokens[:n]), value=self._tensor(req.slots)))
        self.alloc.free(req.slots[req.protected:result.prefix_len])
        tree.dec_lock_ref(req.last_node)
        self.history[req.conversation] = tokens

    def idle(self) -> bool:
        return not (self.requests_left or self.waiting or self.prefilling or self.running)


# ------------------------------------------------------------------------------------------------ the sources
SOURCES = ("follow@{before}", "follow", "walk")
ROOT = Path(__file__).resolve().parents[1]


def module_at(rev: str, path: str, name: str, replace: tuple[tuple[str, str], ...] = ()) -> types.ModuleType:
    """The module ``path`` (in this repository) as of git revision ``rev``, loaded as ``name`` (``replace``: text
    replacements first, e.g. an import redirected to another module loaded as of ``rev``)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True,
                          check=True).stdout
    for old, new in replace:
        text = text.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module  # (dataclasses look their module up)
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module


def radix_index_at(rev: str) -> types.ModuleType:
    """``kvcanary.sglang.radix_index`` as of ``rev``, over ``kvcanary.runtime.sweep_index`` and
    ``kvcanary.runtime.streams`` as of ``rev`` (a revision's index imports names a later module may not have)."""
    tag = "".join(c for c in rev if c.isalnum())
    index = module_at(rev, "plugin/kvcanary/runtime/sweep_index.py", f"_bench_sweep_index_{tag}")
    streams = module_at(rev, "plugin/kvcanary/runtime/streams.py", f"_bench_streams_{tag}")
    return module_at(rev, "plugin/kvcanary/sglang/radix_index.py", f"_bench_radix_index_{tag}",
                     (("from kvcanary.runtime.sweep_index import", f"from {index.__name__} import"),
                      ("from kvcanary.runtime.streams import", f"from {streams.__name__} import")))


def make_source(name: str, tree):
    if name == "walk":
        return radix.radix_sweep_source(tree)
    if "@" in name:
        return radix_index_at(name.split("@", 1)[1]).RadixSweepIndex(tree, v0_5_12.RADIX_NODE_HOOKS)
    source = v0_5_12.sweep_source(tree)
    assert isinstance(source, radix_index.RadixSweepIndex)
    return source


class OpCounter(TorchDispatchMode):
    """Counts the aten operations that do device work (views and metadata reads left out): on a GPU each is a launch
    or a copy, ~6-10 µs of host time on the H200 host. (On the CPU an upload to the device is no operation, so a GPU
    counts one more per upload.)"""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket.__name__ in _NO_WORK):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _kernel_launches(source) -> int:
    """The kvcanary kernel launches an incremental source's index has made (``SweepIndex.launches``: the commit's
    ``canary_sweep_plan_update``, a tvm-ffi call the aten counter does not see); 0 for a source without them."""
    return getattr(getattr(source, "_index", None), "launches", 0)


_NO_WORK = {"detach", "alias", "lift_fresh", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
            "is_same_size", "resolve_conj", "resolve_neg", "_local_scalar_dense", "empty", "empty_strided"}


PIECES = {"index": ("append", "commit", "compact", "reserve", "clear"), "source": ("_pending_spans", "_update"),
          "module": ("walk_spans",), "watch": ("emit",)}


def time_pieces(source) -> tuple[dict[str, list[int]], list]:
    """Wrap the pieces of an incremental source (its index's methods, its own, its module's walk and the tree
    watch's ``emit``: the per-event cost inside sglang's tree operations) with timers: ``{piece: [ns, calls]}``,
    and the undo."""
    pieces: dict[str, list[int]] = {}
    module = sys.modules[type(source).__module__]
    owners = {"index": source._index, "source": source, "module": module, "watch": module._TreeWatch}
    undo = []

    def timed(fn, name):
        def wrapper(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                entry = pieces.setdefault(name, [0, 0])
                entry[0] += time.perf_counter_ns() - t0
                entry[1] += 1
        return wrapper

    for owner_name, names in PIECES.items():
        owner = owners[owner_name]
        for name in names:
            if hasattr(owner, name):
                had = vars(owner).get(name)
                setattr(owner, name, timed(getattr(owner, name), name))
                undo.append((owner, name, had))
    return pieces, undo


def run(source_name: str, interval: int, args, count_ops: bool, pieces: bool = False) -> dict:
    device = torch.device(args.device)
    engine = Engine(args.seed, device)
    source = make_source(source_name, engine.tree)
    timers, undo = time_pieces(source) if pieces and hasattr(source, "_index") else (None, [])
    sweep_ns: list[int] = []
    entries = forwards = 0
    counter = OpCounter() if count_ops else None
    gc.collect()
    while forwards < args.forwards and not engine.idle():
        engine.forward()
        forwards += 1
        if forwards % interval:
            continue
        if counter is not None:
            launches = _kernel_launches(source)
            with counter:
                found = source()
            counter.calls += _kernel_launches(source) - launches  # (a kernel launch is a device operation too)
        else:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # (the engine's work drained first: the sweep's host time alone)
            t0 = time.perf_counter_ns()
            found = source()
            sweep_ns.append(time.perf_counter_ns() - t0)
        if isinstance(found, tuple):
            entries += len(found[0])
        else:
            entries += int(found.plan.verify_num_valid.item()) - found.skipped
    if not isinstance(found, tuple):  # the plan the last sweep verified holds exactly what a walk of the tree finds
        plan, n = found.plan, int(found.plan.verify_num_valid.item())
        rows = zip(plan.verify_slot_indices[:n].tolist(), plan.verify_prev_slot_indices[:n].tolist(),
                   plan.verify_expected_positions[:n].tolist(), strict=True)
        walked = zip(*(t.tolist() for t in radix.gather_entries(engine.tree)), strict=True)
        if sorted(r for r in rows if r[0]) != sorted(walked):
            raise SystemExit(f"bench_sweep_churn: {source_name}: the plan differs from a walk of the tree")
    sweeps = forwards // interval
    out = {"source": source_name, "interval": interval, "forwards": forwards, "sweeps": sweeps,
           "entries_per_sweep": entries / max(sweeps, 1), "tree_ms": engine.tree_ns / 1e6}
    if counter is not None:
        out["ops_per_sweep"] = counter.calls / max(sweeps, 1)
    else:
        out["sweep_us"] = sum(sweep_ns) / max(sweeps, 1) / 1e3
        out["sweep_us_per_forward"] = sum(sweep_ns) / max(forwards, 1) / 1e3
    for owner, name, had in reversed(undo):
        if had is None:
            delattr(owner, name)
        else:
            setattr(owner, name, had)
    if timers is not None:
        out["pieces"] = {k: {"us_per_call": ns / calls / 1e3, "calls": calls, "us_per_forward": ns / forwards / 1e3}
                         for k, (ns, calls) in timers.items()}
    if hasattr(source, "walks"):
        out["walks"] = source.walks
        out["walk_reasons"] = dict(getattr(source, "walk_reasons", {}))
        out["compactions"] = getattr(source, "compactions", None)
        out["events"] = getattr(source, "events", None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--forwards", type=int, default=2160)
    ap.add_argument("--intervals", default="10,3")
    ap.add_argument("--sources", default=",".join(SOURCES),
                    help="comma-separated: follow, follow@REV (the source as of git revision REV), walk")
    ap.add_argument("--before", default="96fc4c0", help="the revision of follow@{before} (default: before the fix)")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per source and interval (min is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pieces", action="store_true",
                    help="one more, instrumented run per incremental source: host µs per piece (index methods, the "
                         "pending spans, the walk, the tree watch's emit per event)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    results = []
    for interval in (int(x) for x in args.intervals.split(",")):
        for name in args.sources.format(before=args.before).split(","):
            rounds = [run(name, interval, args, count_ops=False) for _ in range(args.rounds)]
            best = min(rounds, key=lambda r: r["sweep_us"])
            best["ops_per_sweep"] = run(name, interval, args, count_ops=True)["ops_per_sweep"]
            best["tree_ms"] = min(r["tree_ms"] for r in rounds)
            if args.pieces:
                best["pieces"] = run(name, interval, args, count_ops=False, pieces=True).get("pieces")
            results.append(best)
            print(line(best), flush=True)
            for piece, p in (best.get("pieces") or {}).items():
                print(f"    {piece:<15} {p['calls']:>5} calls {p['us_per_call']:8.1f} µs/call "
                      f"{p['us_per_forward']:6.2f} µs/forward", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


def line(r: dict) -> str:
    s = (f"{r['source']:<24} every {r['interval']:>2}: {r['sweeps']} sweeps of {r['entries_per_sweep']:.0f} entries "
         f"over {r['forwards']} forwards: {r['sweep_us']:.0f} µs/sweep, {r['sweep_us_per_forward']:.1f} µs/forward, "
         f"{r['ops_per_sweep']:.1f} device ops/sweep; tree ops {r['tree_ms']:.0f} ms")
    if "walks" in r:
        reasons = ", ".join(f"{k} {v}" for k, v in r["walk_reasons"].items() if v)
        s += f"; walks {r['walks']}" + (f" ({reasons})" if reasons else "")
        if r.get("compactions") is not None:
            s += f", compactions by gather {r['compactions']}"
    return s


if __name__ == "__main__":
    sys.exit(main())
