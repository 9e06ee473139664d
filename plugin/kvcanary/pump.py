"""Device → host copies that never block the forward: preallocated pinned buffers, a side stream, events.

A ``PinnedChannel`` copies a (prefix of a) device tensor into its own pinned host buffer once the work
enqueued so far on the compute stream has run: the side stream waits on the compute stream, copies and
records an event. A later step checks the event with a non-blocking query and only then reads the host
copy. Buffers, streams and events are allocated once, so a step costs a few microseconds of host time.
On the CPU the copy is immediate.
"""

from __future__ import annotations

import torch


class PinnedChannel:
    """One reusable device → host copy of up to ``numel`` elements of ``dtype``."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device = device
        self.stream = stream
        self.host = torch.zeros(max(numel, 1), dtype=dtype, pin_memory=device.type == "cuda")
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.count = 0
        self.step = 0
        self.meta: dict[str, int] = {}
        self.busy = False

    def start(self, src: torch.Tensor, *, step: int, **meta: int) -> None:
        """Copy the 1-D contiguous device tensor ``src`` (at most ``numel`` elements)."""
        if self.busy:
            raise RuntimeError("PinnedChannel: a copy is already in flight")
        n = src.numel()
        self.count, self.step, self.meta, self.busy = n, step, meta, True
        if self.stream is None:
            self.host[:n].copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.host[:n].copy_(src, non_blocking=True)
            assert self.event is not None
            self.event.record(self.stream)

    def ready(self) -> bool:
        return self.busy and (self.event is None or self.event.query())

    def take(self) -> list[int]:
        """The copied values (call once ``ready()``); frees the channel for the next copy."""
        self.busy = False
        return self.host[: self.count].tolist()


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream device → host copies run on (None on the CPU)."""
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None
