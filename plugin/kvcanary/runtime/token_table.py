"""The expected-token table of the token check (SPEC §4.3; ``KVCANARY_VERIFY_TOKENS``) and its uploads.

One row per ``req_to_token`` row: the token the request holds at each position (int32, like req_to_token and
sglang's own ``req_to_verify_expected_tokens``: half the memory of int64), and a valid length per row. The plan
(:meth:`kvcanary.runtime.device_state.DeviceState.before_forward`) puts the expected token into each verify entry inside
the valid length, and verify compares it with the stored token (``verify_token``).

A serving loop sends each row only what it appended since its last update (one token per decode row), and every
row of a forward in one call, best as :class:`TokenColumns` (rows, starts, counts, and the updates' tokens back to
back: what :func:`kvcanary.sglang.tokens.expected_token_updates` builds). A call is one launch of
``canary_token_update`` (csrc/canary_tokens.cuh) and no device or pinned allocation: the columns are packed by one
``struct.pack_into`` (plus one per prompt) into a staging buffer of int64 (the layout of
:data:`~kvcanary.kernels.layout.TOKEN_UPDATE_FIELDS`), which on CUDA is pinned host memory the kernel reads in place
(no H2D copy). A batch of one token per row (a decode forward) is staged as rows, starts and tokens alone (the layout
of :data:`~kvcanary.kernels.layout.TOKEN_APPEND_FIELDS`) for ``canary_token_append``, bound to each staging once
(``canary_token_append_bind``: no tensor validated or driver query made per forward): no valid lengths or offsets to
build on the host, 3 values a row instead of 6. A launch may still be reading its staging when the host packs the next
batch, so the stagings form a ring: each is reused only once an event recorded after its last launch, on that launch's
stream, has completed (the host waits on it in the rare case the GPU is a whole ring behind). One event is recorded
per :data:`TOKEN_EVENT_EVERY` launches, not per launch: it covers every launch queued on its
stream before it (the ring: :mod:`kvcanary.runtime.staging`).
"""

from __future__ import annotations

import ctypes
import logging
import operator
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.jit import load_module
from kvcanary.kernels.tokens import canary_token_update
from kvcanary.runtime.staging import EVENT_EVERY, StagingEvent, StagingRing, device_events

logger = logging.getLogger(__name__)

# Stagings in the ring on CUDA: a launch's staging is rewritten RING_SIZE batches later, by when the GPU has long run
# the (microsecond) launch unless it is that many forwards behind. At least TOKEN_EVENT_EVERY: by a staging's next turn
# the event covering its launch has been recorded (at most TOKEN_EVENT_EVERY - 1 launches after it).
RING_SIZE = 32
# Launches per event record (twice the shared EVENT_EVERY): the uploads run on every forward with the token check,
# and each record is a torch call of host time; the ring above holds four groups of them.
TOKEN_EVENT_EVERY = 2 * EVENT_EVERY

# Tokens from which an update's tokens are a run of their own in TokenColumns (packed by a call of their own, never
# copied); shorter updates (a decode row's one token) share a run, so a row costs at most one pack call.
LONG_UPDATE_TOKENS = 32

_FIELDS = layout.TOKEN_UPDATE_FIELDS
_APPEND_FIELDS = layout.TOKEN_APPEND_FIELDS
_VALUE_BYTES = 8  # int64 staging values
_ERROR_PREFIX = "CanaryManager.update_expected_tokens"
_add = operator.add
_pack_into = struct.pack_into
_MAIL_FIELDS = layout.TOKEN_MAIL_FIELDS
_MAIL_RECORD_BYTES = _MAIL_FIELDS * _VALUE_BYTES
_STEP = struct.Struct("q")  # a mail record's step: one value per batch, its bytes repeated per record

# Records the token mail holds (32 bytes each, pinned on CUDA: 128 KiB): 16 decode batches of the largest batch sglang
# runs by default, while the host is never more than a forward or two ahead of the device.
TOKEN_MAIL_CAPACITY = 4096


@dataclass(eq=False, slots=True)
class TokenColumns(Sequence):
    """A batch of expected-token updates as columns: update ``i`` writes its ``counts[i]`` tokens into row ``rows[i]``
    from position ``starts[i]``. The updates' tokens, back to back in update order, are held in ``token_runs``, split
    into runs anywhere: a prompt is best a run of its own (its request's own list, never copied), short updates
    share one (a decode batch: one run of a token per row).

    The form :meth:`TokenTable.update` stages in bulk (whole-column calls and one per run, no per-update Python),
    which a serving loop can build directly (:func:`kvcanary.sglang.tokens.expected_token_updates`). It is also the
    sequence of the ``(row, start, tokens)`` updates it holds, so it goes wherever a list of them does. Runs may be
    the caller's own lists: stage the columns before those change.
    """

    rows: Sequence[int]
    starts: Sequence[int]
    counts: Sequence[int]
    token_runs: Sequence[Sequence[int]]

    @classmethod
    def of(cls, updates: Sequence[tuple[int, int, Sequence[int]]]) -> TokenColumns:
        """The columns of ``(row, start, tokens)`` updates (long updates' tokens are runs of their own, not copies)."""
        if not updates:
            return cls((), (), (), ())
        rows, starts, per_update = zip(*updates, strict=True)
        runs = TokenRuns()
        for update_tokens in per_update:
            runs.add(update_tokens)
        return cls(rows, starts, tuple(map(len, per_update)), runs.done())

    @property
    def tokens(self) -> list[int]:
        """Every update's tokens back to back (a copy of the runs, joined)."""
        return list(chain.from_iterable(self.token_runs))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):  # an update (row, start, tokens); a slice gives a list of them
        return list(self)[index]

    def __eq__(self, other: object) -> bool:  # the same updates in the same order, in whatever sequence
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # equal to mutable sequences

    def __iter__(self):
        tokens = self.tokens
        offset = 0
        for row, start, count in zip(self.rows, self.starts, self.counts, strict=True):
            yield row, start, tokens[offset : offset + count]
            offset += count


class TokenRuns:
    """The updates' tokens of :class:`TokenColumns`, back to back, as they are added: a short update's tokens join
    the current run (``run``: a caller may append a one-token update to it directly), a long one
    (:data:`LONG_UPDATE_TOKENS` or more: a prompt) is a run of its own, the caller's list (packed as it is, not
    copied). ``run`` is a new list after a long update; ``run`` given: the current run so far (a caller that
    gathered one-token updates before it needed a TokenRuns)."""

    __slots__ = ("runs", "run")

    def __init__(self, run: list[int] | None = None) -> None:
        self.runs: list[Sequence[int]] = []
        self.run: list[int] = [] if run is None else run

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) < LONG_UPDATE_TOKENS:
            self.run += tokens
            return
        if self.run:
            self.runs.append(self.run)
            self.run = []
        self.runs.append(tokens)

    def done(self) -> list[Sequence[int]]:
        """Every run, in order (at least one, maybe empty)."""
        if self.run or not self.runs:
            self.runs.append(self.run)
        return self.runs


_COUNTED = (list, tuple)  # the count columns whose one-token-each test is list.count (any other: the general path)


class TokenMail:
    """The token check's mailbox (issue 25): a decode batch's appends (one token per row) as records that the next
    check launch applies before it verifies anything (csrc/canary_check.cuh, the token mail), instead of a launch of
    their own: the same forward checks them, as it checked those of the launch the mail replaces.

    ``records`` (int64 ``[layout.TOKEN_MAIL_FIELDS, capacity]``: a column each of rows, starts, tokens and steps) is a
    ring the host fills in
    order; ``published`` (int64 ``[1]``) then says how many records were ever written. Both are host memory (pinned on
    CUDA: the kernel reads them in place), both bound to the check launch. A check launch applies, in order, the
    records published since the device's read cursor whose step is at most its own forward's, and moves the cursor,
    which reaches the host in the status mirror: a record's ring slot is written again only once the cursor has
    passed it.

    Closed until :meth:`open` (then :meth:`post` takes batches; ``CanaryManager(token_mail=True)`` opens it): only
    where every forward after a batch hook runs this table's check launch with the step the host counts (the
    manager's ``steps + 1``), so that every record is applied by its own forward's launch, before any upload a later
    batch launches. Why the order matters: a record applied after a later upload to its row (another request's
    prompt) would write the old request's token into it.
    """

    def __init__(self, capacity: int, *, pinned: bool) -> None:
        if capacity < 1:
            raise ValueError(f"TokenMail: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.records = torch.zeros((_MAIL_FIELDS, capacity), dtype=torch.int64, pin_memory=pinned)
        self.published = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self._records_view = (ctypes.c_char * (capacity * _MAIL_RECORD_BYTES)).from_address(self.records.data_ptr())
        # each column's byte offset in the view: row, start, token, step
        self._column = tuple(field * capacity * _VALUE_BYTES for field in range(_MAIL_FIELDS))
        # ... and its address (what post_filled's fill writes)
        self._column_addresses = tuple(self.records.data_ptr() + offset for offset in self._column)
        self._packers: dict[int, tuple[Callable[..., None], ...]] = {}  # n -> its packs (_packer), once per size
        self._published_view = (ctypes.c_int64 * 1).from_address(self.published.data_ptr())
        self.written = 0  # records ever written (what ``published`` says once a batch is posted)
        self.posted = 0  # batches posted
        # posts refused for want of room: the caller launches the batch instead, or offers it once more first (the
        # sglang batch hook's refused post goes through TokenTable.update_columns, which posts before it launches)
        self.full = 0
        self._read: Sequence[int] | None = None  # the mirrored header the read cursor is read from (None: closed)
        self._read_at = 0
        self._steps: Any = None  # what counts the forwards (its ``steps``)
        self._rows = self._width = 0

    @property
    def is_open(self) -> bool:
        return self._read is not None

    def open(self, header: Sequence[int], steps: Any, rows: int, width: int) -> None:
        """Take batches from now on: ``header`` is the status mirror's values (its
        ``layout.STATE_TOKEN_MAIL_READ`` is the device's read cursor, as the last finished check launch left it: an
        older value only delays reuse), ``steps.steps + 1`` the step of the forward a batch is posted for, ``rows``
        and ``width`` the table's (a record outside them is not posted)."""
        self._read, self._read_at, self._steps = header, layout.STATE_TOKEN_MAIL_READ, steps
        self._rows, self._width = rows, width

    def post(self, rows: Sequence[int], starts: Sequence[int], tokens: Sequence[int]) -> bool:
        """Post one append per row (``tokens[i]`` at ``starts[i]`` of row ``rows[i]``) for the next forward: False,
        with nothing published, when the mail is closed, lacks room, or a row or start lies outside the table (the
        caller then launches the batch, whose path clips or names it).

        Host cost (every decode forward with the token check): a pack per column, no per-record Python. Rows and
        starts are packed unsigned, so a negative one is refused by its pack (records written past the published
        count are not read: the next post writes them again); only their upper bounds cost a pass (``max``). The
        steps column, one value for the whole batch, is that value's bytes repeated, packed as one string."""
        header = self._read
        n = len(rows)
        if header is None or not n:
            return False
        written = self.written
        capacity = self.capacity
        if written + n - header[self._read_at] > capacity:
            self.full += 1
            return False
        if len(tokens) != n or len(starts) != n:
            raise ValueError(f"TokenMail.post: {n} rows, {len(starts)} starts and {len(tokens)} tokens")
        if max(rows) >= self._rows or max(starts) >= self._width:
            return False
        step = _STEP.pack(self._steps.steps + 1) * n
        at = written % capacity
        first = min(n, capacity - at)  # records up to the ring's end; the rest from its start
        view, (row_at, start_at, token_at, step_at) = self._records_view, self._column
        offset = at * _VALUE_BYTES
        try:
            if first == n:  # (one C-level pack per column)
                unsigned, signed, raw = self._packers.get(n) or self._packer(n)
                unsigned(view, row_at + offset, *rows)
                unsigned(view, start_at + offset, *starts)
                signed(view, token_at + offset, *tokens)
                raw(view, step_at + offset, step)
            else:  # the ring's end: each column in two packs
                head, tail = self._packer(first), self._packer(n - first)
                for kind, column, values in ((0, row_at, rows), (0, start_at, starts), (1, token_at, tokens)):
                    head[kind](view, column + offset, *values[:first])
                    tail[kind](view, column, *values[first:])
                cut = first * _VALUE_BYTES
                head[2](view, step_at + offset, step[:cut])
                tail[2](view, step_at, step[cut:])
        except struct.error:  # a negative row or start (or a token outside int64)
            return False
        # Published after the records (x86 stores become visible in program order; the kernel loads the count first)
        self.written = written + n
        self._published_view[0] = written + n
        self.posted += 1
        return True

    def post_filled(self, n: int, fill: Callable[..., int], *args: Any) -> bool:
        """Post the ``n`` records that ``fill(*args, columns, at, capacity, rows, width, step)`` writes into the ring
        itself (:func:`kvcanary.runtime.host_ext.decode_fill`: a decode batch read from its requests in C): slots
        ``at .. at + n - 1`` (mod ``capacity``) of the int64 columns whose addresses ``columns`` gives (rows, starts,
        tokens, steps), each record inside ``rows`` and ``width``, with the step ``step``; it returns ``n`` when it
        wrote them all, anything else to refuse the batch (nothing is published).

        False with no call when the mail is closed or lacks room for ``n``: a refusal here is not counted in
        ``full`` (the caller then offers the batch to :meth:`post`, which counts it)."""
        header = self._read
        if header is None or n < 1:
            return False
        written = self.written
        if written + n - header[self._read_at] > self.capacity:
            return False
        if fill(*args, self._column_addresses, written % self.capacity, self.capacity, self._rows, self._width,
                self._steps.steps + 1) != n:
            return False
        # Published after the records, as in post
        self.written = written + n
        self._published_view[0] = written + n
        self.posted += 1
        return True

    def _packer(self, n: int) -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]]:
        """The packs of ``n`` values, built once per batch size (a batch's post makes no format string): unsigned
        int64 (rows, starts), int64 (tokens), and ``n`` values' bytes as one string (the steps)."""
        packers = self._packers.get(n)
        if packers is None:
            if len(self._packers) >= 512:
                self._packers.clear()
            packers = self._packers[n] = (struct.Struct(f"{n}Q").pack_into, struct.Struct(f"{n}q").pack_into,
                                          struct.Struct(f"{n * _VALUE_BYTES}s").pack_into)
        return packers


class TokenTable:
    """``expected_tokens`` (int32 ``[rows, width]``, :data:`~kvcanary.kernels.layout.NO_EXPECTED_TOKEN` where
    unknown) and ``valid_lens_by_row`` (int64 ``[rows]``) on ``device``; both keep their addresses (graph capture).

    ``staging`` is the :class:`~kvcanary.runtime.staging.StagingRing` of the uploads, recording an event per
    :data:`TOKEN_EVENT_EVERY` launches. ``event_factory`` makes its events (default:
    :func:`~kvcanary.runtime.staging.device_events`: CUDA events on the stream of the launches they cover; on the CPU
    the kernel has run when the call returns, so there are no events and one staging, unless a factory is given: tests
    drive the ring with simulated events, all launches taken as on one stream).
    ``ring_size`` defaults to :data:`RING_SIZE` with events, 1 without.
    """

    def __init__(self, rows: int, width: int, device: torch.device, *,
                 event_factory: Callable[[], StagingEvent] | None = None, ring_size: int | None = None,
                 mail: bool = False) -> None:
        self.device = device
        self.expected_tokens = torch.full((rows, width), layout.NO_EXPECTED_TOKEN, dtype=torch.int32, device=device)
        self.valid_lens_by_row = torch.zeros(rows, dtype=torch.int64, device=device)
        self._rows, self._width = rows, width
        event_factory, stream = device_events(device, event_factory)
        size = ring_size if ring_size is not None else (RING_SIZE if event_factory is not None else 1)
        module = load_module("cuda" if device.type == "cuda" else "cpu")
        self._launch = module.canary_token_update
        # ``mail``: the decode batches' appends through the check launch's mailbox (TokenMail; its owner binds it to
        # the check launch and opens it); None: each batch is launched
        self.mail = TokenMail(TOKEN_MAIL_CAPACITY, pinned=device.type == "cuda") if mail else None
        # A decode batch's append, bound to each staging once (csrc canary_token_append_bind: the tensors validated and
        # the pinned staging's device address resolved at binding, not on every forward)
        bind, table, lens = module.canary_token_append_bind, self.expected_tokens, self.valid_lens_by_row
        self.staging = StagingRing(size, pinned=device.type == "cuda", event_factory=event_factory,
                                   event_every=TOKEN_EVENT_EVERY, launch_stream=stream,
                                   bind=lambda buffer: bind(table, lens, buffer))

    def update(self, updates: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """For each ``(row, start, tokens)``: the row's expected tokens at positions ``start..`` become ``tokens``
        (clipped at the table width) and its valid length ``start + len(tokens)`` (clipped likewise; earlier
        positions keep what they hold). Updates apply in order: a row updated twice in one call ends as the later
        update leaves it. Non-blocking; call outside graph capture. Raises ``ValueError`` for a row outside the
        table or a negative start (nothing is written to the table).

        ``updates`` may be :class:`TokenColumns` (staged as they are) or any sequence of tuples (turned into columns
        first). The columns' rules and errors are :meth:`update_columns`'."""
        columns = updates if updates.__class__ is TokenColumns else TokenColumns.of(updates)
        self.update_columns(columns.rows, columns.starts, columns.counts, columns.token_runs)

    def update_columns(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                       token_runs: Sequence[Sequence[int]]) -> None:
        """:meth:`update` of the updates in columns (see :class:`TokenColumns`): update ``i`` writes its ``counts[i]``
        tokens (the next ones of ``token_runs``, joined) into row ``rows[i]`` from position ``starts[i]``. One
        launch; the staging is written by one pack of all the columns, plus one per further run (one token per
        update in list or tuple columns, every start inside the width: the rows, starts and tokens alone, for
        ``canary_token_append``). Raises ``ValueError`` naming the column (and the update) for a row outside the
        table, a negative start or count, columns of different lengths, or runs of another length than ``counts``
        add up to (nothing is written to the table).

        The serving loop's call (:func:`kvcanary.sglang.tokens.expected_token_columns` builds its arguments): the
        columns are staged here with no further Python call before the pack (no :class:`TokenColumns` built)."""
        n = len(rows)
        if len(starts) != n or len(counts) != n:
            raise ValueError(f"{_ERROR_PREFIX}: rows, starts and counts have {n}, {len(starts)} and {len(counts)} "
                             "values (one per update each)")
        if not n and not any(token_runs):
            return
        # One token per update (a decode forward): list.count over the counts, no Python loop. Staged as the runs of
        # layout.TOKEN_APPEND_FIELD_* (rows, starts, tokens: one pack of 3 values a row, no valid lengths or offsets
        # to build) for canary_token_append, here rather than in a method of its own: every decode batch takes this
        # branch, and a Python call from the engine's cold caches costs several µs of its host time.
        if len(token_runs) == 1 and counts.__class__ in _COUNTED and counts.count(1) == n and len(token_runs[0]) == n:
            mail = self.mail
            if mail is not None and mail.post(rows, starts, token_runs[0]):  # (the next check launch applies them)
                return
            try:
                staged_len = _APPEND_FIELDS * n
                staging = self.staging.acquire(staged_len)
                _pack_into(f"{staged_len}q", staging.view, 0, *rows, *starts, *token_runs[0])
                staging.bound(self.valid_lens_by_row, n)  # (the table's own tensor: the launch's stream)
                self.staging.launched(staging)
                return
            except Exception:
                # Refused before anything was written (the pack, or the export's host-side check of every update):
                # a start at or past the width (which only the general path clips), a bad row or token. The general
                # path below clips, or raises the error naming the column.
                logger.debug("token table: a one-token-per-row batch refused by canary_token_append", exc_info=True)
        try:
            self._stage_and_launch(rows, starts, counts, map(_add, starts, counts), token_runs)
        except Exception:
            # Nothing was written: the pack refuses runs that do not add up, and the launch checks every header on
            # the host before it writes (csrc/canary_tokens.cuh), so the columns are checked here only when refused
            # (a decode batch pays no Python loop over them): the first bad one is named, or updates past the width
            # are staged again clipped.
            clipped = self._checked_and_clipped(rows, starts, counts, token_runs)
            if clipped is None:  # the columns are fine: the launch refused something else, its error stands
                raise
            self._stage_and_launch(*clipped)

    def _stage_and_launch(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                          ends: Iterable[int], token_runs: Sequence[Sequence[int]]) -> None:
        """Pack the columns into the ring's next staging (the field-major header of layout.TOKEN_UPDATE_FIELD_*:
        row, start, count, valid length ``ends``, offset; then the tokens) and launch the update. Raises (before the
        launch) if the runs do not hold the tokens ``counts`` add up to."""
        n = len(rows)
        header_len = _FIELDS * n
        offsets = list(accumulate(counts, initial=header_len))  # each update's first token in the staging
        staged_len = offsets.pop()
        staging = self.staging.acquire(staged_len)
        view = staging.view
        if len(token_runs) == 1:  # a decode batch: header and tokens in one call
            _pack_into(f"{staged_len}q", view, 0, *rows, *starts, *counts, *ends, *offsets, *token_runs[0])
        else:
            # ``*run`` of a list or tuple copies its item array in C: a prompt's run is one call, no per-token Python
            _pack_into(f"{header_len}q", view, 0, *rows, *starts, *counts, *ends, *offsets)
            at = header_len
            for run in token_runs:
                _pack_into(f"{len(run)}q", view, at * _VALUE_BYTES, *run)
                at += len(run)
            if at != staged_len:
                raise ValueError(f"{_ERROR_PREFIX}: token_runs hold {at - header_len} tokens, counts add up to "
                                 f"{staged_len - header_len}")
        try:
            self._launch(self.expected_tokens, self.valid_lens_by_row, staging.buffer, n, staged_len)
        except Exception:
            # Validation fails before anything is launched: the keyword wrapper names the argument (or re-raises).
            canary_token_update(expected_tokens=self.expected_tokens, valid_lens_by_row=self.valid_lens_by_row,
                                staging=staging.buffer, num_updates=n, staged_len=staged_len)
            raise
        self.staging.launched(staging)

    def _checked_and_clipped(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                             token_runs: Sequence[Sequence[int]]) -> tuple[list, ...] | None:
        """The columns one update at a time: an error for the first bad update; None if no update reaches past the
        width, else the columns with each update's tokens clipped at the width (its valid length too): rows, starts,
        counts, valid lengths and the tokens as one run."""
        rows_total, width = self._rows, self._width
        tokens = list(chain.from_iterable(token_runs))
        clipped_counts, ends, kept = [], [], []
        offset = 0
        past_the_width = False
        for i, (row, start, count) in enumerate(zip(rows, starts, counts, strict=True)):
            if not 0 <= row < rows_total:
                raise ValueError(f"{_ERROR_PREFIX}: row {row} outside [0, {rows_total}): rows[{i}]")
            if start < 0:
                raise ValueError(f"{_ERROR_PREFIX}: start {start} < 0 (row {row}): starts[{i}]")
            if count < 0:
                raise ValueError(f"{_ERROR_PREFIX}: count {count} < 0 (row {row}): counts[{i}]")
            past_the_width = past_the_width or start + count > width
            fits = max(0, min(count, width - start))
            clipped_counts.append(fits)
            ends.append(min(start + count, width))
            kept += tokens[offset : offset + fits]
            offset += count
        if offset != len(tokens):
            raise ValueError(f"{_ERROR_PREFIX}: token_runs hold {len(tokens)} tokens, counts add up to {offset}")
        return (list(rows), list(starts), clipped_counts, ends, [kept]) if past_the_width else None
