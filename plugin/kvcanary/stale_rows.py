"""Which rows of a reused input buffer may still hold an earlier fill's values (engine-agnostic).

A CUDA-graph runner keeps one set of input buffers for all its graphs: each replay fills rows ``[0, filled)`` and
its graph of ``size`` rows reads ``[0, size)``. The rows ``[filled, size)`` are padding; any of them that a larger
earlier fill wrote still holds that fill's values, which the canary must not read as a request's (sglang 0.5.12
leaves a decode graph's padded ``req_pool_indices`` stale: the adapter zeroes them before the replay,
``kvcanary.sglang.hooks``).

Zeroing every padded replay's padding is a torch call (7-11 µs of host time inside sglang's scheduler on the H200
host) on nearly every decode replay. But padding that no fill wrote since it was last zeroed is zero already: while
the batch size stands still or grows, nothing is stale. :class:`StaleRows` follows the fills and says which
rows to zero: only what a larger fill left behind, once.

It only sees the fills it is told of. A buffer written by anything else (an engine path that fills rows without
the hook that reports fills) must not be tracked: zero its whole padding on every replay instead.
"""

from __future__ import annotations


class StaleRows:
    """The rows of one buffer that may hold stale values, as one interval ``[lo, hi)`` (the hull of the truth: never
    smaller). A buffer seen first is stale everywhere (``length`` rows: what its capture or anything before left)."""

    __slots__ = ("lo", "hi", "filled")

    def __init__(self, length: int) -> None:
        self.lo, self.hi = 0, length
        self.filled = 0  # rows the last fill wrote

    def to_clear(self, filled: int, size: int) -> tuple[int, int] | None:
        """A fill wrote rows ``[0, filled)`` for a graph reading ``[0, size)``: the rows the caller must zero now (an
        interval inside ``[filled, size)``), or None; the caller zeroes them before the graph runs."""
        lo, hi = self.lo, self.hi
        previous, self.filled = self.filled, filled
        if previous > filled:  # the last fill's rows past this one are stale now
            lo, hi = (filled, previous) if lo >= hi else (min(lo, filled), max(hi, previous))
        if lo < filled:  # this fill's rows hold its own values
            lo = filled
        end = min(hi, size)
        if lo >= end:  # nothing stale inside this graph's padding
            self.lo, self.hi = lo, hi
            return None
        # cleared [lo, end); what stays stale is past the graph's rows
        self.lo, self.hi = (size, hi) if hi > size else (0, 0)
        return lo, end
