"""The device half of one canary (SPEC §5): every buffer the kernels read and write, and every launch.

:class:`DeviceState` owns the canary buffer, the write and verify plans, one flat int64 state buffer (a header,
then the violation ring) right after the violation metadata in one allocation (so that the host drains the header,
the next ring rows and their metadata with one copy), the per-slot writer attribution, the row serials, and the
forward's snapshot of token ids, positions and slots. Every buffer keeps its address for the state's lifetime
(CUDA-graph capture). Every kernel launch of the runtime (the per-kernel wrappers in ``kvcanary.kernels``) happens here,
and only here (host → device uploads live with their owners: the token table, the sweep plan):

* ``DeviceState.check_batch``: one ``canary_check_step`` launch (plan + verify of every batch row's prefix, the
  write plan, the snapshot of token ids, positions and slots, the forward counter, the drained-ring reuse), which
  also runs the deferred write when one is pending (below);
* ``DeviceState.write_tokens(num_tokens)``: write;
* :meth:`DeviceState.sweep`: verify over a sweep plan (tag SWEEP).

Deferred writes (issue 25). Each launch costs an eager forward ~1.5 torch launches of host time in an engine's loop
(tvm-ffi's call, the driver's launch, from cold caches), and an eager forward makes two (check, write).
:meth:`DeviceState.defer_write` only records a decode's write (its token count, in :attr:`DeviceState.pending`); the
next ``check_batch`` passes it to the bound check call, whose one kernel runs that write before anything it
verifies (csrc/canary_check.cuh), so an eager decode pays one launch. The write reads what it always read (the write
plan and snapshot the previous check stored, the device forward counter still holding that forward's number), before
the launch overwrites or verifies anything. The price: it fingerprints the decode's K/V when the next forward's check
runs, not right after the decode, so a stray write into those slots in between that kvcanary does not see (another
stream's kernel) is taken into the record instead of reported (the engine's own host-tier copies go through the
manager, which flushes first). Only an eager decode defers (the adapter's choice, never with decode CUDA graphs, the
default). What else reads or writes what the write touches, or
changes what it reads, launches the pending write first (:meth:`flush_pending_write`): the sweep, the snapshot fix-up,
the forward counter's reset, a row-serial upload; the manager flushes before its other record readers and writers. A
pending write is never captured in a CUDA graph: the manager refuses a capture with one pending. Status copies may
show a deferred write's counters and rows one forward late (each row carries its own forward number).

The forward counter (kvcanary+). Forward k is the one after which the manager's ``step()`` has run k times
(``steps``). The header's forward counter holds the number of the forward whose launches run: the check launch of
every forward sets it, to ``steps + 1`` when ``check_batch`` runs eagerly (the host knows the number), or to
the counter + 1 when the launch is captured in a CUDA graph (each replay counts one forward: no host work, no
sync). Every violation row gets a metadata row beside it (``violation_meta``; the ring's 8 columns stay the
seed's) holding the counter value its launch read, the request's req_to_token row and the slot's writer
attribution. A sweep launched by ``step()`` after forward k reads k: its rows say step k too.

What keeps the counter equal to ``steps``: eager planning sets it, so a re-plan inside a forward (an adapter
rewriting records) or a warm-up run that no ``step()`` follows cannot push it ahead; :meth:`mark_init_finished`
(called once warm-up and graph capture are over) sets it to ``steps``, so the first replay after the warm-up
runs counts from there. The drain (:mod:`kvcanary.runtime.drain`) corrects any drift that nothing anchored.

Writer attribution (kvcanary+): ``slot_attribution`` (int64 ``[num_slots, 2]``) gets, from the write kernel, the
forward counter and the writer serial of every record it stores; the writer serial is ``row_serials[req_to_token
row]`` (:meth:`upload_row_serials`; serials are handed out by :mod:`kvcanary.runtime.writers`). Verify and sweep read it
for failing entries only.

The drain reads this state only through :meth:`mirrored_header`, :meth:`status_copy`, :meth:`ring_segments`,
:func:`parse_header` and :meth:`acknowledge_ring`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.call import prepare_real_kv
from kvcanary.kernels.check import CheckLaunch
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.kernels.tags import NUM_LAUNCH_TAGS, LaunchTag
from kvcanary.kernels.verify import SweepLaunch
from kvcanary.kernels.write import WriteLaunch
from kvcanary.runtime.serial_upload import RowSerialUpload
from kvcanary.runtime.token_table import TokenTable

logger = logging.getLogger(__name__)

# The flat int64 state buffer: a header (layout ``STATE_*``, the kernels' kvcanary/layout.h), then the violation
# ring. The ring's int32 write index lives in the low half of element 0.
STATE_HEADER = layout.STATE_HEADER_FIELDS
STATE_WRITE_INDEX = layout.STATE_WRITE_INDEX
STATE_KERNEL_RUNS = layout.STATE_KERNEL_RUNS
STATE_SLOT_RUNS = layout.STATE_SLOT_RUNS
STATE_RING_EPOCH = layout.STATE_RING_EPOCH
STATE_FORWARD = layout.STATE_FORWARD
STATE_DRAINED_TO = layout.STATE_DRAINED_TO
STATE_RING_LOST_AT_RESET = layout.STATE_RING_LOST_AT_RESET
STATE_RING_REUSED_AT = layout.STATE_RING_REUSED_AT
_KERNEL_RUNS = slice(STATE_KERNEL_RUNS, STATE_KERNEL_RUNS + NUM_LAUNCH_TAGS)
_SLOT_RUNS = slice(STATE_SLOT_RUNS, STATE_SLOT_RUNS + NUM_LAUNCH_TAGS)
_MAX_CACHED_SEGMENTS = 64  # status-copy source views kept (one per (first, peek_end) the drain asks for)
# Metadata elements a status copy may carry beyond the rows it peeks to be one copy instead of two (64 KiB, a few
# µs of copy-engine time per drain period at most): the default 1024-row ring's whole table (32 KiB) qualifies.
STATUS_COPY_MAX_META = 8192


class StateHeader(NamedTuple):
    """A host copy of the state header (see :func:`parse_header`)."""

    write_index: int  # the ring's int32 write index (negative: it wrapped, the ring is full)
    kernel_runs: tuple[int, ...]  # per launch tag
    slot_runs: tuple[int, ...]  # per launch tag
    ring_epoch: int  # how many times the drained ring was emptied
    forward: int  # the device forward counter
    lost_at_reset: int  # rows never stored that ring resets counted (cumulative; the host reports them lost)
    reused_at: int  # the acknowledged index the last ring reuse applied (where the emptied epoch ended)


@dataclass(frozen=True)
class EagerLaunches:
    """A forward's two launches as the bound tvm-ffi calls themselves, for an adapter's per-forward hot path (every
    Python frame between an engine's forward and the launch is host time a CPU-bound serving loop pays, several µs
    each from the engine's cold caches). Same launches as ``DeviceState.check_batch`` / ``write_tokens``:

    * ``check(req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, new_forward,
      forward_step_value, pending_write_tokens)``: ints for the last three (see ``check_batch``; the last
      ``pending.tokens``, which the caller sets to -1 once the call returned);
    * ``pending``: the deferred write (:class:`PendingWrite`): with ``pending.on``, a decode records its token count
      there instead of calling ``write`` (:meth:`PendingWrite.defers`);
    * ``write(*write_arguments[num_tokens])`` after the model ran, ``write_arguments_of(num_tokens)`` for a count
      not in ``write_arguments`` yet.

    Both validate every argument before they enqueue anything, but their errors are tvm-ffi's, unnamed: a caller that
    gets one makes the call again through the manager (``before_forward`` / ``after_forward``), whose error names the
    BatchView field or capacity."""

    check: Callable[..., None]
    write: Callable[..., None]
    write_arguments: Mapping[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    write_arguments_of: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    pending: PendingWrite


class StatusCopy(NamedTuple):
    """One status copy (:meth:`DeviceState.status_copy`): its device sources, copied back to back, and where its
    parts land in the copy (offsets in int64 elements)."""

    sources: tuple[torch.Tensor, ...]
    state_at: int  # the header, then the ring rows up to the peek's end
    meta_at: int  # the metadata of the first peeked row, then the next rows'


def parse_header(values: Sequence[int]) -> StateHeader:
    """The header at the start of a host copy of the state buffer (``values``: at least ``STATE_HEADER`` ints)."""
    index = values[STATE_WRITE_INDEX] & 0xFFFFFFFF
    index = index - (1 << 32) if index >= 1 << 31 else index  # the int32 in the low half
    # (positional: a NamedTuple built by keywords costs ~1 us more, and the drain parses one header per read)
    return StateHeader(index, tuple(values[_KERNEL_RUNS]), tuple(values[_SLOT_RUNS]), values[STATE_RING_EPOCH],
                       values[STATE_FORWARD], values[STATE_RING_LOST_AT_RESET], values[STATE_RING_REUSED_AT])


class PendingWrite:
    """The deferred write (issue 25): shared by :class:`DeviceState` and an adapter's eager hot path, which reads and
    sets it with no Python frame of its own (:class:`EagerLaunches`).

    ``tokens``: the token count of the last planned forward's write, not launched yet (-1: none); the next check
    launch runs it (pass it as the bound check's ``pending_write_tokens``, then set -1 once the call returned: a call
    that raises enqueued nothing). ``on``: whether eager decodes defer their writes (the manager's
    ``set_defer_writes``). Only a decode defers (:meth:`defers`): the check launch writes one request per thread."""

    __slots__ = ("tokens", "on")

    def __init__(self) -> None:
        self.tokens = -1
        self.on = False

    @staticmethod
    def defers(num_tokens: int, rows: int) -> bool:
        """Whether a forward of ``num_tokens`` tokens over ``rows`` batch rows may defer its write: at most one token
        a row (a decode; an extend's chain would be walked one thread per request by the check launch's opener)."""
        return num_tokens <= rows


def _staged(values: list[int], device: torch.device) -> torch.Tensor:
    """Host int64 values to copy to ``device`` without blocking (pinned on CUDA: the caching host allocator keeps
    the buffer until the copy has run)."""
    staged = torch.tensor(values, dtype=torch.int64)
    return staged.pin_memory() if device.type == "cuda" else staged


class DeviceState:
    """The buffers and launches of one KV pool's canary (arguments as in
    :class:`~kvcanary.runtime.manager.CanaryManager`, already checked by it).

    Public buffers (stable addresses): ``canary_buf``, ``write_plan``, ``state`` (the flat
    header + ring) and its views ``violation_write_index``, ``kernel_run_counters``,
    ``slot_run_counters``, ``violation_ring``, ``forward_counter``; ``violation_meta``, ``slot_attribution``,
    ``row_serials``, ``enable_chain_position_assert``, and the snapshot ``input_ids_snapshot``,
    ``positions_snapshot``, ``out_cache_loc_snapshot``. Per-forward launches: ``check_batch`` / ``write_tokens``
    (bound calls, below), or ``defer_write`` instead of ``write_tokens`` (the next ``check_batch`` launches it).
    """

    def __init__(
        self,
        *,
        num_slots: int,
        req_to_token: torch.Tensor,
        device: torch.device,
        max_batch_size: int,
        max_tokens_per_forward: int,
        ring_capacity: int,
        real_kv_sources: Sequence[RealKvSource],
        real_kv_mode: int,
        swa_window_size: int,
        kv_token_id_vs_position_offset: int,
        full_to_swa_index_mapping: torch.Tensor | None,
        token_table: TokenTable | None,
    ) -> None:
        self.device = dev = device
        self.req_to_token = req_to_token
        self.real_kv_sources = tuple(real_kv_sources)
        self.real_kv_mode = real_kv_mode
        self._real_kv_launch = prepare_real_kv(self.real_kv_sources, dev)  # once, not per launch
        self.swa_window_size = swa_window_size
        self.kv_token_id_vs_position_offset = kv_token_id_vs_position_offset
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        self.ring_capacity = ring_capacity
        i64 = {"dtype": torch.int64, "device": dev}

        self.canary_buf = torch.zeros((num_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=dev)
        self.write_plan = WritePlan.allocate(max_batch_size, dev)
        # One allocation: the violation metadata table (kvcanary+), then the state buffer. The status copy then
        # takes the metadata rows it peeks, the header and the peeked ring rows in ONE device -> host copy while
        # the metadata it carries along is small (:meth:`status_copy`): each copy start is ~10 us of host time.
        meta = layout.VIOLATION_META_FIELDS
        self._meta_numel = ring_capacity * meta
        self._status_backing = torch.empty(self._meta_numel + STATE_HEADER + ring_capacity * layout.VIOLATION_FIELDS,
                                           **i64)
        self.state = state = self._status_backing[self._meta_numel :]
        state.zero_()
        self.violation_write_index = state[STATE_WRITE_INDEX : STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
        self.kernel_run_counters = state[STATE_KERNEL_RUNS : STATE_KERNEL_RUNS + NUM_LAUNCH_TAGS]
        self.slot_run_counters = state[STATE_SLOT_RUNS : STATE_SLOT_RUNS + NUM_LAUNCH_TAGS]
        self.violation_ring = state[STATE_HEADER:].view(ring_capacity, layout.VIOLATION_FIELDS)
        self.forward_counter = state[STATE_FORWARD : STATE_FORWARD + 1]
        # kvcanary+ metadata beside the ring (row i describes ring row i) and writer attribution beside the
        # canary buffer; the ring and the 32-byte records stay the seed's.
        self.violation_meta = self._status_backing[: self._meta_numel].view(ring_capacity, meta)
        self.violation_meta.fill_(layout.META_UNKNOWN)
        self.slot_attribution = torch.full((num_slots, layout.SLOT_ATTRIBUTION_FIELDS), layout.META_UNKNOWN, **i64)
        self.row_serials = torch.full((req_to_token.shape[0],), layout.META_UNKNOWN, **i64)
        # (its stagings are allocated on the first upload: a canary that never gets a new request holds none)
        self._row_serial_upload = RowSerialUpload(self.row_serials)
        # Ring index up to which the host has read every row (<= 0: none acknowledged): the check launch of the
        # next forward empties the ring if nothing was appended since (csrc/canary_check.cuh).
        self._ring_drained_to = state[STATE_DRAINED_TO : STATE_DRAINED_TO + 1]
        self.enable_chain_position_assert = torch.zeros(1, dtype=torch.int32, device=dev)
        # The forward's own copy of the batch's token ids, positions and slots: some models change them in place
        # during the forward, and the write after it must record what the forward was given.
        self.input_ids_snapshot = torch.zeros(max_tokens_per_forward, **i64)
        self.positions_snapshot = torch.zeros(max_tokens_per_forward, **i64)
        self.out_cache_loc_snapshot = torch.zeros(max_tokens_per_forward, **i64)
        # The token check: the table and its per-row valid lengths (uploads are the TokenTable's; the check launch
        # reads each batch row's valid length itself).
        self._expected_tokens: torch.Tensor | None = None
        self._expected_valid_lens_by_row: torch.Tensor | None = None
        mail = None if token_table is None else token_table.mail  # (None unless the manager asked for the token mail)
        if token_table is not None:
            self._expected_tokens = token_table.expected_tokens
            self._expected_valid_lens_by_row = token_table.valid_lens_by_row
        self._sweep_views = self._build_counter_views(LaunchTag.SWEEP)  # (verify-tag launches: the check's state)
        self._sweep = SweepLaunch(canary_buf=self.canary_buf, kernel_kind=LaunchTag.SWEEP, **self._sweep_views,
                                  real_kv_sources=self._real_kv_launch, real_kv_hash_mode=self.real_kv_mode,
                                  check_tokens=False)
        self._status_copies: dict[tuple[int, int], StatusCopy] = {}
        # The status mirror: every check launch's last block writes the finished header here (host memory, pinned on
        # CUDA, written by the kernel in place), so the drain learns whether anything moved with no device -> host
        # copy and no event (each costs tens of µs of host time from the engine's cold caches). Read through a ctypes
        # array over the same memory: one C-level copy to a list, no torch op.
        self.status_mirror = torch.zeros(STATE_HEADER, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._mirror_values = (ctypes.c_int64 * STATE_HEADER).from_address(self.status_mirror.data_ptr())
        # The two per-forward launches, their fixed arguments bound once (a forward's host time is the product's cost).
        # The check also binds what the write takes beyond its own arguments (the chain-position flag, the row
        # serials): it runs a deferred write inside its launch.
        self._check = CheckLaunch(
            state=self.state, status_mirror=self.status_mirror, canary_buf=self.canary_buf, write_plan=self.write_plan,
            req_to_token=req_to_token,
            input_ids_out=self.input_ids_snapshot, positions_out=self.positions_snapshot,
            out_cache_loc_out=self.out_cache_loc_snapshot, violation_meta=self.violation_meta,
            slot_attribution=self.slot_attribution, swa_window_size=swa_window_size,
            full_to_swa_index_mapping=full_to_swa_index_mapping, expected_tokens=self._expected_tokens,
            expected_valid_lens_by_row=self._expected_valid_lens_by_row,
            token_mail=None if mail is None else mail.records,
            token_mail_published=None if mail is None else mail.published,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, real_kv_sources=self._real_kv_launch,
            real_kv_hash_mode=real_kv_mode, check_tokens=self._expected_tokens is not None,
            deferred_write_chain_assert=self.enable_chain_position_assert, deferred_write_row_serials=self.row_serials,
        )
        self._write = WriteLaunch(
            canary_buf=self.canary_buf, write_plan=self.write_plan, input_ids=self.input_ids_snapshot,
            positions=self.positions_snapshot, out_cache_loc=self.out_cache_loc_snapshot, kernel_kind=LaunchTag.WRITE,
            **self._build_counter_views(LaunchTag.WRITE),
            enable_chain_position_assert=self.enable_chain_position_assert, real_kv_sources=self._real_kv_launch,
            real_kv_hash_mode=real_kv_mode,
        )
        # ``check_batch(batch, count_forward, forward_step_value, pending_write_tokens=-1)``: everything that runs
        # before the model writes KV, as ONE launch (``canary_check_step``): the pending deferred write, if any (pass
        # ``pending.tokens``, then set it to -1: a call that raises enqueued nothing), then plan and verify every batch
        # row's prefix, store the write plan, snapshot the batch's token ids, positions and slots, set the forward
        # counter (``count_forward`` 1: to ``forward_step_value``, or the counter + 1 when that is -1, i.e. captured)
        # and empty a ring the host acknowledged in full. The batch was validated and fits the capacities (the manager
        # checks both when the launch refuses it); its arrays may be int32 or int64. The bound call itself (a frame
        # fewer than a method: a forward's host time is the product's cost).
        self.check_batch = self._check.of_batch
        self.pending = PendingWrite()
        # ``write_tokens(num_tokens)``: write the records of the last planned forward's ``num_tokens`` tokens from the
        # snapshot (after the model wrote KV): one launch, the bound call itself (a frame fewer than a method: a
        # forward's host time is the product's cost).
        self.write_tokens = self._write
        self.eager_launches = EagerLaunches(self._check.bound, self._write.bound, self._write.arguments,
                                            self._write.arguments_of, self.pending)

    # ------------------------------------------------------------------------------------------ launches
    def defer_write(self, num_tokens: int) -> None:
        """Record the write of the last planned forward's ``num_tokens`` tokens for the next ``check_batch`` to
        run (no device work, no C++ call now). A write already pending is launched first: it was planned by the
        same check (no check ran between), and a write is never dropped."""
        if self.pending.tokens >= 0:
            self.flush_pending_write()
        self.pending.tokens = num_tokens

    def flush_pending_write(self) -> None:
        """Launch the pending deferred write now, on its own, on the current stream (nothing when none is pending):
        for anything that must see the records, counters or attribution it writes, or changes what it reads, before
        the next check launch."""
        n = self.pending.tokens
        if n >= 0:
            self.pending.tokens = -1  # (also when the launch raises: it would fail the same way again)
            self._write(n)

    @property
    def pending_write(self) -> int:
        """The deferred write's token count not launched yet; -1 when none is pending."""
        return self.pending.tokens

    def _build_counter_views(self, tag: LaunchTag) -> dict[str, torch.Tensor]:
        """The ring, counter and metadata arguments of a ``tag`` launch (built once: slicing costs host time)."""
        views = {
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

    def sweep(self, plan: VerifyPlan, skipped: int = 0) -> None:
        """Verify ``plan``'s entries with real-KV and no token check, tag SWEEP (host-called, outside capture).

        ``skipped``: how many of the entries are tombstones (the padding slot): verify's entry counter counts every
        plan entry, so they are taken off the SWEEP count right after the launch, in stream order (a status copy
        sees both or neither). A pending deferred write goes first: the sweep verifies records it writes."""
        if self.pending.tokens >= 0:
            self.flush_pending_write()
        self._sweep(plan)
        if skipped:
            self._sweep_views["slot_run_counter"].sub_(skipped)

    # ------------------------------------------------------------------------------------------ host-called updates
    def mark_init_finished(self, steps: int) -> None:
        """Switch the write chain-position assert on and set the forward counter to ``steps`` (a pending deferred
        write first: it reads both as its forward left them)."""
        self.flush_pending_write()
        self.enable_chain_position_assert.fill_(1)
        self.forward_counter.fill_(steps)

    def set_snapshot_position(self, index: int, position: int) -> None:
        """Overwrite the snapshot position of token ``index`` of the last forward (stream-ordered; a pending deferred
        write first: it reads the snapshot as its check stored it)."""
        self.flush_pending_write()
        self.positions_snapshot[index] = position

    def upload_row_serials(self, rows: list[int], serials: list[int]) -> None:
        """``row_serials[rows[i]] = serials[i]``: one batched, non-blocking upload (a reused staging, one launch that
        reads it in place: :class:`kvcanary.runtime.serial_upload.RowSerialUpload`). A pending deferred write goes
        first: it attributes its records through ``row_serials``, and a row's new request must not take over the
        previous forward's records (the rows change in prefill batches only: one more launch on those)."""
        if self.pending.tokens >= 0:
            self.flush_pending_write()
        self._row_serial_upload(rows, serials)

    # ------------------------------------------------------------------------------------------ what the drain reads
    def status_copy(self, first: int, peek_end: int) -> StatusCopy:
        """What a status copy copies: the state prefix up to ring row ``peek_end`` (header included) and the
        metadata of ring rows ``first..peek_end``. One source (metadata rows ``first..ring_capacity``, then the
        state prefix: they are adjacent in memory) while those metadata rows are at most ``STATUS_COPY_MAX_META``
        elements, else two (the state prefix, the metadata rows ``first..peek_end``)."""
        key = (first, peek_end)
        copy = self._status_copies.get(key)
        if copy is None:  # views built once per range (a clean run uses one): slicing costs host time per drain
            if len(self._status_copies) >= _MAX_CACHED_SEGMENTS:
                self._status_copies.clear()
            copy = self._status_copies[key] = self._build_status_copy(first, peek_end)
        return copy

    def _build_status_copy(self, first: int, peek_end: int) -> StatusCopy:
        numel = STATE_HEADER + peek_end * layout.VIOLATION_FIELDS
        meta_after = (self.ring_capacity - first) * layout.VIOLATION_META_FIELDS  # metadata rows first.. to the end
        if meta_after <= STATUS_COPY_MAX_META:
            start = self._meta_numel - meta_after
            return StatusCopy((self._status_backing[start : self._meta_numel + numel],), state_at=meta_after,
                              meta_at=0)
        return StatusCopy((self.state[:numel], self.violation_meta[first:peek_end].view(-1)), state_at=0,
                          meta_at=numel)

    @property
    def mirrored_values(self) -> Sequence[int]:
        """The status mirror itself, as int64 values read in place (no copy; as torn as :meth:`mirrored_header`
        says): for a reader of one field per forward (the token mail's read cursor)."""
        return self._mirror_values

    def mirrored_header(self) -> list[int]:
        """The status mirror's values (the header as the last finished check launch left it; ``parse_header`` reads
        them). No device call and no sync: on CUDA the launch may still be writing it, so a read can be torn between
        two launches' headers, each field holding one of the two values; every field only moves forward within a
        ring epoch, so a torn read is an older view that the next read corrects. Records of a later launch (a write,
        a sweep) show from the next check launch on."""
        return self._mirror_values[:]

    def ring_segments(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring rows ``first..end`` and their metadata rows, both flat."""
        return self.violation_ring[first:end].view(-1), self.violation_meta[first:end].view(-1)

    def acknowledge_ring(self, index: int, epoch: int) -> None:
        """Tell the device the host read every ring row below write index ``index`` (> 0) in ring epoch ``epoch``:
        the next forward's check launch may then empty the ring, keeping the rows appended since (an
        acknowledgement of an epoch the device already emptied is ignored; csrc/canary_check.cuh). A non-blocking
        copy, stream-ordered before the next forward."""
        value = (epoch << layout.DRAINED_TO_EPOCH_SHIFT) | index
        self._ring_drained_to.copy_(_staged([value], self.device), non_blocking=True)

    def synchronize(self) -> None:
        """Wait for all device work (shutdown and tests only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
