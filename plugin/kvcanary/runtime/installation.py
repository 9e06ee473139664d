"""One engine runner's canary installation, independent of any engine: the managers of its KV groups
(:class:`Group`, one :class:`~kvcanary.runtime.manager.CanaryManager` per :class:`GroupSpec`), the ``model.forward``
wrapper that puts plan/verify/write inside the model's forward (and so inside captured CUDA graphs), the host
half run after each real forward (drain, health, stats, sweep) and its host-time accounting.

Nothing here names an engine attribute: an engine adapter (``kvcanary.sglang``) turns engine objects into
:class:`GroupSpec`, :class:`~kvcanary.kernels.batch.BatchView` and plain callables, and calls these methods from its
hooks. Whatever else an adapter concern keeps per runner (fault injection, the token check's mirror, a host KV tier's
follower, protect mode) is that concern's own object, held by the adapter; the installation only offers the
extension points those concerns run through (``wrapper_call``, ``step_hooks``).
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvcanary.kernels.batch import BatchView
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.report.metrics import CanaryMetrics, NoMetrics, metrics_for
from kvcanary.runtime.config import Config
from kvcanary.runtime.manager import CanaryManager, SweepSource
from kvcanary.runtime.sweep import SweepTally
from kvcanary.runtime.token_table import TokenColumns, TokenMail

# (rows, starts, counts, token_runs) -> None: one batch's expected-token updates as columns, sent to every group's table
TokenColumnsUpload = Callable[[Sequence[int], Sequence[int], Sequence[int], Sequence[Sequence[int]]], None]
# (rows, starts, tokens) -> whether posted: one token per row (a decode batch) into the token mail; False (nothing
# posted): the caller sends the batch through its TokenColumnsUpload instead
TokenAppendPost = Callable[[Sequence[int], Sequence[int], Sequence[int]], bool]
# TokenMail.post_filled: (n, fill, *fill's leading arguments) -> posted
TokenFilledPost = Callable[..., bool]
# (forward_batch, positions) -> (req_pool_indices, prefix_lens, extend_lens, out_cache_loc), the check launch's arrays
# read straight from an engine's batch, or None when that batch takes the general path (a BatchView per group)
BatchArrays = Callable[[object, torch.Tensor], "tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None"]

logger = logging.getLogger(__name__)

# A forward with this much kvcanary host time or more is counted in the host-time line's slow_forwards: 1 ms is a
# sixth of an 8B model's decode step on an H200 (issue 28), enough to show in the inter-token latency's p99 if it
# stalls the loop.
SLOW_FORWARD_NS = 1_000_000


@dataclass(repr=False)
class GroupSpec:
    """One shadowed KV (sub-)pool: its slot count, real-KV sources and, for a sliding-window pool, the LUT."""

    name: str
    num_slots: int
    sources: tuple[RealKvSource, ...]
    swa_window_size: int = 0
    full_to_swa_index_mapping: torch.Tensor | None = None
    # Which slot array of a ForwardBatch this group writes: "full" (out_cache_loc) or "swa" (translated).
    loc: str = "full"


class StepHooks(Protocol):
    """What an adapter concern runs in :meth:`Installation.host_after` around the managers' step (drain, health,
    stats, sweep) of a real forward: ``before_step`` right before it, ``after_step`` right after it (also when the
    step raised)."""

    def before_step(self) -> None: ...

    def after_step(self) -> None: ...


class WrapperCall(enum.Enum):
    """What one call of the ``model.forward`` wrapper is, as the engine adapter's gate sees it."""

    EAGER = "eager"  # run the canary: an eager forward, or a decode-graph capture (the launches are captured)
    PIECEWISE = "piecewise"  # run the canary: a real forward a piecewise (prefill) graph runner serves around it
    SKIP = "skip"  # run nothing: a capture-time forward of a piecewise graph runner (dummy batch, not serving)


@dataclass
class HostTime:
    """Host time the canary adds to forwards, against the host time of the forwards themselves (ns).

    A serving engine whose scheduler loop is CPU-bound (small models, CUDA-graph decode) pays every host
    microsecond of the canary per forward; this is what ``kvcanary host time:`` lines report. Three places add
    it: the forward hook around each real forward (``hook_ns``), the ``model.forward`` wrapper's launches
    (``in_forward_ns``) and the engine's per-batch hook where the batch is built (``batch_init_ns``: writer
    attribution, token-table uploads, the fault injector's request facts; sglang's ``ForwardBatch.init_new``); and
    outside forwards, the host KV tier's hooks (``host_tier_ns``) and an incremental sweep source following the
    prefix cache's changes (the sweep tally's ``event_ns``, passed to :meth:`line`).
    """

    forwards: int = 0
    eager_forwards: int = 0  # forwards whose wrapper launched eagerly, not served by a piecewise graph runner
    forward_ns: int = 0  # around ModelRunner.forward, canary included (launch time: nothing waits for the GPU)
    # the adapter's host half around the model (fault injection; host_after: drain, health, stats, sweep), and its
    # hooks that run inside the forward (sglang 0.5.12: zeroing a decode graph's padded input rows before the replay)
    hook_ns: int = 0
    in_forward_ns: int = 0  # the wrapper's plan/verify/write launches (eager and piecewise-served forwards)
    piecewise_forwards: int = 0  # real forwards a piecewise (prefill) graph runner served, the wrapper around it
    piecewise_launch_ns: int = 0  # the wrapper's launches in those forwards (part of in_forward_ns)
    piecewise_hook_ns: int = 0  # the hooks' time in those forwards (part of hook_ns)
    batch_inits: int = 0  # calls of the adapter's batch hook (one per batch the engine builds)
    batch_init_ns: int = 0  # their host time (outside ModelRunner.forward: not in forward_ns)
    host_tier_ns: int = 0  # the host KV tier's hooks (record copies of backups and load-backs; outside forwards)
    # Tails, not means: a stall of the scheduler shows in an engine's inter-token latency p99 but hardly in a mean.
    # A forward's kvcanary host time: its hook half and launches, plus the batch hooks and host-tier hooks since the
    # previous forward (its batch's), accounted once, by account_forward.
    slow_forwards: int = 0  # forwards of at least SLOW_FORWARD_NS, since the start (cumulative, like the sums)
    max_forward_ns: int = 0  # the longest forward since the last host-time line (reset after each line)
    in_forward_seen_ns: int = 0  # in_forward_ns at the last forward's accounting (its launches = the difference)
    since_forward_ns: int = 0  # batch-hook and host-tier time since the last forward's accounting

    def line(self, step: int, sweep: SweepTally | None = None) -> str:
        """The ``kvcanary host time:`` line; ``sweep``: the prefix-cache sweeps of the same period (the sweepers
        count them): their host time is part of ``hook_ns``; their source's time following the cache's changes is
        not (it runs in the engine's cache operations) and is added to the canary's total."""
        n = max(self.forwards, 1)
        events = sweep.event_ns if sweep is not None else 0  # (spent in the engine's cache operations: added here)
        canary = (self.hook_ns + self.in_forward_ns + self.batch_init_ns + self.host_tier_ns + events) / n / 1e3
        eager_launch = self.in_forward_ns - self.piecewise_launch_ns
        pw = max(self.piecewise_forwards, 1)
        # batch_init_us, then host_tier_us (only with a host tier) and sweep_us (the sweeps' part of hooks_us, only
        # with a sweep), go last: parsers of the older line still match
        return (
            f"kvcanary host time: step={step} forwards={self.forwards} eager={self.eager_forwards} "
            f"canary_us_per_forward={canary:.1f} hooks_us={self.hook_ns / n / 1e3:.1f} "
            f"launch_us_per_eager_forward={eager_launch / max(self.eager_forwards, 1) / 1e3:.1f} "
            f"forward_us={self.forward_ns / n / 1e3:.1f} piecewise={self.piecewise_forwards} "
            f"launch_us_per_piecewise_forward={self.piecewise_launch_ns / pw / 1e3:.1f} "
            f"canary_us_per_piecewise_forward={(self.piecewise_launch_ns + self.piecewise_hook_ns) / pw / 1e3:.1f} "
            f"batch_init_us={self.batch_init_ns / n / 1e3:.1f}"
            + (f" host_tier_us={self.host_tier_ns / n / 1e3:.1f}" if self.host_tier_ns else "")
            + (f" sweep_us={sweep.host_ns / n / 1e3:.1f} sweeps={sweep.sweeps} sweep_walks={sweep.walks} "
               f"sweep_compactions={sweep.compactions} sweep_event_us={events / n / 1e3:.1f}"
               if sweep is not None and (sweep.sweeps or events) else "")
            + f" max_forward_us={self.max_forward_ns / 1e3:.1f} slow_forwards={self.slow_forwards}"
        )


@dataclass(repr=False)
class Group:
    spec: GroupSpec
    manager: CanaryManager


@dataclass(repr=False)
class Installation:
    """kvcanary on one engine runner (e.g. an sglang ModelRunner): its KV groups' managers and the per-forward glue."""

    config: Config
    groups: list[Group]
    to_views: Callable[[object, torch.Tensor, torch.Tensor], list[BatchView]]  # forward_batch, ids, pos -> per group
    req_to_token: torch.Tensor
    # The adapter's eager hot path for an installation of one group (None: every forward through to_views): the check
    # launch's arrays read straight from the engine's batch, no BatchView (see wrap_model_forward)
    to_arrays: BatchArrays | None = None
    steps: int = 0
    host_time: HostTime = field(default_factory=HostTime)
    # The adapter's gate, asked on every call of the model.forward wrapper (None: always EAGER), and how many real
    # forwards are in progress (the adapter's forward hook counts them, so the gate can tell a replay of a real
    # forward from a capture-time one).
    wrapper_call: Callable[[], WrapperCall] | None = None
    serving: int = 0
    _piecewise_now: bool = False  # this real forward was served by a piecewise graph runner (for account_forward)
    # What runs in host_after right before and right after the managers' step (None: nothing), e.g. the undo actions
    # of an injected fault (kvcanary.runtime.faults.FaultInjectionState).
    step_hooks: StepHooks | None = None
    # Prometheus counters (kvcanary.report.metrics), built when init finishes (or by the first host_after of an
    # installation that never got there); model_name is their label when known.
    metrics: CanaryMetrics | NoMetrics | None = None
    model_name: str | None = None
    # What the metrics were last fed from: that object and the sum of the managers' drain reads then (the counts
    # metrics read move only when a drain reads; an unchanged sum means nothing to add).
    _metrics_fed: tuple[object, int] | None = None
    _sweep_at_init: SweepTally = field(default_factory=SweepTally)  # the sweeps before serving (HostTime restarts)
    # Log mode: why kvcanary stopped on this runner after an error in its part of a forward (None: running). Every
    # per-forward entry point (the model.forward wrapper, the adapter's hooks) then calls straight through.
    stopped: str | None = None
    # Whether the managers defer each eager decode's write into the next forward's check launch (issue 25: one
    # launch per eager decode instead of two; CanaryManager.set_defer_writes), from mark_init_finished on
    # (warm-up and graph capture are over). The adapter sets it only where every forward runs the wrapper eagerly:
    # a CUDA-graph replay runs its captured check with no call that could launch a pending write.
    defer_writes: bool = False

    @property
    def manager(self) -> CanaryManager:
        """The manager of the full pool (the first group)."""
        return self.groups[0].manager

    def keeps_serving(self, exc: Exception, where: str) -> bool:
        """Whether the engine's forward goes on after ``exc`` was raised by kvcanary's part of it (``where``, e.g.
        "before the forward"). Log mode: yes, and kvcanary stops on this runner (``stopped``; one ERROR line with the
        traceback): nothing kvcanary does may stop serving, and a canary that failed half-way through a forward
        cannot be trusted on the next. Protect mode: the same as log mode. Raise and off modes: no, the caller
        re-raises."""
        if not self.config.mode.keeps_serving:
            return False
        if self.stopped is None:
            self.stopped = f"{where}: {type(exc).__name__}: {exc}"
            logger.error("kvcanary: stopped on this runner after an error %s (log mode: serving goes on without the "
                         "canary; its records are no longer checked here): %s: %s", where, type(exc).__name__, exc,
                         exc_info=exc)
            # The health channels say so too (a kvcanary.health/1 JSON line, the health-errors counter), so an alert
            # on canary health fires: the health check itself stops with the canary. Once, on the first group's
            # reporter (the groups share the report file).
            try:
                self.manager.reporter.health_error(f"kvcanary stopped on this runner after an error {where}: "
                                                   f"{type(exc).__name__}: {exc}", step=self.steps)
            except Exception:  # noqa: BLE001 - log mode: a failing report must not stop serving either
                logger.exception("kvcanary: could not report the stop")
            self.flush_metrics()
        return True

    # ------------------------------------------------------------------------------------------- in-graph half
    def wrap_model_forward(self, model: torch.nn.Module) -> None:
        """Replace the instance's ``model.forward`` so plan/verify/write sit inside captured decode graphs.

        A piecewise (prefill) graph runner replays only the layer stack inside this forward: there the launches
        run eagerly on the forward's stream before and after the replayed pieces. ``wrapper_call`` tells such
        a forward (counted apart) from a capture-time forward of that runner (nothing runs); while torch.compile
        traces a caller, the wrapper only calls through.

        With one group and the adapter's ``to_arrays``, a real forward (``serving``) takes the eager hot path: the
        check launch gets the batch's arrays as the engine holds them and the write its cached arguments, through the
        manager's bound calls (:meth:`~kvcanary.runtime.manager.CanaryManager.eager_launches`), with no BatchView and
        no Python frame between this wrapper and either launch (each is several µs of a CPU-bound engine's host time
        from its cold caches). Anything else takes the general path: graph capture, a batch ``to_arrays`` leaves to it
        (an idle batch, a mode seen for the first time), and a batch the check launch refuses, which the general path
        launches again through ``before_forward`` and so names the field (or converts: a strided ``out_cache_loc``).
        """
        original = model.forward
        if getattr(original, "kvcanary_wrapped", False):
            return
        forward = self._general_forward(original)
        if self.to_arrays is not None and len(self.groups) == 1:
            forward = self._eager_forward(original, forward)
        forward.kvcanary_wrapped = True  # type: ignore[attr-defined]
        model.forward = forward

    def _general_forward(self, original: Callable) -> Callable:
        """The wrapper of any forward: a BatchView per group, each group's ``before_forward`` / ``after_forward``."""
        install = self

        @functools.wraps(original)
        def forward(input_ids, positions, forward_batch, *args, **kwargs):
            # torch.compile tracing this frame (a compiled caller): trace the model only, never a kvcanary op
            # (nor a clock read: dynamo cannot trace time.perf_counter_ns).
            if torch.compiler.is_compiling():
                return original(input_ids, positions, forward_batch, *args, **kwargs)
            t0 = time.perf_counter_ns()  # before the gate: asking it is the canary's host time too
            call = install.wrapper_call() if install.wrapper_call is not None else WrapperCall.EAGER
            if call is WrapperCall.SKIP or install.stopped is not None:
                return original(input_ids, positions, forward_batch, *args, **kwargs)
            try:
                views = install.to_views(forward_batch, input_ids, positions)
                # A real forward's adapter hook asked the device already (it runs nothing while a capture is in
                # progress): no second driver query here. Outside one (a graph capture calling model.forward), ask.
                capturing = False if install.serving else None
                for group, view in zip(install.groups, views, strict=False):
                    group.manager.before_forward(view, capturing=capturing)
            except Exception as exc:  # (log mode: this forward and the rest run without the canary)
                if not install.keeps_serving(exc, "before the forward (plan/verify launch)"):
                    raise
                return original(input_ids, positions, forward_batch, *args, **kwargs)
            t1 = time.perf_counter_ns()
            out = original(input_ids, positions, forward_batch, *args, **kwargs)
            t2 = time.perf_counter_ns()
            try:
                for group, view in zip(install.groups, views, strict=False):
                    group.manager.after_forward(view)
            except Exception as exc:
                if not install.keeps_serving(exc, "after the forward (write launch)"):
                    raise
                return out
            host = install.host_time
            launch = t1 - t0 + time.perf_counter_ns() - t2
            host.in_forward_ns += launch
            if call is WrapperCall.PIECEWISE:
                host.piecewise_launch_ns += launch
                install._piecewise_now = True
            else:
                host.eager_forwards += 1  # also counted during capture; reset by mark_init_finished
            return out

        return forward

    def _eager_forward(self, original: Callable, general: Callable) -> Callable:
        """The wrapper of one group's real forwards (see :meth:`wrap_model_forward`); ``general`` takes the rest.
        What it reads every call sits in this closure's cells (one lookup each), and the bookkeeping is written out:
        the frames it saves are the point."""
        install = self
        manager = self.groups[0].manager
        launches = manager.eager_launches()
        check, write = launches.check, launches.write
        write_arguments, write_arguments_of = launches.write_arguments, launches.write_arguments_of
        pending = launches.pending  # the deferred write (set_defer_writes: on from mark_init_finished)
        to_arrays = self.to_arrays
        is_compiling = torch.compiler.is_compiling
        clock = time.perf_counter_ns
        eager, piecewise, skip = WrapperCall.EAGER, WrapperCall.PIECEWISE, WrapperCall.SKIP

        @functools.wraps(original)
        def forward(input_ids, positions, forward_batch, *args, **kwargs):
            # (serving: a real forward, whose hook asked whether a capture is in progress; anything else, and a
            # torch.compile trace, is the general path's)
            if not install.serving or is_compiling():
                return general(input_ids, positions, forward_batch, *args, **kwargs)
            t0 = clock()
            gate = install.wrapper_call
            call = eager if gate is None else gate()
            if call is skip or install.stopped is not None:
                return original(input_ids, positions, forward_batch, *args, **kwargs)
            try:
                arrays = to_arrays(forward_batch, positions)
                if arrays is not None:
                    check(arrays[0], arrays[1], arrays[2], input_ids, positions, arrays[3], 1, manager.steps + 1,
                          pending.tokens)
                    pending.tokens = -1  # (the launch ran it; a refused call enqueued nothing: it stays pending)
            except Exception:  # refused before anything was enqueued: the general path names it (or converts)
                arrays = None
            if arrays is None:  # (outside the try: what the general path raises, the model's own errors too, stands)
                return general(input_ids, positions, forward_batch, *args, **kwargs)
            t1 = clock()
            out = original(input_ids, positions, forward_batch, *args, **kwargs)
            t2 = clock()
            n = input_ids.shape[0]
            try:
                if pending.on and n <= arrays[0].shape[0]:  # a decode: the next check launch writes it (PendingWrite)
                    pending.tokens = n  # (the check above took any older one)
                else:
                    found = write_arguments.get(n)
                    write(*(found if found is not None else write_arguments_of(n)))
            except Exception:
                try:
                    manager.write_tokens(n)  # (the same launch, its error naming the argument)
                except Exception as exc:
                    if not install.keeps_serving(exc, "after the forward (write launch)"):
                        raise
                    return out
            host = install.host_time  # (as the general path counts it)
            launch = t1 - t0 + clock() - t2
            host.in_forward_ns += launch
            if call is piecewise:
                host.piecewise_launch_ns += launch
                install._piecewise_now = True
            else:
                host.eager_forwards += 1
            return out

        return forward

    # ------------------------------------------------------------------------------------------- host half
    def host_after(self) -> None:
        """Outside the graph, after a real forward: drain violations, health, stats, sweep (per group)."""
        self.steps += 1
        hooks = self.step_hooks
        try:
            if hooks is not None:
                hooks.before_step()
            for group in self.groups:
                group.manager.step(capturing=False)  # host_after runs for real forwards only, never in capture
        finally:
            if hooks is not None:
                hooks.after_step()
            metrics = self.metrics
            if metrics is None:
                metrics = self.metrics = metrics_for(self.manager.rank, self.model_name)
            # deltas of the managers' counts, fed after every drain read (a violation is counted at once, raise
            # mode included: the drain counts a read before it reports; the volume counters at most once a second,
            # see kvcanary.report.metrics); a forward without one adds an integer sum and a compare. observe never
            # raises.
            reads = 0
            for group in self.groups:
                reads += group.manager.violation_drain.reads
            fed = self._metrics_fed
            if fed is None or fed[0] is not metrics or fed[1] != reads:
                metrics.observe([g.manager for g in self.groups])
                self._metrics_fed = (metrics, reads)

    def mark_init_finished(self) -> None:
        for group in self.groups:
            group.manager.mark_init_finished()
            if self.defer_writes:
                group.manager.set_defer_writes(True)
        # The metrics now, not on the first serving forward: building them (prometheus_client's import and the
        # collectors' registration) took 11-17 ms, which the first request's forward paid and every forward's host
        # time averaged in (~1 launch unit over a 1000-forward window on the H200, 2026-12-03). Never raises.
        if self.metrics is None:
            self.metrics = metrics_for(self.manager.rank, self.model_name)
        if self.defer_writes:
            logger.info("kvcanary: eager decodes defer their record writes into the next forward's check launch")
        self.host_time = HostTime()  # warmup and graph capture are not serving
        self._sweep_at_init = self.sweep_tally()

    def flush_pending_writes(self) -> None:
        """Launch every group's deferred write now, on the current stream (the forward's, in an adapter's forward
        hooks): before an adapter concern changes K/V bytes, records or ``req_to_token`` outside the managers (fault
        injection), so the last forward's write still sees them as that forward left them."""
        for group in self.groups:
            group.manager.flush_pending_write()

    def sweep_tally(self) -> SweepTally:
        """Every group's sweeps so far (differences of two give a period's)."""
        total = SweepTally()
        for group in self.groups:
            total = total + group.manager.sweeper.tally()
        return total

    def account_forward(self, forward_ns: int, hook_ns: int) -> None:
        """One real forward's host times (called by the adapter's forward hook); logs a
        ``kvcanary host time:`` line with the stats line."""
        host = self.host_time
        host.forwards += 1
        host.forward_ns += forward_ns
        host.hook_ns += hook_ns
        canary_ns = hook_ns + host.in_forward_ns - host.in_forward_seen_ns + host.since_forward_ns
        host.in_forward_seen_ns = host.in_forward_ns
        host.since_forward_ns = 0
        if canary_ns >= SLOW_FORWARD_NS:
            host.slow_forwards += 1
        if canary_ns > host.max_forward_ns:
            host.max_forward_ns = canary_ns
        if self._piecewise_now:
            host.piecewise_forwards += 1
            host.piecewise_hook_ns += hook_ns
            self._piecewise_now = False
        every = self.config.stats_every
        if every and host.forwards % every == 0:
            logger.info("%s", host.line(self.steps, self.sweep_tally() - self._sweep_at_init))
            host.max_forward_ns = 0  # (the line's max_forward_us covers the forwards since the previous line)

    def account_host_tier(self, ns: int) -> None:
        """Host time of a host KV tier's hook (a backup's or load-back's record copies), outside any forward."""
        self.host_time.host_tier_ns += ns
        self.host_time.since_forward_ns += ns

    def account_batch_init(self, ns: int) -> None:
        """Host time of one call of the adapter's per-batch hook (where the engine builds a forward's batch)."""
        host = self.host_time
        host.batch_inits += 1
        host.batch_init_ns += ns
        host.since_forward_ns += ns

    def set_sweep_source(self, source: SweepSource | None) -> None:
        """The full pool's sweep source (:meth:`CanaryManager.set_sweep_source`, which primes it); in log mode a
        source that fails there stops kvcanary on this runner, as a failing sweep would. Before the first real forward
        the priming is start-up work: the ``kvcanary host time`` lines' sweep figures start after it."""
        try:
            self.manager.set_sweep_source(source)
        except Exception as exc:
            if not self.keeps_serving(exc, "priming the prefix-cache sweep"):
                raise
        if self.host_time.forwards == 0:
            self._sweep_at_init = self.sweep_tally()

    def update_expected_tokens(self, updates: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """The token check's uploads (see :meth:`CanaryManager.update_expected_tokens`), the same ``updates`` for
        every group's table (:class:`~kvcanary.runtime.token_table.TokenColumns` are read, never changed)."""
        for group in self.groups:
            group.manager.update_expected_tokens(updates)

    def expected_token_upload(self) -> TokenColumnsUpload | None:
        """What sends one batch's token-check updates, as columns (rows, starts, counts, token runs: see
        :meth:`~kvcanary.runtime.token_table.TokenTable.update_columns`), to every group's table: with one group the
        table's own ``update_columns`` (what :meth:`update_expected_tokens` reaches through two more Python calls, each
        several µs of a batch's host time from the engine's cold caches). None without the token check. Asked once
        (the adapter keeps it): the groups and their tables never change."""
        if not self.verify_tokens:
            return None
        tables = [group.manager.token_table for group in self.groups]
        if len(tables) == 1 and tables[0] is not None:
            return tables[0].update_columns

        def upload(rows: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                   token_runs: Sequence[Sequence[int]]) -> None:
            self.update_expected_tokens(TokenColumns(rows, starts, counts, token_runs))

        return upload

    def expected_token_post(self) -> TokenAppendPost | None:
        """What posts a batch of one token per row (a decode batch) straight to the token mail: with one group whose
        table has the mail, the mail's own ``post`` (True: posted, the next check launch applies it; False: nothing
        posted, send the batch through :meth:`expected_token_upload`, which launches it). None otherwise.

        Why beside :meth:`expected_token_upload`, whose ``update_columns`` posts such a batch itself: called
        directly it saves that call's frame and its one-token-per-row test on every decode batch (several µs of a
        batch's host time from the engine's cold caches; issue 25). Asked once, like the upload."""
        mail = self._token_mail()
        return None if mail is None else mail.post

    def expected_token_post_filled(self) -> TokenFilledPost | None:
        """Where :meth:`expected_token_post` is not None, the same mail's ``post_filled``: a batch whose records a
        fill function writes into the mail itself (the adapter's decode batch read from its requests in C, no
        columns built in Python). None otherwise. Asked once, like the upload."""
        mail = self._token_mail()
        return None if mail is None else mail.post_filled

    def _token_mail(self) -> TokenMail | None:
        """The token mail of the one group's table; None with the token check off, several groups or no mail."""
        if not self.verify_tokens or len(self.groups) != 1:
            return None
        table = self.groups[0].manager.token_table
        return None if table is None else table.mail

    @property
    def verify_tokens(self) -> bool:
        return self.config.verify_tokens

    def flush_metrics(self) -> None:
        """Add to the metrics whatever the managers counted that :meth:`host_after` left for later (the volume
        counters wait up to ``kvcanary.report.metrics.PUBLISH_INTERVAL_S``); never raises."""
        if self.metrics is not None:
            self.metrics.flush([g.manager for g in self.groups])

    def close(self) -> None:
        try:
            for group in self.groups:
                group.manager.close()
        finally:  # after the managers' final drains (raise mode: what they counted before raising)
            self.flush_metrics()
