"""sglang 0.5.12: the version's facts (SPEC §6) for the shared adapter (:mod:`kvcanary.sglang.hooks`).

Hook targets and the parameters the hooks rely on, the forward-mode table, the KV pool and prefix-cache classes,
where the scheduler keeps its stream, and the accessors through which the shared hook bodies read a ModelRunner,
a Scheduler and a ModelWorkerBatch. The contract it satisfies is :class:`kvcanary.sglang.contract.VersionModule`.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Sequence

import torch

from kvcanary.batch import ForwardKind
from kvcanary.config import Config
from kvcanary.installation import GroupSpec
from kvcanary.sglang import batches, guards, pools, radix
from kvcanary.sglang.contract import RunnerParts
from kvcanary.sglang.ranks import runner_ranks
from kvcanary.sglang.targets import Target

SGLANG_VERSION = "0.5.12"
VERSION_RANGE = ">=0.5.12,<0.5.13"  # post releases of 0.5.12 included

_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
T_INIT_MEMORY_POOL = f"{_MR}.init_memory_pool"
T_FORWARD = f"{_MR}.forward"
T_INITIALIZE = f"{_MR}.initialize"
T_POPULATE = "sglang.srt.model_executor.cuda_graph_runner.DecodeInputBuffers.populate_from_forward_batch"
T_INIT_CACHE = "sglang.srt.managers.scheduler.Scheduler.init_cache_with_memory_pool"
T_FB_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
_SPEC = "sglang.srt.speculative"
T_DRAFT_REPLAY = f"{_SPEC}.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.replay"
T_DRAFT_EXTEND_REPLAY = f"{_SPEC}.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.replay"
T_VERIFY_DONE = f"{_SPEC}.eagle_worker_v2.EAGLEWorkerV2.on_verify_complete_cpu"
_HICACHE = "sglang.srt.managers.cache_controller.HiCacheController"
T_HICACHE_WRITE = f"{_HICACHE}.write"
T_HICACHE_LOAD = f"{_HICACHE}.load"
T_HICACHE_START_LOADING = f"{_HICACHE}.start_loading"
STARTUP_FAILURE_TARGET = f"{_MR}.__init__"

# Hook name (kvcanary.sglang.hooks.AdapterHooks) -> target, in registration order.
HOOK_TARGETS: dict[str, Target] = {
    "after_init_memory_pool": Target(T_INIT_MEMORY_POOL, "AFTER", ("self", "pre_model_load_memory")),
    "around_forward": Target(T_FORWARD, "AROUND", ("self", "forward_batch")),
    "after_initialize": Target(T_INITIALIZE, "AFTER", ("self", "pre_model_load_memory")),
    # 0.5.12 leaves padded rows' req_pool_indices and positions stale in the decode graph's buffers.
    "after_populate": Target(T_POPULATE, "AFTER", ("self", "forward_batch", "raw_bs", "raw_num_token", "bs")),
    "after_init_cache": Target(T_INIT_CACHE, "AFTER", ("self",)),
    "after_forward_batch_init": Target(T_FB_INIT_NEW, "AFTER", ("cls", "batch", "model_runner"), classmethod=True),
    # EAGLE (topk 1, spec v2; kvcanary.sglang.speculative): the draft model's CUDA-graph replays bypass
    # ModelRunner.forward (their host half runs here), and the scheduler's host copy of the accept lengths.
    "around_draft_replay": Target(T_DRAFT_REPLAY, "AROUND", ("self", "forward_batch")),
    "around_draft_extend_replay": Target(T_DRAFT_EXTEND_REPLAY, "AROUND", ("self", "forward_batch")),
    "after_verify_complete": Target(T_VERIFY_DONE, "AFTER", ("self", "num_correct_drafts_per_req")),
    # HiCache (kvcanary.sglang.hicache): records follow backups (device -> host) and load-backs (host -> device)
    "after_hicache_write": Target(T_HICACHE_WRITE, "AFTER", ("self", "device_indices")),
    "after_hicache_load": Target(T_HICACHE_LOAD, "AFTER", ("self", "host_indices")),
    "around_hicache_start_loading": Target(T_HICACHE_START_LOADING, "AROUND", ("self",)),
}
TARGETS: tuple[Target, ...] = tuple(HOOK_TARGETS.values())

# KVCANARY_MODE=protect only (kvcanary.sglang.protect): registered after HOOK_TARGETS, in no other mode.
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
PROTECT_HOOK_TARGETS: dict[str, Target] = {
    "protect_after_init_cache": Target(T_INIT_CACHE, "AFTER", ("self",)),
    "protect_after_forward_batch_init": Target(T_FB_INIT_NEW, "AFTER", ("cls", "batch", "model_runner"),
                                               classmethod=True),
    # between forwards, where sglang's own retraction runs (update_running_batch, inside it)
    "protect_before_schedule": Target(f"{_SCHED}.get_next_batch_to_run", "BEFORE", ("self",)),
    # KVCANARY_PROTECT_HOLD: before a batch's tokens are appended and sent
    "protect_before_results": Target(f"{_SCHED}.process_batch_result", "BEFORE", ("self", "batch", "result")),
}

# sglang ForwardMode name -> kvcanary ForwardKind. Anything else is refused (spec-v1 DRAFT_EXTEND, split prefill,
# prebuilt, dLLM); an EAGLE runner adds its pool's TARGET_VERIFY or DRAFT_EXTEND_V2 (kvcanary.sglang.speculative).
FORWARD_MODES: dict[str, ForwardKind] = {
    "EXTEND": ForwardKind.EXTEND,
    "DECODE": ForwardKind.DECODE,
    "MIXED": ForwardKind.MIXED,
    "IDLE": ForwardKind.IDLE,
}

POOL_CLASSES = pools.PoolClasses(
    mha="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
    mla="sglang.srt.mem_cache.memory_pool.MLATokenToKVPool",
    swa="sglang.srt.mem_cache.swa_memory_pool.SWAKVPool",
)
RADIX_CACHE_CLASS = "sglang.srt.mem_cache.radix_cache.RadixCache"
SCHEDULE_STREAM_ATTR = "schedule_stream"  # Scheduler attribute, set when its event loop starts

__all__ = [
    "SGLANG_VERSION", "VERSION_RANGE", "STARTUP_FAILURE_TARGET", "HOOK_TARGETS", "TARGETS", "FORWARD_MODES",
    "check_supported", "check_after_initialize", "server_args_of", "runner_parts", "runner_ranks", "pool_groups",
    "batch_view", "batch_requests", "scheduler_cache", "radix_cache", "scheduler_stream_of",
]


# ----------------------------------------------------------------------------------------------- guards
def check_supported(server_args) -> None:
    """Refuse setups kvcanary cannot protect on 0.5.12, naming the setting to change."""
    guards.check_supported(server_args, SGLANG_VERSION)


def check_after_initialize(runner) -> None:
    guards.check_after_initialize(runner)


# ----------------------------------------------------------------------------------------------- accessors
def server_args_of(runner):
    return runner.server_args


def runner_parts(runner) -> RunnerParts:
    """0.5.12 names the largest decode-graph batch in its server arguments (``cuda_graph_max_bs``)."""
    max_bs = int(getattr(runner.server_args, "cuda_graph_max_bs", 0) or 0)
    return RunnerParts.of_runner(runner, cuda_graph_max_bs=max_bs)


def pool_groups(pool, config: Config, *, sliding_window_size: int | None = None,
                layers: Sequence[int] | None = None) -> list[GroupSpec]:
    """The KV groups of a 0.5.12 token-to-KV pool (MHA, MLA, SWA; see :func:`kvcanary.sglang.pools.pool_groups`)."""
    return pools.pool_groups(pool, config, POOL_CLASSES, SGLANG_VERSION, sliding_window_size=sliding_window_size,
                             layers=layers)


# batch_view(fb, input_ids, positions, ones, empty): one 0.5.12 ForwardBatch as a BatchView (SPEC §4.3 mode table),
# bound to this version's mode table once (the per-forward path: kvcanary.sglang.batches.batch_view_of).
batch_view = batches.batch_view_of(FORWARD_MODES, SGLANG_VERSION)

def batch_requests(batch) -> Sequence[object]:
    """The engine's requests of a ModelWorkerBatch, one per row, in order (``reqs``)."""
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
