"""Device → host copies that never block the forward: preallocated pinned buffers, a side stream, events.

A ``PinnedChannel`` copies one or more (prefixes of) device tensors into its own pinned host buffer once
the work enqueued so far on the compute stream has run: the side stream waits on the compute stream,
copies each segment and records one event. A later step checks the event with a non-blocking query and
only then reads the host copy. Buffers, streams and events are allocated once, so a step costs a few
microseconds of host time. On the CPU the copy is immediate.
"""

from __future__ import annotations

import torch


class PinnedChannel:
    """One reusable device → host copy of up to ``numel`` elements of ``dtype`` in all."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device = device
        self.stream = stream
        self.host = torch.zeros(max(numel, 1), dtype=dtype, pin_memory=device.type == "cuda")
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.counts: tuple[int, ...] = ()
        self.step = 0
        self.meta: dict[str, int] = {}
        self.busy = False
        self._views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    @property
    def count(self) -> int:
        return sum(self.counts)

    def start(self, *srcs: torch.Tensor, step: int, **meta: int) -> None:
        """Copy the 1-D contiguous device tensors ``srcs`` (at most ``numel`` elements in all), back to back."""
        if self.busy:
            raise RuntimeError("PinnedChannel: a copy is already in flight")
        counts = tuple(src.numel() for src in srcs)
        if sum(counts) > self.host.numel():
            raise ValueError(f"PinnedChannel: {sum(counts)} elements do not fit the {self.host.numel()}-element buffer")
        self.counts, self.step, self.meta, self.busy = counts, step, meta, True
        if self.stream is None:
            for dst, src in zip(self._host_views(counts), srcs, strict=True):
                dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in zip(self._host_views(counts), srcs, strict=True):
                dst.copy_(src, non_blocking=True)
            assert self.event is not None
            self.event.record(self.stream)

    def _host_views(self, counts: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The host buffer's back-to-back slices for segments of ``counts`` elements (built once per layout: a
        drain reuses one or two layouts, and slicing costs host time)."""
        views = self._views.get(counts)
        if views is None:
            if len(self._views) >= 64:
                self._views.clear()
            out, at = [], 0
            for n in counts:
                out.append(self.host[at : at + n])
                at += n
            views = self._views[counts] = tuple(out)
        return views

    def ready(self) -> bool:
        return self.busy and (self.event is None or self.event.query())

    def take(self) -> list[int]:
        """The copied values, all segments back to back (call once ``ready()``); frees the channel."""
        self.busy = False
        return self.host[: self.count].tolist()

    def take_segments(self) -> list[list[int]]:
        """The copied values, one list per segment given to ``start``; frees the channel."""
        flat = self.take()
        out, at = [], 0
        for n in self.counts:
            out.append(flat[at : at + n])
            at += n
        return out


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream device → host copies run on (None on the CPU)."""
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None
