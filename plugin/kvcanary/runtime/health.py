"""Health checks and the periodic stats line (SPEC §5). Pure Python over host copies of the counters.

The manager drains ``kernel_run_counter`` (int64 ``[NUM_LAUNCH_TAGS]``) asynchronously, like the violation
index, and feeds the host copy to ``HealthMonitor.observe`` once per step. A tag that should run but whose
counter did not advance over a whole window means the canary path is not executing (a hook was bypassed, a
CUDA graph was captured without the canary, the sweep never fires): report it with ``Reporter.health_error``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from kvcanary.kernels.tags import LaunchTag, tag_name

logger = logging.getLogger(__name__)
_MODULE_LOGGER = logger

STATS_PREFIX = "kvcanary stats:"


def expected_launch_tags(sweep_interval: int, health_window: int, sweeping: bool) -> tuple[int, ...]:
    """Tags whose kernel_run_counter must advance every health window: verify and write, and sweep when a sweep
    source is set (``sweeping``) and ``0 < sweep_interval <= health_window`` (a slower sweep cannot be checked with
    that window)."""
    if sweeping and 0 < sweep_interval <= health_window:
        return (LaunchTag.VERIFY, LaunchTag.WRITE, LaunchTag.SWEEP)
    return (LaunchTag.VERIFY, LaunchTag.WRITE)


class HealthMonitor:
    """Detects expected launch tags whose kernel_run_counter stops advancing.

    The first ``observe`` after construction (or after ``set_expected``) records the baseline; the first
    observation at least ``window`` steps after it compares the counters with the baseline, returns the
    expected tags whose count did not grow, and makes the current counts the new baseline. Windows are counted
    in steps, not observations: a manager that reads the device counters only every ``drain_every`` steps
    observes that often, and its window still spans ``window`` forwards. A tag that runs only every k steps
    needs ``window >= k``.
    """

    def __init__(self, window: int, expected_tags: Iterable[int]) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window: expected an int >= 1; got {window!r}")
        self.window = window
        self.expected: tuple[int, ...] = ()
        self._baseline: list[int] | None = None
        self._baseline_step = 0
        self.checks = 0
        self.set_expected(expected_tags)

    def set_expected(self, tags: Iterable[int]) -> None:
        """Change the expected tags (e.g. sweep turned on); the window restarts at the next observation."""
        self.expected = tuple(sorted({int(t) for t in tags}))
        if any(t < 0 for t in self.expected):
            raise ValueError(f"expected tags must be >= 0; got {self.expected}")
        self.reset()

    def reset(self) -> None:
        """Forget the baseline: the next observation starts a new window."""
        self._baseline = None
        self._baseline_step = 0

    def observe(self, step: int, kernel_run_counts: Sequence[int]) -> list[int]:
        """Feed one step's counters; returns the stalled expected tags (empty except at a failing check)."""
        if self.expected and self.expected[-1] >= len(kernel_run_counts):
            raise ValueError(f"kernel_run_counts has {len(kernel_run_counts)} entries; expected tags {self.expected}")
        if self._baseline is not None and step - self._baseline_step < self.window:
            return []  # inside the window (most drains): nothing to copy or compare
        counts = [int(c) for c in kernel_run_counts]
        if self._baseline is None:
            self._baseline, self._baseline_step = counts, step
            return []
        stalled = [t for t in self.expected if counts[t] <= self._baseline[t]]
        self._baseline, self._baseline_step = counts, step
        self.checks += 1
        return stalled

    def message(self, stalled: Iterable[int], step: int) -> str:
        """Text for ``Reporter.health_error`` about ``stalled`` tags."""
        names = ",".join(tag_name(t) for t in stalled)
        return (
            f"step={step} stalled={names} window={self.window}: kernel_run_counter did not advance; "
            "the canary path is not executing"
        )


class StatsLogger:
    """Logs one INFO stats line every ``every`` steps (``0``: never)."""

    def __init__(self, every: int, *, labels: str = "", logger: logging.Logger | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every: expected an int >= 0; got {every!r}")
        self.every = every
        self.labels = labels  # appended to every line: which pool / group of a process's several canaries it is
        self._log = logger if logger is not None else _MODULE_LOGGER
        self._last_logged_step = 0
        # The first step at which ``due`` holds (never when ``every`` is 0): a caller's per-step test is one compare.
        self.next_due: float = every if every > 0 else float("inf")

    def due(self, step: int) -> bool:
        """Whether ``maybe_log`` at ``step`` would log (lets the manager skip gathering the numbers)."""
        return step >= self.next_due

    def maybe_log(
        self,
        step: int,
        *,
        forwards: int,
        tokens_written: int,
        entries_verified: int,
        entries_swept: int,
        violations: int,
        lost: int,
        host_tier: tuple[int, int] | None = None,
    ) -> str | None:
        """Log and return the stats line when due (``every`` steps after the last one), else return None.

        Format: ``kvcanary stats: step=S forwards=F tokens_written=W entries_verified=V entries_swept=E
        violations=N lost=L`` (cumulative counts), then ``host_backed_up=B host_loaded=H`` when the pool has a host
        KV tier (``host_tier = (B, H)``: slots whose records went to the host tier, and came back from it), then the
        ``labels`` (e.g. `` pool=draft``, `` group=swa``: a process with several canaries prints a line for each).
        """
        if not self.due(step):
            return None
        self._last_logged_step = step
        self.next_due = step + self.every
        line = (
            f"{STATS_PREFIX} step={step} forwards={forwards} tokens_written={tokens_written} "
            f"entries_verified={entries_verified} entries_swept={entries_swept} violations={violations} lost={lost}"
        )
        if host_tier is not None:
            line += f" host_backed_up={host_tier[0]} host_loaded={host_tier[1]}"
        line += self.labels
        self._log.info("%s", line)
        return line
