#!/usr/bin/env python3
"""The engine's per-forward host path, reproduced: what kvcanary adds to one eager forward of sglang 0.5.12.

    PYTHONPATH=plugin python3 benchmarks/bench_forward_path.py [--device cuda] [--quick] [--json OUT]

Runs, per forward, what sglang 0.5.12's scheduler and ModelRunner run around kvcanary, through the adapter's real
code (``kvcanary.sglang.hooks.AdapterHooks`` of the 0.5.12 version module, its ``install`` building the real
Installation, BatchConverter and managers): ``ForwardBatch.init_new`` -> the ``after_forward_batch_init`` hook
(writer attribution, token-table uploads) -> ``ModelRunner.forward`` -> the ``around_forward`` hook (the
``model.forward`` wrapper's eager hot path: the batch's arrays -> the bound check -> the model -> the bound write
(BatchConverter -> before_forward per group -> the model -> after_forward for the first batch of a mode);
host_after: step, drain, sweep, metrics; account_forward). The engine objects are light stand-ins with
0.5.12's field names and dtypes (a ForwardBatch with int64 input_ids / positions / out_cache_loc /
req_pool_indices / seq_lens and int32 extend_prefix_lens / extend_seq_lens, a ``Req`` with ``origin_input_ids`` /
``output_ids``, an MHA pool of the tiny Llama's shape, a RadixCache-shaped tree walked by the real sweep source):
no sglang import, so it runs wherever torch and apache-tvm-ffi do.

Cases at batch 64: decode (context ~1000), extend (64 new requests x 32 new tokens on a cached 992-token prefix)
and mixed (8 such extend rows + 56 decode rows); real-KV NONE and PARTIAL; token check; sweep every 10 forwards
(~52k entries). Each case prints the canary's host µs per forward split as kvcanary's own ``kvcanary host time``
accounting splits it (hooks / launches / batch-init / total), once measured from outside by this script and once
as the Installation's HostTime counters saw the same forwards, then a per-piece breakdown (a second, instrumented
pass). On the CPU the kernels run inline, so ``launches`` include their execution (the ``kernels`` column);
``--kernels null`` replaces them with one counter bump each (the host path alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import gc
import json
import logging
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcanary.kernels import call, layout
from kvcanary.runtime.installation import HostTime, Installation, WrapperCall
from kvcanary.sglang import base, piecewise, pools, v0_5_12
from kvcanary.sglang import hooks as hooks_module
from kvcanary.sglang.hooks import AdapterHooks, installation_of
from kvcanary.sglang.installed import RunnerState, runner_state_of
from kvcanary.sglang.radix import radix_sweep_source
from kvcanary.sglang.radix_index import RadixSweepIndex

BS = 64  # rows per forward (--batch-size)
# plugin/kvcanary/: the frames counted as kvcanary's Python calls
_KVCANARY_DIR = os.path.dirname(os.path.abspath(hooks_module.__file__)).rsplit(os.sep, 1)[0] + os.sep
CONTEXT = 1000  # decode rows' context when a round starts
SHARED_PREFIX = 992  # the cached prefix every extend row starts from
EXTEND = 32  # new tokens per extend row
MIXED_EXTEND_ROWS = 8
SWEEP_TOKENS_PER_ROW = 800  # decode rows' first tokens held by the stand-in prefix cache, in 4 nodes each
SWEEP_NODES_PER_ROW = 4
VOCAB = 2048
# The tiny Llama of integration/sglang_e2e.py: 2 layers, 2 KV heads x 64 dims, bf16 (256 bytes per token and buffer).
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
PAGE_SIZE = 1

_ENV_KEYS = ("KVCANARY_MODE", "KVCANARY_REAL_KV", "KVCANARY_VERIFY_TOKENS", "KVCANARY_SWEEP_INTERVAL",
             "KVCANARY_HEALTH_WINDOW", "KVCANARY_FAULT", "KVCANARY_REPORT")


# ------------------------------------------------------------------------------------------------ engine stand-ins
class ForwardMode(enum.IntEnum):
    """sglang's ForwardMode, the members the adapter maps (it reads ``.name`` only)."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4


class Req:
    """sglang's ``Req``: the fields the adapter reads."""

    def __init__(self, rid: str, row: int, origin: list[int], output: list[int]) -> None:
        self.rid = rid
        self.req_pool_idx = row
        self.origin_input_ids = origin
        self.output_ids = output


@dataclass
class WorkerBatch:
    """sglang's ModelWorkerBatch, as ``ForwardBatch.init_new`` receives it."""

    forward_mode: ForwardMode
    reqs: list[Req]


@dataclass
class ForwardBatch:
    """sglang 0.5.12's ForwardBatch: the fields the adapter reads, with the engine's dtypes."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    out_cache_loc: torch.Tensor  # int64 [tokens]
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs]
    extend_prefix_lens: torch.Tensor | None = None  # int32 [bs] (extend / mixed)
    extend_seq_lens: torch.Tensor | None = None  # int32 [bs]
    rids: list[str] | None = None


class StandInMHAPool:
    """MHATokenToKVPool's shape: ``size`` slots (+ the padding page), per-layer K and V buffers."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.page_size = size, PAGE_SIZE
        shape = (size + PAGE_SIZE, KV_HEADS, HEAD_DIM)
        # any bytes: the stand-in model never changes them (a distinct constant per buffer)
        self.k_buffer = [torch.full(shape, 0.5 + i, dtype=torch.bfloat16, device=device) for i in range(LAYERS)]
        self.v_buffer = [torch.full(shape, -0.5 - i, dtype=torch.bfloat16, device=device) for i in range(LAYERS)]


class StandInMLAPool:  # never built: pools.pool_groups asks about all three classes
    pass


class StandInSWAPool:
    pass


class StandInModel(torch.nn.Module):
    """The model: does nothing (or, with ``launches``, that many one-element ``add_`` launches on the device: the
    model's own launches, whose host time the bench prints beside kvcanary's), and keeps its own host time (what the
    wrapper's time excludes).

    The time goes into a plain holder: ``self.inner_ns += ...`` on the module itself would run
    ``nn.Module.__setattr__`` (its Parameter / Buffer / Module isinstance checks: ~3.5 µs per forward on the CPU
    box) after the model's own clock stopped, i.e. inside what the bench counts as the canary's launches."""

    def __init__(self, launches: int = 0, device: torch.device | None = None) -> None:
        super().__init__()
        self.clock = types.SimpleNamespace(ns=0)
        self.launches = launches
        self.x = torch.zeros(1, device=device) if launches else None

    @property
    def inner_ns(self) -> int:
        return self.clock.ns

    def forward(self, input_ids, positions, forward_batch):
        t0 = time.perf_counter_ns()
        out = input_ids
        for _ in range(self.launches):
            self.x.add_(1)
        self.clock.ns += time.perf_counter_ns() - t0
        return out


class StandInRunner:
    """A ModelRunner as ``kvcanary.sglang.v0_5_12.runner_parts`` / ``runner_ranks`` read it."""

    def __init__(self, rows: int, context: int, slots: int, device: torch.device, *,
                 disable_cuda_graph: bool = False, model_launches: int = 0) -> None:
        # disable_cuda_graph: the adapter defers each decode's write into the next check launch (issue 25)
        self.server_args = types.SimpleNamespace(cuda_graph_max_bs=0, disable_piecewise_cuda_graph=True,
                                                 served_model_name="bench", dp_size=1,
                                                 disable_cuda_graph=disable_cuda_graph)
        self.req_to_token_pool = types.SimpleNamespace(
            req_to_token=torch.zeros((rows, context), dtype=torch.int32, device=device), size=rows - 1)
        self.token_to_kv_pool = StandInMHAPool(slots, device)
        self.model = StandInModel(model_launches, device)
        self.sliding_window_size = None
        self.tp_rank, self.tp_size = 0, 1
        self.model_outer_ns = 0  # around the (wrapped) model.forward call, as ModelRunner.forward makes it

    def forward(self, forward_batch: ForwardBatch):
        """ModelRunner.forward's own body: forward_decode / forward_extend call ``self.model.forward``."""
        t0 = time.perf_counter_ns()
        out = self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
        self.model_outer_ns += time.perf_counter_ns() - t0
        return out


class Node:
    """A RadixCache TreeNode: ``children``, ``value`` (int64 slots), ``lock_ref``, ``parent``, ``key``."""

    def __init__(self, value: torch.Tensor | None, parent: Node | None = None, key: object = None) -> None:
        self.children: dict = {}
        self.value = value
        self.lock_ref = 0
        self.parent = parent
        self.key = key


class StandInRadixCache:
    """A RadixCache as the sweep follows it: ``root_node``, ``device`` and the methods the incremental sweep wraps
    (``v0_5_12.RADIX_NODE_HOOKS``; ``kvcanary.sglang.radix_index``). :meth:`churn` is what a serving engine's cache
    does between two sweeps (a request's leaf evicted, a finished request inserted): the "tree changing" cases call
    it every forward. It deletes a leaf and stores a new node with the same slots in its place, so every record the
    sweep reads stays valid while the sweep source sees one deletion and one new node per forward."""

    def __init__(self, root: Node, device: torch.device) -> None:
        self.root_node = root
        self.device = device
        self._leaves = [n for n in self._nodes() if not n.children]
        self._turn = 0

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            out += node.children.values()
            stack += node.children.values()
        return out

    def _record_store_event(self, node: Node) -> None:
        pass

    def _delete_leaf(self, node: Node) -> None:
        del node.parent.children[node.key]

    def _split_node(self, key, child, split_len):
        raise NotImplementedError("the bench's prefix cache never splits")

    def reset(self) -> None:
        raise NotImplementedError("the bench's prefix cache is never reset")

    def churn(self) -> None:
        i = self._turn % len(self._leaves)
        self._turn += 1
        leaf = self._leaves[i]
        self._delete_leaf(leaf)
        new = self._leaves[i] = Node(leaf.value, leaf.parent, leaf.key)
        leaf.parent.children[leaf.key] = new
        self._record_store_event(new)


def bench_version() -> types.ModuleType:
    """The 0.5.12 version module with the stand-in pool classes and the piecewise gate's flags off (no sglang)."""
    v = types.ModuleType("kvcanary_bench_v0_5_12")
    v.__dict__.update({k: getattr(v0_5_12, k) for k in dir(v0_5_12) if not k.startswith("__")})
    classes = pools.PoolClasses(mha=f"{__name__}.StandInMHAPool", mla=f"{__name__}.StandInMLAPool",
                                swa=f"{__name__}.StandInSWAPool")
    pool_groups = base.pool_groups_of(v0_5_12.SGLANG_VERSION, classes)

    def wrapper_gate(inst):  # sglang's two piecewise flags are module globals; here, always off
        off = (types.SimpleNamespace(_in_piecewise_cuda_graph=False),
               types.SimpleNamespace(_in_breakable_cuda_graph=False))
        return piecewise.wrapper_gate(inst, flag_modules=off)

    # (POOL_CLASSES too: the install's speculative check asks pools.pool_kind with it, which imports the classes it
    # names; with 0.5.12's it imported sglang, which this bench runs without: b450279 broke it)
    v.pool_groups, v.wrapper_gate, v.POOL_CLASSES = pool_groups, wrapper_gate, classes
    return v


# ------------------------------------------------------------------------------------------------ workload
def token(row: int, pos: int) -> int:
    return (row * 7919 + pos * 104729) % VOCAB


@dataclass(frozen=True)
class Case:
    kind: str  # decode | extend | mixed
    real_kv: str  # none | partial
    tokens: bool
    sweep: int  # sweep interval, 0: off
    tree_changes: bool = False  # the prefix cache changes every forward (StandInRadixCache.churn)
    walk: bool = False  # the sweep walks the tree on every sweep (the source before issue 25) instead of following it
    deferred: bool = False  # --disable-cuda-graph: each decode's write runs in the next check launch (issue 25)

    @property
    def name(self) -> str:
        extras = [self.real_kv.upper()] + (["tokens"] if self.tokens else []) + (
            [f"sweep {self.sweep}" + (" (tree changing)" if self.tree_changes else "") + (" walk" if self.walk else "")]
            if self.sweep else []) + (["deferred write"] if self.deferred else [])
        return f"{self.kind} bs{BS} {' + '.join(extras)}"


def all_cases() -> list[Case]:
    out = []
    # (a mixed batch holds extend rows and at least one decode row: none at batch size 1)
    for kind in ("decode", "extend", "mixed") if BS >= 2 else ("decode", "extend"):
        out += [Case(kind, "none", False, 0), Case(kind, "partial", False, 0), Case(kind, "partial", True, 0),
                Case(kind, "partial", False, 10), Case(kind, "partial", True, 10)]
    # what a serving engine pays for the sweep: its tree changes between two sweeps; followed (the engine's source
    # for a RadixCache), and walked on every sweep (the source before issue 25, and a HiRadixCache's today)
    out += [Case("decode", "partial", False, 10, tree_changes=True), Case("decode", "partial", True, 10, True),
            Case("decode", "partial", False, 10, tree_changes=True, walk=True)]
    # an eager engine with --disable-cuda-graph: one launch per decode (the write inside the next check launch)
    out += [Case("decode", "partial", False, 0, deferred=True), Case("decode", "partial", True, 0, deferred=True)]
    return out


class Workload:
    """Slots, requests and batches of one case (rows 1..64; row 65 holds the shared prefix at set-up).

    Slot layout: [1, 1 + SHARED_PREFIX) the cached prefix; then per decode row a contiguous range of ``context``
    slots; then per extend row its EXTEND slots (freed and reused by each forward's new request)."""

    def __init__(self, case: Case, forwards: int, device: torch.device) -> None:
        self.case, self.device = case, device
        self.context = max(CONTEXT + forwards + 8, SHARED_PREFIX + EXTEND)
        self.rows = BS + 2
        self.decode_base = 1 + SHARED_PREFIX
        self.extend_base = self.decode_base + BS * self.context
        self.slots = self.extend_base + BS * EXTEND + 16
        n_ext = {"decode": 0, "extend": BS, "mixed": min(MIXED_EXTEND_ROWS, BS - 1)}[case.kind]
        self.extend_rows = list(range(1, 1 + n_ext))
        self.decode_rows = list(range(1 + n_ext, 1 + BS))
        self.serial = 0
        self.tokens = [[token(r, p) for p in range(self.context)] for r in range(BS + 1)]  # row 0: the shared prefix
        self.decode_reqs = {r: Req(f"d{r}", r, self.tokens[r][:CONTEXT], [self.tokens[r][CONTEXT]])
                            for r in self.decode_rows}

    def decode_slot(self, row: int, pos: int) -> int:
        return self.decode_base + (row - 1) * self.context + pos

    def fill_r2t(self, r2t: torch.Tensor) -> None:
        """req_to_token as the engine holds it: decode rows' full ranges, extend rows' cached prefix + new slots."""
        for r in range(1, 1 + BS):
            r2t[r] = torch.arange(self.decode_slot(r, 0), self.decode_slot(r, 0) + self.context, dtype=torch.int32)
        r2t[BS + 1, :SHARED_PREFIX] = torch.arange(1, 1 + SHARED_PREFIX, dtype=torch.int32)  # set-up only
        for r in self.extend_rows:
            r2t[r, :SHARED_PREFIX] = torch.arange(1, 1 + SHARED_PREFIX, dtype=torch.int32)
            r2t[r, SHARED_PREFIX : SHARED_PREFIX + EXTEND] = torch.arange(
                self.extend_base + (r - 1) * EXTEND, self.extend_base + r * EXTEND, dtype=torch.int32)

    def sweep_tree(self) -> StandInRadixCache:
        """A RadixCache-shaped tree: the shared prefix, and each decode row's first SWEEP_TOKENS_PER_ROW slots in
        SWEEP_NODES_PER_ROW chained nodes (~52k entries; slots on the KV device, as sglang keeps node values)."""
        root = Node(None)
        i64 = {"dtype": torch.int64, "device": self.device}
        root.children["shared"] = Node(torch.arange(1, 1 + SHARED_PREFIX, **i64), root, "shared")
        step = SWEEP_TOKENS_PER_ROW // SWEEP_NODES_PER_ROW
        for r in range(1, 1 + BS):
            parent = root
            for k in range(SWEEP_NODES_PER_ROW):
                start = self.decode_slot(r, k * step)
                node = Node(torch.arange(start, start + step, **i64), parent, (r, k))
                parent.children[(r, k)] = node
                parent = node
        return StandInRadixCache(root, self.device)

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        # the engine builds its batch tensors on the host and copies them over (non-blocking), as here
        t = torch.tensor(values, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def setup_batches(self) -> list[tuple[WorkerBatch, ForwardBatch]]:
        """The prefills that write every record the cases read: each decode range's first ``context`` tokens
        (all 64 rows, set up as decode rows) and the shared prefix (row 65)."""
        reqs = [Req(f"setup{r}", r, list(self.tokens[r]), []) for r in range(1, 1 + BS)]
        shared = [Req("shared", BS + 1, self.tokens[0][:SHARED_PREFIX], [])]
        out = []
        for group in (reqs, shared):
            ids, pos, loc = [], [], []
            for q in group:
                n = len(q.origin_input_ids)
                ids += q.origin_input_ids
                pos += range(n)
                loc += (range(1, 1 + n) if q.rid == "shared" else
                        range(self.decode_slot(q.req_pool_idx, 0), self.decode_slot(q.req_pool_idx, 0) + n))
            lens = [len(q.origin_input_ids) for q in group]
            fb = ForwardBatch(ForwardMode.EXTEND, len(group), self._tensor(ids), self._tensor(pos),
                              self._tensor(loc), self._tensor([q.req_pool_idx for q in group]), self._tensor(lens),
                              self._tensor([0] * len(group), torch.int32), self._tensor(lens, torch.int32),
                              [q.rid for q in group])
            out.append((WorkerBatch(ForwardMode.EXTEND, group), fb))
        return out

    def reset_round(self) -> None:
        """Decode rows back to their starting context (the same requests: their next upload is a full row)."""
        for q in self.decode_reqs.values():
            del q.output_ids[1:]

    def next_batch(self) -> tuple[WorkerBatch, ForwardBatch]:
        """The next forward's batch: new extend requests on the cached prefix first, then the decode rows."""
        ids, pos, loc, rows, seq, pre, ext, reqs = [], [], [], [], [], [], [], []
        for r in self.extend_rows:
            self.serial += 1
            q = Req(f"e{self.serial}", r, self.tokens[0][:SHARED_PREFIX]
                    + self.tokens[r][SHARED_PREFIX : SHARED_PREFIX + EXTEND], [])
            reqs.append(q)
            ids += q.origin_input_ids[SHARED_PREFIX:]
            pos += range(SHARED_PREFIX, SHARED_PREFIX + EXTEND)
            loc += range(self.extend_base + (r - 1) * EXTEND, self.extend_base + r * EXTEND)
            rows.append(r)
            seq.append(SHARED_PREFIX + EXTEND)
            pre.append(SHARED_PREFIX)
            ext.append(EXTEND)
        for r in self.decode_rows:
            q = self.decode_reqs[r]
            reqs.append(q)
            p = len(q.origin_input_ids) + len(q.output_ids) - 1  # the last output token is this forward's input
            ids.append(q.output_ids[-1])
            pos.append(p)
            loc.append(self.decode_slot(r, p))
            rows.append(r)
            seq.append(p + 1)
            pre.append(p)
            ext.append(1)
        mode = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED}[
            self.case.kind]
        extend_like = mode is not ForwardMode.DECODE
        fb = ForwardBatch(mode, len(rows), self._tensor(ids), self._tensor(pos), self._tensor(loc),
                          self._tensor(rows), self._tensor(seq),
                          self._tensor(pre, torch.int32) if extend_like else None,
                          self._tensor(ext, torch.int32) if extend_like else None, [q.rid for q in reqs])
        return WorkerBatch(mode, reqs), fb

    def after_forward(self) -> None:
        """The scheduler appends each decode row's sampled token."""
        for r, q in self.decode_reqs.items():
            q.output_ids.append(self.tokens[r][len(q.origin_input_ids) + len(q.output_ids)])


# ------------------------------------------------------------------------------------------------ instrumentation
@dataclass
class Pieces:
    """Host ns per named piece, summed over the timed forwards (the instrumented pass)."""

    ns: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    on: bool = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[name] = self.ns.get(name, 0) + time.perf_counter_ns() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def null_export(*args) -> None:
    """``--kernels null``: a kernel export that does nothing (the health window is lifted for such runs)."""


class KernelModule:
    """The kernel module ``call.load_module`` returns, with every ``canary_*`` export timed (``kernels``) and, with
    ``null``, replaced by :func:`null_export`; a ``*_bind`` export's per-forward launch is the function it returns,
    so that function is what is timed or replaced. Everything else passes through."""

    def __init__(self, module, pieces: Pieces, null: bool) -> None:
        self._module, self._pieces, self._null = module, pieces, null

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        if not (name.startswith("canary_") and callable(fn)):
            return fn
        if name.endswith("_bind"):
            return lambda *args: self._pieces.wrap("kernels", null_export if self._null else fn(*args))
        return self._pieces.wrap("kernels", null_export if self._null else fn)


def patch_kernels(pieces: Pieces, null: bool) -> Callable[[], None]:
    """Route every kernel export the runtime binds (the wrappers in ``kvcanary.kernels`` fetch them through
    ``kvcanary.kernels.call.load_module``, also for the launches they bind once per manager) through
    :class:`KernelModule`; returns the undo."""
    saved = call.load_module

    @functools.wraps(saved)
    def load_module(*args, **kwargs):
        return KernelModule(saved(*args, **kwargs), pieces, null)

    call.load_module = load_module

    def undo() -> None:
        call.load_module = saved

    return undo


def instrument(inst: Installation, state: RunnerState, pieces: Pieces) -> Callable[[], None]:
    """Wrap the Installation's pieces and the batch hook's token upload (instance attributes only; the undo restores
    them)."""
    undo: list[Callable[[], None]] = []

    def patch(obj, attr: str, name: str) -> None:
        if not hasattr(obj, attr):
            return
        had = attr in vars(obj)
        old = getattr(obj, attr)
        setattr(obj, attr, pieces.wrap(name, old))
        undo.append((lambda: setattr(obj, attr, old)) if had else (lambda: delattr(obj, attr)))

    patch(inst, "to_views", "BatchConverter")
    for g in inst.groups:
        m = g.manager
        for attr, name in (("before_forward", "before_forward"), ("after_forward", "after_forward"),
                           ("step", "step"), ("assign_requests", "assign_requests")):
            patch(m, attr, name)
        patch(m.sweeper, "run_source", "sweep (in step)")
    if inst.metrics is not None:
        patch(inst.metrics, "observe", "metrics")
    patch(inst, "account_forward", "account_forward")
    if state.token_upload is not None:  # (the batch hook's upload: the token table's, called directly)
        patch(state, "token_upload", "token table upload")
    # (a decode batch's post to the token mail, straight from the batch hook; an older kvcanary has none)
    if getattr(state, "token_post", None) is not None:
        patch(state, "token_post", "token mail post")
    # (... or, where the host extension loads, read from the requests and posted by one C call)
    if getattr(state, "token_post_filled", None) is not None:
        patch(state, "token_post_filled", "token decode post (C)")
    old = hooks_module.expected_token_columns
    hooks_module.expected_token_columns = pieces.wrap("expected_token_updates", old)
    undo.append(lambda: setattr(hooks_module, "expected_token_columns", old))
    return lambda: [u() for u in reversed(undo)]


# ------------------------------------------------------------------------------------------------ the run
@dataclass
class Timing:
    forwards: int = 0
    batch_init_ns: int = 0
    around_ns: int = 0
    outer_ns: int = 0  # the wrapped model.forward, as ModelRunner.forward calls it
    inner_ns: int = 0  # the model itself


def host_diff(after: HostTime, before: HostTime) -> dict[str, int]:
    return {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(HostTime)}


def run_case(case: Case, args, device: torch.device) -> dict:
    env = {"KVCANARY_MODE": "raise", "KVCANARY_REAL_KV": case.real_kv,
           "KVCANARY_VERIFY_TOKENS": "1" if case.tokens else "0", "KVCANARY_SWEEP_INTERVAL": str(case.sweep)}
    if args.kernels == "null":  # no kernel counts its runs: the health check would stop the run
        env["KVCANARY_HEALTH_WINDOW"] = str(1 << 30)
    saved_env = {k: os.environ.get(k) for k in _ENV_KEYS}
    for k in _ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(env)
    pieces = Pieces()
    undo_kernels = patch_kernels(pieces, args.kernels == "null")
    try:
        return _run_case(case, args, device, pieces)
    finally:
        undo_kernels()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_case(case: Case, args, device: torch.device, pieces: Pieces) -> dict:
    forwards, rounds = args.forwards, args.rounds
    work = Workload(case, forwards, device)
    runner = StandInRunner(work.rows, work.context, work.slots, device, disable_cuda_graph=case.deferred,
                           model_launches=args.model_launches)
    work.fill_r2t(runner.req_to_token_pool.req_to_token)
    hooks = AdapterHooks(bench_version())
    hooks.after_init_memory_pool(None, runner)
    inst = installation_of(runner)
    assert inst is not None and inst.wrapper_call() is WrapperCall.EAGER
    tree = None
    if case.sweep:
        tree = work.sweep_tree()
        inst.set_sweep_source(radix_sweep_source(tree) if case.walk
                              else RadixSweepIndex(tree, v0_5_12.RADIX_NODE_HOOKS))
        runner_state_of(runner).prefix_cache = tree
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    # the engine's own host work between two batches, evicting kvcanary's code and data from the caches (--cold)
    thrash = torch.zeros(args.cold << 20, dtype=torch.uint8) if args.cold else None

    # --kernels null: no check launch applies the token mail, so the device's part is played here, untimed: its read
    # cursor (in the status mirror the host reads it from) moves past every record posted, as a check launch's would.
    # Without it the mail fills after a few dozen forwards and every later batch is launched instead (what the bench
    # timed until 2026-12-03).
    mails = [(g.manager.token_table.mail, g.manager.device_state.mirrored_values) for g in inst.groups
             if args.kernels == "null" and g.manager.token_table is not None and g.manager.token_table.mail is not None]

    def forward(wb: WorkerBatch, fb: ForwardBatch, timing: Timing | None) -> None:
        t0 = time.perf_counter_ns()
        hooks.after_forward_batch_init(fb, ForwardBatch, wb, runner)  # ForwardBatch.init_new's AFTER hook
        t1 = time.perf_counter_ns()
        hooks.around_forward(type(runner).forward, runner, fb)  # ModelRunner.forward's AROUND hook
        t2 = time.perf_counter_ns()
        sync()  # the scheduler reads the sampled tokens
        for mail, mirror in mails:
            mirror[layout.STATE_TOKEN_MAIL_READ] = mail.written
        if timing is not None:
            timing.forwards += 1
            timing.batch_init_ns += t1 - t0
            timing.around_ns += t2 - t1

    # set-up: write every record the cases read (the engine's earlier prefills), then initialize as sglang does
    for wb, fb in work.setup_batches():
        forward(wb, fb, None)
    work.fill_r2t(runner.req_to_token_pool.req_to_token)  # the case's rows (extend rows point at the prefix)
    hooks.after_initialize(None, runner)  # mark_init_finished: HostTime restarts

    def measure(instrumented: bool) -> list[dict]:
        """Rounds of ``forwards`` timed forwards; per round the outside split and the HostTime split (µs/forward)."""
        out = []
        for _ in range(rounds):
            work.reset_round()
            forward(*work.next_batch(), None)  # a round's first forward re-sends the decode rows (untimed)
            work.after_forward()
            gc.collect()
            timing = Timing()
            before = dataclasses.replace(inst.host_time)
            outer0, inner0 = runner.model_outer_ns, runner.model.inner_ns
            pieces.on = instrumented
            for _ in range(forwards):
                wb, fb = work.next_batch()
                forward(wb, fb, timing)
                work.after_forward()
                if thrash is not None:
                    thrash.add_(1)
                if case.tree_changes:
                    tree.churn()  # (outside the timed hooks: the engine's own insert and eviction; the wrapped
                    # methods' bookkeeping is kvcanary's, a few µs per change, not counted here)
            pieces.on = False
            timing.outer_ns = runner.model_outer_ns - outer0
            timing.inner_ns = runner.model.inner_ns - inner0
            out.append(round_split(timing, host_diff(inst.host_time, before)))
        return out

    def python_calls_per_forward() -> float:
        """kvcanary's Python function calls per forward over one round (a pass of its own: the profile hook slows
        every call). From the engine's cold caches each distinct call costs several µs (see ``--cold``), so this
        count drives the per-forward cost there more than any warm timing does."""
        calls = 0

        def count(frame, event, arg) -> None:
            nonlocal calls
            if event == "call" and frame.f_code.co_filename.startswith(_KVCANARY_DIR):
                calls += 1

        work.reset_round()
        forward(*work.next_batch(), None)  # (the round's first forward re-sends the decode rows, as measure's)
        work.after_forward()
        sys.setprofile(count)
        try:
            for _ in range(forwards):
                forward(*work.next_batch(), None)
                work.after_forward()
                if case.tree_changes:
                    tree.churn()
        finally:
            sys.setprofile(None)
        return calls / forwards

    measure(False)  # warm: allocator, channels, the first sweep
    per_round = measure(False)
    undo = instrument(inst, runner_state_of(runner), pieces)
    try:
        measure(True)
    finally:
        undo()
    calls_per_forward = python_calls_per_forward()
    for g in inst.groups:
        g.manager.flush()
        reporter = g.manager.reporter
        if reporter.total_reported or reporter.total_health_errors:
            raise SystemExit(f"bench_forward_path: {case.name}: {reporter.total_reported} violations, "
                             f"{reporter.total_health_errors} health errors: the synthetic forwards are wrong")
    for mail, _ in mails:  # (the device's part played above: a full mail means the bench timed the fallback)
        if mail.full:
            raise SystemExit(f"bench_forward_path: {case.name}: the token mail refused {mail.full} posts for room")
    inst.close()
    n = forwards * rounds
    stat = min if args.stat == "min" else statistics.median
    bench = {k: stat(r["bench"][k] for r in per_round) for k in SPLIT}
    own = {k: stat(r["host_time"][k] for r in per_round) for k in SPLIT}
    model = stat(r["model"] for r in per_round)
    return {"case": case.name, "kind": case.kind, "real_kv": case.real_kv, "tokens": case.tokens,
            "sweep": case.sweep, "forwards": n, "bench_us": bench, "host_time_us": own, "model_us": model,
            "agreement": own["total"] / bench["total"] if bench["total"] else None,
            "rounds": per_round, "pieces_us": {k: v / n / 1e3 for k, v in sorted(pieces.ns.items())},
            "python_calls_per_forward": calls_per_forward}


SPLIT = ("hooks", "launches", "batch_init", "total")


def round_split(t: Timing, host: dict[str, int]) -> dict[str, dict[str, float]]:
    """One round's µs per forward, split like HostTime: measured from outside (``bench``) and HostTime's own."""
    n = max(t.forwards, 1)
    bench = {"hooks": (t.around_ns - t.outer_ns) / n / 1e3, "launches": (t.outer_ns - t.inner_ns) / n / 1e3,
             "batch_init": t.batch_init_ns / n / 1e3}
    model = t.inner_ns / n / 1e3  # the stand-in model's own host time (its launches with --model-launches)
    hn = max(host["forwards"], 1)
    own = {"hooks": host["hook_ns"] / hn / 1e3, "launches": host["in_forward_ns"] / hn / 1e3,
           "batch_init": host.get("batch_init_ns", 0) / hn / 1e3}
    for split in (bench, own):
        split["total"] = split["hooks"] + split["launches"] + split["batch_init"]
    return {"bench": bench, "host_time": own, "host_time_forwards": host["forwards"], "model": model}


# ------------------------------------------------------------------------------------------------ output
PIECE_COLUMNS = ("BatchConverter", "before_forward", "after_forward", "step", "sweep (in step)", "metrics",
                 "account_forward", "assign_requests", "expected_token_updates", "token table upload",
                 "token mail post", "token decode post (C)", "kernels")


def launch_unit_us(device: torch.device, n: int = 2000) -> float:
    """Host µs of one small torch launch (``x.add_(1)``) here, median of 5 runs: the unit that compares this
    bench with the engine (integration/loop_probe.py times the same launch inside sglang's scheduler process; on
    the H200 host on 2026-11-30 it cost 9.2-11.5 µs there against 6.2-6.5 µs in this bench's process)."""
    x = torch.zeros(1, device=device)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            x.add_(1)
        runs.append((time.perf_counter_ns() - t0) / n / 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sorted(runs)[2]


def markdown(results: list[dict], title: str, unit_us: float | None = None) -> str:
    f = lambda x: f"{x:.1f}"  # noqa: E731
    lines = [f"### {title}", "",
             "| case | bench hooks | bench launches | bench batch-init | **bench total** | HostTime hooks | "
             "HostTime launches | HostTime batch-init | **HostTime total** | HostTime / bench | kvcanary Python calls "
             "per forward |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, h = r["bench_us"], r["host_time_us"]
        calls = r.get("python_calls_per_forward")
        lines.append(f"| {r['case']} | {f(b['hooks'])} | {f(b['launches'])} | {f(b['batch_init'])} | "
                     f"**{f(b['total'])}** | {f(h['hooks'])} | {f(h['launches'])} | {f(h['batch_init'])} | "
                     f"**{f(h['total'])}** | {r['agreement']:.2f} | {'-' if calls is None else f(calls)} |")
    lines += ["", "Per piece, host µs per forward (instrumented pass; pieces nest: `sweep` is inside `step`, "
              "`kernels` inside before/after_forward and sweep, `token table upload` and `assign_requests` inside "
              "batch-init):", "",
              "| case | " + " | ".join(PIECE_COLUMNS) + " |", "|---" * (len(PIECE_COLUMNS) + 1) + "|"]
    for r in results:
        p = r["pieces_us"]
        lines.append(f"| {r['case']} | " + " | ".join(f(p[c]) if c in p else "-" for c in PIECE_COLUMNS) + " |")
    if unit_us:
        lines += ["", f"One torch launch (`x.add_(1)`) on this host: {unit_us:.1f} µs; bench totals in those units: "
                  + ", ".join(f"{r['case']} {r['bench_us']['total'] / unit_us:.1f}" for r in results)
                  + " (the e2e `--loop-probe` reports the engine's own unit)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global BS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="few forwards per case (CI smoke)")
    ap.add_argument("--forwards", type=int, default=None, help="timed forwards per round (default 100; quick 10)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per case (default 7; quick 3)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="per column over the rounds (min: on a busy host, noise only adds)")
    ap.add_argument("--kernels", choices=("auto", "real", "null"), default="auto",
                    help="null: launches only bump their counter (the host path without kernel work); auto: real "
                         "on CUDA (launches are asynchronous), null on the CPU (kernels run inline, 2-60 ms here)")
    ap.add_argument("--cases", default="",
                    help="comma-separated case names (or parts of names: every case containing it)")
    ap.add_argument("--cold", type=int, default=0, metavar="MB",
                    help="between two forwards (untimed) write a host buffer of MB MiB, as the engine's own work "
                         "between two batches does: kvcanary's code and data then run from cold caches (0: warm)")
    ap.add_argument("--model-launches", type=int, default=0, metavar="N",
                    help="the stand-in model launches N one-element add_ kernels (0: none); its host time is "
                         "printed beside kvcanary's: an order of launches that moves a cost from kvcanary's launch "
                         "to the model's first one shows there")
    ap.add_argument("--batch-size", type=int, default=64,
                    help="rows per forward (default 64; the 8B engine of issue 28 decoded 256 at once)")
    ap.add_argument("--json", default=None, help="write the results (and the markdown) here")
    args = ap.parse_args(argv)
    BS = args.batch_size  # (module-wide: the cases' names and the workload read it)
    args.forwards = args.forwards or (10 if args.quick else 100)
    args.rounds = args.rounds or (3 if args.quick else 7)
    if args.kernels == "auto":
        args.kernels = "real" if args.device.startswith("cuda") else "null"
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny host tensors: no intra-op pool to wake (and no contention on small hosts)
    cases = all_cases()
    if args.cases:
        chosen: list[Case] = []
        for w in (w.strip() for w in args.cases.split(",") if w.strip()):  # a name, else every name containing it
            chosen += [c for c in cases if c.name == w] or [c for c in cases if w in c.name and c not in chosen]
        cases = chosen
    results = []
    for case in cases:
        results.append(run_case(case, args, device))
        r = results[-1]
        print(f"{case.name}: {r['bench_us']['total']:.1f} µs (HostTime {r['host_time_us']['total']:.1f}; launches "
              f"{r['bench_us']['launches']:.1f}, the model {r['model_us']:.1f})", file=sys.stderr)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = (f"kvcanary host µs per eager forward, sglang 0.5.12 call sequence ({dev_name}, torch {torch.__version__}, "
             f"kernels {args.kernels}, {args.stat} of {args.rounds} rounds x {args.forwards} forwards per case"
             f"{f', caches cold: {args.cold} MiB written between forwards' if args.cold else ''}"
             f"{f', the model {args.model_launches} launches per forward' if args.model_launches else ''})")
    unit = launch_unit_us(device)
    md = markdown(results, title, unit)
    print(md)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev_name, "torch": torch.__version__, "kernels": args.kernels, "stat": args.stat,
                       "launch_unit_us": unit, "cold_mib": args.cold, "model_launches": args.model_launches,
                       "forwards": args.forwards, "rounds": args.rounds, "cases": results, "markdown": md}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
