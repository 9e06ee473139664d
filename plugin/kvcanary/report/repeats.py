"""Repeat suppression for violation log lines (log mode, ``KVCANARY_LOG_REPEAT_WINDOW``).

A corrupted slot that a running request keeps reading fails verify on every forward with the same row until the
request ends. ``RepeatFilter`` decides which rows get a log line: a row whose key (``RepeatFilter.key``: every
field of the record except ``step``) was logged less than ``window`` forward steps before is suppressed and
counted; the next row of that key at ``step >= last logged step + window`` is logged with ``repeats=<N>``, the
rows suppressed in between. A key whose rows stop inside a window has its count reported by a summary line once
the window has passed (``expired``), when the key is evicted from the bounded table (least recently seen first),
or at close (``drain``). The filter only decides about log lines: the JSONL report keeps every row, and raise
mode does not use it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

DEFAULT_MAX_KEYS = 4096


class Row(Protocol):
    """The fields of a violation row the filter reads (``kvcanary.report.Violation`` has them). A protocol rather
    than the record type: reporter.py imports this module, and naming its record here closed an import circle."""

    @property
    def step(self) -> int: ...
    @property
    def kernel_kind(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def stored_token(self) -> int: ...
    @property
    def expected_token(self) -> int: ...
    @property
    def stored_chain_hash(self) -> int: ...
    @property
    def expected_aux(self) -> int: ...
    @property
    def fail_reason_bits(self) -> int: ...
    @property
    def request_row(self) -> int | None: ...
    @property
    def written_step(self) -> int | None: ...
    @property
    def writer_rid(self) -> str | None: ...


RowT = TypeVar("RowT", bound=Row)  # the caller's row type: summaries hand back the rows it admitted


@dataclass
class RepeatSummary(Generic[RowT]):
    """Rows of one key that were suppressed and not yet accounted for by a ``repeats=`` on a logged line."""

    violation: RowT  # the last suppressed row
    count: int
    first_step: int
    last_step: int


@dataclass
class _Entry(Generic[RowT]):
    last_logged_step: int
    last_row: RowT
    suppressed: int = 0
    first_suppressed_step: int = 0
    last_suppressed_step: int = 0

    def summary(self) -> RepeatSummary[RowT]:
        return RepeatSummary(self.last_row, self.suppressed, self.first_suppressed_step, self.last_suppressed_step)


class RepeatFilter(Generic[RowT]):
    """Which violation rows to log. ``window`` forward steps (``0``: log every row); at most ``max_keys`` keys."""

    def __init__(self, window: int, *, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"RepeatFilter: window: expected an int >= 0; got {window!r}")
        if max_keys < 1:
            raise ValueError(f"RepeatFilter: max_keys: expected an int >= 1; got {max_keys!r}")
        self.window = window
        self.max_keys = max_keys
        self._entries: OrderedDict[Hashable, _Entry[RowT]] = OrderedDict()
        self._evicted: list[RepeatSummary[RowT]] = []
        self.total_suppressed = 0
        self._latest_step: int | None = None

    @staticmethod
    def key(v: Row) -> Hashable:
        """What makes two rows "the same violation": every recorded field but the step."""
        return (
            v.kernel_kind, v.slot, v.position, v.stored_token, v.expected_token, v.stored_chain_hash,
            v.expected_aux, v.fail_reason_bits, v.request_row, v.written_step, v.writer_rid,
        )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def __len__(self) -> int:
        return len(self._entries)

    def admit(self, v: RowT) -> int | None:
        """None: suppress this row. Otherwise log it, with this many earlier rows of its key suppressed since
        the previous line (``repeats=``; 0 means none)."""
        if self._latest_step is None or v.step > self._latest_step:
            self._latest_step = v.step
        if not self.enabled:
            return 0
        k = self.key(v)
        entry = self._entries.get(k)
        if entry is not None:
            self._entries.move_to_end(k)
            if v.step < entry.last_logged_step + self.window:
                if entry.suppressed == 0:
                    entry.first_suppressed_step = v.step
                entry.suppressed += 1
                entry.last_suppressed_step = v.step
                entry.last_row = v
                self.total_suppressed += 1
                return None
            repeats = entry.suppressed
            entry.last_logged_step, entry.last_row, entry.suppressed = v.step, v, 0
            return repeats
        self._entries[k] = _Entry(last_logged_step=v.step, last_row=v)
        if len(self._entries) > self.max_keys:
            _, old = self._entries.popitem(last=False)
            if old.suppressed:
                self._evicted.append(old.summary())
        return 0

    def expired(self) -> list[RepeatSummary[RowT]]:
        """Summaries due now: keys evicted with suppressed rows, and keys whose window (from their last logged
        line) has passed the latest step seen with suppressed rows left; those keys are forgotten, so their
        next row is logged as new."""
        out, self._evicted = self._evicted, []
        if self._latest_step is None:
            return out
        done = [
            k for k, e in self._entries.items()
            if e.suppressed and self._latest_step >= e.last_logged_step + self.window
        ]  # fmt: skip
        for k in done:
            out.append(self._entries.pop(k).summary())
        return out

    def drain(self) -> list[RepeatSummary[RowT]]:
        """Every pending summary (close): evicted keys and keys with suppressed rows. Forgets every key."""
        out, self._evicted = self._evicted, []
        out.extend(e.summary() for e in self._entries.values() if e.suppressed)
        self._entries.clear()
        return out
