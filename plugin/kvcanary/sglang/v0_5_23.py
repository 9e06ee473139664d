"""sglang 0.5.23: the version's facts (SPEC §6) for the shared adapter (:mod:`kvcanary.sglang.hooks`).

What moved since 0.5.12 (read from the 0.5.23 wheel, and run on CPU against a real 0.5.23 ModelRunner):

* A runner comes up in steps the scheduler drives: ``ModelRunner.__init__`` only loads the model; then
  ``alloc_memory_pool`` (KV pools, the ``kv_index_translator``, sglang's own canary), ``init_attention_backends``,
  ``init_cuda_graphs`` (the eager runner, the decode and prefill graph runners). kvcanary installs after
  ``alloc_memory_pool`` and marks init finished after ``init_cuda_graphs`` (0.5.12: ``init_memory_pool`` and
  ``initialize``).
* ``Scheduler.init_cache_with_memory_pool`` is gone: ``Scheduler.__init__`` builds the prefix cache through
  ``kv_cache_builder.build_kv_cache``; its ``schedule_stream`` is created in ``init_model_worker`` before that. The
  default prefix cache is ``UnifiedRadixCache`` (a Rust tree core by default, a Python one as fallback), walked
  through its public ``tree_core.walk_for_kv_canary`` (what sglang's own canary sweeps with).
* Decode graphs (``decode_cuda_graph_runner``, ``runner_utils/buffers.py DecodeInputBuffers``) fill their static
  buffers through ``CudaGraphBufferRegistry.fill_from``, which zeroes the padded rows' ``req_pool_indices``,
  ``positions`` and ``out_cache_loc`` (``PaddingPolicy.ZERO``): the 0.5.12 ``populate_from_forward_batch`` fix-up
  has no target and is not needed.
* Prefill graphs (``prefill_cuda_graph_runner``, breakable by default on CUDA, ``full`` opt-in) capture only the
  layer stack (``layer_model.forward``); each replay calls the top-level ``model.forward`` eagerly with the static
  batch (``_execute_body_capture``), so kvcanary's ``model.forward`` wrapper plans/verifies before and writes
  after the replayed body, exactly as in an eager forward; capture never calls the wrapper. The static batch's
  ``input_ids``/``positions``/``out_cache_loc`` are padded to the capture bucket: the canary's token buffers
  must cover the largest bucket (checked after init, refused by name otherwise).
* ``ForwardBatch`` lost ``req_to_token_pool``, ``token_to_kv_pool``, ``attn_backend``, ``out_cache_loc_swa``;
  it gained ``kv_loc_plan``, ``out_cache_loc_virtual``, ``out_cache_loc_is_physical``. Under the unified pool
  (``--enable-unified-memory``) ``req_to_token`` holds virtual slot ids and pages move (compaction); kvcanary's
  records are indexed by physical slot, so that pool is refused by name. On every other pool the translator is
  the identity (``kv_index_translator.is_translating`` False) and the 0.5.12 reading holds.
* Requests keep their row in ``req.kv.req_pool_idx`` (0.5.12: ``req.req_pool_idx``); ranks come from
  ``runtime_context.get_parallel()`` (0.5.12: ModelRunner attributes).
* sglang 0.5.23 has its own canary (``--kv-canary none|log|raise``): kvcanary refuses to install twice.

The rest is the shared default (:mod:`kvcanary.sglang.base`: the forward-mode table, which the eager runner keeps
by turning MIXED into EXTEND before the model runs, pool and RadixCache classes, ``schedule_stream``, the Scheduler
accessors). The contract it satisfies is :class:`kvcanary.sglang.contract.VersionModule`.
"""

from __future__ import annotations

import dataclasses
import logging
import pkgutil
import types
import weakref
from collections.abc import Callable, Sequence

import torch

from kvcanary.runtime.installation import Installation, WrapperCall
from kvcanary.runtime.streams import run_on_producer_stream
from kvcanary.sglang import base, guards, radix, ranks
from kvcanary.sglang.base import *  # noqa: F403  (the shared defaults; what follows is what 0.5.23 states)
from kvcanary.sglang.contract import RunnerParts
from kvcanary.sglang.installed import installation_of
from kvcanary.sglang.refusal import UnsupportedSetupError
from kvcanary.sglang.targets import Target

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
VERSION_RANGE = ">=0.5.23,<0.5.24"  # post releases of 0.5.23 included

_MR = base.MODEL_RUNNER
T_ALLOC_MEMORY_POOL = f"{_MR}.alloc_memory_pool"
T_INIT_CUDA_GRAPHS = f"{_MR}.init_cuda_graphs"
T_SCHEDULER_INIT = f"{base.SCHEDULER}.__init__"

# Hook name (kvcanary.sglang.hooks.AdapterHooks) -> target, in registration order. No after_populate: 0.5.23's
# buffer registry zeroes the padded rows itself.
HOOK_TARGETS: dict[str, Target] = {
    "after_init_memory_pool": Target(T_ALLOC_MEMORY_POOL, "AFTER", ("self", "memory_pool_config")),
    "around_forward": Target(base.T_FORWARD, "AROUND", ("self", "forward_batch")),
    "after_initialize": Target(T_INIT_CUDA_GRAPHS, "AFTER", ("self", "capture_decode_cuda_graph")),
    # Scheduler.__init__ has built the prefix cache (tree_cache) over its req_to_token_pool by the time it returns.
    "after_init_cache": Target(T_SCHEDULER_INIT, "AFTER", ("self", "server_args")),
    "after_forward_batch_init": Target(base.T_FB_INIT_NEW, "AFTER", ("cls", "batch", "model_runner"),
                                       classmethod=True),
}
TARGETS: tuple[Target, ...] = tuple(HOOK_TARGETS.values())

UNIFIED_RADIX_CACHE_CLASS = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
# A legacy RadixCache (no UnifiedRadixCache) is walked on every sweep: 0.5.23's ``_insert_helper`` reports new nodes
# through ``kv_events.record_store``, not a method of the tree; following it is not taught (issue 25 covers 0.5.12).
RADIX_NODE_HOOKS = None
UNIFIED_POOL_FLAG = "--enable-unified-memory"
NO_PREFILL_GRAPHS_FLAG = "--cuda-graph-backend-prefill disabled"
# Prefill graph backends whose replay calls the top-level model.forward eagerly around the captured layer stack
# (PrefillCudaGraphRunner._uses_eager_prefill_tail; ``tc_piecewise`` was removed in 0.5.23).
EAGER_TAIL_PREFILL_BACKENDS = ("breakable", "full")

# Bound to this version's string (refusals, pool errors and unsupported forward modes name it); ``out_cache_loc``
# holds physical ids, which on the pools kvcanary accepts are the slot ids ``req_to_token`` stores. MHA pools only:
# MLA and sliding-window pools (and 0.5.23's unified radix cache's SWA component) have run on 0.5.12 only, so here
# they are refused by name.
POOL_CLASSES = dataclasses.replace(base.POOL_CLASSES, followed=frozenset({"mha"}))
pool_groups = base.pool_groups_of(SGLANG_VERSION, POOL_CLASSES)
batch_view = base.batch_view_of(SGLANG_VERSION)


# ----------------------------------------------------------------------------------------------- guards
def check_supported(server_args) -> None:
    """Refuse setups kvcanary cannot protect on 0.5.23, naming the setting to change: the shared guards (sglang's own
    ``--kv-canary``, torch.compile, split prefill, speculative decoding), then the unified KV pool."""
    guards.check_supported(server_args, SGLANG_VERSION)
    if getattr(server_args, "enable_unified_memory", False):
        raise UnsupportedSetupError(_unified_pool_reason())


def _unified_pool_reason() -> str:
    return (
        f"sglang's unified KV pool ({UNIFIED_POOL_FLAG}) stores virtual slot ids in req_to_token and moves pages "
        "between physical slots (compaction), while kvcanary's records are indexed by physical slot and do not move "
        f"with them: remove {UNIFIED_POOL_FLAG} or unset KVCANARY_MODE"
    )


def check_after_initialize(runner) -> None:
    """After ``init_cuda_graphs``: every graph kvcanary runs in pads within the canary's buffers (refused by name
    otherwise), and a prefill graph runner is one kvcanary knows to call ``model.forward`` eagerly around its
    replay."""
    inst = installation_of(runner)
    if inst is None:
        return
    manager = inst.manager
    rows = int(inst.to_views.ones.shape[0])  # the canary's plan rows (BatchConverter: one per batch row)
    decode = getattr(runner, "decode_cuda_graph_runner", None)
    if decode is not None and int(getattr(decode, "max_bs", 0) or 0) > rows:
        raise UnsupportedSetupError(
            f"the decode CUDA graphs pad batches to {decode.max_bs} rows, more than the canary's {rows}-row plan "
            "buffers: lower --cuda-graph-max-bs-decode or pass --cuda-graph-backend-decode disabled"
        )
    prefill = getattr(runner, "prefill_cuda_graph_runner", None)
    if prefill is None or type(prefill).__name__ == "EagerRunner":
        return
    backend = getattr(prefill, "prefill_backend_name", None)
    known = type(prefill).__name__ == "PrefillCudaGraphRunner" and backend in EAGER_TAIL_PREFILL_BACKENDS
    if not known:
        raise UnsupportedSetupError(
            f"prefill forwards are served by {type(prefill).__name__} (backend {backend}), which kvcanary "
            f"does not know to run model.forward eagerly around its replay: pass {NO_PREFILL_GRAPHS_FLAG}"
        )
    padded = max((int(n) for n in getattr(prefill, "capture_num_tokens", ()) or ()), default=0)
    if padded > manager.max_tokens_per_forward:
        raise UnsupportedSetupError(
            f"prefill CUDA graphs pad forwards to up to {padded} tokens, more than the canary's "
            f"{manager.max_tokens_per_forward}-token buffers: lower the prefill capture sizes or pass "
            f"{NO_PREFILL_GRAPHS_FLAG}"
        )
    logger.info("kvcanary: prefill forwards of up to %d tokens are served by sglang's %s (%s backend); the canary "
                "plans, verifies and writes them around each replayed layer stack", padded, type(prefill).__name__,
                backend)


# ----------------------------------------------------------------------------------------------- accessors
def _decode_graph_max_bs() -> int:
    """The decode graphs' largest batch as the published config states it (0: not stated or not published)."""
    try:
        from sglang.srt.runtime_context import get_exec

        cfg = get_exec().graph.cuda_graph_config
        return int(getattr(getattr(cfg, "decode", None), "max_bs", 0) or 0)
    except Exception:  # not published (a bare runner in a test): the after-init check still bounds it
        return 0


def runner_parts(runner) -> RunnerParts:
    """What install reads from a 0.5.23 runner after ``alloc_memory_pool``; a translating (unified) pool is
    refused here, where the runner's translator says so whatever the arguments were."""
    translator = getattr(runner, "kv_index_translator", None)
    if translator is not None and getattr(translator, "is_translating", False):
        raise UnsupportedSetupError(_unified_pool_reason())
    return RunnerParts.of_runner(runner, cuda_graph_max_bs=_decode_graph_max_bs())


def runner_ranks(runner) -> tuple[dict[str, int], int]:
    """The shared rank rule (:func:`kvcanary.sglang.ranks.runner_ranks`) on 0.5.23's ranks, which live in
    ``runtime_context.get_parallel()`` (attention DP: ``attn_dp_size`` > 1; ``enable_dp_attention`` is deprecated)."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()

    def read(name: str, default):
        try:
            value = getattr(p, name)
        except (AttributeError, RuntimeError, ValueError):  # not written in this process (no rank bundle)
            return default
        return default if value is None else value

    attn_dp = int(read("attn_dp_size", 1)) > 1
    view = types.SimpleNamespace(
        server_args=types.SimpleNamespace(dp_size=read("attn_dp_size", 1) if attn_dp else read("dp_size", 1),
                                          enable_dp_attention=attn_dp),
        tp_rank=read("tp_rank", 0), tp_size=read("tp_size", 1), pp_rank=read("pp_rank", 0),
        pp_size=read("pp_size", 1), dp_rank=read("attn_dp_rank", None) if attn_dp else read("dp_rank", None),
    )
    return ranks.runner_ranks(view)


class RequestView:
    """A 0.5.23 ``Req`` as the shared token check and fault injector read requests (0.5.12's names): the row is
    ``req.kv.req_pool_idx``; a request is mid-prefill (``is_chunked``) while its extend window ends before its
    prompt does. One view per Req (``batch_requests`` caches them), so "same request as last time" holds."""

    __slots__ = ("_req", "__weakref__")

    def __init__(self, req) -> None:
        self._req = req

    @property
    def req(self):
        return self._req

    @property
    def req_pool_idx(self) -> int | None:
        kv = getattr(self._req, "kv", None)
        return getattr(kv, "req_pool_idx", None)

    @property
    def origin_input_ids(self):
        return self._req.origin_input_ids

    @property
    def output_ids(self):
        return self._req.output_ids

    @property
    def sampling_params(self):
        return self._req.sampling_params

    @property
    def is_chunked(self) -> int:
        end = getattr(self._req, "extend_end", None)
        return int(end is not None and not self._req.output_ids and end < len(self._req.origin_input_ids))


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def batch_requests(batch) -> Sequence[object]:
    """The engine's requests of a ScheduleBatch (0.5.23's ``ForwardBatch.init_new`` takes the ScheduleBatch), one
    per row, in order, as :class:`RequestView`."""
    out = []
    for req in getattr(batch, "reqs", None) or ():
        view = _VIEWS.get(req)
        if view is None:
            view = _VIEWS[req] = RequestView(req)
        out.append(view)
    return out


def sweep_source(tree_cache, producer_stream: Callable[[], torch.cuda.Stream | None] | None = None
                 ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """``() -> (slots, prevs, positions)`` of every slot the prefix cache holds, or None for a cache kvcanary cannot
    walk. UnifiedRadixCache: its tree core's ``walk_for_kv_canary`` (every FULL device slot with its position and
    predecessor, -1 under the root; device-evicted nodes keep their depth); a legacy RadixCache: the shared walker.
    The walk runs on the scheduler's stream (the node values' producer; :mod:`kvcanary.runtime.streams`)."""
    unified = pkgutil.resolve_name(UNIFIED_RADIX_CACHE_CLASS)
    if isinstance(tree_cache, unified):
        core = tree_cache.tree_core

        def walk() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            found = core.walk_for_kv_canary(unlocked_only=False, swa_resident_only=False)
            return (found.slot_indices.to(torch.int64), found.prev_slot_indices.to(torch.int64),
                    found.positions.to(torch.int64))

        def source() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            producer = producer_stream() if producer_stream is not None else None
            return run_on_producer_stream(producer, walk)

        return source
    legacy = base.radix_cache(tree_cache)
    return radix.radix_sweep_source(legacy, producer_stream) if legacy is not None else None


def wrapper_gate(inst: Installation) -> Callable[[], WrapperCall]:
    """How kvcanary's ``model.forward`` wrapper classifies its calls on 0.5.23: always a forward to plan, verify and
    write. Prefill graph capture calls the layer stack, never the wrapper; a prefill replay calls the wrapper
    eagerly around the replayed body; decode graph capture records the wrapper's launches like 0.5.12's."""
    del inst

    def gate() -> WrapperCall:
        return WrapperCall.EAGER

    return gate


def max_static_tokens(server_args) -> int:
    """0: the prefill graphs' largest bucket is checked against the canary's buffers after init instead
    (:func:`check_after_initialize`); the buffers already cover the pool's slot count."""
    del server_args
    return 0
