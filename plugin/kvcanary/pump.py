"""Device → host copies that never block the forward: pinned buffers, a side stream and an event.

A snapshot is taken after a forward's work is enqueued: the side stream waits on the compute stream,
copies the tensors into pinned host memory and records an event. A later step checks the event
(``ready()``, a non-blocking query) and only then reads the host copies. On the CPU the copy is
immediate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Snapshot:
    """Host copies of some device tensors, valid once ``ready()``."""

    values: dict[str, torch.Tensor]
    step: int
    event: torch.cuda.Event | None = None
    keep_alive: list[torch.Tensor] = field(default_factory=list)

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class DevicePump:
    """Schedules snapshots of device tensors on a side stream (CUDA) or copies at once (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def snapshot(self, tensors: dict[str, torch.Tensor], *, step: int) -> Snapshot:
        """Copy `tensors` (device) to fresh host tensors once the work enqueued so far has run."""
        if not self.cuda:
            return Snapshot({k: v.detach().clone() for k, v in tensors.items()}, step)
        assert self.stream is not None
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        host: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.stream):
            for name, t in tensors.items():
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out.copy_(t, non_blocking=True)
                host[name] = out
            event = torch.cuda.Event()
            event.record(self.stream)
        # The sources are read on the side stream: keep torch's allocator from reusing them too early.
        for t in tensors.values():
            t.record_stream(self.stream)
        return Snapshot(host, step, event, keep_alive=list(tensors.values()))
