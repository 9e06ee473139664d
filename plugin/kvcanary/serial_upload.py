"""The upload of writer serials (kvcanary+): ``row_serials[rows[i]] = serials[i]`` on the device, per prefill batch.

:meth:`kvcanary.device_state.DeviceState.upload_row_serials` runs it whenever rows get new requests (the batch hook
of every prefill). Per call: the rows and serials are packed into a host staging of the token table's
:class:`~kvcanary.token_table.StagingRing` (pinned on CUDA, reused once the copy that read it has completed), copied
to the device without blocking, and scattered with one ``index_put_``. What it replaced cost a ``torch.tensor`` of
the values and, on CUDA, a ``pin_memory()`` copy of it (a pinned allocation per batch) before the same copy and
scatter.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence

import torch

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

    def __call__(self, rows: Sequence[int], serials: Sequence[int]) -> None:
        """Rows repeated in one call: as ``index_put_`` leaves them (the later one on the CPU)."""
        m = len(rows)
        if m != len(serials):
            raise ValueError(f"upload_row_serials: {m} rows but {len(serials)} serials")
        if not m:
            return
        staging = self.staging.acquire(2 * m)
        _pack_into(f"{2 * m}q", staging.view, 0, *rows, *serials)
        values = staging.buffer[: 2 * m]
        if self._copies:
            values = values.to(self._device, non_blocking=True)
        self._row_serials.index_put_((values[:m],), values[m:])
        self.staging.launched(staging)  # after the copy that reads the staging
