"""Host stagings a kernel reads in place, and when they may be written again: :class:`StagingRing`.

Three uploads pack their values into an int64 host staging that the kernel reads without a copy (pinned memory on
CUDA): the token check's (:mod:`kvcanary.runtime.token_table`), the writer serials'
(:mod:`kvcanary.runtime.serial_upload`) and the sweep plan's commits (:mod:`kvcanary.runtime.sweep_index`). A launch
may still be reading its staging when the host packs the next one, so the stagings form a ring: each is handed out
again only once an event recorded after its last launch, on that launch's stream, has completed (the host waits on
it in the rare case the device is a whole ring behind). One event may cover several launches (``event_every``): it
covers every launch queued on its stream before it, and each record is host time on the per-forward path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvcanary.runtime.streams import current_stream

logger = logging.getLogger(__name__)

# Launches per event record on CUDA: the ring records an event after every EVENT_EVERY-th launch only (an event covers
# every launch queued before it on its stream), sparing the others the record's host cost (a torch call per forward).
EVENT_EVERY = 4
# int64 values a staging holds at first (32 KiB: a decode batch of 64 rows needs 384); a batch that does not fit
# grows its staging to the next power of two.
MIN_STAGING_VALUES = 4096


class StagingEvent(Protocol):
    """What the ring needs of an event (:class:`CudaStagingEvent` on CUDA; tests inject their own). ``record`` is
    called with no argument (the current stream), or with the launches' stream when the ring is given a
    ``launch_stream``."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaStagingEvent:
    """A ``torch.cuda.Event`` recorded on ``stream``, by default ``device``'s current stream (:func:`launch_stream_of`):
    the stream tvm-ffi launches on for the table's tensors, whichever device is current (a tensor-parallel rank may
    call with another one current). A ``device`` without an index means the device current at each record, as
    ``torch.cuda.current_stream(device)`` reads it."""

    def __init__(self, device: torch.device) -> None:
        self._device_index = device.index
        self._event = torch.cuda.Event()

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        if stream is None:
            index = self._device_index
            # (streams.current_stream: on the per-forward path; torch.cuda.current_stream alone costs ~3 µs)
            stream = current_stream(index if index is not None else torch.cuda.current_device())
        self._event.record(stream)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


def launch_stream_of(device: torch.device) -> Callable[[], torch.cuda.Stream]:
    """What reads the stream a launch on ``device`` goes on, as :class:`CudaStagingEvent` records on it: the current
    stream of ``device`` (of the current device for one without an index; the same Stream object for the same
    stream, from :func:`kvcanary.runtime.streams.current_stream`'s cache)."""
    index = device.index
    if index is None:
        return lambda: current_stream(torch.cuda.current_device())
    return functools.partial(current_stream, index)


@dataclass
class Staging:
    """One staging of the ring: the buffer, a writable byte view of it, its event (recorded when its launch is the
    one that closes a group, :meth:`StagingRing.launched`), and the event covering its last launch."""

    buffer: torch.Tensor  # int64 [capacity]; pinned on CUDA
    view: Any  # ctypes byte array over buffer's memory (struct.pack_into writes through it; holds no reference)
    event: StagingEvent | None
    capacity: int  # buffer's int64 values (kept here: buffer.numel() is a torch call on every upload)
    bound: Any = None  # what the ring's ``bind`` made of buffer (a launch bound to it), None without one
    in_flight: bool = False  # a launch read buffer, not yet seen complete
    cover: StagingEvent | None = None  # in flight: the event recorded after its last launch (None: not recorded yet)


class StagingRing:
    """Host stagings that are safe to write: each is handed out again only once an event recorded after its last
    launch, on that launch's stream, has completed (queried; waited on when the device is a whole ring behind), and a
    staging too small for a batch is replaced only then, so no buffer the device may still read is ever rewritten or
    freed.

    ``pinned``: allocate pinned host memory (CUDA). ``event_factory``: None means no events (the launches read the
    staging before they return, as the CPU build's do).

    Events: the launches since the last record form a group; one event, recorded after the group's last launch,
    covers all of them, on their stream (an event completes only once all work queued on its stream before it has).
    A group is closed (its event recorded) by its ``event_every``-th launch (capped at the ring's size, so that a
    staging's group is closed by its next turn when every launch in between went through), by a launch on another
    stream than the group's (recorded on the group's stream, before the new launch joins a new group), or, should a
    staging's turn come while its group is still open (launches refused between its turns), by that turn.
    ``launch_stream``: reads the stream a launch went on (the Stream object to record on; the same object for the
    same stream); None means every launch on the current stream of one device (the tests' simulated events).

    ``bind``: called with each new staging's buffer; what it returns is the staging's ``bound`` (e.g. a launch with
    its tensors bound to that buffer once, ``canary_token_append_bind``), made again whenever a staging is replaced.

    Every staging is allocated here, at ``min_values`` int64 (default :data:`MIN_STAGING_VALUES`; a user whose batches
    are bounded passes its bound), before serving: a page-locked allocation is one of CUDA's implicit
    synchronisations, so one made on a staging's first use would wait for the device mid-serving. Only a batch larger
    than a staging still allocates then (once per size, capacities doubling).
    """

    def __init__(self, size: int, *, pinned: bool, event_factory: Callable[[], StagingEvent] | None,
                 event_every: int = 1, launch_stream: Callable[[], Any] | None = None,
                 min_values: int = MIN_STAGING_VALUES, bind: Callable[[torch.Tensor], Any] | None = None) -> None:
        if size < 1:
            raise ValueError(f"StagingRing: size must be >= 1, got {size}")
        if event_every < 1:
            raise ValueError(f"StagingRing: event_every must be >= 1, got {event_every}")
        self._next = 0
        self._min_values = min_values
        self._pinned = pinned
        self._event_factory = event_factory
        self._event_every = min(event_every, size)
        self._launch_stream = launch_stream
        self._bind = bind
        self._stream: Any = None  # the open group's stream (launch_stream's), None without launch_stream
        self._group: list[Staging] = []  # the open group: stagings launched since the last record, in launch order
        self._slots: list[Staging] = [self._new(min_values, None) for _ in range(size)]
        self.waits = 0  # stagings still read by the device when their turn came (the host waited)
        self.grows = 0  # stagings replaced by a larger one

    @property
    def size(self) -> int:
        return len(self._slots)

    def acquire(self, values: int) -> Staging:
        """The ring's next staging, no longer read by the device, holding at least ``values`` int64."""
        index = self._next
        self._next = index + 1 if index + 1 < len(self._slots) else 0
        staging = self._slots[index]
        if staging.in_flight:
            cover = staging.cover
            if cover is None:  # its group is still open (launches were refused since its turn): record its event now
                cover = self._close_group()
            if not cover.query():  # the device is a whole ring of batches behind: wait, never overwrite its input
                self.waits += 1
                cover.synchronize()
            staging.in_flight = False
            staging.cover = None
        if staging.capacity < values:
            # the old buffer is dropped only now: its last launch completed above, or it never had one
            self.grows += 1
            staging = self._slots[index] = self._new(values, staging.event)
        return staging

    def launched(self, staging: Staging) -> None:
        """``staging`` was read by a launch just queued (on the current stream): it joins the open group, and the
        group's event is recorded when this launch closes it (see the class)."""
        if staging.event is None:
            return
        staging.in_flight = True
        group = self._group
        if self._launch_stream is not None:
            stream = self._launch_stream()
            if stream is not self._stream:  # (another Stream object for the same stream: a record early, still exact)
                if group:
                    self._close_group()  # on the group's stream, which this launch is not on
                self._stream = stream
        group.append(staging)
        if len(group) >= self._event_every:
            self._close_group()

    def _close_group(self) -> StagingEvent:
        """Record the event of the open group's last staging, on the group's stream, as every group staging's cover.

        Why that event object, and why no record of it comes too early: an event is recorded only here, once per
        launch of its staging ``x`` at most, as the cover of a group whose last launch read ``x``. Its previous record
        covered a group of stagings handed out at or before the turn of ``x``'s previous launch, so each of them has
        had its next turn (the ring hands stagings out in order, each ``size`` turns after its last) and tested that
        record by the turn of ``x``'s latest launch (``x`` itself at that turn, before the launch), which came before
        this record. A record thus never replaces one that a staging still in flight is yet to be tested against
        (which would still be safe, as a later record completes later, but could make the host wait for launches
        queued after that staging's)."""
        group = self._group
        event = group[-1].event
        assert event is not None  # a group holds launched stagings, which have events
        if self._stream is None:
            event.record()
        else:
            event.record(self._stream)
        for staging in group:
            staging.cover = event
        group.clear()
        return event

    def _new(self, values: int, event: StagingEvent | None) -> Staging:
        capacity = max(self._min_values, 1 << (values - 1).bit_length())
        buffer = torch.empty(capacity, dtype=torch.int64, pin_memory=self._pinned)
        view = (ctypes.c_char * (capacity * buffer.element_size())).from_address(buffer.data_ptr())
        if event is None and self._event_factory is not None:
            event = self._event_factory()
        logger.debug("staging ring: a staging of %d values (%s)", capacity, "pinned" if self._pinned else "cpu")
        return Staging(buffer, view, event, capacity, None if self._bind is None else self._bind(buffer))


def device_events(device: torch.device, event_factory: Callable[[], StagingEvent] | None = None,
                  ) -> tuple[Callable[[], StagingEvent] | None, Callable[[], Any] | None]:
    """``(event_factory, launch_stream)`` of a ring whose launches run on ``device``: ``event_factory`` as given (tests
    inject simulated events, taken as all on one stream), else on CUDA :class:`CudaStagingEvent` recorded on the
    stream :func:`launch_stream_of` reads, and on the CPU none (the CPU build's launch has read its staging when it
    returns: no events, and a ring of one staging serves)."""
    if event_factory is None and device.type == "cuda":
        return functools.partial(CudaStagingEvent, device), launch_stream_of(device)
    return event_factory, None
