"""kvcanary.runtime.health: stalled-tag detection and the periodic stats line."""

from __future__ import annotations

import logging

import pytest

from kvcanary.kernels.tags import NUM_LAUNCH_TAGS, LaunchTag
from kvcanary.runtime.health import HealthMonitor, StatsLogger

V, W, S = int(LaunchTag.VERIFY), int(LaunchTag.WRITE), int(LaunchTag.SWEEP)


def test_stalled_tag_detected_after_the_window_and_not_before() -> None:
    mon = HealthMonitor(window=4, expected_tags=[V, W])
    counts = [0] * NUM_LAUNCH_TAGS
    assert mon.observe(0, counts) == []  # baseline
    for step in range(1, 4):
        counts[V] += 1  # verify runs, write never does
        assert mon.observe(step, counts) == [], step
    counts[V] += 1
    assert mon.observe(4, counts) == [W]
    assert mon.checks == 1


def test_healthy_tags_pass_every_window() -> None:
    mon = HealthMonitor(window=3, expected_tags=[V, W])
    counts = [0, 0, 0]
    for step in range(30):
        counts[V] += 1
        counts[W] += 1
        assert mon.observe(step, counts) == []
    assert mon.checks == 9


def test_tag_that_stops_is_caught_by_the_next_full_window() -> None:
    mon = HealthMonitor(window=5, expected_tags=[V])
    counts = [0, 0, 0]
    stalled_at = []
    for step in range(30):
        if step < 7:
            counts[V] += 1
        if mon.observe(step, counts):
            stalled_at.append(step)
    # checks at 5, 10, 15, ...; the window 5..10 saw steps 6 (advance) so passes; 10..15 is the first stalled one
    assert stalled_at == [15, 20, 25]


def test_progress_in_only_one_step_of_the_window_is_enough() -> None:
    mon = HealthMonitor(window=10, expected_tags=[S])
    counts = [0, 0, 0]
    results = []
    for step in range(41):
        if step % 10 == 3:  # a sweep every 10 steps
            counts[S] += 1
        results.append(mon.observe(step, counts))
    assert all(r == [] for r in results)


def test_set_expected_restarts_the_window() -> None:
    mon = HealthMonitor(window=2, expected_tags=[V])
    counts = [0, 0, 0]
    mon.observe(0, counts)
    counts[V] += 1
    mon.observe(1, counts)
    mon.set_expected([V, S])  # sweep turned on: its baseline starts now
    counts[V] += 1
    assert mon.observe(2, counts) == []  # new baseline
    counts[V] += 1
    counts[S] += 1
    assert mon.observe(3, counts) == []
    counts[V] += 1
    assert mon.observe(4, counts) == []  # sweep advanced within 2..4
    counts[V] += 1
    assert mon.observe(5, counts) == []
    counts[V] += 1
    assert mon.observe(6, counts) == [S]
    mon.set_expected([])
    for step in range(7, 20):
        assert mon.observe(step, counts) == []


def test_counter_going_backwards_is_not_progress() -> None:
    mon = HealthMonitor(window=1, expected_tags=[W])
    assert mon.observe(0, [0, 10, 0]) == []
    assert mon.observe(1, [0, 3, 0]) == [W]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        HealthMonitor(window=0, expected_tags=[V])
    with pytest.raises(ValueError):
        HealthMonitor(window=True, expected_tags=[V])
    with pytest.raises(ValueError):
        HealthMonitor(window=3, expected_tags=[-1])
    mon = HealthMonitor(window=3, expected_tags=[S])
    with pytest.raises(ValueError, match="entries"):
        mon.observe(0, [1, 2])


def test_message_names_tags() -> None:
    mon = HealthMonitor(window=100, expected_tags=[V, W])
    text = mon.message([W, S], step=300)
    assert "stalled=write,sweep" in text and "step=300" in text and "window=100" in text


def test_stats_logger_period(caplog: pytest.LogCaptureFixture) -> None:
    stats = StatsLogger(every=3)
    numbers = dict(forwards=1, tokens_written=2, entries_verified=3, entries_swept=4, violations=5, lost=6)
    with caplog.at_level(logging.INFO, logger="kvcanary.runtime.health"):
        lines = {step: stats.maybe_log(step, **numbers) for step in range(1, 11)}
    assert [s for s, line in lines.items() if line is not None] == [3, 6, 9]
    assert lines[3] == (
        "kvcanary stats: step=3 forwards=1 tokens_written=2 entries_verified=3 entries_swept=4 violations=5 lost=6"
    )
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.getMessage() for r in infos] == [lines[3], lines[6], lines[9]]


def test_stats_logger_ends_its_line_with_its_labels() -> None:
    """A process with several canaries (EAGLE's target and draft pools, an SWA pool's groups) prints a line for each:
    the labels say whose it is, after the counters (a parser reading the counters by name is unaffected)."""
    numbers = dict(forwards=1, tokens_written=2, entries_verified=3, entries_swept=4, violations=5, lost=6)
    line = StatsLogger(every=1, labels=" pool=draft").maybe_log(1, **numbers, host_tier=(7, 8))
    assert line == ("kvcanary stats: step=1 forwards=1 tokens_written=2 entries_verified=3 entries_swept=4 "
                    "violations=5 lost=6 host_backed_up=7 host_loaded=8 pool=draft")


def test_stats_logger_off_and_skipped_steps(caplog: pytest.LogCaptureFixture) -> None:
    numbers = dict(forwards=0, tokens_written=0, entries_verified=0, entries_swept=0, violations=0, lost=0)
    off = StatsLogger(every=0)
    with caplog.at_level(logging.INFO, logger="kvcanary.runtime.health"):
        assert all(off.maybe_log(step, **numbers) is None for step in range(100))
    assert not caplog.records
    stats = StatsLogger(every=10)
    logged = [step for step in (4, 9, 13, 17, 22, 23, 40) if stats.maybe_log(step, **numbers)]
    assert logged == [13, 23, 40]
    with pytest.raises(ValueError):
        StatsLogger(every=-1)
