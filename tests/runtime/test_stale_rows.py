"""StaleRows: after any sequence of fills, zeroing what it says leaves every padded row a graph reads zero, and it
asks for no zeroing while the fills stand still or grow (checked against a row-by-row model of the buffer)."""

from __future__ import annotations

import random

import pytest

from kvcanary.stale_rows import StaleRows


def replay(buffer: list[int], tracker: StaleRows, filled: int, size: int, value: int) -> tuple[int, int] | None:
    buffer[:filled] = [value] * filled  # the fill: the real rows
    cleared = tracker.to_clear(filled, size)
    if cleared is not None:
        lo, hi = cleared
        assert filled <= lo < hi <= size  # only padding this graph reads
        buffer[lo:hi] = [0] * (hi - lo)
    return cleared


@pytest.mark.parametrize("seed", range(20))
def test_every_padded_row_a_graph_reads_is_zero(seed: int) -> None:
    rng = random.Random(seed)
    length = 16
    buffer = [rng.randint(1, 9) for _ in range(length)]  # capture left anything
    tracker = StaleRows(length)
    for step in range(300):
        size = rng.choice((1, 2, 4, 8, 16))
        filled = rng.randint(0, size)
        replay(buffer, tracker, filled, size, 100 + step)
        assert buffer[filled:size] == [0] * (size - filled), (step, filled, size, buffer)


def test_no_zeroing_while_the_batch_stands_still_or_grows() -> None:
    buffer = [7] * 8
    tracker = StaleRows(8)
    assert replay(buffer, tracker, 2, 8, 1) == (2, 8)  # first sight: the capture's leftovers
    assert replay(buffer, tracker, 2, 8, 1) is None
    assert replay(buffer, tracker, 3, 4, 1) is None  # grows
    assert replay(buffer, tracker, 3, 4, 1) is None
    assert replay(buffer, tracker, 2, 4, 1) == (2, 3)  # shrinks: only the row the larger fill left
    assert replay(buffer, tracker, 2, 4, 1) is None
    assert replay(buffer, tracker, 2, 8, 1) is None  # a larger graph: its padding is zero already


def test_the_stale_interval_is_a_hull_never_smaller_than_the_truth() -> None:
    buffer = [7] * 8
    tracker = StaleRows(8)
    assert replay(buffer, tracker, 2, 4, 1) == (2, 4)  # rows 4..8 stay stale (the graph does not read them)
    assert replay(buffer, tracker, 3, 4, 1) is None
    # the fill of 3 left row 2 stale; with 4..8 one interval [2, 8): row 3, zero already, is cleared again
    assert replay(buffer, tracker, 2, 4, 1) == (2, 4)
    assert buffer == [1, 1, 0, 0, 7, 7, 7, 7]


def test_rows_past_a_small_graph_stay_stale_for_a_larger_one() -> None:
    buffer = [0] * 8
    tracker = StaleRows(0)  # (a buffer known zero: nothing stale at first)
    assert replay(buffer, tracker, 8, 8, 5) is None
    assert replay(buffer, tracker, 1, 2, 5) == (1, 2)  # the small graph reads one padded row
    assert replay(buffer, tracker, 1, 8, 5) == (2, 8)  # the rest, left by the fill of 8, when a graph reads them
    assert buffer == [5] + [0] * 7
