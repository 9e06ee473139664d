"""The ``Reporter``: turns drained violations into WARNING log lines, JSONL rows and (raise mode) exceptions
(SPEC §3, §5). The records and their line and JSON forms are ``kvcanary.report.record``'s.

Repeat suppression (log mode only; ``KVCANARY_LOG_REPEAT_WINDOW`` forward steps, default 1000, ``0`` = off;
``kvcanary.report.repeats.RepeatFilter``): a row whose key (every recorded field except ``step``: tag, slot, position,
stored and expected values, reason bits, request_row, written_step, writer_rid) was logged less than ``window``
steps earlier gets no line; it is counted. The next row of that key at ``step >= last logged step + window`` is
logged with one more key after the rank keys, ``repeats=<N>``: the rows suppressed since the previous line of
that key. A key whose rows stop before that gets one summary line (WARNING) instead, when a later report sees
a step past its window, when it is evicted from the table (at most 4096 keys, least recently seen first), or
at ``Reporter.flush_repeats()`` / ``close()``; the key is then forgotten (the summary line's form:
``kvcanary.report.record``). Every row still goes to the JSONL report, and raise mode logs and raises every row as
before.

Report sink failures (``Reporter``): in log mode a write error (disk full, removed file or directory, bad
descriptor) is logged as ERROR (the first, then at most one line per ``SINK_ERROR_INTERVAL_S`` with counts),
counted (``total_sink_errors``, ``total_lines_dropped``), and the lines are dropped; the next report tries the
file again. In raise mode the error is logged, counted and the original ``OSError`` raised.

Concurrency: the report file is opened with ``O_APPEND`` and each line is written with one ``os.write``, so
several processes (TP ranks) may append to the same file and their lines never interleave (on a local file
system; use ``{rank}`` in the path for network file systems). Lines reach the OS immediately (no user-space
buffer), so a crash of the process loses nothing that ``report`` has returned from or raised after.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcanary.kernels.tags import tag_name
from kvcanary.report.record import (
    HEALTH_LOG_PREFIX,
    HEALTH_SCHEMA,
    INJECTION_SCHEMA,
    LOST_LOG_PREFIX,
    LOST_SCHEMA,
    Violation,
    repeat_line,
)
from kvcanary.report.repeats import RepeatFilter, RepeatSummary
from kvcanary.report.sink import ReportFile
from kvcanary.settings import Mode, log_repeat_window_from_env

logger = logging.getLogger(__name__)
_MODULE_LOGGER = logger

SINK_LOG_PREFIX = "kvcanary report:"

# Log mode: at most one ERROR line per this many seconds about a failing report sink.
SINK_ERROR_INTERVAL_S = 60.0

# How many log lines CanaryViolationError's message includes.
ERROR_MESSAGE_LINES = 5


class CanaryViolationError(RuntimeError):
    """Raised in ``raise`` mode: the KV cache failed an integrity check. ``.violations`` holds the batch."""

    def __init__(self, violations: Sequence[Violation], *, lost: int = 0) -> None:
        self.violations: list[Violation] = list(violations)
        self.lost = int(lost)
        n = len(self.violations)
        head = f"{n} kvcanary violation{'s' if n != 1 else ''}"
        if self.lost:
            head += f" (+{self.lost} lost to violation ring overflow)"
        lines = [f"{head}: KV cache integrity check failed"]
        lines.extend(f"  {v.log_line()}" for v in self.violations[:ERROR_MESSAGE_LINES])
        if n > ERROR_MESSAGE_LINES:
            lines.append(f"  ... and {n - ERROR_MESSAGE_LINES} more")
        super().__init__("\n".join(lines))


class CanaryHealthError(RuntimeError):
    """Raised in ``raise`` mode when a canary launch that should run shows no progress."""


def _as_mode(mode: Mode | str) -> Mode:
    return mode if isinstance(mode, Mode) else Mode(str(mode).strip().lower())


class Reporter:
    """Turns drained violations into WARNING log lines, JSONL rows and (raise mode) exceptions.

    ``report_path`` (already rank-formatted, see ``Config.report_path_for``) is checked and opened at
    construction with ``O_APPEND | O_CREAT`` (parent directories created), so a bad path fails at install time
    with a ``ValueError`` naming ``KVCANARY_REPORT`` (``kvcanary.report.sink``). In ``off`` mode nothing is opened and
    every method is a no-op. ``rank`` (e.g. ``{"tp_rank": 0}``) is attached to violations that carry none and to
    the lost/health/injection JSON lines. Thread-safe.

    ``repeat_window``: log-mode repeat suppression in forward steps (module docstring; ``0`` logs every row);
    ``None`` reads ``KVCANARY_LOG_REPEAT_WINDOW`` (default 1000).

    A failing report sink (disk full, file or directory removed, a bad descriptor) never stops serving in
    ``log`` mode: the lines that could not be written are dropped and counted (``total_sink_errors``,
    ``total_lines_dropped``), the first failure is one ERROR line, later ones at most one ERROR line per
    ``sink_error_interval_s`` seconds with the counts since, and every report tries the file again (reopening
    it when it was closed, removed or replaced). The WARNING lines are logged before the file is written, so
    they go out regardless. In ``raise`` mode the failure is logged and counted, then the original
    ``OSError`` is raised (for violations, health errors and injections alike).
    """

    def __init__(
        self,
        mode: Mode | str,
        report_path: str | None = None,
        *,
        logger: logging.Logger | None = None,
        rank: Mapping[str, int] | None = None,
        repeat_window: int | None = None,
        sink_error_interval_s: float = SINK_ERROR_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mode = _as_mode(mode)
        self.report_path = report_path
        self.rank: dict[str, int] | None = dict(rank) if rank else None
        self.total_reported = 0
        self.total_lost = 0
        self.total_health_errors = 0
        self.total_injections = 0
        self.total_sink_errors = 0
        self.total_lines_dropped = 0
        self._log = logger if logger is not None else _MODULE_LOGGER
        self._lock = threading.Lock()
        if not self.mode.keeps_serving:  # only log (and protect) mode suppresses: raise and off ignore it
            repeat_window = 0
        elif repeat_window is None:
            repeat_window = log_repeat_window_from_env()
        self._repeats: RepeatFilter[Violation] = RepeatFilter(repeat_window)
        self._sink_error_interval_s = float(sink_error_interval_s)
        self._clock = clock
        self._sink = _SinkErrorState()
        self._file: ReportFile | None = None
        self._atexit_registered = False
        if self.mode is not Mode.OFF and report_path:
            self._file = ReportFile(report_path)
            self._file.open()
            self._register_atexit()

    # -- file --------------------------------------------------------------------------------------------
    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True

    def _write_lines(self, objects: Iterable[dict[str, Any]]) -> OSError | None:
        """Append objects as JSON lines (caller holds the lock). Returns the sink's error, already logged and
        counted (the lines it could not write are dropped), or None."""
        if self._file is None:
            return None
        lines = [(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode() for obj in objects]
        if not lines:
            return None
        if not self._file.is_open:  # closed earlier (e.g. atexit ran before a last drain): reopen, lose nothing
            self._register_atexit()
        written, error = self._file.write_lines(lines)
        if error is None:
            self._sink_recovered()
            return None
        self._sink_failed(error, dropped=len(lines) - written)
        return error

    def _sink_failed(self, error: OSError, *, dropped: int) -> None:
        """Count a sink failure and log it: always the first of a streak and in raise mode, else at most one
        ERROR line per interval with what was dropped since the previous one (caller holds the lock)."""
        self.total_sink_errors += 1
        self.total_lines_dropped += dropped
        state = self._sink
        state.errors_since += 1
        state.dropped_since += dropped
        now = self._clock()
        due = state.last_logged is None or now - state.last_logged >= self._sink_error_interval_s
        if self.mode is not Mode.RAISE and not due:
            return
        if not state.failing:
            self._log.error(
                "%s cannot write the report %s: %s; %d line(s) dropped%s",
                SINK_LOG_PREFIX, self.report_path, _describe(error), dropped,
                " (raise mode: raising)" if self.mode is Mode.RAISE else
                f"; the engine keeps serving, every report retries the file, further errors are logged at most "
                f"once per {self._sink_error_interval_s:g} s",
            )  # fmt: skip
        else:
            self._log.error(
                "%s the report %s still fails: %s; %d error(s) and %d line(s) dropped since the last message "
                "(%d line(s) in all)",
                SINK_LOG_PREFIX, self.report_path, _describe(error), state.errors_since, state.dropped_since,
                self.total_lines_dropped,
            )  # fmt: skip
        state.failing = True
        state.last_logged = now
        state.errors_since = state.dropped_since = 0
        state.logged_since_recovery = True

    def _sink_recovered(self) -> None:
        state = self._sink
        if not state.failing:
            return
        state.failing = False
        if state.logged_since_recovery:  # a flapping sink: one recovery line per logged error, no more
            self._log.warning(
                "%s the report %s is written again; %d line(s) dropped in all (%d since the last message)",
                SINK_LOG_PREFIX, self.report_path, self.total_lines_dropped, state.dropped_since,
            )  # fmt: skip
            state.logged_since_recovery = False
            state.errors_since = state.dropped_since = 0

    @property
    def closed(self) -> bool:
        return self._file is None or not self._file.is_open

    def close(self) -> None:
        """Log pending repeat summaries and close the report file (idempotent). Writes reach the OS as they
        happen, so there is nothing to flush."""
        self.flush_repeats(all_pending=True)
        with self._lock:
            if self._sink.dropped_since and self._file is not None:
                self._log.error(
                    "%s closing the report %s: %d line(s) dropped since the last message (%d in all)",
                    SINK_LOG_PREFIX, self.report_path, self._sink.dropped_since, self.total_lines_dropped,
                )  # fmt: skip
                self._sink.dropped_since = self._sink.errors_since = 0
            if self._file is not None:
                self._file.close()
            if self._atexit_registered:
                atexit.unregister(self.close)
                self._atexit_registered = False

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- repeat suppression --------------------------------------------------------------------------------
    @property
    def repeat_window(self) -> int:
        return self._repeats.window

    @property
    def total_log_lines_suppressed(self) -> int:
        """Violation rows not logged because of repeat suppression (every one is in the JSONL report)."""
        return self._repeats.total_suppressed

    def flush_repeats(self, *, all_pending: bool = False) -> None:
        """Log the summary lines that are due (``all_pending``: every key with suppressed rows, as at close)."""
        if not self.mode.keeps_serving:
            return
        with self._lock:
            self._log_summaries(self._repeats.drain() if all_pending else self._repeats.expired())

    def _log_summaries(self, summaries: Iterable[RepeatSummary[Violation]]) -> None:
        for summary in summaries:
            self._log.warning("%s", repeat_line(summary, rank=self.rank))

    # -- reporting ---------------------------------------------------------------------------------------
    def report(self, violations: Sequence[Violation], *, lost: int = 0, step: int | None = None) -> None:
        """Log, record and (raise mode) raise one drained batch.

        ``lost``: rows the ring overflowed in this batch (index beyond capacity), reported as one WARNING line
        and one ``kvcanary.lost/1`` JSON line. ``step`` labels the lost line; it defaults to the last
        violation's step. Everything is logged and written before ``CanaryViolationError`` is raised. Log mode
        suppresses repeated lines (class docstring); every row is written to the JSONL report.
        """
        if self.mode is Mode.OFF or (not violations and lost <= 0):
            return
        lost = max(int(lost), 0)
        if step is None and violations:
            step = violations[-1].step
        if self.rank:
            violations = [v if v.rank is not None else dataclasses.replace(v, rank=self.rank) for v in violations]
        now = time.time()
        with self._lock:
            for v in violations:
                if self.mode.keeps_serving:
                    repeats = self._repeats.admit(v)
                    if repeats is not None:
                        self._log.warning("%s", v.log_line(repeats=repeats))
                else:
                    self._log.warning("%s", v.log_line())
            if self.mode.keeps_serving:
                self._log_summaries(self._repeats.expired())
            if lost:
                self._log.warning(
                    "%s step=%s count=%d (violation ring overflowed; raise KVCANARY_RING_CAPACITY to keep more)",
                    LOST_LOG_PREFIX,
                    "-" if step is None else step,
                    lost,
                )
            records = [v.to_json(now=now) for v in violations]
            if lost:
                records.append({"schema": LOST_SCHEMA, "count": lost, "step": step, "rank": self.rank, "time": now})
            self.total_reported += len(violations)
            self.total_lost += lost
            error = self._write_lines(records)
        if self.mode is Mode.RAISE:
            if error is not None:
                raise error
            raise CanaryViolationError(violations, lost=lost)

    def health_error(self, message: str, *, step: int | None = None, tags: Iterable[int] = ()) -> None:
        """A canary path is not executing: ERROR log line (log mode) or ``CanaryHealthError`` (raise mode).

        Also writes a ``kvcanary.health/1`` JSON line first, in both modes. When that write fails in raise
        mode, the ERROR line is logged too and the sink's ``OSError`` is raised.
        """
        if self.mode is Mode.OFF:
            return
        line = f"{HEALTH_LOG_PREFIX} {message}"
        record = {
            "schema": HEALTH_SCHEMA,
            "message": message,
            "step": step,
            "tags": [tag_name(t) for t in tags],
            "rank": self.rank,
            "time": time.time(),
        }
        with self._lock:
            self.total_health_errors += 1
            error = self._write_lines([record])
            if self.mode.keeps_serving or error is not None:
                self._log.error("%s", line)
        if self.mode is Mode.RAISE:
            if error is not None:
                raise error
            raise CanaryHealthError(line)

    def record_injection(self, injection: Any) -> dict[str, Any] | None:
        """Write one ``kvcanary.injection/1`` JSON line for an injected fault (``kvcanary.runtime.faults.Injection`` or
        any object with ``fault``, ``step``, ``slots`` and ``detail``), so a test can match detections to injections.

        Returns the record (None in ``off`` mode). Never raises for the mode: an injection is not a violation.
        A failing sink is handled as for violations (log mode: logged, counted, dropped; raise mode: the
        ``OSError`` is raised). The injector itself logs the WARNING line.
        """
        if self.mode is Mode.OFF:
            return None
        step = getattr(injection, "step", None)
        record = {
            "schema": INJECTION_SCHEMA,
            "fault": str(injection.fault),
            "step": None if step is None else int(step),
            "slots": [int(s) for s in injection.slots],
            "detail": str(injection.detail),
            "rank": self.rank,
            "time": time.time(),
        }
        with self._lock:
            self.total_injections += 1
            error = self._write_lines([record])
        if error is not None and self.mode is Mode.RAISE:
            raise error
        return record


    def record(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Write one JSON line of another module's schema (e.g. ``kvcanary.spec/1``, speculative-decoding counters);
        the reporter's ``rank`` is set when ``obj`` has none (or None). Nothing in ``off`` mode; a failing sink is
        handled as for injections."""
        if self.mode is Mode.OFF:
            return None
        record = dict(obj)
        if record.get("rank") is None:
            record["rank"] = self.rank
        with self._lock:
            error = self._write_lines([record])
        if error is not None and self.mode is Mode.RAISE:
            raise error
        return record


@dataclass
class _SinkErrorState:
    """The rate limiter of sink error lines."""

    failing: bool = False  # the last write failed
    last_logged: float | None = None  # clock() of the last ERROR line
    errors_since: int = 0  # failures since the last ERROR line
    dropped_since: int = 0  # lines dropped since the last ERROR line
    logged_since_recovery: bool = False


def _describe(error: OSError) -> str:
    name = errno.errorcode.get(error.errno or 0, "")
    text = error.strerror or str(error)
    return f"[{name}] {text}" if name else text
