"""sglang 0.5.12: the version's facts (SPEC §6) for the shared adapter (:mod:`kvcanary.sglang.hooks`).

0.5.12's reading is the shared default (:mod:`kvcanary.sglang.base`: the forward-mode table, pool and prefix-cache
classes, the scheduler's stream, the accessors, the piecewise-CUDA-graph gate); this module states its hook targets,
protect mode's targets and the members bound to its version string. The contract it satisfies is
:class:`kvcanary.sglang.contract.VersionModule`.
"""

from __future__ import annotations

from kvcanary.sglang import base
from kvcanary.sglang.base import *  # noqa: F403  (the shared defaults; what follows is what 0.5.12 states)
from kvcanary.sglang.targets import Target

SGLANG_VERSION = "0.5.12"
VERSION_RANGE = ">=0.5.12,<0.5.13"  # post releases of 0.5.12 included

_MR = base.MODEL_RUNNER
T_INIT_MEMORY_POOL = f"{_MR}.init_memory_pool"
T_INITIALIZE = f"{_MR}.initialize"
T_POPULATE = "sglang.srt.model_executor.cuda_graph_runner.DecodeInputBuffers.populate_from_forward_batch"
T_INIT_CACHE = f"{base.SCHEDULER}.init_cache_with_memory_pool"
_SPEC = "sglang.srt.speculative"
T_DRAFT_REPLAY = f"{_SPEC}.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.replay"
T_DRAFT_EXTEND_REPLAY = f"{_SPEC}.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.replay"
T_VERIFY_DONE = f"{_SPEC}.eagle_worker_v2.EAGLEWorkerV2.on_verify_complete_cpu"
_HICACHE = "sglang.srt.managers.cache_controller.HiCacheController"
T_HICACHE_WRITE = f"{_HICACHE}.write"
T_HICACHE_LOAD = f"{_HICACHE}.load"
T_HICACHE_START_LOADING = f"{_HICACHE}.start_loading"

# Hook name (kvcanary.sglang.hooks.AdapterHooks) -> target, in registration order.
HOOK_TARGETS: dict[str, Target] = {
    "after_init_memory_pool": Target(T_INIT_MEMORY_POOL, "AFTER", ("self", "pre_model_load_memory")),
    "around_forward": Target(base.T_FORWARD, "AROUND", ("self", "forward_batch")),
    "after_initialize": Target(T_INITIALIZE, "AFTER", ("self", "pre_model_load_memory")),
    # 0.5.12 leaves padded rows' req_pool_indices and positions stale in the decode graph's buffers.
    "after_populate": Target(T_POPULATE, "AFTER", ("self", "forward_batch", "raw_bs", "raw_num_token", "bs")),
    "after_init_cache": Target(T_INIT_CACHE, "AFTER", ("self",)),
    "after_forward_batch_init": Target(base.T_FB_INIT_NEW, "AFTER", ("cls", "batch", "model_runner"),
                                       classmethod=True),
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
_SCHED = base.SCHEDULER
PROTECT_HOOK_TARGETS: dict[str, Target] = {
    "protect_after_init_cache": Target(T_INIT_CACHE, "AFTER", ("self",)),
    "protect_after_forward_batch_init": Target(base.T_FB_INIT_NEW, "AFTER", ("cls", "batch", "model_runner"),
                                               classmethod=True),
    # between forwards, where sglang's own retraction runs (update_running_batch, inside it)
    "protect_before_schedule": Target(f"{_SCHED}.get_next_batch_to_run", "BEFORE", ("self",)),
    # KVCANARY_PROTECT_HOLD: before a batch's tokens are appended and sent
    "protect_before_results": Target(f"{_SCHED}.process_batch_result", "BEFORE", ("self", "batch", "result")),
}

# Bound to this version's string (refusals, pool errors and unsupported forward modes name it).
check_supported = base.check_supported_of(SGLANG_VERSION)
pool_groups = base.pool_groups_of(SGLANG_VERSION)
batch_view = base.batch_view_of(SGLANG_VERSION)
