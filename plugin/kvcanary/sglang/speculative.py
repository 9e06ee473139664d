"""EAGLE speculative decoding on sglang 0.5.12 (``--speculative-eagle-topk 1``, the spec-v2 overlap worker).

sglang's ``EAGLEWorkerV2`` runs two ModelRunners over one slot space: the target and a draft model with its own KV
pool (``is_draft_worker``; both share ``req_to_token`` and the allocator). kvcanary installs in both, one manager
per pool (the draft's with the token shift of :data:`kvcanary.runtime.speculative.DRAFT_TOKEN_OFFSET`), and its lines
and records carry ``pool=target`` / ``pool=draft``. Per scheduler step (seq_lens = L committed positions, the bonus
token at L known), in this order:

==============================  ======================  ===================================================
forward (runner, ForwardMode)   how it runs             the canary's (prefix, extend)
==============================  ======================  ===================================================
target prefill (EXTEND)         eager                   (extend_prefix_lens, extend_seq_lens)
draft prefill (EXTEND)          eager                   the same; the draft is fed the next token (shift)
draft decode x (num_steps - 1)  draft CUDA graph        (positions, 1): position L + i, the i-th draft
(DECODE)                        (EAGLEDraftCuda-        (``EAGLEDraftCudaGraphRunner.replay`` bypasses
                                GraphRunner) or eager   ModelRunner.forward: host half in its hook)
target verify (TARGET_VERIFY)   target CUDA graph or    (seq_lens, draft_token_num): bonus + drafts at
                                eager                   L .. L + n - 1 into pre-allocated slots
draft extend (DRAFT_EXTEND_V2)  draft-extend CUDA       (seq_lens - extend_seq_lens, extend_seq_lens): the
                                graph or eager          target's predictions at L .. L + n - 1
IDLE (DP attention)             as the runner           nothing written, plan/verify/write still launch
==============================  ======================  ===================================================

The draft-extend graph leaves the padded rows' ``req_pool_indices`` stale (0.5.12): its replay hook zeroes them
first, as ``after_populate`` does for decode and verify graphs. Rejected drafts are never rolled back: see
:mod:`kvcanary.runtime.speculative` for why no later verify can reach their records. ``DRAFT_EXTEND`` (spec v1) and
every other mode are refused by name; so are the setups :func:`check_speculative` lists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.tags import LaunchTag
from kvcanary.runtime.installation import Installation
from kvcanary.runtime.speculative import (
    DRAFT,
    DRAFT_ROLE,
    TARGET,
    TARGET_ROLE,
    PoolRole,
    SpecCounters,
    SpecLens,
    draft_extend_view,
    target_verify_view,
)
from kvcanary.sglang.batches import dense

logger = logging.getLogger(__name__)

SUPPORTED_ALGORITHMS = ("EAGLE",)  # sglang turns NEXTN into EAGLE for the models that have one
# sglang versions whose EAGLE worker, graph runners and forward modes this module was written against (another
# version's adapter refuses EAGLE until its own hook targets are checked).
COVERED_VERSIONS = ("0.5.12",)
TARGET_VERIFY = "TARGET_VERIFY"
DRAFT_EXTEND_V2 = "DRAFT_EXTEND_V2"
# The ForwardModes each pool adds to the version's table (both are extends of a row's committed prefix).
POOL_MODES: dict[str, dict[str, ForwardKind]] = {
    TARGET: {TARGET_VERIFY: ForwardKind.EXTEND},
    DRAFT: {DRAFT_EXTEND_V2: ForwardKind.EXTEND},
}
SPEC_ATTR = "_kvcanary_spec"  # ModelRunner attribute holding its SpecState


def check_speculative(server_args, sglang_version: str) -> None:
    """Refuse speculative setups kvcanary does not cover, naming what to change (no speculative algorithm: ok)."""
    from kvcanary.sglang.refusal import UnsupportedSetupError

    algo = getattr(server_args, "speculative_algorithm", None)
    if not algo:
        return
    name = str(getattr(algo, "name", algo)).upper()
    if sglang_version not in COVERED_VERSIONS:
        raise UnsupportedSetupError(
            f"speculative decoding (--speculative-algorithm {algo}) is covered by kvcanary on sglang "
            f"{', '.join(COVERED_VERSIONS)} only, not {sglang_version}: remove --speculative-algorithm or unset "
            "KVCANARY_MODE"
        )
    topk = getattr(server_args, "speculative_eagle_topk", None) or 1
    if topk > 1:
        raise UnsupportedSetupError(
            f"EAGLE with --speculative-eagle-topk {topk} builds a draft tree: its verify writes sibling branches and "
            "sglang then moves the accepted path to other slots, which breaks the canary's one position, one slot "
            "chain: set --speculative-eagle-topk 1"
        )
    if name not in SUPPORTED_ALGORITHMS:
        raise UnsupportedSetupError(
            f"speculative decoding with --speculative-algorithm {algo} is not covered by the kvcanary sglang "
            f"{sglang_version} adapter (covered: EAGLE with --speculative-eagle-topk 1): use EAGLE, remove "
            "--speculative-algorithm or unset KVCANARY_MODE"
        )
    if getattr(server_args, "disable_overlap_schedule", False):
        raise UnsupportedSetupError(
            "EAGLE without the overlap scheduler runs sglang's spec-v1 worker (DRAFT_EXTEND forwards, accepted KV "
            "moved between slots), which kvcanary does not cover: drop --disable-overlap-schedule and keep "
            "SGLANG_ENABLE_SPEC_V2 on"
        )
    if getattr(server_args, "enable_multi_layer_eagle", False):
        raise UnsupportedSetupError(
            "--enable-multi-layer-eagle runs another draft worker (MultiLayerEagleWorkerV2) that kvcanary does not "
            "cover: remove --enable-multi-layer-eagle"
        )
    if getattr(server_args, "speculative_adaptive", False):
        raise UnsupportedSetupError(
            "--speculative-adaptive swaps the draft step count and its CUDA graphs at run time, which kvcanary's "
            "captured views do not follow: remove --speculative-adaptive"
        )


# kvcanary.sglang.pools.pool_kind's kinds EAGLE has not been run over (a draft model on DeepSeek's NEXTN / MTP MLA
# pool, or on a sliding-window pool), with how a refusal names them
UNFOLLOWED_POOL_KINDS = {"mla": "an MLA KV pool", "swa": "a sliding-window KV pool"}


def check_pool_kind(kind: str, pool_class: str, server_args) -> None:
    """Refuse speculative decoding over a pool kind (``kvcanary.sglang.pools.pool_kind``) kvcanary has not followed
    it on, naming the flag: EAGLE is followed on MHA pools (paged or not); over an MLA or a sliding-window pool it
    has not been run, so it is refused at start-up rather than installed on trust."""
    from kvcanary.sglang.refusal import UnsupportedSetupError

    algo = getattr(server_args, "speculative_algorithm", None)
    if not algo or kind not in UNFOLLOWED_POOL_KINDS:
        return
    raise UnsupportedSetupError(
        f"speculative decoding (--speculative-algorithm {getattr(algo, 'name', algo)}) over "
        f"{UNFOLLOWED_POOL_KINDS[kind]} ({pool_class}) is not followed by kvcanary (EAGLE is, on MHA pools): remove "
        "--speculative-algorithm or unset KVCANARY_MODE"
    )


def pool_role(runner, server_args) -> PoolRole | None:
    """The runner's pool in a speculative engine (draft when ``is_draft_worker``), None without speculation."""
    if not getattr(server_args, "speculative_algorithm", None):
        return None
    return DRAFT_ROLE if getattr(runner, "is_draft_worker", False) else TARGET_ROLE


def manager_kwargs(role: PoolRole | None) -> dict[str, int]:
    """CanaryManager arguments of the pool: the draft pool's token shift."""
    return {} if role is None or not role.token_offset else {"kv_token_id_vs_position_offset": role.token_offset}


class SpecBatchView:
    """A version's ``batch_view`` plus the speculative modes (SPEC §4.3 mode table,
    ``kvcanary.runtime.speculative``)."""

    def __init__(self, base: Callable[..., BatchView], lens: SpecLens) -> None:
        self.base = base
        self.lens = lens

    def __call__(self, fb, input_ids: torch.Tensor, positions: torch.Tensor, ones: torch.Tensor,
                 empty: torch.Tensor) -> BatchView:
        name = getattr(fb.forward_mode, "name", str(fb.forward_mode))
        if name == TARGET_VERIFY:
            return target_verify_view(self.lens, input_ids=input_ids, positions=positions,
                                      out_cache_loc=dense(fb.out_cache_loc), req_pool_indices=fb.req_pool_indices,
                                      seq_lens=fb.seq_lens)
        if name == DRAFT_EXTEND_V2:  # the captured graph has no extend_prefix_lens: seq_lens counts the new tokens
            return draft_extend_view(input_ids=input_ids, positions=positions, out_cache_loc=dense(fb.out_cache_loc),
                                     req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
                                     extend_seq_lens=fb.extend_seq_lens)
        return self.base(fb, input_ids, positions, ones, empty)


def batch_view_for(role: PoolRole | None, base: Callable[..., BatchView], max_batch_size: int,
                   device: torch.device) -> Callable[..., BatchView]:
    return base if role is None else SpecBatchView(base, SpecLens(max_batch_size, device))


@dataclass(repr=False)
class SpecState:
    """kvcanary's speculative state of one ModelRunner (its pool's role, counters, the engine's step shape)."""

    inst: Installation
    role: PoolRole
    draft_token_num: int  # tokens per row of a target verify / draft extend (bonus + drafts)
    num_steps: int  # draft steps per decode step (num_steps - 1 draft forwards)
    counters: SpecCounters = field(default_factory=SpecCounters)


def attach(runner, inst: Installation, role: PoolRole | None, server_args) -> SpecState | None:
    """Keep the runner's SpecState on it (EAGLE only: ``role`` from :func:`pool_role`)."""
    if role is None:
        return None
    sa = server_args
    state = SpecState(inst, role, int(sa.speculative_num_draft_tokens), int(sa.speculative_num_steps))
    setattr(runner, SPEC_ATTR, state)
    logger.info("kvcanary: EAGLE %s pool (topk 1, %d draft tokens, %d steps)%s", role.pool, state.draft_token_num,
                state.num_steps, "; token check shifted by one (slot p holds token p + 1)" if role.token_offset else "")
    return state


def spec_of(runner) -> SpecState | None:
    return getattr(runner, SPEC_ATTR, None) if runner is not None else None


def forward_modes(runner, base: Mapping[str, ForwardKind]) -> Mapping[str, ForwardKind]:
    """The ForwardModes ``runner`` accepts: the version's, plus its pool's speculative one."""
    state = spec_of(runner)
    return base if state is None else {**base, **POOL_MODES[state.role.pool]}


def count_forward(state: SpecState, fb) -> None:
    """Host counters of one real forward of a speculative runner (ModelRunner.forward). The draft graph runners'
    warm-up forwards at capture time also pass through ModelRunner.forward, with a ForwardBatch they build
    themselves: only one built by ``ForwardBatch.init_new`` from the scheduler's batch (``rids`` set) counts."""
    if getattr(fb, "rids", None) is None:
        return
    name = getattr(fb.forward_mode, "name", str(fb.forward_mode))
    rows = int(getattr(fb, "batch_size", 0) or 0)
    c = state.counters
    if name == TARGET_VERIFY:
        c.add_verify(rows, state.draft_token_num)
    elif name == DRAFT_EXTEND_V2:
        c.add_draft_extend(rows, state.draft_token_num - 1)
    elif state.role.pool == DRAFT and name == "EXTEND":
        c.add_draft_extend(rows)
    elif state.role.pool == DRAFT and name == "DECODE":
        c.add_draft_decode(rows)


def log_stats(state: SpecState) -> None:
    """The ``kvcanary spec stats:`` line and its ``kvcanary.spec/1`` record, every KVCANARY_STATS_EVERY steps."""
    inst = state.inst
    if not state.counters.due(inst.steps, inst.config.stats_every):
        return
    manager = inst.manager
    runs = manager.stats.slot_runs
    extra = {"forwards": inst.steps, "tokens_written": int(runs[LaunchTag.WRITE]),
             "entries_verified": int(runs[LaunchTag.VERIFY]), "violations": manager.reporter.total_reported}
    rank = manager.reporter.rank or {}
    logger.info("%s", state.counters.line(inst.steps, state.role.pool, {
        **extra, **{k: v for k, v in rank.items() if k != "pool"}}))
    manager.reporter.record(state.counters.record(inst.steps, state.role.pool, None, extra))


def feed_metrics(state: SpecState) -> None:
    """``sglang:kv_canary_drafts_rolled_back_total`` (kvcanary.report.metrics; the installation builds its metrics on
    its first host step): the growth of this pool's ``rolled_back`` count."""
    metrics = state.inst.metrics
    if metrics is not None:
        metrics.update_drafts(state.counters, state.counters.rolled_back)


def after_forward(runner, fb) -> None:
    """After a real ModelRunner.forward's host half: count it and log the stats when due (no-op without EAGLE)."""
    state = spec_of(runner)
    if state is not None:
        count_forward(state, fb)
        feed_metrics(state)
        log_stats(state)


def _replay(state: SpecState | None, original, graph_runner, forward_batch, args, kwargs, count: Callable[[], None]):
    """A draft CUDA-graph replay as one real forward of the draft installation: host half around it."""
    if state is None or state.inst.stopped is not None:
        return original(graph_runner, forward_batch, *args, **kwargs)
    inst = state.inst
    t0 = time.perf_counter_ns()  # (nothing before the replay: the draft pool takes no injected faults)
    t1 = time.perf_counter_ns()
    out = original(graph_runner, forward_batch, *args, **kwargs)
    t2 = time.perf_counter_ns()
    try:
        count()
        inst.host_after()
    except Exception as exc:  # (log mode: kvcanary stops on this runner; raise mode's errors stand)
        if not inst.keeps_serving(exc, "after a draft graph replay (drain, health)"):
            raise
        return out
    t3 = time.perf_counter_ns()
    inst.account_forward(t3 - t0, t1 - t0 + t3 - t2)
    feed_metrics(state)
    log_stats(state)
    return out


def around_draft_replay(original, graph_runner, forward_batch, *args, **kwargs):
    """``EAGLEDraftCudaGraphRunner.replay``: the ``num_steps - 1`` captured draft decode forwards (their plan,
    verify and write were captured inside the wrapped ``model.forward``); this is their host half."""
    state = spec_of(getattr(graph_runner, "model_runner", None))
    rows = int(forward_batch.batch_size)

    def count() -> None:
        state.counters.add_draft_decode(rows, max(state.num_steps - 1, 0))

    return _replay(state, original, graph_runner, forward_batch, args, kwargs, count)


# The graph runner's attribute: how many leading rows of its req_pool_indices buffer may hold a request's row; every
# row from there on is zero (the padding row). Unset: the whole buffer (capture wrote it).
ROWS_WRITTEN_ATTR = "_kvcanary_rows_written"


def around_draft_extend_replay(original, graph_runner, forward_batch, *args, **kwargs):
    """``EAGLEDraftExtendCudaGraphRunner.replay`` (DRAFT_EXTEND_V2): zero the padded rows' stale
    ``req_pool_indices`` (0.5.12 copies only the real rows; row 0 is the padding row), then the host half.

    Only rows a larger earlier replay left behind are zeroed, once: at a steady batch size a replay launches
    nothing here (it zeroed ``[rows:]`` on every replay, a slice and a launch each)."""
    state = spec_of(getattr(graph_runner, "model_runner", None))
    rows = int(forward_batch.batch_size)
    if state is not None and state.inst.stopped is None:
        try:
            zero_rows_left_behind(graph_runner.buffers.req_pool_indices, graph_runner, rows)
        except Exception as exc:  # (log mode: kvcanary stops on this runner, and _replay only calls through)
            if not state.inst.keeps_serving(exc, "before a draft-extend graph replay (padded rows)"):
                raise

    def count() -> None:
        state.counters.add_draft_extend(rows, state.draft_token_num - 1)

    return _replay(state, original, graph_runner, forward_batch, args, kwargs, count)


def zero_rows_left_behind(req_pool_indices, graph_runner, rows: int) -> None:
    """Before a replay that copies its ``rows`` real rows into ``req_pool_indices``: zero the rows from ``rows`` on
    that may still hold an earlier replay's (or the capture's) requests; remember that only ``rows`` may now."""
    written = getattr(graph_runner, ROWS_WRITTEN_ATTR, None)
    if written is None:
        written = int(req_pool_indices.shape[0])
    if rows < written:
        req_pool_indices[rows:written].zero_()
    setattr(graph_runner, ROWS_WRITTEN_ATTR, rows)


def after_verify_complete(result, worker, num_correct_drafts_per_req=None, *args, **kwargs):
    """``EAGLEWorkerV2.on_verify_complete_cpu``: the accepted drafts per row, on the host (the scheduler copied
    them anyway), into both pools' counters."""
    if num_correct_drafts_per_req is None:
        return result
    draft_worker = getattr(worker, "draft_worker", None)
    runners = (getattr(getattr(worker, "target_worker", None), "model_runner", None),
               getattr(draft_worker, "draft_runner", None))
    for runner in runners:
        state = spec_of(runner)
        if state is None or state.inst.stopped is not None:
            continue
        try:
            state.counters.add_verdicts(list(num_correct_drafts_per_req), state.draft_token_num - 1)
            feed_metrics(state)
        except Exception as exc:  # (a scheduler hook: log mode must not stop serving from here either)
            if not state.inst.keeps_serving(exc, "after a verify (speculative counters, metrics)"):
                raise
    return result


__all__ = [
    "COVERED_VERSIONS", "POOL_MODES", "ROWS_WRITTEN_ATTR", "SPEC_ATTR", "SUPPORTED_ALGORITHMS", "SpecBatchView",
    "SpecState", "after_forward", "after_verify_complete", "around_draft_extend_replay", "around_draft_replay",
    "attach", "batch_view_for", "check_pool_kind", "check_speculative", "count_forward", "feed_metrics",
    "forward_modes", "log_stats",
    "manager_kwargs", "pool_role", "spec_of", "zero_rows_left_behind",
]
