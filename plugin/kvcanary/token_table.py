"""The expected-token table of the token check (SPEC §4.3; ``KVCANARY_VERIFY_TOKENS``) and its uploads.

One row per ``req_to_token`` row: the token the request holds at each position (int32, like req_to_token and
sglang's own ``req_to_verify_expected_tokens``: half the memory of int64), and a valid length per row. The plan
(:meth:`kvcanary.device_state.DeviceState.before_forward`) puts the expected token into each verify entry inside
the valid length, and verify compares it with the stored token (``verify_token``).

A serving loop sends each row only what it appended since its last update (one token per decode row), and every
row of a forward in one call, best as :class:`TokenColumns` (rows, starts, counts, and every update's tokens back to
back: what :func:`kvcanary.sglang.tokens.expected_token_updates` builds). A call is one launch of
``canary_token_update`` (csrc/canary_tokens.cuh) and no device or pinned allocation: the columns are packed by one
``struct.pack_into`` into a staging buffer of int64 (the layout of :data:`~kvcanary.layout.TOKEN_UPDATE_FIELDS`),
which on CUDA is pinned host memory the kernel reads in place (no H2D copy). A launch may still be reading its
staging when the host packs the next batch, so the stagings form a ring: each is reused only once the event recorded
after its last launch has completed (the host waits on that event in the rare case the GPU is a whole ring behind).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol

import torch

from kvcanary import layout, ops
from kvcanary.jit import load_module

logger = logging.getLogger(__name__)

# Stagings in the ring on CUDA: a launch's staging is rewritten RING_SIZE batches later, by when the GPU has long run
# the (microsecond) launch unless it is that many forwards behind.
RING_SIZE = 8
# int64 values a staging holds at first (32 KiB: a decode batch of 64 rows needs 384); a batch that does not fit
# grows its staging to the next power of two.
MIN_STAGING_VALUES = 4096

_FIELDS = layout.TOKEN_UPDATE_FIELDS
_VALUE_BYTES = 8  # int64 staging values
_ERROR_PREFIX = "CanaryManager.update_expected_tokens"
_add = operator.add
_pack_into = struct.pack_into


@dataclass(eq=False, slots=True)
class TokenColumns(Sequence):
    """A batch of expected-token updates as columns: update ``i`` writes the next ``counts[i]`` values of ``tokens``
    (every update's tokens back to back, in update order) into row ``rows[i]`` from position ``starts[i]``.

    The form :meth:`TokenTable.update` stages in bulk (a few whole-column calls, no per-update Python), which a
    serving loop can build directly (:func:`kvcanary.sglang.tokens.expected_token_updates`). It is also a sequence
    of the ``(row, start, tokens)`` updates it holds, so it goes wherever a list of them does.
    """

    rows: Sequence[int]
    starts: Sequence[int]
    counts: Sequence[int]
    tokens: Sequence[int]

    @classmethod
    def of(cls, updates: Sequence[tuple[int, int, Sequence[int]]]) -> TokenColumns:
        """The columns of ``(row, start, tokens)`` updates."""
        if not updates:
            return cls((), (), (), ())
        rows, starts, per_update = zip(*updates, strict=True)
        flat: list[int] = []
        for update_tokens in per_update:  # a list extend per update: a prompt's ~1k tokens are one C copy
            flat += update_tokens
        return cls(rows, starts, tuple(map(len, per_update)), flat)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):  # an update (row, start, tokens); a slice gives a list of them
        if isinstance(index, slice):
            return list(self)[index]
        row = self.rows[index]  # IndexError (the sequence's end) before anything else
        index = operator.index(index) % len(self.rows)
        offset = sum(self.counts[:index])
        return row, self.starts[index], list(self.tokens[offset : offset + self.counts[index]])

    def __eq__(self, other: object) -> bool:  # the same updates in the same order, in whatever sequence
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # equal to mutable sequences

    def __iter__(self):
        offset = 0
        for row, start, count in zip(self.rows, self.starts, self.counts, strict=True):
            yield row, start, list(self.tokens[offset : offset + count])
            offset += count


class StagingEvent(Protocol):
    """What the ring needs of an event (:class:`CudaStagingEvent` on CUDA; tests inject their own)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaStagingEvent:
    """A ``torch.cuda.Event`` recorded on ``device``'s current stream: the stream tvm-ffi launches on for the table's
    tensors, whichever device is current (a tensor-parallel rank may call with another one current)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


@dataclass
class Staging:
    """One staging of the ring: the buffer, a writable byte view of it, and the event after its last launch."""

    buffer: torch.Tensor  # int64 [capacity]; pinned on CUDA
    view: Any  # ctypes byte array over buffer's memory (struct.pack_into writes through it; holds no reference)
    event: StagingEvent | None
    in_flight: bool = False  # event recorded after a launch that read buffer, not yet seen complete


class StagingRing:
    """Host stagings that are safe to write: each is handed out again only once the event recorded after its last
    launch has completed (queried; waited on when the device is a whole ring behind), and a staging too small for a
    batch is replaced only then, so no buffer the device may still read is ever rewritten or freed.

    ``pinned``: allocate pinned host memory (CUDA). ``event_factory``: None means no events (the launches read the
    staging before they return, as the CPU build's do).
    """

    def __init__(self, size: int, *, pinned: bool, event_factory: Callable[[], StagingEvent] | None) -> None:
        if size < 1:
            raise ValueError(f"StagingRing: size must be >= 1, got {size}")
        self._slots: list[Staging | None] = [None] * size
        self._next = 0
        self._pinned = pinned
        self._event_factory = event_factory
        self.waits = 0  # stagings still read by the device when their turn came (the host waited)
        self.grows = 0  # stagings replaced by a larger one

    @property
    def size(self) -> int:
        return len(self._slots)

    def acquire(self, values: int) -> Staging:
        """The ring's next staging, no longer read by the device, holding at least ``values`` int64."""
        index = self._next
        self._next = index + 1 if index + 1 < len(self._slots) else 0
        staging = self._slots[index]
        if staging is not None and staging.in_flight:
            event = staging.event
            assert event is not None  # in_flight is only set after recording it
            if not event.query():  # the device is a whole ring of batches behind: wait, never overwrite its input
                self.waits += 1
                event.synchronize()
            staging.in_flight = False
        if staging is None or staging.buffer.numel() < values:
            # the old buffer (if any) is dropped only now: its last launch completed above, or it never had one
            if staging is not None:
                self.grows += 1
            staging = self._slots[index] = self._new(values, staging.event if staging is not None else None)
        return staging

    def launched(self, staging: Staging) -> None:
        """Record ``staging``'s event after the launch that reads it (on the launch's stream: the current one)."""
        if staging.event is not None:
            staging.event.record()
            staging.in_flight = True

    def _new(self, values: int, event: StagingEvent | None) -> Staging:
        capacity = max(MIN_STAGING_VALUES, 1 << (values - 1).bit_length())
        buffer = torch.empty(capacity, dtype=torch.int64, pin_memory=self._pinned)
        view = (ctypes.c_char * (capacity * buffer.element_size())).from_address(buffer.data_ptr())
        if event is None and self._event_factory is not None:
            event = self._event_factory()
        logger.debug("token table: staging of %d values (%s)", capacity, "pinned" if self._pinned else "cpu")
        return Staging(buffer, view, event)


class TokenTable:
    """``expected_tokens`` (int32 ``[rows, width]``, :data:`~kvcanary.layout.NO_EXPECTED_TOKEN` where unknown) and
    ``valid_lens_by_row`` (int64 ``[rows]``) on ``device``; both keep their addresses (graph capture).

    ``staging`` is the :class:`StagingRing` of the uploads. ``event_factory`` makes its events (default:
    :class:`CudaStagingEvent` on CUDA; on the CPU the kernel has run when the call returns, so there are no events and
    one staging, unless a factory is given: tests drive the ring with simulated events). ``ring_size`` defaults to
    :data:`RING_SIZE` with events, 1 without.
    """

    def __init__(self, rows: int, width: int, device: torch.device, *,
                 event_factory: Callable[[], StagingEvent] | None = None, ring_size: int | None = None) -> None:
        self.device = device
        self.expected_tokens = torch.full((rows, width), layout.NO_EXPECTED_TOKEN, dtype=torch.int32, device=device)
        self.valid_lens_by_row = torch.zeros(rows, dtype=torch.int64, device=device)
        self._rows, self._width = rows, width
        if event_factory is None and device.type == "cuda":
            event_factory = functools.partial(CudaStagingEvent, device)
        size = ring_size if ring_size is not None else (RING_SIZE if event_factory is not None else 1)
        self.staging = StagingRing(size, pinned=device.type == "cuda", event_factory=event_factory)
        self._launch = load_module("cuda" if device.type == "cuda" else "cpu").canary_token_update

    def update(self, updates: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """For each ``(row, start, tokens)``: the row's expected tokens at positions ``start..`` become ``tokens``
        (clipped at the table width) and its valid length ``start + len(tokens)`` (clipped likewise; earlier
        positions keep what they hold). Updates apply in order: a row updated twice in one call ends as the later
        update leaves it. Non-blocking; call outside graph capture. Raises ``ValueError`` for a row outside the
        table or a negative start (before anything is staged).

        ``updates`` may be :class:`TokenColumns` (staged as they are: the serving loop's form) or any sequence of
        tuples (turned into columns first)."""
        columns = updates if updates.__class__ is TokenColumns else TokenColumns.of(updates)
        self.update_columns(columns.rows, columns.starts, columns.counts, columns.tokens)

    def update_columns(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                       tokens: Sequence[int]) -> None:
        """:meth:`update` of the updates in columns (see :class:`TokenColumns`): update ``i`` writes the next
        ``counts[i]`` values of ``tokens`` into row ``rows[i]`` from position ``starts[i]``. One launch; the
        staging is written by one pack of all the columns. Raises ``ValueError`` naming the column (and the update)
        for a row outside the table, a negative start or count, columns of different lengths, or ``tokens`` of
        another length than ``counts`` add up to (before anything is staged)."""
        n = len(rows)
        if len(starts) != n or len(counts) != n:
            raise ValueError(f"{_ERROR_PREFIX}: rows, starts and counts have {n}, {len(starts)} and {len(counts)} "
                             "values (one per update each)")
        if not n:
            if tokens:
                raise ValueError(f"{_ERROR_PREFIX}: tokens has {len(tokens)} values, counts add up to 0")
            return
        # Whole-column builtins, no per-update loop: a decode batch of 64 rows pays a few C loops.
        ends = list(map(_add, starts, counts))  # valid lengths
        if (min(rows) < 0 or max(rows) >= self._rows or min(starts) < 0 or min(counts) < 0
                or max(ends) > self._width):
            rows, starts, counts, ends, tokens = self._checked_and_clipped(rows, starts, counts, tokens)
        offsets = list(accumulate(counts, initial=_FIELDS * n))  # each update's first token in the staging
        staged_len = offsets.pop()
        if staged_len - _FIELDS * n != len(tokens):
            raise ValueError(f"{_ERROR_PREFIX}: tokens has {len(tokens)} values, counts add up to "
                             f"{staged_len - _FIELDS * n}")
        staging = self.staging.acquire(staged_len)
        # the field-major header (layout.TOKEN_UPDATE_FIELD_*: row, start, count, valid length, offset), then tokens
        _pack_into(f"{staged_len}q", staging.view, 0, *rows, *starts, *counts, *ends, *offsets, *tokens)
        try:
            self._launch(self.expected_tokens, self.valid_lens_by_row, staging.buffer, n, staged_len)
        except Exception:
            # Validation fails before anything is launched: the keyword wrapper names the argument (or re-raises).
            ops.canary_token_update(expected_tokens=self.expected_tokens, valid_lens_by_row=self.valid_lens_by_row,
                                    staging=staging.buffer, num_updates=n, staged_len=staged_len)
            raise
        self.staging.launched(staging)

    def _checked_and_clipped(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                             tokens: Sequence[int]) -> tuple[list[int], ...]:
        """The columns one update at a time: an error for the first bad update, each update's tokens clipped at the
        width (its valid length too); returns rows, starts, counts, valid lengths and tokens."""
        rows_total, width = self._rows, self._width
        clipped_counts, ends, kept = [], [], []
        offset = 0
        for i, (row, start, count) in enumerate(zip(rows, starts, counts, strict=True)):
            if not 0 <= row < rows_total:
                raise ValueError(f"{_ERROR_PREFIX}: row {row} outside [0, {rows_total}): rows[{i}]")
            if start < 0:
                raise ValueError(f"{_ERROR_PREFIX}: start {start} < 0 (row {row}): starts[{i}]")
            if count < 0:
                raise ValueError(f"{_ERROR_PREFIX}: count {count} < 0 (row {row}): counts[{i}]")
            fits = max(0, min(count, width - start))
            clipped_counts.append(fits)
            ends.append(min(start + count, width))
            kept += tokens[offset : offset + fits]
            offset += count
        if offset != len(tokens):
            raise ValueError(f"{_ERROR_PREFIX}: tokens has {len(tokens)} values, counts add up to {offset}")
        return list(rows), list(starts), clipped_counts, ends, kept
