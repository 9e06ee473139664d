"""CanaryManager: the engine-agnostic runtime an adapter drives once per forward (SPEC §5).

Per forward: ``before_forward(batch)`` (plan, then verify every running request's prefix; snapshots the
batch's token, position and slot arrays because some models mutate them) runs before the model writes
KV; ``after_forward(batch)`` (write the new records with real-KV fingerprints) runs after. Both only
enqueue device work with fixed capacities and stable buffers, so they can sit inside a captured CUDA
graph, and neither ever synchronises with the host.

``step()`` is the host half, called after each forward outside any graph capture: it drains violations
and counters through :class:`kvcanary.pump.PinnedChannel` copies (a snapshot of the ring index, counters and the
next few ring rows taken at step T is read at step T+1 on CUDA, at once on the CPU; a burst larger than
the peek is fetched by one more copy), reports them (log lines, JSONL, or an exception in raise
mode), runs the health check and the stats line, and sweeps the prefix cache every ``sweep_interval``.

Which forward found a violation (kvcanary+). Forward k is the one after which ``step()`` has run k times
(``steps``). A device forward counter holds the number of the forward whose launches run: the plan launch of
every forward sets it, to ``steps + 1`` when ``before_forward`` runs eagerly (the host knows the number), or to
the counter + 1 when the launch is captured in a CUDA graph (each replay counts one forward: no host work, no
sync). Every violation row gets a metadata row beside it (``violation_meta``; the ring's 8 columns stay the
seed's) holding the counter value its launch read, the request's req_to_token row and the slot's writer
attribution. A sweep launched by ``step()`` after forward k reads k: its rows say step k too.

What keeps the counter equal to ``steps``: eager planning sets it, so a re-plan inside a forward (an adapter
rewriting records) or a warm-up run that no ``step()`` follows cannot push it ahead; ``mark_init_finished``
(called once warm-up and graph capture are over) sets it to ``steps``, so the first replay after the warm-up
runs counts from there. As a fallback, every drained snapshot carries the counter, and the host labels rows
with ``counter - (snapshot counter - snapshot step)``: a drift that nothing anchored (e.g. a graph captured
after ``mark_init_finished``) is corrected from the next snapshot on. ``before_forward(new_forward=False)``
leaves the counter alone (a rewrite after ``step()``).

Writer attribution (kvcanary+). A per-slot table beside the canary buffer (``slot_attribution``, int64
``[num_slots, 2]``) gets, from the write kernel, the forward counter and the writer serial of every record it
stores; the writer serial is ``row_serials[req_to_token row]``, which ``assign_requests`` sets when a row gets a
new request (the manager keeps serial → request id for the last ``MAX_WRITER_IDS`` requests). Verify and sweep
read it for failing entries only, so a violation says which forward last wrote the slot and for which request
(``written_step``, ``writer_rid``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvcanary import layout, ops
from kvcanary.batch import BatchView
from kvcanary.config import Config, Mode
from kvcanary.health import HealthMonitor, StatsLogger
from kvcanary.plan import VerifyPlan, WritePlan
from kvcanary.pump import PinnedChannel, side_stream
from kvcanary.real_kv import RealKvSource
from kvcanary.report import Reporter, Violation
from kvcanary.tags import NUM_LAUNCH_TAGS, LaunchTag

logger = logging.getLogger(__name__)

# () -> (slots, prev slots or -1, positions) of every slot the prefix cache holds: int sequences, or int64
# tensors (slots and prevs may stay on the device the cache keeps them on: no device -> host copy).
_Ints = Sequence[int] | torch.Tensor
SweepSource = Callable[[], tuple[_Ints, _Ints, _Ints]]
DEFAULT_VERIFY_CAPACITY_PER_SLOT = 3  # prefix sharing lets Σ prefix exceed the pool
ROW_PEEK = 32  # ring rows copied with every status snapshot: the usual few violations need no second copy
MAX_STATUS_ROWS = 1024  # the status copy is the state prefix up to the peeked rows; past this, no peek
MAX_WRITER_IDS = 1 << 16  # request ids kept for writer attribution (serial -> rid), oldest dropped first

# Layout of the manager's flat int64 state buffer: one header, then the violation ring, so that the
# header drains with one copy. The ring's int32 write index lives in the low half of element 0.
_STATE_WRITE_INDEX = 0
_STATE_OVERFLOWS = 1
_STATE_KERNEL_RUNS = 2
_STATE_SLOT_RUNS = _STATE_KERNEL_RUNS + NUM_LAUNCH_TAGS
_STATE_RING_EPOCH = _STATE_SLOT_RUNS + NUM_LAUNCH_TAGS  # how many times the drained ring was emptied
_STATE_FORWARD = _STATE_RING_EPOCH + 1  # the device forward counter (+1 by each forward's plan launch)
_STATE_HEADER = 16
assert _STATE_FORWARD < _STATE_HEADER
_META = layout.VIOLATION_META_FIELDS


@dataclass
class CanaryStats:
    """Host view of the device counters (as of the last drained snapshot)."""

    forwards: int = 0
    kernel_runs: tuple[int, ...] = (0,) * NUM_LAUNCH_TAGS
    slot_runs: tuple[int, ...] = (0,) * NUM_LAUNCH_TAGS
    violations_seen: int = 0  # every violation the device counted, kept or lost, over the manager's life
    verify_overflows: int = 0
    sweeps: int = 0


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Token-table updates of at most this many tokens per row go into one batched scatter; longer ones (a request's
# first upload) are copied row by row.
_SCATTER_MAX_TOKENS = 32


class CanaryManager:
    """Owns the canary buffer, plans, violation ring and counters of one KV pool.

    Args:
        config: runtime settings (mode must not be off).
        num_slots: KV slots of the pool (rows of the canary buffer; slot 0 is the padding slot).
        req_to_token: the engine's live int32 [rows, max_context_len] request → slot table.
        device: where the canary lives (the pool's device).
        max_batch_size: most batch rows in one forward (CUDA-graph padding included).
        max_tokens_per_forward: most tokens in one forward.
        real_kv_sources: real KV bytes to fingerprint (at most 4).
        verify_capacity: most prefix entries verified per forward (default 3 × num_slots).
        swa_window_size / full_to_swa_index_mapping: sliding-window pool (verify only the window).
        kv_token_id_vs_position_offset: the token check expects token ``p + offset`` of the request at position
            ``p`` (SPEC §4.3; 1 for an EAGLE draft pool, whose slot at p holds the KV of token p + 1).
        reporter: where violations go (default: one built from ``config``).
        rank: e.g. ``{"tp_rank": 1}``, attached to every violation.
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
        verify_capacity: int | None = None,
        swa_window_size: int = 0,
        kv_token_id_vs_position_offset: int = 0,
        full_to_swa_index_mapping: torch.Tensor | None = None,
        reporter: Reporter | None = None,
        rank: dict[str, int] | None = None,
    ) -> None:
        if not config.enabled:
            raise ValueError("CanaryManager: config: mode is off; do not build a manager")
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
        self.num_slots = num_slots
        self.req_to_token = req_to_token
        self.real_kv_sources = tuple(real_kv_sources)
        self.real_kv_mode = config.real_kv_mode if self.real_kv_sources else layout.REAL_KV_HASH_MODE_NONE
        self._real_kv_launch = ops.prepare_real_kv(self.real_kv_sources, self.device)  # once, not per launch
        self._counter_views_by_tag: dict[int, dict[str, torch.Tensor]] = {}
        self.swa_window_size = int(swa_window_size)
        self.kv_token_id_vs_position_offset = int(kv_token_id_vs_position_offset)
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        self.rank = dict(rank) if rank else None
        self.reporter = reporter if reporter is not None else Reporter(
            config.mode, config.report_path_for(self.rank.get("tp_rank", 0) if self.rank else 0), rank=self.rank,
            repeat_window=config.log_repeat_window,
        )
        dev = self.device
        i64 = {"dtype": torch.int64, "device": dev}

        # Device state. Every buffer keeps its address for the manager's lifetime (graph capture).
        self.canary_buf = torch.zeros((num_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=dev)
        self.write_plan = WritePlan.allocate(max_batch_size, dev)
        vcap = verify_capacity if verify_capacity is not None else DEFAULT_VERIFY_CAPACITY_PER_SLOT * num_slots
        self.verify_plan = VerifyPlan.allocate(vcap, dev)
        ring_numel = config.ring_capacity * layout.VIOLATION_FIELDS
        self._state = torch.zeros(_STATE_HEADER + ring_numel, **i64)
        self.violation_write_index = self._state[_STATE_WRITE_INDEX : _STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
        self.verify_overflow_count = self._state[_STATE_OVERFLOWS : _STATE_OVERFLOWS + 1]
        self.kernel_run_counters = self._state[_STATE_KERNEL_RUNS : _STATE_KERNEL_RUNS + NUM_LAUNCH_TAGS]
        self.slot_run_counters = self._state[_STATE_SLOT_RUNS : _STATE_SLOT_RUNS + NUM_LAUNCH_TAGS]
        self.violation_ring = self._state[_STATE_HEADER:].view(config.ring_capacity, layout.VIOLATION_FIELDS)
        self._ring_epoch = self._state[_STATE_RING_EPOCH : _STATE_RING_EPOCH + 1]
        self.forward_counter = self._state[_STATE_FORWARD : _STATE_FORWARD + 1]
        # kvcanary+ metadata beside the ring (row i describes ring row i) and writer attribution beside the
        # canary buffer; the ring and the 32-byte records stay the seed's.
        self.violation_meta = torch.full((config.ring_capacity, _META), layout.META_UNKNOWN, **i64)
        self.slot_attribution = torch.full((num_slots, layout.SLOT_ATTRIBUTION_FIELDS), layout.META_UNKNOWN, **i64)
        self.row_serials = torch.full((req_to_token.shape[0],), layout.META_UNKNOWN, **i64)
        # Ring index value up to which the host has read every row (-1: none pending). The next forward
        # empties the ring if nothing was appended since (see _reuse_drained_ring).
        self._ring_drained_to = torch.full((1,), -1, **i64)
        self.enable_chain_position_assert = torch.zeros(1, dtype=torch.int32, device=dev)
        self.max_tokens_per_forward = max_tokens_per_forward
        self._input_ids = torch.zeros(max_tokens_per_forward, **i64)
        self._positions = torch.zeros(max_tokens_per_forward, **i64)
        self._out_cache_loc = torch.zeros(max_tokens_per_forward, **i64)
        rows, max_ctx = req_to_token.shape
        self.expected_tokens: torch.Tensor | None = None
        self._expected_valid_lens_by_row: torch.Tensor | None = None
        self._expected_valid_lens = torch.zeros(max_batch_size, **i64)
        if config.verify_tokens:
            # int32 like req_to_token (and sglang's own req_to_verify_expected_tokens): half the memory of int64
            self.expected_tokens = torch.full((rows, max_ctx), layout.NO_EXPECTED_TOKEN, dtype=torch.int32, device=dev)
            self._expected_valid_lens_by_row = torch.zeros(rows, **i64)
        self._sweep_plan: VerifyPlan | None = None

        # Host state.
        stream = side_stream(dev)
        status_rows = min(config.ring_capacity, MAX_STATUS_ROWS)
        self._status_channel = PinnedChannel(_STATE_HEADER + status_rows * layout.VIOLATION_FIELDS + ROW_PEEK * _META,
                                             torch.int64, dev, stream)
        self._rows_channel = PinnedChannel(ring_numel + config.ring_capacity * _META, torch.int64, dev, stream)
        self._forwards = 0
        self._steps = 0
        self._rows_requested = 0  # ring rows already asked for (all rows below this are in flight or read)
        self._lost_reported = 0
        self._epoch = 0
        self._index_base = 0  # violations counted in ring epochs already emptied
        self._last_index = 0
        self._drained_marker_sent: int | None = None
        self._overflows_reported = 0
        # host step = device forward counter - _step_offset (as of the last drained snapshot; see the module doc)
        self._step_offset = 0
        self._validated_batch: BatchView | None = None
        # writer attribution: the request id each row holds, and serial -> request id of recent requests
        self._row_requests: dict[int, str] = {}
        self._writer_ids: OrderedDict[int, str] = OrderedDict()
        self._next_serial = 1
        self.stats = CanaryStats()
        self.violations: list[Violation] = []
        self._sweep_source: SweepSource | None = None
        self._in_forward = False
        self.health = HealthMonitor(config.health_window, self._expected_tags())
        self.stats_logger = StatsLogger(config.stats_every)
        logger.info(
            "kvcanary: manager on %s: %d slots, batch<=%d, tokens<=%d, verify<=%d entries, %d real-KV source(s) "
            "(%s); %s",
            dev, num_slots, max_batch_size, max_tokens_per_forward, vcap, len(self.real_kv_sources),
            layout.RealKvHashMode(self.real_kv_mode).name.lower(), config.describe(),
        )

    # ------------------------------------------------------------------------------------------ forward half
    def _counter_views(self, tag: LaunchTag) -> dict[str, torch.Tensor]:
        """The ring, counter and metadata arguments of a ``tag`` launch (built once: slicing costs host time)."""
        views = self._counter_views_by_tag.get(tag)
        if views is None:
            views = self._counter_views_by_tag[tag] = {
                "violation_ring": self.violation_ring,
                "violation_write_index": self.violation_write_index,
                "slot_run_counter": self.slot_run_counters[tag : tag + 1],
                "kernel_run_counter": self.kernel_run_counters[tag : tag + 1],
                "violation_meta": self.violation_meta,
                "forward_step": self.forward_counter,
                "slot_attribution": self.slot_attribution,
            }
            if tag == LaunchTag.WRITE:
                views["row_serials"] = self.row_serials
        return views

    def _reuse_drained_ring(self) -> None:
        """Empty the ring if the host has read every row and nothing was appended since.

        Device ops, stream-ordered before this forward's launches: when the write index still equals
        the value the host acknowledged, no row beyond what it read exists, so resetting loses nothing.
        The epoch counter tells the host the ring restarted. Without this a long-running engine would
        keep details of only its first ``ring_capacity`` violations.
        """
        drained = self.violation_write_index == self._ring_drained_to
        self.violation_write_index.masked_fill_(drained, 0)
        self._ring_epoch.add_(drained)
        self._ring_drained_to.masked_fill_(drained, -1)

    def _validate(self, batch: BatchView) -> None:
        """Check a BatchView once per object (after_forward usually gets the one before_forward got): the fast
        ``well_formed`` test, and ``validate`` (errors naming the field) only when it fails."""
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

    def before_forward(self, batch: BatchView, *, new_forward: bool = True) -> None:
        """Plan and verify (before the model writes KV). Graph-capturable; never synchronises.

        ``new_forward=False``: plan and verify without touching the forward counter (its launches read the
        current value), e.g. an adapter rewriting records of a forward that ``step()`` already counted.
        Raises ``TypeError`` / ``ValueError`` naming the BatchView field for a malformed batch.
        """
        self._validate(batch)
        n, bs = batch.num_tokens, batch.batch_size
        self._check_tokens_fit(n)
        if bs > self.write_plan.capacity:
            raise ValueError(f"CanaryManager: batch has {bs} rows, more than max_batch_size={self.write_plan.capacity}")
        capturing = _is_capturing(self.device)
        if self._drained_marker_sent is not None or capturing:
            self._reuse_drained_ring()  # else a no-op on the device: nothing acknowledged (graphs always carry it)
        self._input_ids[:n].copy_(batch.input_ids)
        self._positions[:n].copy_(batch.positions)
        self._out_cache_loc[:n].copy_(batch.out_cache_loc)
        expected = {}
        if self.expected_tokens is not None and self._expected_valid_lens_by_row is not None:
            rows = self._expected_valid_lens_by_row.shape[0]
            valid = self._expected_valid_lens[:bs]
            rps = batch.req_pool_indices.clamp(0, rows - 1)
            torch.index_select(self._expected_valid_lens_by_row, 0, rps, out=valid)
            expected = {"expected_tokens": self.expected_tokens, "expected_tokens_valid_lens": valid}
        ops.canary_plan_step(
            write_plan=self.write_plan,
            verify_plan=self.verify_plan,
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            req_to_token=self.req_to_token,
            swa_window_size=self.swa_window_size,
            full_to_swa_index_mapping=self.full_to_swa_index_mapping,
            kv_token_id_vs_position_offset=self.kv_token_id_vs_position_offset,
            **expected,
            forward_counter=self.forward_counter if new_forward else None,
            forward_step_value=-1 if capturing else self._steps + 1,  # captured: each replay adds 1
        )
        self.verify_overflow_count += self.verify_plan.verify_enable == 0
        ops.canary_verify_step(
            canary_buf=self.canary_buf,
            **self.verify_plan.kernel_args(),
            kernel_kind=LaunchTag.VERIFY,
            **self._counter_views(LaunchTag.VERIFY),
            real_kv_sources=self._real_kv_launch,
            real_kv_hash_mode=self.real_kv_mode,
            check_tokens=self.expected_tokens is not None,
        )
        self._in_forward = True

    def after_forward(self, batch: BatchView) -> None:
        """Write the new records (after the model wrote KV). Graph-capturable; never synchronises."""
        self._validate(batch)
        n = batch.num_tokens
        self._check_tokens_fit(n)
        ops.canary_write_step(
            canary_buf=self.canary_buf,
            **self.write_plan.kernel_args(),
            input_ids=self._input_ids[:n],
            positions=self._positions[:n],
            out_cache_loc=self._out_cache_loc[:n],
            kernel_kind=LaunchTag.WRITE,
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
            **self._counter_views(LaunchTag.WRITE),
            enable_chain_position_assert=self.enable_chain_position_assert,
            real_kv_sources=self._real_kv_launch,
            real_kv_hash_mode=self.real_kv_mode,
        )
        self._in_forward = False

    def mark_init_finished(self) -> None:
        """Warmup and capture are over: switch the write chain-position assert on, and set the forward counter to
        the host's step count (warm-up runs without a ``step()`` moved it; replays count from here)."""
        self.enable_chain_position_assert.fill_(1)
        self.forward_counter.fill_(self._steps)
        self._chain_position_assert_armed = True  # host copy, for chain_position_assert_on()
        logger.info("kvcanary: init finished; chain-position assert on")

    # ------------------------------------------------------------------------------------------ writer attribution
    def assign_requests(self, requests: Iterable[tuple[int, object]]) -> None:
        """For each ``(row, request_id)``: the req_to_token row now holds that request (writer attribution).

        A row whose request id changed gets a new writer serial on the device (one batched, non-blocking upload
        for the whole call; nothing when no row changed), and the manager remembers serial → ``str(request_id)``
        for the last ``MAX_WRITER_IDS`` requests, so a violation names the request that last wrote its slot
        (``writer_rid``). Call outside graph capture, before the forward that writes for the new request
        (e.g. when the engine builds the batch); a row that keeps its request costs one dict lookup.
        """
        rows_total = self.row_serials.shape[0]
        rows: list[int] = []
        serials: list[int] = []
        for row, request_id in requests:
            rid = str(request_id)
            if self._row_requests.get(row) == rid:
                continue
            if not 0 <= row < rows_total:
                raise ValueError(f"CanaryManager.assign_requests: row {row} outside [0, {rows_total})")
            serial = self._next_serial
            self._next_serial += 1
            self._row_requests[row] = rid
            self._writer_ids[serial] = rid
            if len(self._writer_ids) > MAX_WRITER_IDS:
                self._writer_ids.popitem(last=False)
            rows.append(row)
            serials.append(serial)
        if not rows:
            return
        staged = torch.tensor(rows + serials, dtype=torch.int64)
        if self.device.type == "cuda":
            staged = staged.pin_memory()  # the caching host allocator keeps it until the copy has run
        dev = staged.to(self.device, non_blocking=True)
        m = len(rows)
        self.row_serials.index_put_((dev[:m],), dev[m:])

    def writer_id(self, serial: int) -> str | None:
        """The request id of a writer serial (None: unknown, or older than the last MAX_WRITER_IDS requests)."""
        return self._writer_ids.get(serial) if serial > 0 else None

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
        and every row of a forward in one call: one pinned upload and two scatters, whatever the batch size.
        Non-blocking; call outside graph capture.
        """
        if self.expected_tokens is None or self._expected_valid_lens_by_row is None:
            raise RuntimeError("CanaryManager: update_expected_tokens needs config.verify_tokens")
        if not updates:
            return
        rows_total, width = self.expected_tokens.shape
        tok_rows: list[int] = []
        tok_cols: list[int] = []
        tok_vals: list[int] = []
        len_rows: list[int] = []
        len_vals: list[int] = []
        for row, start, tokens in updates:
            if not 0 <= row < rows_total:
                raise ValueError(f"CanaryManager.update_expected_tokens: row {row} outside [0, {rows_total})")
            if start < 0:
                raise ValueError(f"CanaryManager.update_expected_tokens: start {start} < 0 (row {row})")
            count = max(0, min(len(tokens), width - start))
            if count > _SCATTER_MAX_TOKENS:  # a whole request: one contiguous copy beats (row, col) index pairs
                staged_row = torch.tensor(list(tokens[:count]), dtype=torch.int64)
                if self.device.type == "cuda":
                    staged_row = staged_row.pin_memory()
                self.expected_tokens[row, start : start + count].copy_(staged_row, non_blocking=True)
            elif count:
                tok_rows += [row] * count
                tok_cols += range(start, start + count)
                tok_vals += tokens[:count]
            len_rows.append(row)
            len_vals.append(min(start + len(tokens), width))
        n, m = len(tok_vals), len(len_rows)
        staged = torch.tensor(tok_rows + tok_cols + tok_vals + len_rows + len_vals, dtype=torch.int64)
        if self.device.type == "cuda":
            staged = staged.pin_memory()  # the caching host allocator keeps it until the copy has run
        dev = staged.to(self.device, non_blocking=True)
        if n:  # the staging is int64 (one upload); the table is int32
            self.expected_tokens.index_put_((dev[:n], dev[n : 2 * n]), dev[2 * n : 3 * n].to(torch.int32))
        self._expected_valid_lens_by_row.index_put_((dev[3 * n : 3 * n + m],), dev[3 * n + m :])

    # ------------------------------------------------------------------------------------------ sweep
    def set_sweep_source(self, source: SweepSource | None) -> None:
        """`source()` returns (slots, prevs, positions) of every slot the prefix cache holds."""
        self._sweep_source = source
        self.health.set_expected(self._expected_tags())

    def _expected_tags(self) -> tuple[int, ...]:
        tags = [LaunchTag.VERIFY, LaunchTag.WRITE]
        if 0 < self.config.sweep_interval <= self.config.health_window and self._sweep_source is not None:
            tags.append(LaunchTag.SWEEP)
        return tuple(tags)

    def sweep(self, slots: Sequence[int] | torch.Tensor, prevs: Sequence[int] | torch.Tensor,
              positions: Sequence[int] | torch.Tensor) -> None:
        """Verify the given entries (slot, predecessor slot or -1, position) with real-KV, tag SWEEP.

        Each argument is an int sequence or a 1-D int64 tensor on any device (a prefix cache that keeps its slots
        on the GPU hands them over without a device -> host copy). Host-called, outside graph capture; the copies
        are non-blocking.
        """
        n = len(slots)
        if len(prevs) != n or len(positions) != n:
            raise ValueError(
                f"CanaryManager.sweep: slots/prevs/positions lengths differ: {n}/{len(prevs)}/{len(positions)}"
            )
        plan = self._sweep_plan
        if plan is None or plan.capacity < n:
            plan = self._sweep_plan = VerifyPlan.allocate(max(n, 2 * (plan.capacity if plan else 0), 1024), self.device)
        cuda = self.device.type == "cuda"
        for dst, src, name in ((plan.verify_slot_indices, slots, "slots"),
                               (plan.verify_prev_slot_indices, prevs, "prevs"),
                               (plan.verify_expected_positions, positions, "positions")):
            if isinstance(src, torch.Tensor):
                if src.dim() != 1 or src.dtype != torch.int64:
                    raise ValueError(f"CanaryManager.sweep: {name}: expected a 1-D int64 tensor, got {src.dtype} "
                                     f"{list(src.shape)}")
                if src.device.type == "cpu" and cuda:
                    src = src.pin_memory()
            else:
                src = torch.tensor(list(src), dtype=torch.int64)
                if cuda:
                    src = src.pin_memory()
            dst[:n].copy_(src, non_blocking=True)
        counts = torch.tensor([n, 1], dtype=torch.int32)
        if cuda:
            counts = counts.pin_memory()
        plan.verify_expected_tokens[:n].fill_(layout.NO_EXPECTED_TOKEN)
        plan.verify_num_valid.copy_(counts[0:1], non_blocking=True)
        plan.verify_enable.copy_(counts[1:2], non_blocking=True)
        ops.canary_verify_step(
            canary_buf=self.canary_buf,
            **plan.kernel_args(),
            kernel_kind=LaunchTag.SWEEP,
            **self._counter_views(LaunchTag.SWEEP),
            real_kv_sources=self._real_kv_launch,
            real_kv_hash_mode=self.real_kv_mode,
            check_tokens=False,
        )
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
        self._forwards += 1
        self._steps += 1
        interval = self.config.sweep_interval
        if self._sweep_source is not None and interval > 0 and self._steps % interval == 0:
            self.sweep(*self._sweep_source())
        every = self.config.drain_every
        if every > 1 and not self._rows_channel.busy:  # (a burst of rows in flight is read every step)
            phase = self._steps % every
            if phase == every - 1:  # (a stale snapshot still unread, e.g. after a flush, is read first)
                reported = self._drain(restart=True)  # starts the snapshot the next step reads
            else:
                reported = self._drain(restart=False) if phase == 0 else []
        else:
            reported = self._drain()
        self._log_stats_if_due()
        return reported

    def _log_stats_if_due(self) -> None:
        """The stats line every ``stats_every`` steps, whatever the drain cadence: the counters are those of the
        last drained snapshot (at most ``drain_every`` forwards old), so it costs no device read of its own."""
        if not self.stats_logger.due(self._steps):
            return
        slot_runs = self.stats.slot_runs
        self.stats_logger.maybe_log(
            self._steps,
            forwards=self._forwards,
            tokens_written=slot_runs[LaunchTag.WRITE],
            entries_verified=slot_runs[LaunchTag.VERIFY],
            entries_swept=slot_runs[LaunchTag.SWEEP],
            violations=self.reporter.total_reported,
            lost=self.reporter.total_lost,
        )

    def poll(self) -> list[Violation]:
        """Drain whatever the device has announced, without counting a forward."""
        if _is_capturing(self.device):
            return []
        return self._drain()

    def _start_status(self) -> None:
        """One copy of the state prefix: the header (ring index, overflows, counters, forward counter) and the
        ring up to the next ROW_PEEK unread rows, plus those rows' metadata (none once more than MAX_STATUS_ROWS
        rows were read: then rows come by the rows channel, one step later)."""
        first = self._rows_requested
        peek_end = min(first + ROW_PEEK, self.violation_ring.shape[0])
        if peek_end > MAX_STATUS_ROWS:
            peek_end = first = 0
        numel = _STATE_HEADER + peek_end * layout.VIOLATION_FIELDS
        self._status_channel.start(self._state[:numel], self.violation_meta[first:peek_end].view(-1),
                                   step=self._steps, first=first, peek_end=peek_end)

    def _drain(self, restart: bool = True) -> list[Violation]:
        """Read whatever copies are ready; ``restart``: start the next status copy at once (draining every step)."""
        reported: list[Violation] = []
        for _ in range(2):  # the second pass reads a snapshot that is ready at once (CPU, idle GPU)
            if self._rows_channel.ready():
                reported += self._read_rows()
            if self._status_channel.ready():
                reported += self._read_status()
            if restart and not self._status_channel.busy:
                self._start_status()
        return reported

    def _read_status(self) -> list[Violation]:
        channel = self._status_channel
        step, first, peek_end = channel.step, channel.meta["first"], channel.meta["peek_end"]
        flat, peek_meta = channel.take_segments()
        header = flat[:_STATE_HEADER]
        fields = layout.VIOLATION_FIELDS
        peek = flat[_STATE_HEADER + first * fields : _STATE_HEADER + peek_end * fields]
        index = header[_STATE_WRITE_INDEX] & 0xFFFFFFFF
        index = index - (1 << 32) if index >= 1 << 31 else index  # the int32 in the low half
        epoch = header[_STATE_RING_EPOCH]
        # The snapshot was taken after forward `step` (stream order), when the device counter read
        # header[_STATE_FORWARD]: forwards the host never stepped (warm-up, capture) are the difference.
        self._step_offset = header[_STATE_FORWARD] - step
        if epoch != self._epoch:  # the device emptied the ring after we acknowledged every row
            # at most one reset per acknowledgement: the emptied epoch ended at the index we acknowledged
            self._index_base += self._drained_marker_sent or 0
            self._epoch, self._rows_requested, self._lost_reported = epoch, 0, 0
            self._drained_marker_sent = None
        self._last_index = index
        overflows = header[_STATE_OVERFLOWS]
        kernel_runs = tuple(header[_STATE_KERNEL_RUNS : _STATE_KERNEL_RUNS + NUM_LAUNCH_TAGS])
        slot_runs = tuple(header[_STATE_SLOT_RUNS : _STATE_SLOT_RUNS + NUM_LAUNCH_TAGS])
        self.stats.kernel_runs, self.stats.slot_runs = kernel_runs, slot_runs
        self.stats.violations_seen = self._index_base + index
        self.stats.forwards = self._forwards
        if overflows > self._overflows_reported:
            logger.warning(
                "kvcanary: verify skipped for %d forward(s): the plan exceeded its capacity of %d entries "
                "(raise verify_capacity)", overflows - self._overflows_reported, self.verify_plan.capacity,
            )
            self._overflows_reported = overflows
            self.stats.verify_overflows = overflows
        capacity = self.violation_ring.shape[0]
        kept = min(index, capacity) if index >= 0 else capacity  # a wrapped int32 index: the ring is full
        lost_total = max(0, index - capacity) if index >= 0 else 0
        reported: list[Violation] = []
        if not self._rows_channel.busy and kept > self._rows_requested:
            have = min(kept, first + len(peek) // fields)
            peeked: list[list[int]] = []
            metas: list[list[int]] = []
            if first == self._rows_requested and have > first:
                peeked = [peek[i * fields : (i + 1) * fields] for i in range(have - first)]
                metas = [peek_meta[i * _META : (i + 1) * _META] for i in range(have - first)]
                self._rows_requested = have  # before reporting: raise mode must not see these rows again
            if kept > self._rows_requested:  # more rows than the peek carried: fetch them (read next step)
                self._rows_channel.start(
                    self.violation_ring[self._rows_requested : kept].view(-1),
                    self.violation_meta[self._rows_requested : kept].view(-1),
                    step=step, lost=lost_total, offset=self._step_offset,
                )
                self._rows_requested = kept
            if peeked:
                reported += self._report_rows(peeked, metas, step, self._step_offset, lost_total)
        elif not self._rows_channel.busy and lost_total > self._lost_reported:
            reported += self._report_rows([], [], step, self._step_offset, lost_total)
        self._acknowledge_drained_rows()
        stalled = self.health.observe(self._steps, kernel_runs)
        if stalled:
            self.reporter.health_error(self.health.message(stalled, self._steps), step=self._steps, tags=stalled)
        return reported

    def _read_rows(self) -> list[Violation]:
        channel = self._rows_channel
        step, lost_total, offset = channel.step, channel.meta["lost"], channel.meta["offset"]
        flat, flat_meta = channel.take_segments()
        fields = layout.VIOLATION_FIELDS
        rows = [flat[i : i + fields] for i in range(0, len(flat), fields)]
        metas = [flat_meta[i : i + _META] for i in range(0, len(flat_meta), _META)]
        reported = self._report_rows(rows, metas, step, offset, lost_total)
        self._acknowledge_drained_rows()
        return reported

    def _acknowledge_drained_rows(self) -> None:
        """Tell the device every row up to the last seen index was read (so the next forward may empty
        the ring). A non-blocking copy, stream-ordered before the next forward."""
        index = self._last_index
        capacity = self.violation_ring.shape[0]
        if index <= 0 or self._rows_channel.busy or index == self._drained_marker_sent:
            return
        if self._rows_requested < min(index, capacity) or self._lost_reported < max(0, index - capacity):
            return
        staged = torch.tensor([index], dtype=torch.int64)
        if self.device.type == "cuda":
            staged = staged.pin_memory()
        self._ring_drained_to.copy_(staged, non_blocking=True)
        self._drained_marker_sent = index

    def _violation(self, row: list[int], meta: list[int], snapshot_step: int, offset: int) -> Violation:
        """A ring row and its metadata row as a Violation: device forward counter values become host steps."""
        unknown = layout.META_UNKNOWN
        found = meta[layout.VIOLATION_META_COL_STEP]
        request_row = meta[layout.VIOLATION_META_COL_REQUEST_ROW]
        written = meta[layout.VIOLATION_META_COL_WRITTEN_STEP]
        written_step = written - offset if written != unknown and written - offset > 0 else None  # <= 0: warm-up
        return Violation.from_row(
            row,
            step=found - offset if found != unknown else snapshot_step,
            rank=self.rank,
            request_row=None if request_row == unknown else request_row,
            written_step=written_step,
            writer_rid=self.writer_id(meta[layout.VIOLATION_META_COL_WRITER_SERIAL]),
        )

    def _report_rows(self, rows: list[list[int]], metas: list[list[int]], step: int, offset: int,
                     lost_total: int) -> list[Violation]:
        """Record and report rows already marked as read (so a raise never repeats them)."""
        lost = max(0, lost_total - self._lost_reported)
        self._lost_reported = max(self._lost_reported, lost_total)
        violations = [self._violation(r, m, step, offset) for r, m in zip(rows, metas, strict=True)]
        self.violations.extend(violations)
        try:
            self.reporter.report(violations, lost=lost, step=step)
        finally:
            self._acknowledge_drained_rows()
        return violations

    def flush(self) -> list[Violation]:
        """Synchronise and drain everything (shutdown / tests only: this blocks)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        reported: list[Violation] = []
        for _ in range(3):
            reported += self._drain()
            if not self._rows_channel.busy and not self._status_channel.busy:
                break
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return reported

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

    @property
    def steps(self) -> int:
        """Forward steps so far (``step()`` calls outside capture): forward k is the one after which this is k."""
        return self._steps

    # ------------------------------------------------------------------------------------------ adapter queries
    # What an engine adapter's fault injector (kvcanary.sglang.fault_injection) asks of a manager, as public API:
    # host-side answers (no device read) and one stream-ordered rewrite. Nothing here runs in a normal forward.
    _chain_position_assert_armed: bool = False  # set by mark_init_finished (the device flag's host copy)

    def has_sweep_source(self) -> bool:
        """Whether a prefix-cache sweep source is set (``set_sweep_source``)."""
        return self._sweep_source is not None

    def sweeps_on_next_step(self) -> bool:
        """Whether the next ``step()`` (outside capture) runs the sweep: a source is set, ``sweep_interval`` > 0
        and the step count reaches a multiple of it."""
        interval = self.config.sweep_interval
        return self._sweep_source is not None and interval > 0 and (self._steps + 1) % interval == 0

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
        successor written next is not reported too.
        """
        n = batch.num_tokens
        for index, position in positions_fix.items():
            if not 0 <= index < n:
                raise ValueError(f"CanaryManager.rewrite_last_forward: token index {index} outside [0, {n})")
            self._positions[index] = position
        self.after_forward(batch)
