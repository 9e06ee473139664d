"""Device → host copies that never block the host: preallocated pinned buffers, stream-ordered copies, events.

A ``PinnedChannel`` copies one or more (prefixes of) device tensors into its own pinned host buffer once the work
enqueued so far has run. A later step checks the channel's event with a non-blocking query and only then reads the
host copy. Buffers and events are allocated once. On the CPU the copy is immediate.

Which stream copies. By default (``stream=None``) the stream current when the copy starts: the engine's compute
stream, where the copy is ordered after the forward's kernels with nothing else to arrange. Each start is one
``copy_`` per segment and one event record. With a side stream the copy also needs a fence (an event recorded on
the compute stream that the side stream waits for) and two stream switches: about three more driver calls. On the
H200 host one call costs 7-11 µs, and inside sglang's scheduler process a drain measured ~120 µs of host time
(2026-11-30, the e2e loop probe). What the side stream buys is little: the copy is a few KiB, ~2-3 µs of device
time once per drain period, which the compute stream now spends in line.
"""

from __future__ import annotations

import torch


class PinnedChannel:
    """One reusable device → host copy of up to ``numel`` elements of ``dtype`` in all.

    ``stream``: the CUDA stream the copies run on, after a fence on the stream current at ``start``; ``None``
    (the default): the current stream itself (see the module docstring). Ignored on the CPU.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.stream = stream if cuda else None
        self.host = torch.zeros(max(numel, 1), dtype=dtype, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        # the side stream's wait on the compute stream: one event, recorded again at every start (wait_stream
        # would create a new event object per call)
        self._fence = torch.cuda.Event() if self.stream is not None else None
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
        views = self._host_views(counts)
        event = self.event
        if event is None:  # CPU: the copy is done when copy_ returns
            for dst, src in zip(views, srcs, strict=True):
                dst.copy_(src)
            return
        stream = self.stream
        if stream is None:  # the current (compute) stream: ordered after everything enqueued on it so far
            for dst, src in zip(views, srcs, strict=True):
                dst.copy_(src, non_blocking=True)
            event.record()
            return
        fence = self._fence
        assert fence is not None
        fence.record()
        stream.wait_event(fence)
        with torch.cuda.stream(stream):
            for dst, src in zip(views, srcs, strict=True):
                dst.copy_(src, non_blocking=True)
            event.record(stream)

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
    """A side stream for device → host copies (None on the CPU); a PinnedChannel uses the compute stream without
    one."""
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None
