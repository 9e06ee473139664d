"""What every supported sglang version shares: the defaults a version module starts from.

A version module (``v0_5_12``, ``v0_5_23``; the contract is :class:`kvcanary.sglang.contract.VersionModule`)
opens with ``from kvcanary.sglang.base import *`` and then states only what differs from these:

* always: ``SGLANG_VERSION``, ``VERSION_RANGE``, its ``HOOK_TARGETS`` and ``TARGETS`` (hook targets move between
  releases), and the three members bound to its version string, which their errors name:
  ``check_supported = base.check_supported_of(SGLANG_VERSION)``,
  ``pool_groups = base.pool_groups_of(SGLANG_VERSION)``,
  ``batch_view = base.batch_view_of(SGLANG_VERSION)``;
* ``PROTECT_HOOK_TARGETS`` where protect mode is taught (none here: ``KVCANARY_MODE=protect`` is refused);
* any accessor or table whose sglang reading moved. A member built from a table here (``radix_cache`` and
  ``sweep_source`` from ``RADIX_CACHE_CLASS``, ``scheduler_stream_of`` from ``SCHEDULE_STREAM_ATTR``) reads this
  module's value: a version that changes the table states the accessor too.

The defaults are sglang 0.5.12's reading, which later versions keep unless their module says otherwise: the
``ModelRunner.forward`` and ``ForwardBatch.init_new`` targets, the forward-mode table, the pool and prefix-cache
classes, the scheduler's stream attribute, the ModelRunner/Scheduler/ScheduleBatch accessors, the rank rule
(:mod:`kvcanary.sglang.ranks`), the RadixCache sweep (``RADIX_NODE_HOOKS``), and the piecewise-CUDA-graph wrapper
gate and token bound (:mod:`kvcanary.sglang.piecewise`).
"""

from __future__ import annotations

import pkgutil
import types
from collections.abc import Callable, Mapping, Sequence

import torch

from kvcanary.kernels.batch import ForwardKind
from kvcanary.runtime.config import Config
from kvcanary.runtime.installation import GroupSpec
from kvcanary.sglang import batches, guards, piecewise, pools, radix, radix_index, ranks
from kvcanary.sglang.batches import BatchViewFn
from kvcanary.sglang.contract import RunnerParts
from kvcanary.sglang.installed import installation_of
from kvcanary.sglang.targets import Target

MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
T_FORWARD = f"{MODEL_RUNNER}.forward"
T_FB_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
STARTUP_FAILURE_TARGET = f"{MODEL_RUNNER}.__init__"  # re-raises a start-up error (kvcanary.sglang.register)

# KVCANARY_MODE=protect hook name (kvcanary.sglang.protect.ProtectHooks) -> target; empty: protect mode is refused.
PROTECT_HOOK_TARGETS: Mapping[str, Target] = types.MappingProxyType({})

# sglang ForwardMode name -> kvcanary ForwardKind. Anything else is refused by name (spec-v1 DRAFT_EXTEND, split
# prefill, prebuilt, dLLM); an EAGLE runner adds its pool's TARGET_VERIFY or DRAFT_EXTEND_V2
# (kvcanary.sglang.speculative).
FORWARD_MODES: Mapping[str, ForwardKind] = types.MappingProxyType({
    "EXTEND": ForwardKind.EXTEND,
    "DECODE": ForwardKind.DECODE,
    "MIXED": ForwardKind.MIXED,
    "IDLE": ForwardKind.IDLE,
})

POOL_CLASSES = pools.PoolClasses(
    mha="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
    mla="sglang.srt.mem_cache.memory_pool.MLATokenToKVPool",
    swa="sglang.srt.mem_cache.swa_memory_pool.SWAKVPool",
)
RADIX_CACHE_CLASS = "sglang.srt.mem_cache.radix_cache.RadixCache"
# The RadixCache methods its cached entries change through, which the incremental sweep follows
# (kvcanary.sglang.radix_index); None: the tree is walked on every sweep. 0.5.12's ``_insert_helper`` calls
# ``_record_store_event`` with every node it creates (and nothing else calls it).
RADIX_NODE_HOOKS: radix_index.RadixNodeHooks | None = radix_index.RadixNodeHooks(
    stored="_record_store_event", split="_split_node", deleted="_delete_leaf", reset="reset")
SCHEDULE_STREAM_ATTR = "schedule_stream"  # Scheduler attribute (0.5.12: set when its event loop starts)
# The sliding-window models' prefix cache. Its nodes keep their full-attention slots while cached (a tombstone frees
# only the window's slots; a node leaves the tree with its full slots), so it is swept as a RadixCache is walked: the
# full group's records (the first group, the installation's manager) every sweep; the swa group is not swept. Pages
# of one slot only: SWA with --page-size > 1 has not run under the sweep yet (it stays off there, with the warning).
SWA_RADIX_CACHE_CLASS = "sglang.srt.mem_cache.swa_radix_cache.SWARadixCache"

__all__ = [
    "MODEL_RUNNER", "SCHEDULER", "T_FORWARD", "T_FB_INIT_NEW", "STARTUP_FAILURE_TARGET", "PROTECT_HOOK_TARGETS",
    "FORWARD_MODES", "POOL_CLASSES", "RADIX_CACHE_CLASS", "RADIX_NODE_HOOKS", "SCHEDULE_STREAM_ATTR",
    "check_after_initialize", "server_args_of", "runner_parts", "runner_ranks", "batch_requests", "scheduler_cache",
    "radix_cache", "swept_tree", "scheduler_stream_of", "sweep_source", "wrapper_gate", "max_static_tokens",
]


# ------------------------------------------------------------------------------ bound to a version (factories)
def check_supported_of(sglang_version: str) -> Callable[[object], None]:
    """``check_supported(server_args)``: the shared guards (:func:`kvcanary.sglang.guards.check_supported`), their
    messages naming ``sglang_version``."""

    def check_supported(server_args) -> None:
        """Refuse setups kvcanary cannot protect on this version, naming the setting to change."""
        guards.check_supported(server_args, sglang_version)

    return check_supported


def pool_groups_of(sglang_version: str, pool_classes: pools.PoolClasses = POOL_CLASSES
                   ) -> Callable[..., list[GroupSpec]]:
    """``pool_groups(pool, config, *, sliding_window_size, layers)``: the KV groups of a token-to-KV pool of
    ``pool_classes`` (MHA, MLA, SWA; see :func:`kvcanary.sglang.pools.pool_groups`), errors naming
    ``sglang_version``."""

    def pool_groups(pool, config: Config, *, sliding_window_size: int | None = None,
                    layers: Sequence[int] | None = None) -> list[GroupSpec]:
        return pools.pool_groups(pool, config, pool_classes, sglang_version, sliding_window_size=sliding_window_size,
                                 layers=layers)

    return pool_groups


def batch_view_of(sglang_version: str, forward_modes: Mapping[str, ForwardKind] = FORWARD_MODES) -> BatchViewFn:
    """``batch_view(fb, input_ids, positions, ones, empty)``: one ForwardBatch as a BatchView (SPEC §4.3 mode table),
    bound to ``forward_modes`` once (the per-forward path: :func:`kvcanary.sglang.batches.batch_view_of`), a mode
    outside it refused naming ``sglang_version``."""
    return batches.batch_view_of(forward_modes, sglang_version)


# ----------------------------------------------------------------------------------------------- guards
def check_after_initialize(runner) -> None:
    """After init (warm-up and graph capture are over): refuse a prefill graph runner kvcanary does not know
    (:func:`guards.check_after_initialize`); with kvcanary installed on ``runner``, check the piecewise runner's
    padding, keep kvcanary's wrapper on ``model.forward`` and say what serves prefill
    (:func:`kvcanary.sglang.piecewise.after_initialize`)."""
    guards.check_after_initialize(runner)
    inst = installation_of(runner)
    if inst is not None:
        piecewise.after_initialize(runner, inst)


# ----------------------------------------------------------------------------------------------- accessors
def server_args_of(runner):
    return runner.server_args


def runner_parts(runner) -> RunnerParts:
    """The largest decode-graph batch is named in the server arguments (``cuda_graph_max_bs``)."""
    max_bs = int(getattr(runner.server_args, "cuda_graph_max_bs", 0) or 0)
    return RunnerParts.of_runner(runner, cuda_graph_max_bs=max_bs)


def runner_ranks(runner) -> tuple[dict[str, int], int]:
    """The rank keys and ``{rank}`` value of a runner whose ranks are its own attributes (:mod:`ranks`)."""
    return ranks.runner_ranks(runner)


def batch_requests(batch) -> Sequence[object]:
    """The engine's requests of the batch ``ForwardBatch.init_new`` is given, one per row, in order (``reqs``)."""
    return getattr(batch, "reqs", None) or ()


def scheduler_cache(scheduler) -> tuple[object | None, torch.Tensor | None]:
    """(prefix cache, req_to_token of its request pool) of a Scheduler; either None when it has none."""
    r2t_pool = getattr(scheduler, "req_to_token_pool", None)
    return getattr(scheduler, "tree_cache", None), getattr(r2t_pool, "req_to_token", None)


def radix_cache(tree_cache):
    """The RadixCache behind the prefix cache (itself, or the one a wrapper holds), or None."""
    return radix.unwrap_radix_cache(tree_cache, pkgutil.resolve_name(RADIX_CACHE_CLASS))


def scheduler_stream_of(scheduler) -> Callable[[], torch.cuda.Stream | None]:
    """The stream the scheduler's event loop runs on, read when asked (weakly; None before the loop starts)."""
    return radix.scheduler_stream_of(scheduler, SCHEDULE_STREAM_ATTR)


def swa_radix_cache(tree_cache):
    """The ``SWA_RADIX_CACHE_CLASS`` tree behind sglang's prefix cache, or None (also when this sglang has no such
    class)."""
    try:
        cls = pkgutil.resolve_name(SWA_RADIX_CACHE_CLASS)
    except (ImportError, AttributeError):
        return None
    return radix.unwrap_radix_cache(tree_cache, cls)


def swept_tree(tree_cache):
    """The tree whose cached slots the sweep walks and the fault injector reads idle slots from: the RadixCache
    behind ``tree_cache`` (:func:`radix_cache`), else its SWARadixCache (:func:`swa_radix_cache`); None for any
    other prefix cache."""
    tree = radix_cache(tree_cache)
    return tree if tree is not None else swa_radix_cache(tree_cache)


def sweep_source(tree_cache, producer_stream: Callable[[], torch.cuda.Stream | None] | None = None
                 ) -> Callable[[], object] | None:
    """The sweep source over the RadixCache behind ``tree_cache`` (:func:`radix_cache`), or None when there is none:
    for exactly ``RADIX_CACHE_CLASS`` with ``RADIX_NODE_HOOKS``, the incremental plan that follows the tree's changes
    (:class:`kvcanary.sglang.radix_index.RadixSweepIndex`); otherwise (a subclass: HiRadixCache moves node values in
    methods of its own) the walker, every sweep; an ``SWA_RADIX_CACHE_CLASS`` tree's full slots (pages of one slot):
    the walker too."""
    tree = radix_cache(tree_cache)
    if tree is None:
        swa_tree = swa_radix_cache(tree_cache)
        if swa_tree is None or getattr(swa_tree, "page_size", 1) != 1:
            return None
        return radix.radix_sweep_source(swa_tree, producer_stream)
    if RADIX_NODE_HOOKS is not None and type(tree) is pkgutil.resolve_name(RADIX_CACHE_CLASS):
        return radix_index.RadixSweepIndex(tree, RADIX_NODE_HOOKS, producer_stream)
    return radix.radix_sweep_source(tree, producer_stream)


# How kvcanary's model.forward wrapper classifies its calls, and the most tokens a prefill graph replay hands it:
# sglang's piecewise CUDA graph runner (kvcanary.sglang.piecewise).
wrapper_gate = piecewise.wrapper_gate
max_static_tokens = piecewise.max_static_tokens
