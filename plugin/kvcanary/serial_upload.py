"""The upload of writer serials (kvcanary+): ``row_serials[rows[i]] = serials[i]`` on the device, per prefill batch.

:meth:`kvcanary.device_state.DeviceState.upload_row_serials` runs it whenever rows get new requests (the batch hook
of every prefill). Per call: the rows and serials are packed into a host staging of the token table's
:class:`~kvcanary.token_table.StagingRing` (pinned on CUDA, reused once the copy that read it has completed), copied
to the device without blocking, and scattered with one ``index_put_``. What it replaced cost a ``torch.tensor`` of
the values and, on CUDA, a ``pin_memory()`` copy of it (a pinned allocation per batch) before the same copy and
scatter.

Host cost: two torch calls per upload (the copy, the scatter) and an event record. Each staging of the ring has its
own device buffer, and the tensor views an upload of ``m`` rows needs (the staging's and the device buffer's first
``2m`` values, the rows and the serials) are built once per staging and ``m``: a slice or a ``.to()`` is a torch
call of its own, 7-11 µs of host time on the H200 host, where the batch hook measured ~110 µs per prefill batch.
A device buffer is rewritten only when its staging is handed out again, i.e. after the event recorded behind the
scatter that read it has completed (:class:`~kvcanary.token_table.StagingRing`), whichever stream the next upload
runs on.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence

import torch

from kvcanary.identity_cache import IdentityCache
from kvcanary.token_table import CudaStagingEvent, StagingEvent, StagingRing

# Stagings in the ring on CUDA: a staging is rewritten RING_SIZE prefills later (see kvcanary.token_table.RING_SIZE).
RING_SIZE = 4

_pack_into = struct.pack_into


class RowSerialUpload:
    """``row_serials[rows[i]] = serials[i]`` into ``row_serials`` (int64 ``[rows]``, keeps its address), non-blocking.

    ``event_factory`` as in :class:`~kvcanary.token_table.TokenTable` (default: CUDA events on CUDA; on the CPU the
    scatter has read the staging when the call returns: no events, one staging).
    """

    def __init__(self, row_serials: torch.Tensor, *,
                 event_factory: Callable[[], StagingEvent] | None = None) -> None:
        device = row_serials.device
        if event_factory is None and device.type == "cuda":
            event_factory = functools.partial(CudaStagingEvent, device)
        self._row_serials = row_serials
        self._device = device
        self._copies = device.type != "cpu"  # the scatter reads a device copy of the staging (else the staging)
        self.staging = StagingRing(RING_SIZE if event_factory is not None else 1, pinned=device.type == "cuda",
                                   event_factory=event_factory)
        # (staging, None) -> its device buffer; (staging, m) -> (host values, device values, rows, serials)
        self._views = IdentityCache(1024)

    def __call__(self, rows: Sequence[int], serials: Sequence[int]) -> None:
        """Rows repeated in one call: as ``index_put_`` leaves them (the later one on the CPU)."""
        m = len(rows)
        if m != len(serials):
            raise ValueError(f"upload_row_serials: {m} rows but {len(serials)} serials")
        if not m:
            return
        staging = self.staging.acquire(2 * m)
        _pack_into(f"{2 * m}q", staging.view, 0, *rows, *serials)
        host, device, row_view, serial_view = self._views_for(staging, m)
        if device is not None:
            device.copy_(host, non_blocking=True)
        self._row_serials.index_put_((row_view,), serial_view)
        self.staging.launched(staging)  # after the copy that reads the staging

    def _views_for(self, staging, m: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The staging's first ``2m`` values, the device copy's (None on the CPU: the scatter reads the staging),
        and the rows and serials the scatter reads; built once per staging and ``m``."""
        views = self._views.get(staging, m)
        if views is None:
            device = None
            if self._copies:  # the staging's own device buffer (a replaced staging's goes with the cache's restart)
                device = self._views.get(staging)
                if device is None:
                    device = self._views.put(staging, None, torch.empty_like(staging.buffer, device=self._device))
                device = device[: 2 * m]
            host = staging.buffer[: 2 * m]
            values = device if device is not None else host
            views = self._views.put(staging, m, (host, device, values[:m], values[m:]))
        return views
