"""The hook bodies, shared by every sglang version: written against a version module's facts and accessors
(:class:`~kvcanary.sglang.contract.VersionModule`), never against sglang attributes directly.

:func:`hooks_for` gives the one :class:`AdapterHooks` of a version module; its ``table`` pairs each of the
version's targets with the bound hook (built once, so ``HookRegistry`` sees the same callables on every
``register()``). The hooks:

* ``after_init_memory_pool``: :meth:`AdapterHooks.install`: one manager per KV group, ``model.forward`` wrapped;
* ``around_forward``: the host half of each real forward (drain, health, stats, sweep; fault injection in the layer
  :mod:`kvcanary.sglang.fault_hooks` registers instead of these hooks when ``KVCANARY_FAULT`` is set);
* ``after_initialize``: init finished (warm-up and graph capture are over): the version's after-init checks
  (``check_after_initialize``), then the chain-position assert goes on, and with ``--disable-cuda-graph`` (no EAGLE)
  the managers start deferring each forward's write into the next forward's launch (:func:`defers_writes`);
* ``after_populate``: with an EAGLE pool, zero the padded rows' ``req_pool_indices`` of a decode graph that 0.5.12
  leaves stale (without one nothing: the plan treats a row whose first token is on the padding slot as padding);
* ``after_init_cache``: the prefix cache becomes the sweep source (the version's ``sweep_source``);
* ``after_forward_batch_init``: writer attribution, token-table uploads (``KVCANARY_VERIFY_TOKENS``).
"""

from __future__ import annotations

import enum
import logging
import operator
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from kvcanary.report.reporter import Reporter
from kvcanary.runtime.config import Config
from kvcanary.runtime.identity_cache import IdentityCache
from kvcanary.runtime.installation import Group, Installation
from kvcanary.runtime.manager import CanaryManager
from kvcanary.sglang import hicache, pools, speculative
from kvcanary.sglang.batches import BatchConverter, mode_name, mode_name_of, unsupported_mode
from kvcanary.sglang.contract import VersionModule
from kvcanary.sglang.installed import RUNNER_STATE_ATTR, RunnerState, installation_of, keep, runner_states
from kvcanary.sglang.targets import Target
from kvcanary.sglang.tokens import DECODE_NAMES, decode_fill, expected_token_columns

if TYPE_CHECKING:  # (the fault-injection layer's: the serving path imports none of it)
    from kvcanary.sglang.fault_injection import SglangFaultInjection

logger = logging.getLogger(__name__)

# torch's "is a CUDA graph being captured on the current stream" query without its Python shim
# (torch.cuda.is_current_stream_capturing is one line calling this C function): a frame less on every forward; the
# shim itself where a torch build names it otherwise
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing

# Forward modes whose batch gives no row a new request (the batch hook skips writer attribution for them): a request
# enters through a prefill (EXTEND or MIXED) on every runner, EAGLE's draft runner included; a verify and a draft
# extend follow a decode step of requests already there (their attribution would be a lookup per row, every step).
_NO_NEW_REQUESTS = frozenset({"DECODE", "IDLE", speculative.TARGET_VERIFY, speculative.DRAFT_EXTEND_V2})

class AdapterHooks:
    """The hooks of one sglang version module (``version``); see the module docstring."""

    def __init__(self, version: VersionModule) -> None:
        self.version = version
        # Host time of after_populate during the forward in progress: it runs inside ModelRunner.forward (a decode
        # graph's input buffers are filled before the replay), so around_forward adds it to the forward's canary time.
        self.graph_input_ns = 0
        # (buffers, rows) -> the req_pool_indices view to zero
        self._padding = IdentityCache(1024)
        # True once an EAGLE pool is installed in this process: sglang then also fills the graph buffers on paths
        # after_populate does not see (a replay with skip_attn_backend_init), whose out_cache_loc this adapter does not
        # know to be the padding slot in every padded row, so the padded rows' req_pool_indices are zeroed there
        self.zero_graph_padding = False
        # Whether this kind of hooks has per-batch request facts to gather (a layer overriding batch_facts): the plain
        # hooks then skip the call on every batch
        self._has_batch_facts = type(self).batch_facts is not AdapterHooks.batch_facts
        # Whether before_model / after_model are these hooks' own (no layer extends them): the forward hook then runs
        # their bodies written out, with no call for either on a forward without a host KV tier
        self._plain_model_hooks = (type(self).before_model is AdapterHooks.before_model
                                   and type(self).after_model is AdapterHooks.after_model)
        # id(ForwardMode member) -> (the member, whether its batches get writer attribution, whether a plain runner
        # serves it): what the batch hook and the forward hook ask of a mode, each one dict read (both derive from the
        # member's name, which never changes; IdentityCache's scheme: the entry holds its member)
        self._mode_facts: dict[int, tuple[object, bool, bool]] = {}
        # Bound once: HookRegistry's duplicate check (targets.register_hooks) compares hooks by identity.
        self.table: tuple[tuple[Target, Callable], ...] = tuple(
            (target, getattr(self, name)) for name, target in version.HOOK_TARGETS.items()
        )

    # ------------------------------------------------------------------------------------------- install
    def install(self, runner) -> Installation:
        """Build the managers for the runner's pools and wrap its ``model.forward`` (after init_memory_pool); the
        runner's :class:`~kvcanary.sglang.installed.RunnerState` holds the Installation and the concerns' state."""
        existing = installation_of(runner)
        if existing is not None:
            return existing
        v = self.version
        config = Config.from_env()
        v.check_supported(v.server_args_of(runner))
        parts = v.runner_parts(runner)
        pool = parts.kv_pool
        specs = v.pool_groups(pool, config, sliding_window_size=parts.sliding_window_size)
        speculative.check_pool_kind(pools.pool_kind(pool, v.POOL_CLASSES), type(pool).__name__,
                                    v.server_args_of(runner))  # EAGLE: MHA pools only
        r2t = parts.req_to_token
        device = r2t.device
        max_bs = max(parts.max_running_requests + 1, parts.cuda_graph_max_bs)
        # a piecewise prefill replay hands model.forward its batch padded up to the next capture size
        max_tokens = max(max_bs, v.max_static_tokens(v.server_args_of(runner)))
        rank, report_rank = v.runner_ranks(runner)
        role = speculative.pool_role(runner, v.server_args_of(runner))  # EAGLE: target or draft pool (pool=...)
        if role is not None:
            rank = role.rank(rank)
            self.zero_graph_padding = True  # (before any replay: pools are installed at init)
        groups = []
        for spec in specs:
            # A pool of several groups (SWAKVPool: full and swa) numbers its slots per group: every line and record
            # then says which group's slot it is (``group=swa``), or slot 3250 could be either pool's
            group_rank = {**rank, "group": spec.name} if len(specs) > 1 else rank
            manager = CanaryManager(
                config,
                num_slots=spec.num_slots,
                req_to_token=r2t,
                device=device,
                max_batch_size=max_bs,
                max_tokens_per_forward=max(spec.num_slots, max_tokens),
                real_kv_sources=spec.sources,
                swa_window_size=spec.swa_window_size,
                full_to_swa_index_mapping=spec.full_to_swa_index_mapping,
                reporter=Reporter(config.mode, config.report_path_for(report_rank), rank=group_rank,
                                  repeat_window=config.log_repeat_window),
                rank=group_rank,
                # A plain runner's decode appends ride the next check launch's mailbox (no launch of their own): every
                # forward after a batch hook runs each group's check with the manager's next step. An EAGLE pool's
                # draft steps and verify do not, so its appends are launched.
                token_mail=role is None and config.verify_tokens,
                **speculative.manager_kwargs(role),
            )
            groups.append(Group(spec, manager))
        # (an EAGLE pool's batches have modes and arrays of their own: no eager hot path, forward_modes None)
        to_views = BatchConverter(specs, max_bs, device, speculative.batch_view_for(role, v.batch_view, max_bs, device),
                                  forward_modes=v.FORWARD_MODES if role is None else None)
        inst = Installation(
            config=config,
            groups=groups,
            to_views=to_views,
            to_arrays=to_views.arrays,
            req_to_token=r2t,
            model_name=getattr(v.server_args_of(runner), "served_model_name", None),  # the metrics' model_name label
        )
        inst.defer_writes = defers_writes(v.server_args_of(runner), role)  # (from mark_init_finished on)
        post_filled = inst.expected_token_post_filled()
        fill = None if post_filled is None else decode_fill()
        state = RunnerState(inst, faults=self.fault_injection(inst, report_rank, role),
                            token_upload=inst.expected_token_upload(), token_post=inst.expected_token_post(),
                            token_post_filled=None if fill is None else post_filled, token_fill=fill)
        inst.step_hooks = state.faults  # an injection's undo actions run around the managers' step
        # set before piecewise graphs capture (they call the wrapper); each version classifies calls its own way
        inst.wrapper_call = v.wrapper_gate(inst)
        inst.wrap_model_forward(parts.model)
        keep(runner, state)
        speculative.attach(runner, inst, role, v.server_args_of(runner))
        logger.info(
            "kvcanary: installed on %s (%s, %s, report %s) with %d group(s): %s", type(pool).__name__, device,
            " ".join(f"{k}={v}" for k, v in rank.items()), groups[0].manager.reporter.report_path or "-", len(groups),
            ", ".join(f"{g.spec.name}: {g.spec.num_slots} slots, {len(g.spec.sources)} real-KV source(s)"
                      for g in groups),
        )
        return inst

    # ------------------------------------------------------------------------------------------- around the model
    # What a real forward does on the host around the model; the fault-injection layer extends each
    # (kvcanary.sglang.fault_hooks), so the serving path carries no test machinery.
    def fault_injection(self, inst: Installation, report_rank: int, role) -> SglangFaultInjection | None:
        """The fault injection of a new installation: none (the fault-injection layer gives one)."""
        del inst, report_rank, role
        return None

    def before_model(self, state: RunnerState, forward_batch) -> None:
        """Before the model runs: HiCache's records of the copies since the last forward, and its load fence."""
        if state.host_tier is not None:
            state.host_tier.before_forward()

    def after_model(self, state: RunnerState, forward_batch) -> None:
        """After the model ran: drain, health, stats, sweep (``Installation.host_after``)."""
        del forward_batch
        state.inst.host_after()

    def _facts_of(self, mode: object) -> tuple[object, bool, bool]:
        """(``mode``, whether a batch of that forward mode may give a row a new request, whether the version's mode
        table has it: a plain runner's forward in it needs no further check), remembered for an enum member."""
        name = mode_name_of(mode)
        entry = (mode, name not in _NO_NEW_REQUESTS, name in self.version.FORWARD_MODES)
        if isinstance(mode, enum.Enum):
            if len(self._mode_facts) >= 256:
                self._mode_facts.clear()
            self._mode_facts[id(mode)] = entry
        return entry

    def batch_facts(self, state: RunnerState, reqs) -> None:
        """Per batch, what else needs the batch's requests: nothing (the fault injector's request facts)."""
        del state, reqs

    # ------------------------------------------------------------------------------------------- hooks
    def after_init_memory_pool(self, result, runner, *args, **kwargs):
        self.install(runner)
        return result

    def after_initialize(self, result, runner, *args, **kwargs):
        inst = installation_of(runner)
        if inst is not None:
            self.version.check_after_initialize(runner)  # (and its fix-ups: 0.5.12 re-wraps a compiled forward)
            inst.mark_init_finished()
        return result

    def around_forward(self, original, runner, forward_batch, *args, **kwargs):
        t0 = time.perf_counter_ns()  # first: everything up to the model is the canary's host time
        # (runner_state_of and speculative.spec_of written out here and in the batch hook: each call costs ~5 µs of
        # the engine's host time from cold caches)
        state = getattr(runner, RUNNER_STATE_ATTR, None)
        if state is None:
            return original(runner, forward_batch, *args, **kwargs)
        inst = state.inst
        # (is_cuda, not a torch.device built from the tensor: that costs ~1 µs per forward)
        if inst.stopped is not None or (inst.req_to_token.is_cuda and _stream_capturing()):
            return original(runner, forward_batch, *args, **kwargs)
        spec = getattr(runner, speculative.SPEC_ATTR, None)  # (None on every runner but an EAGLE pool's)
        # A plain runner's forward in a mode its table has (seen before), no host KV tier, no layer over the model
        # hooks: nothing to check or run before the model (the general branch's checks and before_model, written out
        # as one test; a mode seen first takes the general branch, which also remembers its facts)
        plain = (spec is None and self._plain_model_hooks and state.host_tier is None
                 and (facts := self._mode_facts.get(id(mode := forward_batch.forward_mode))) is not None
                 and facts[0] is mode and facts[2])
        if not plain:
            try:
                modes = self.version.FORWARD_MODES if spec is None else speculative.forward_modes(
                    runner, self.version.FORWARD_MODES)
                name = mode_name(forward_batch)
                if name not in modes:
                    raise unsupported_mode(name, modes, self.version.SGLANG_VERSION)
                if spec is None:
                    self._facts_of(forward_batch.forward_mode)
                self.before_model(state, forward_batch)
            except Exception as exc:  # (log mode: kvcanary stops on this runner, the forward runs: Installation)
                if not inst.keeps_serving(exc, "before a forward (host half)"):
                    raise
                return original(runner, forward_batch, *args, **kwargs)
        t1 = time.perf_counter_ns()
        self.graph_input_ns = 0
        inst.serving += 1  # a piecewise replay inside is a real forward's (capture-time ones run outside)
        try:
            out = original(runner, forward_batch, *args, **kwargs)
        finally:
            inst.serving -= 1
        t2 = time.perf_counter_ns()
        try:
            if self._plain_model_hooks:
                inst.host_after()  # (after_model's body)
            else:
                self.after_model(state, forward_batch)
            if spec is not None:
                speculative.after_forward(runner, forward_batch)  # EAGLE: spec counters and their stats line
        except Exception as exc:  # (raise mode's violations and health errors raise from here: they stand)
            if not inst.keeps_serving(exc, "after a forward (drain, health, sweep)"):
                raise
            return out
        t3 = time.perf_counter_ns()
        inst.account_forward(t3 - t0, t1 - t0 + t3 - t2 + self.graph_input_ns)
        return out

    def after_populate(self, result, buffers, *args, forward_batch=None, raw_bs=None, raw_num_token=None, bs=None,
                       num_tokens_per_bs=1, **kwargs):
        """With an EAGLE pool, zero the padded rows' req_pool_indices a version leaves stale
        (:meth:`zero_stale_padding`); its host time is the forward's canary hook time (``graph_input_ns``: this runs
        inside ModelRunner.forward). Without one nothing: 0.5.12 zeroes a padded graph's whole out_cache_loc, and the
        plan treats a row whose first new token is on the padding slot as a padding row, whatever its stale
        req_pool_index and position (csrc/canary_plan.cuh)."""
        if not self.zero_graph_padding or raw_bs is None or bs is None:
            return result
        t0 = time.perf_counter_ns()
        try:
            self.zero_stale_padding(buffers, raw_bs, bs)
        except Exception as exc:
            # The buffers are a graph runner's, not one runner's: every installation in the process stops (log mode;
            # stale padded rows would reach the plan), or the error stands (raise mode: the first one says so).
            insts = [state.inst for state in runner_states()]
            if not insts or not all(inst.keeps_serving(exc, "filling a graph's input buffers (padded rows)")
                                    for inst in insts):
                raise
        self.graph_input_ns += time.perf_counter_ns() - t0
        return result

    def zero_stale_padding(self, buffers, raw_bs: int, bs: int) -> None:
        """After a fill of ``raw_bs`` rows for the graph of ``bs``: zero the padded rows' stale ``req_pool_indices``
        (row 0 is the padding row: the plan gives a row of request row 0 no entries and no write, whatever its
        position, so the rows' stale positions need no zeroing). Every replay's whole padding: with an EAGLE pool
        sglang also fills these buffers where this hook does not see it. One ``zero_`` of a view built once per
        buffers and rows (a slice is a torch call of its own: 7-11 µs of host time in sglang's scheduler on the H200
        host)."""
        if bs <= raw_bs:
            return
        view = self._padding.get(buffers, (raw_bs, bs))
        if view is None:
            view = self._padding.put(buffers, (raw_bs, bs), buffers.req_pool_indices[raw_bs:bs])
        view.zero_()

    # EAGLE (kvcanary.sglang.speculative): the draft CUDA-graph replays' host half, the verify verdicts.
    def around_draft_replay(self, original, graph_runner, forward_batch, *args, **kwargs):
        return speculative.around_draft_replay(original, graph_runner, forward_batch, *args, **kwargs)

    def around_draft_extend_replay(self, original, graph_runner, forward_batch, *args, **kwargs):
        return speculative.around_draft_extend_replay(original, graph_runner, forward_batch, *args, **kwargs)

    def after_verify_complete(self, result, worker, *args, **kwargs):
        return speculative.after_verify_complete(result, worker, *args, **kwargs)

    def after_init_cache(self, result, scheduler, *args, **kwargs):
        v = self.version
        tree, r2t = v.scheduler_cache(scheduler)
        mine = [s for s in runner_states() if r2t is None or s.inst.req_to_token is r2t]
        # HiCache: records follow backups and load-backs, or the setup is refused here, at start-up
        follower = None
        if tree is not None:
            inject = any(s.faults is not None and s.inst.stopped is None for s in mine)
            follower = hicache.follow(tree, [s.inst for s in mine], inject_faults=inject)
        for state in mine:
            inst = state.inst
            if follower is not None and any(i is inst for i in follower.installations):
                state.host_tier = follower
            source = v.sweep_source(tree, v.scheduler_stream_of(scheduler)) if tree is not None else None
            if source is not None and follower is not None:
                source = follower.fenced_sweep_source(source)  # (a node's load may still be in flight)
            if source is None:
                if inst.config.sweep_interval > 0:
                    logger.warning("kvcanary: prefix cache %s cannot be swept (supported: RadixCache, SWARadixCache "
                                   "with --page-size 1); sweep off",
                                   type(tree).__name__)
            else:
                inst.set_sweep_source(source)
                state.prefix_cache = tree
                logger.info("kvcanary: sweep source: %s", type(tree).__name__)
        return result

    # ------------------------------------------------------------------------------------------- HiCache
    def after_hicache_write(self, result, controller, device_indices=None, *args, **kwargs):
        """``HiCacheController.write`` backed ``device_indices`` up to the host slots it returns (None: no room)."""
        follower = hicache.follower_of(controller)
        if follower is not None and result is not None:
            self._in_hicache_hook(follower, "in the HiCache backup hook", follower.backup, device_indices, result)
        return result

    def after_hicache_load(self, result, controller, host_indices=None, *args, **kwargs):
        """``HiCacheController.load`` allocated the device slots it returns for ``host_indices`` (None: no room)."""
        follower = hicache.follower_of(controller)
        if follower is not None and result is not None:
            self._in_hicache_hook(follower, "in the HiCache load-back hook", follower.load, host_indices, result)
        return result

    def around_hicache_start_loading(self, original, controller, *args, **kwargs):
        """Nothing here: the fault-injection layer (:mod:`kvcanary.sglang.fault_hooks`) corrupts a load's copies
        before they are enqueued."""
        return original(controller, *args, **kwargs)

    @staticmethod
    def _in_hicache_hook(follower, where: str, action, *args) -> None:
        """Run a HiCache hook's action (its host time counted as the canary's); in log mode an error stops kvcanary
        on the follower's runners (their records no longer follow the KV, so they must stop checking it) and
        sglang's transfer goes on."""
        t0 = time.perf_counter_ns()
        try:
            action(*args)
        except Exception as exc:
            stop = [inst.keeps_serving(exc, where) for inst in follower.installations]
            if not all(stop):
                raise
        finally:
            ns = time.perf_counter_ns() - t0
            for inst in follower.installations:
                inst.account_host_tier(ns)

    def after_forward_batch_init(self, result, cls, batch, model_runner, *args, **kwargs):
        """The per-batch host work: writer attribution for new requests, :meth:`batch_facts`, token-table uploads.

        One Python frame for all of it (what a ``_batch_init`` method did is written out in the ``try``): from the
        engine's cold caches a call costs several µs, and every batch the scheduler builds pays them."""
        t0 = time.perf_counter_ns()
        state = getattr(model_runner, RUNNER_STATE_ATTR, None)  # (runner_state_of written out: see around_forward)
        if state is None:
            return result
        inst = state.inst
        if inst.stopped is not None:
            return result
        try:
            # writer attribution: a row gets a new request in a prefill (the mode's verdict remembered per ForwardMode
            # member, read here: mode_name's call would be one more frame per batch)
            mode = batch.forward_mode
            facts = self._mode_facts.get(id(mode))
            if facts is None or facts[0] is not mode:
                facts = self._facts_of(mode)
            upload = state.token_upload  # (None without the token check)
            # (a batch nothing here reads the requests of, e.g. a decode without the token check: no call for them)
            if facts[1] or upload is not None or self._has_batch_facts:
                reqs = self.version.batch_requests(batch)
                if facts[1]:
                    rows, rids = request_rows(reqs)
                    for group in inst.groups:
                        group.manager.assign_requests(rows, rids)
                if self._has_batch_facts:  # (the fault layer's; the plain hooks make no call for it)
                    self.batch_facts(state, reqs)
                if upload is not None:
                    # A decode batch read and posted to the token mail by one C call (the host extension: no columns
                    # built in Python; a batch that can bring new requests is not offered: its new rows fail the
                    # C call's rule); anything else (a prefill, a row that is not a decode row, a refused post)
                    # takes the Python path, which applies the same rule: its columns, then a decode batch (one
                    # run, one token per update: every update has at least one) posted to the mail, and anything
                    # else, or a post refused, through the upload (which launches it)
                    post_filled = state.token_post_filled
                    if post_filled is None or facts[1] or not post_filled(len(reqs), state.token_fill, reqs,
                                                                          state.token_mirror, DECODE_NAMES):
                        rows, starts, counts, runs = expected_token_columns(state.token_mirror, reqs)
                        post = state.token_post
                        if (post is None or len(runs) != 1 or len(runs[0]) != len(rows)
                                or not post(rows, starts, runs[0])):
                            upload(rows, starts, counts, runs)
        except Exception as exc:
            if not inst.keeps_serving(exc, "in the batch hook (writer attribution, token uploads)"):
                raise
        finally:
            inst.account_batch_init(time.perf_counter_ns() - t0)  # per batch, in the scheduler: HostTime
        return result


def defers_writes(server_args, role) -> bool:
    """Whether a runner's managers may defer each forward's write into the next forward's check launch (issue 25:
    one launch per eager decode instead of two; ``Installation.defer_writes``): only when no CUDA graph
    replays the model once init is over (``--disable-cuda-graph``: every forward runs the ``model.forward`` wrapper
    eagerly; a piecewise prefill graph runs around the wrapper, whose launches stay eager), and never for an EAGLE
    target or draft pool (``role``, or any ``--speculative-algorithm``): their draft and verify graph replays run
    their captured check with no call that could launch a pending write, and a pending write would be lost or land
    after the next forward's check. Fault injection keeps it (its injections and undos launch pending writes first:
    ``FaultInjectionState.settle``)."""
    if role is not None or getattr(server_args, "speculative_algorithm", None):
        return False
    return bool(getattr(server_args, "disable_cuda_graph", False))


_ROW_OF = operator.attrgetter("req_pool_idx")
_RID_OF = operator.attrgetter("rid")


def request_rows(reqs) -> tuple[list, list]:
    """The req_to_token rows and request ids of ``reqs``, as two columns, leaving out a request without either.

    Every prefill batch runs this, once per request: ``map(attrgetter)`` reads the fields in C (sglang's requests
    have both once the batch is built); the filtering loop runs only when some request lacks one.
    """
    try:
        rows = list(map(_ROW_OF, reqs))
        rids = list(map(_RID_OF, reqs))
        if None not in rows and None not in rids:
            return rows, rids
    except AttributeError:
        pass
    pairs = [(row, rid) for r in reqs
             if (row := getattr(r, "req_pool_idx", None)) is not None and (rid := getattr(r, "rid", None)) is not None]
    return [row for row, _ in pairs], [rid for _, rid in pairs]


_HOOKS: dict[tuple[str, type], AdapterHooks] = {}


def hooks_for(version: ModuleType, kind: type[AdapterHooks] = AdapterHooks) -> AdapterHooks:
    """The one ``kind`` (AdapterHooks, or a layer over them) of ``version`` in this process."""
    key = (version.__name__, kind)
    found = _HOOKS.get(key)
    if found is None or found.version is not version:
        found = _HOOKS[key] = kind(version)  # type: ignore[arg-type]
    return found
