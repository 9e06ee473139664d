"""CanaryManager: the engine-agnostic runtime an adapter drives once per forward (SPEC §5).

Per forward: ``before_forward(batch)`` (one launch: plan and verify every running request's prefix, snapshot the
batch's token, position and slot arrays because some models mutate them) runs before the model writes KV;
``after_forward(batch)`` (one launch: write the new records with real-KV fingerprints) runs after. Both only
enqueue device work with fixed capacities and stable buffers, so they can sit inside a captured CUDA graph (two
nodes per forward), and neither ever synchronises with the host.

Deferred writes (issue 25, :meth:`CanaryManager.set_defer_writes`, off by default). Each launch costs an eager
forward ~1.5 torch launches of host time in an engine's loop. With deferral on, ``after_forward`` of an eager decode
(at most one token a row) only records the write's token count, and the next ``before_forward``'s launch runs that
write inside its own kernel before it verifies anything: one launch per eager decode instead of two (an extend's
write is launched at once). Only for an engine whose every forward calls ``before_forward``
eagerly: a CUDA-graph replay runs its captured check node with no Python call in which to launch a pending write, so
an adapter turns deferral on only when no graph will replay the model, after ``mark_init_finished``. Everything that
reads or writes records, attribution or the write's inputs outside the check launches the pending write first
(``flush_pending_write``): sweeps, host-tier copies, ``rewrite_last_forward``, ``poll``, ``flush``, ``close``,
``mark_init_finished``, a writer-serial upload, and a ``before_forward`` that does not start a new forward; a capture
that begins with a write pending is refused (an adapter bug). The drain may see a deferred write's rows and counters
one forward later (each row carries its forward number).

``step()`` is the host half, called after each forward outside any graph capture: it sweeps the prefix cache every
``sweep_interval`` forwards, drains violations and counters on the ``drain_every`` cadence and reports them (log
lines, JSONL, or an exception in raise mode), runs the health check on every drained snapshot, and logs the stats
line every ``stats_every`` forwards.

The manager composes one part per job, each with a small public API:

* :class:`~kvcanary.runtime.device_state.DeviceState` (``device_state``): every device buffer and every kernel launch
  (the forward counter and writer attribution are described there);
* :class:`~kvcanary.runtime.drain.ViolationDrain` (``violation_drain``): the copies to the host, ring epochs and
  acknowledgements, step labelling, reports;
* :class:`~kvcanary.runtime.token_table.TokenTable` (``token_table``, with ``verify_tokens``): the expected tokens;
* :class:`~kvcanary.runtime.writers.WriterTable` (``writers``): writer serials and request ids;
* :class:`~kvcanary.runtime.sweep.Sweeper` (``sweeper``): the sweep's source, plan and cadence.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report.record import Violation
from kvcanary.report.reporter import Reporter
from kvcanary.runtime.config import Config
from kvcanary.runtime.device_state import DeviceState, EagerLaunches, PendingWrite
from kvcanary.runtime.drain import CanaryStats, ViolationDrain
from kvcanary.runtime.health import HealthMonitor, StatsLogger, expected_launch_tags
from kvcanary.runtime.host_tier import HostTierRecords
from kvcanary.runtime.sweep import Sweeper, SweepSource
from kvcanary.runtime.token_table import TokenTable
from kvcanary.runtime.writers import WriterTable
from kvcanary.settings import Mode

__all__ = ["CanaryManager", "CanaryStats", "STATS_LINE_LABELS", "SweepSource"]

# Rank keys the stats line ends with when the manager's rank has them: which of a process's canaries printed it.
STATS_LINE_LABELS = ("pool", "group")

logger = logging.getLogger(__name__)



def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class CanaryManager:
    """The canary of one KV pool: composes its device state, drain, token table, writer table and sweep.

    Args:
        config: runtime settings (mode must not be off).
        num_slots: KV slots of the pool (rows of the canary buffer; slot 0 is the padding slot).
        req_to_token: the engine's live int32 [rows, max_context_len] request → slot table.
        device: where the canary lives (the pool's device).
        max_batch_size: most batch rows in one forward (CUDA-graph padding included).
        max_tokens_per_forward: most tokens in one forward.
        real_kv_sources: real KV bytes to fingerprint (at most 4).
        swa_window_size / full_to_swa_index_mapping: sliding-window pool (verify only the window).
        kv_token_id_vs_position_offset: the token check expects token ``p + offset`` of the request at position
            ``p`` (SPEC §4.3; 1 for an EAGLE draft pool, whose slot at p holds the KV of token p + 1).
        reporter: where violations go (default: one built from ``config``).
        rank: e.g. ``{"tp_rank": 1}``, attached to every violation.
        token_mail: with the token check, a decode batch's appends ride the next check launch's mailbox instead of a
            launch of their own (:class:`~kvcanary.runtime.token_table.TokenMail`). Only where every forward after a
            batch's uploads runs this manager's check with the step ``steps + 1`` (an adapter's plain runner).
    """

    def __init__(
        self,
        config: Config,
        *,
        num_slots: int,
        req_to_token: torch.Tensor,
        device: torch.device | str,
        max_batch_size: int,
        max_tokens_per_forward: int,
        real_kv_sources: Sequence[RealKvSource] = (),
        swa_window_size: int = 0,
        kv_token_id_vs_position_offset: int = 0,
        full_to_swa_index_mapping: torch.Tensor | None = None,
        reporter: Reporter | None = None,
        rank: dict[str, int] | None = None,
        token_mail: bool = False,
    ) -> None:
        if not config.enabled:
            raise ValueError("CanaryManager: config: mode is off; do not build a manager")
        if token_mail and not config.verify_tokens:
            raise ValueError("CanaryManager: token_mail: needs the token check (verify_tokens)")
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        for name, value in (("num_slots", num_slots), ("max_batch_size", max_batch_size),
                            ("max_tokens_per_forward", max_tokens_per_forward)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CanaryManager: {name}: expected an int >= 1, got {value!r}")
        if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2:
            raise ValueError(
                f"CanaryManager: req_to_token: expected int32 [rows, max_context_len], got {req_to_token.dtype} "
                f"{list(req_to_token.shape)}"
            )
        if req_to_token.device != self.device:
            raise ValueError(f"CanaryManager: req_to_token: expected device {self.device}, got {req_to_token.device}")
        for i, src in enumerate(real_kv_sources):
            what = f"CanaryManager: real_kv_sources[{i}]"
            if src.device != self.device:
                raise ValueError(f"{what}: expected device {self.device}, got {src.device}")
            if src.num_slots < num_slots:
                raise ValueError(f"{what}: covers {src.num_slots} slots, fewer than num_slots={num_slots}")
        self._cuda = self.device.type == "cuda"
        self.num_slots = num_slots
        self.max_tokens_per_forward = max_tokens_per_forward
        self._max_batch_size = max_batch_size
        self.req_to_token = req_to_token
        self.real_kv_sources = tuple(real_kv_sources)
        self.real_kv_mode = config.real_kv_mode if self.real_kv_sources else layout.REAL_KV_HASH_MODE_NONE
        self.kv_token_id_vs_position_offset = int(kv_token_id_vs_position_offset)
        self.rank = dict(rank) if rank else None
        self.reporter = reporter if reporter is not None else Reporter(
            config.mode, config.report_path_for(self.rank.get("tp_rank", 0) if self.rank else 0), rank=self.rank,
            repeat_window=config.log_repeat_window,
        )
        rows, max_ctx = req_to_token.shape

        # The parts.
        self.token_table = TokenTable(rows, max_ctx, self.device, mail=token_mail) if config.verify_tokens else None
        self.device_state = DeviceState(
            num_slots=num_slots, req_to_token=req_to_token, device=self.device, max_batch_size=max_batch_size,
            max_tokens_per_forward=max_tokens_per_forward, ring_capacity=config.ring_capacity,
            real_kv_sources=self.real_kv_sources, real_kv_mode=self.real_kv_mode,
            swa_window_size=int(swa_window_size), kv_token_id_vs_position_offset=self.kv_token_id_vs_position_offset,
            full_to_swa_index_mapping=full_to_swa_index_mapping, token_table=self.token_table,
        )
        if self.token_table is not None and self.token_table.mail is not None:
            # the device's read cursor from the status mirror; a record's forward from this manager's steps
            self.token_table.mail.open(self.device_state.mirrored_values, self, rows, max_ctx)
        self.writers = WriterTable(rows)
        self.sweeper = Sweeper(self.device_state, config.sweep_interval)
        self.stats = CanaryStats()
        self.health = HealthMonitor(config.health_window, self._expected_tags())
        # (an EAGLE pool's target and draft canaries, and an SWA pool's groups, each print a stats line: named by these)
        self.stats_logger = StatsLogger(config.stats_every, labels="".join(
            f" {key}={self.rank[key]}" for key in STATS_LINE_LABELS if self.rank and key in self.rank))
        self.violation_drain = ViolationDrain(
            self.device_state, drain_every=config.drain_every, reporter=self.reporter, rank=self.rank,
            writer_id=self.writers.writer_id, stats=self.stats, on_counters=self._observe_health,
            use_mirror=config.mode is not Mode.PROTECT,  # (protect's detection window counts on a copy per drain)
        )
        self.violations: list[Violation] = self.violation_drain.violations  # the same list, appended by the drain

        # Device tensors tests and tools read (the parts' own; stable for the manager's lifetime).
        state = self.device_state
        self.canary_buf = state.canary_buf
        self.violation_ring = state.violation_ring
        self.kernel_run_counters = state.kernel_run_counters
        self.slot_run_counters = state.slot_run_counters
        self.slot_attribution = state.slot_attribution
        self.row_serials = state.row_serials
        self.expected_tokens = self.token_table.expected_tokens if self.token_table is not None else None

        # A host KV tier's records (attach_host_tier), when the engine has one.
        self.host_tier: HostTierRecords | None = None

        # Host state. Forward steps so far (``step()`` calls outside capture): forward k is the one after which this is
        # k (read-only outside the manager; a plain attribute: an adapter's hot path reads it every forward).
        self.steps = 0
        self._validated_batch: BatchView | None = None
        self._defer_this_write = False  # the last before_forward's verdict: its after_forward may defer the write
        self._chain_position_assert_armed = False  # set by mark_init_finished (the device flag's host copy)
        logger.info(
            "kvcanary: manager on %s: %d slots, batch<=%d, tokens<=%d, %d real-KV source(s) (%s); %s",
            self.device, num_slots, max_batch_size, max_tokens_per_forward, len(self.real_kv_sources),
            layout.RealKvHashMode(self.real_kv_mode).name.lower(), config.describe(),
        )

    # ------------------------------------------------------------------------------------------ forward half
    def _validate(self, batch: BatchView) -> None:
        """Check a BatchView once per object (after_forward usually gets the one before_forward's launch accepted):
        the fast ``well_formed`` test, and ``validate`` (errors naming the field) only when it fails. before_forward
        calls it only for a batch that is not a BatchView with a ForwardKind, or one its launch refused."""
        if batch is not self._validated_batch:
            if not isinstance(batch, BatchView):
                raise TypeError(f"CanaryManager: batch: expected BatchView, got {type(batch).__name__}")
            if not batch.well_formed():
                batch.validate()
            self._validated_batch = batch

    def _check_tokens_fit(self, n: int) -> None:
        if n > self.max_tokens_per_forward:
            raise ValueError(
                f"CanaryManager: batch has {n} tokens, more than max_tokens_per_forward={self.max_tokens_per_forward}"
            )

    def before_forward(self, batch: BatchView, *, new_forward: bool = True, capturing: bool | None = None) -> None:
        """Plan and verify (before the model writes KV): one launch. Graph-capturable; never synchronises.

        ``new_forward=False``: plan and verify without touching the forward counter (its launches read the
        current value), e.g. an adapter rewriting records of a forward that ``step()`` already counted.
        ``capturing``: whether a CUDA graph capture is in progress, when the caller already knows (saves a driver
        query per forward); ``None`` asks the device.
        Raises ``TypeError`` / ``ValueError`` naming the BatchView field for a malformed batch.
        """
        # (attribute reads and compares inline, no helper calls: this runs on every forward.) The batch's tensors are
        # checked by the launch itself, before it enqueues anything: dtype int32/int64, 1-d, the token arrays of one
        # length, the row arrays of another, the device, and that they fit the snapshot buffers (max_tokens_per_forward
        # long) and the write plan (max_batch_size rows) (csrc canary_check_step). Checking them here first too cost
        # ~3 us per forward; a launch that refuses the batch is answered with the error naming the BatchView field, or
        # the capacity it exceeds.
        if self._cuda and capturing is None:
            capturing = torch.cuda.is_current_stream_capturing()
        # (on the CPU nothing is captured: ``capturing`` is only the caller's word, which the deferral guard takes)
        state = self.device_state
        pending = state.pending  # (read here, not through the pending_write property: a frame fewer per forward)
        if (capturing or not new_forward) and pending.tokens >= 0:
            self._settle_before_unusual_forward(bool(capturing))
        try:
            if batch.__class__ is not BatchView or batch.kind.__class__ is not ForwardKind:
                self._validate(batch)  # (a subclass passes; anything else raises naming what is wrong)
            # (a decode's write deferred by the last forward runs inside this launch; a refused batch keeps it pending)
            state.check_batch(batch, 1 if new_forward else 0,
                              -1 if self._cuda and capturing else self.steps + 1,  # captured: -1, each replay adds 1
                              pending.tokens)
            pending.tokens = -1
        except Exception:
            self._defer_this_write = False
            self._validate(batch)  # a malformed batch: its error names the field
            self._check_fits(batch)  # one too large for the buffers: the error names the capacity
            raise  # (else the original error stands)
        self._validated_batch = batch  # the launch accepted it: after_forward need not check it again
        # A new forward outside capture may leave its write for the next check launch to run (set_defer_writes).
        self._defer_this_write = pending.on and new_forward and not capturing

    def _settle_before_unusual_forward(self, capturing: bool) -> None:
        """A write is pending at a before_forward that does not start a new eager forward. Captured: refuse (a
        RuntimeError naming it): launching it now would capture it into the graph (every replay would write that
        forward's records again), and the captured check cannot launch it either (a replay makes no call). Not a
        new forward (an adapter re-planning a forward already counted): launch it first, on its own."""
        if capturing:
            raise RuntimeError(
                f"CanaryManager.before_forward: a deferred write of {self.device_state.pending_write} tokens is "
                "pending while a CUDA graph is being captured; an adapter must not defer writes (set_defer_writes) "
                "while graphs are captured or replayed: call flush_pending_write() or set_defer_writes(False) before "
                "a capture")
        self.device_state.flush_pending_write()

    def _check_fits(self, batch: BatchView) -> None:
        """Raise a ValueError naming the capacity a (well-formed) batch exceeds: max_tokens_per_forward, then
        max_batch_size."""
        self._check_tokens_fit(batch.input_ids.numel())
        bs = batch.req_pool_indices.numel()
        if bs > self._max_batch_size:
            raise ValueError(f"CanaryManager: batch has {bs} rows, more than max_batch_size={self._max_batch_size}")

    def after_forward(self, batch: BatchView) -> None:
        """Write the new records (after the model wrote KV). Graph-capturable; never synchronises. With deferral on
        (:meth:`set_defer_writes`) and the forward eager, only the write's token count is recorded: the next
        ``before_forward``'s launch runs the write (no call into C++ here)."""
        if batch is not self._validated_batch:
            self._validate(batch)
        n = batch.input_ids.numel()
        if n > self.max_tokens_per_forward:  # (the write takes the snapshot's first n tokens: a slice never fails)
            self._check_tokens_fit(n)
        if self._defer_this_write and PendingWrite.defers(n, batch.batch_size):
            self.device_state.defer_write(n)
        else:
            self.device_state.write_tokens(n)

    # ------------------------------------------------------------------------------------------ deferred writes
    def set_defer_writes(self, on: bool) -> None:
        """Defer each eager decode's write into the next ``before_forward``'s launch (module docstring): one launch
        per eager decode instead of two. Only for a caller that runs every forward eagerly through
        ``before_forward`` (no CUDA graph replays the model), and only once warm-up and capture are over
        (``mark_init_finished``). Turning it off launches a pending write now."""
        self.device_state.pending.on = bool(on)  # (an adapter's eager hot path reads it there)
        if not on:
            self._defer_this_write = False
            self.device_state.flush_pending_write()

    @property
    def defer_writes(self) -> bool:
        """Whether eager forwards defer their writes (:meth:`set_defer_writes`)."""
        return self.device_state.pending.on

    @property
    def pending_write(self) -> int:
        """The token count of the deferred write not launched yet (-1: none pending)."""
        return self.device_state.pending_write

    def flush_pending_write(self) -> None:
        """Launch the deferred write now, on the current stream (nothing when none is pending): before anything the
        manager does not do itself reads or changes records, attribution, or KV bytes of the last forward's slots
        (e.g. an engine adapter's fault injection). Outside graph capture."""
        self.device_state.flush_pending_write()

    def write_tokens(self, num_tokens: int) -> None:
        """:meth:`after_forward`'s write, for a forward of ``num_tokens`` tokens whose check launch ran (an adapter's
        eager hot path that holds no BatchView): raises a ValueError naming the capacity, or the launch's named
        error."""
        self._check_tokens_fit(num_tokens)
        self.device_state.write_tokens(num_tokens)

    def eager_launches(self) -> EagerLaunches:
        """The two launches of :meth:`before_forward` / :meth:`after_forward` as bound calls, for an adapter's eager
        hot path that has the batch's arrays at hand (no BatchView; see
        :class:`~kvcanary.runtime.device_state.EagerLaunches`). Its check's ``forward_step_value`` is ``steps + 1`` (the
        forward about to run; -1 while a CUDA graph is being captured); a failed call is repeated through
        :meth:`before_forward` / :meth:`after_forward` for the named error."""
        return self.device_state.eager_launches

    def mark_init_finished(self) -> None:
        """Warmup and capture are over: switch the write chain-position assert on, and set the forward counter to
        the host's step count (warm-up runs without a ``step()`` moved it; replays count from here). A pending
        deferred write is launched first (it reads both as its forward left them)."""
        self.device_state.mark_init_finished(self.steps)
        self._chain_position_assert_armed = True  # host copy, for chain_position_assert_on()
        logger.info("kvcanary: init finished; chain-position assert on")

    # ------------------------------------------------------------------------------------------ writer attribution
    def assign_requests(self, rows: Sequence[int], request_ids: Sequence[object]) -> None:
        """Row ``rows[i]`` of req_to_token now holds request ``request_ids[i]`` (writer attribution).

        A row whose request id changed gets a new writer serial on the device (one batched, non-blocking upload
        for the whole call; nothing when no row changed), and the manager remembers serial → ``str(request_id)``
        for the last ``kvcanary.runtime.writers.MAX_WRITER_IDS`` requests, so a violation names the request that last
        wrote its slot (``writer_rid``). Call outside graph capture, before the forward that writes for the new request
        (e.g. when the engine builds the batch); a row that keeps its request costs one list lookup. Raises
        ``ValueError`` for columns of different lengths or a row outside the table (nothing is assigned).
        """
        changed, serials = self.writers.assign(rows, request_ids)
        if changed:
            self.device_state.upload_row_serials(changed, serials)

    def writer_id(self, serial: int) -> str | None:
        """The request id of a writer serial (None: unknown, or older than the last MAX_WRITER_IDS requests)."""
        return self.writers.writer_id(serial)

    # ------------------------------------------------------------------------------------------ host KV tier
    def attach_host_tier(self, num_host_slots: int) -> HostTierRecords:
        """The engine keeps a host-memory KV tier of ``num_host_slots`` slots: keep records for it (once; a second
        call with the same size returns the same tier, another size is a ValueError). See
        :mod:`kvcanary.runtime.host_tier`.
        """
        tier = self.host_tier
        if tier is not None:
            if tier.num_host_slots != num_host_slots:
                raise ValueError(f"CanaryManager.attach_host_tier: a host tier of {tier.num_host_slots} slots is "
                                 f"attached already; got {num_host_slots}")
            return tier
        self.host_tier = HostTierRecords(self.canary_buf, self.slot_attribution, num_host_slots)
        logger.info("kvcanary: host KV tier of %d slots followed (%.1f MB of records on %s)", num_host_slots,
                    num_host_slots * (self.canary_buf.shape[1] + 8 * self.slot_attribution.shape[1]) / 1e6,
                    self.device)
        return self.host_tier

    def backup_to_host(self, device_slots: torch.Tensor | Sequence[int],
                       host_slots: torch.Tensor | Sequence[int]) -> None:
        """The engine is copying device slot ``device_slots[i]`` to host slot ``host_slots[i]``: their records
        follow (on the current stream, which must be ordered after the forwards that wrote those slots; never
        synchronises). Needs :meth:`attach_host_tier`. A pending deferred write goes first: it writes records
        the backup copies."""
        tier = self._host_tier()
        self.device_state.flush_pending_write()
        tier.backup(device_slots, host_slots)

    def load_from_host(self, host_slots: torch.Tensor | Sequence[int],
                       device_slots: torch.Tensor | Sequence[int]) -> None:
        """The engine is loading host slot ``host_slots[i]`` into device slot ``device_slots[i]``: their records
        follow, marked as loaded from the host tier (``via=host_tier`` on a violation). Enqueue it before the
        forward that verifies those slots, on that forward's stream; the K/V itself must have landed before that
        forward's verify reads it (the adapter waits for the engine's load). Needs :meth:`attach_host_tier`. A
        pending deferred write goes first: it may write records of slots the load then takes over (a freed slot
        reused), which must not land on top of the loaded ones."""
        tier = self._host_tier()
        self.device_state.flush_pending_write()
        tier.load(host_slots, device_slots)

    def _host_tier(self) -> HostTierRecords:
        if self.host_tier is None:
            raise RuntimeError("CanaryManager: no host KV tier attached (attach_host_tier first)")
        return self.host_tier

    # ------------------------------------------------------------------------------------------ token check
    def set_expected_tokens(self, row: int, tokens: Sequence[int]) -> None:
        """Tokens of the request in req_to_token row `row` (positions 0..len-1), for the token check.

        Host → device copy through pinned memory, non-blocking; call outside graph capture.
        """
        self.update_expected_tokens([(row, 0, tokens)])

    def update_expected_tokens(self, updates: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """For each ``(row, start, tokens)``: the row's expected tokens at positions ``start..`` become ``tokens``
        and its valid length ``start + len(tokens)`` (earlier positions keep what they hold).

        A serving loop sends each row only what it appended since its last update (one token per decode row),
        and every row of a forward in one call: one launch reading a pinned staging in place, whatever the batch size
        (:mod:`kvcanary.runtime.token_table`); a later update of a row in the same call wins. ``updates`` as
        :class:`~kvcanary.runtime.token_table.TokenColumns` (what the sglang adapter builds) are staged as they are,
        with no per-update Python; any other sequence of tuples is turned into columns first. Non-blocking; call outside
        graph capture.
        """
        table = self.token_table
        if table is None:
            raise RuntimeError("CanaryManager: update_expected_tokens needs config.verify_tokens")
        table.update(updates)

    # ------------------------------------------------------------------------------------------ sweep
    def set_sweep_source(self, source: SweepSource | None) -> None:
        """`source()` returns (slots, prevs, positions) of every slot the prefix cache holds (the very tensors of its
        previous call when the cache has not changed since: see :meth:`sweep`), or a plan it keeps up to date itself
        (:class:`kvcanary.runtime.sweep.SweepPlan`).

        With sweeps on (``sweep_interval`` > 0) the new source is primed here (:meth:`Sweeper.prime
        <kvcanary.runtime.sweep.Sweeper.prime>`: asked once, its answer dropped), so the first sweep's one-off costs
        are paid now rather than by a serving forward. Raises what the source raises."""
        self.sweeper.source = source
        self.health.set_expected(self._expected_tags())
        if self.sweeper.interval > 0:
            self.sweeper.prime()

    def _expected_tags(self) -> tuple[int, ...]:
        return expected_launch_tags(self.config.sweep_interval, self.config.health_window,
                                    self.sweeper.source is not None)

    def sweep(self, slots: Sequence[int] | torch.Tensor, prevs: Sequence[int] | torch.Tensor,
              positions: Sequence[int] | torch.Tensor) -> None:
        """Verify the given entries (slot, predecessor slot or -1, position) with real-KV, tag SWEEP.

        Each argument is an int sequence or a 1-D int64 tensor on any device (a prefix cache that keeps its slots
        on the GPU hands them over without a device -> host copy). The very tensors of the previous sweep (the same
        objects, never changed in place) are not copied again: their entries are verified from the plan that holds
        them. Host-called, outside graph capture; the copies are non-blocking. A pending deferred write is launched
        first (:meth:`DeviceState.sweep <kvcanary.runtime.device_state.DeviceState.sweep>`: the sweep verifies its
        records).
        """
        self.sweeper.run(slots, prevs, positions)
        self.stats.sweeps += 1

    # ------------------------------------------------------------------------------------------ host half
    def step(self, *, capturing: bool | None = None) -> list[Violation]:
        """Host bookkeeping after a forward (no-op during graph capture). Returns violations reported now.

        ``capturing``: whether a CUDA graph capture is in progress, when the caller already knows (saves a
        driver query per forward); ``None`` asks the device.
        Raises ``CanaryViolationError`` (raise mode) or ``CanaryHealthError`` (raise mode, stalled path).
        """
        if _is_capturing(self.device) if capturing is None else capturing:
            return []
        self.steps = steps = self.steps + 1
        # Most steps have nothing due: each part is one integer compare (or attribute read) here, no call.
        sweeper = self.sweeper
        interval = sweeper.interval  # (Sweeper.due written out: no call on the steps between two sweeps)
        if sweeper.source is not None and interval > 0 and steps % interval == 0:
            sweeper.run_source()
            self.stats.sweeps += 1
        drain = self.violation_drain
        reported = drain.on_step(steps) if steps >= drain.next_due else []
        if steps >= self.stats_logger.next_due:
            self._log_stats()
        return reported

    def _observe_health(self, steps: int, kernel_runs: tuple[int, ...]) -> None:
        """The health check, on the counters of every drained status snapshot."""
        stalled = self.health.observe(steps, kernel_runs)
        if stalled:
            self.reporter.health_error(self.health.message(stalled, steps), step=steps, tags=stalled)

    def _log_stats(self) -> None:
        """The stats line (``step()`` calls it every ``stats_every`` steps, whatever the drain cadence): the counters
        are those of the last drained snapshot (at most ``drain_every`` forwards old), so it costs no device read of
        its own."""
        slot_runs = self.stats.slot_runs
        self.stats_logger.maybe_log(
            self.steps,
            forwards=self.steps,
            tokens_written=slot_runs[LaunchTag.WRITE],
            entries_verified=slot_runs[LaunchTag.VERIFY],
            entries_swept=slot_runs[LaunchTag.SWEEP],
            violations=self.reporter.total_reported,
            lost=self.reporter.total_lost,
            host_tier=None if self.host_tier is None else (self.host_tier.slots_backed_up, self.host_tier.slots_loaded),
        )

    def poll(self) -> list[Violation]:
        """Drain whatever the device has announced, without counting a forward (a pending deferred write is
        launched first, so what it finds is announced too)."""
        if _is_capturing(self.device):
            return []
        self.device_state.flush_pending_write()
        return self.violation_drain.drain(self.steps)

    def flush(self) -> list[Violation]:
        """Launch a pending deferred write, synchronise and drain everything (shutdown / tests only: this
        blocks). Callable from any stream: a pending write is launched only once the device is idle (its forward's
        K/V, which it fingerprints, may have been written on another stream: an engine's forward stream), and the
        drain's synchronisation completes it before the next check launch can overwrite what it reads."""
        state = self.device_state
        if state.pending_write >= 0:
            state.synchronize()
            state.flush_pending_write()
        return self.violation_drain.flush(self.steps)

    def close(self) -> None:
        """Drain what is left and close the report file. Errors in raise mode still propagate."""
        try:
            if not _is_capturing(self.device):
                self.flush()
        finally:
            self.reporter.close()

    @property
    def mode(self) -> Mode:
        return self.config.mode

    # ------------------------------------------------------------------------------------------ adapter queries
    # What an engine adapter's fault injector (kvcanary.sglang.fault_injection) asks of a manager, as public API:
    # host-side answers (no device read) and one stream-ordered rewrite. Nothing here runs in a normal forward.
    def has_sweep_source(self) -> bool:
        """Whether a prefix-cache sweep source is set (``set_sweep_source``)."""
        return self.sweeper.source is not None

    def sweeps_on_next_step(self) -> bool:
        """Whether the next ``step()`` (outside capture) runs the sweep: a source is set, ``sweep_interval`` > 0
        and the step count reaches a multiple of it."""
        return self.sweeper.due(self.steps + 1)

    def chain_position_assert_on(self) -> bool:
        """Whether writes check chain positions (after ``mark_init_finished``). A host-side flag: no device read."""
        return self._chain_position_assert_armed

    def rewrite_last_forward(self, batch: BatchView, positions_fix: dict[int, int]) -> None:
        """Write the last forward's records again with corrected positions.

        Re-runs the write of the last forward (its write plan and its snapshot of tokens, positions and slots,
        taken by ``before_forward``) after setting ``positions_fix`` (token index in the forward -> position)
        in the snapshot: stream-ordered after everything already enqueued, no host sync. ``batch`` is that
        forward's batch (only its token count is read). Valid until the next ``before_forward`` replaces plan and
        snapshot; host-called, outside graph capture. Fault injection uses it to undo a position skew, so the
        successor written next is not reported too. A deferred write of that forward is launched first, with the
        snapshot as its check stored it (the forward's own write, as without deferral); the rewrite is launched at
        once, never deferred.
        """
        n = batch.num_tokens
        for index in positions_fix:
            if not 0 <= index < n:
                raise ValueError(f"CanaryManager.rewrite_last_forward: token index {index} outside [0, {n})")
        self.device_state.flush_pending_write()
        for index, position in positions_fix.items():
            self.device_state.set_snapshot_position(index, position)
        defer, self._defer_this_write = self._defer_this_write, False
        try:
            self.after_forward(batch)
        finally:
            self._defer_this_write = defer
