"""Reading tensors that another CUDA stream produces and frees (engine-agnostic).

A serving engine keeps some device tensors on its *scheduler* stream: sglang's RadixCache node values, for
example, are created there (``.to(int64, copy=True)``, ``.clone()`` on a node split) and dropped there (a split
replaces a node's value, eviction frees it). The canary's sweep runs from the forward hook, where the current
stream is the engine's *forward* stream. Reading the scheduler's tensors with a kernel enqueued on the forward
stream is a use-after-free waiting to happen: PyTorch's caching allocator hands a freed block back to the next
allocation **on the stream the block belongs to** at once, without waiting for work another stream still has
queued on it. When the forward stream lags behind the host (a tensor-parallel rank waiting in an all-reduce
for a slower rank), the scheduler frees a node value, reuses its block for the next request's slot copy, and
the sweep's gather, still queued on the forward stream, reads the other request's slots. The sweep then
reports violations on slots nobody corrupted (seen on the H200 at tp=2, issue 11).

:func:`run_on_producer_stream` runs the reads on the producer stream instead, where they are ordered before any
later free and reuse of those blocks, then makes the consumer stream wait for them and marks the results as
used by the consumer stream (so the producer's allocator cannot recycle them early either). Host cost: a
stream switch, one event wait and one ``record_stream`` per result, whatever the number of tensors read.

:func:`update_after_producer` is for device state the consumer stream owns and updates from the producer's tensors
(the incremental sweep plan): the update runs on the consumer stream after the producer's queued work, and the
producer tensors it reads are held until it has run, so the producer never waits for the consumer (a wait there
holds back what the engine queues on its scheduler stream next: issue 28's decode TTFT).

:func:`current_stream` is ``torch.cuda.current_stream(device)`` at a fraction of its host cost, for the event
records on the per-forward path (measured on the H200 host, torch 2.11: ``torch.cuda.current_stream(dev)`` 3.0 µs,
``event.record()`` with no stream 5.0 µs, ``event.record(stream)`` with a stream object at hand 0.8 µs).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T", bound=Sequence[torch.Tensor])

# (device index, raw cudaStream_t) -> its torch.cuda.Stream. Streams an engine runs on are few and live as long as
# the process (torch's pool streams are never destroyed), so the cache stays small; it is emptied if it ever grows.
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_MAX_CACHED_STREAMS = 64


def current_stream(device_index: int) -> torch.cuda.Stream:
    """The current stream of CUDA device ``device_index``, as ``torch.cuda.current_stream(device_index)`` gives it.

    Why: building the Stream object is most of the cost of ``current_stream`` (~3 µs of host time per call, an
    event record per forward pays it). Here the raw stream handle is read (~0.1 µs) and its Stream object, built
    once, is reused: an event recorded on it is recorded on that very handle, which is what makes reuse exact (the
    handle, not the Python object, is what CUDA records on)."""
    raw = _raw_stream(device_index)
    key = (device_index, raw)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = torch.cuda.current_stream(device_index)
        if stream.cuda_stream != raw:  # (never seen: the two reads are of one thread's current stream)
            return stream
        if len(_STREAMS) >= _MAX_CACHED_STREAMS:
            _STREAMS.clear()
        _STREAMS[key] = stream
    return stream


def _raw_stream_fallback(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# torch's own raw-handle read (what Triton's launcher calls); a torch without it takes the slow path.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _raw_stream_fallback


def run_on_producer_stream(producer: torch.cuda.Stream | None, read: Callable[[], T]) -> T:
    """``read()`` with ``producer`` as the current stream, its tensor results handed over to the caller's stream.

    ``read`` gathers from tensors that ``producer`` created and may free; it must return a sequence of tensors
    it allocated. With ``producer`` None (CPU, no engine stream known yet) or already current, ``read()`` runs
    as is. Never synchronises the host.
    """
    consumer = _other_consumer(producer)
    if consumer is None:
        return read()
    results = _on_stream(producer, consumer, read)
    producer_done = _producer_done(producer)
    producer_done.record(producer)
    consumer.wait_event(producer_done)
    for tensor in results:
        if tensor.is_cuda:
            tensor.record_stream(consumer)
    return results


def update_after_producer(producer: torch.cuda.Stream | None, update: Callable[[], None],
                          reads: Sequence[torch.Tensor]) -> None:
    """``update()`` on the caller's (consumer) stream, after everything ``producer`` has queued so far; ``reads``, the
    tensors of ``producer``'s that ``update`` reads, are kept from the caching allocator until ``update``'s device work
    has run.

    For device state only the consumer stream reads and writes (an incremental sweep plan, which the forward stream
    verifies), updated from tensors ``producer`` makes and frees (the prefix cache's node values): the consumer's
    earlier and later reads of the state are in its own stream order, the reads of ``producer``'s tensors come after
    ``producer`` made them, and a tensor ``producer`` frees meanwhile keeps its block until the update has read it
    (held here, released once an event recorded after the update has completed). ``producer`` never waits for the
    consumer: a wait there would hold back everything the engine queues on ``producer`` next (sglang prepares the next
    batch on its schedule stream) until the forward in flight has run (issue 28: ~10 ms of decode TTFT on an 8B
    model). With ``producer`` None or current, ``update()`` runs as is. Never synchronises the host.
    """
    consumer = _other_consumer(producer)
    if consumer is None:
        update()
        return
    producer_done = _producer_done(producer)
    producer_done.record(producer)
    consumer.wait_event(producer_done)
    update()
    _hold_until_done(consumer, reads)


# consumer stream handle -> [(event recorded after an update, the producer tensors it read)], oldest first: held so
# that the caching allocator cannot hand their blocks to the producer's next allocation while the update is queued.
_HELD: dict[int, collections.deque[tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]]] = {}
_MAX_HELD = 64  # updates whose reads are held at once per consumer (past it, the oldest is waited for)


def _hold_until_done(consumer: torch.cuda.Stream, reads: Sequence[torch.Tensor]) -> None:
    """Keep ``reads`` alive until the consumer's work enqueued so far has run; drop what earlier calls held once
    their events completed (one event query per held update, one record per call)."""
    held = _HELD.get(consumer.cuda_stream)
    if held is None:  # (one per consumer stream: an engine's forward streams are few and live as long as it)
        held = _HELD[consumer.cuda_stream] = collections.deque()
    spare = None  # a completed event, recorded again below (an Event object and its CUDA event are made once)
    while held and held[0][0].query():
        spare = held.popleft()[0]
    if len(held) >= _MAX_HELD:  # (the consumer is that many updates behind: wait, rather than grow without bound)
        spare = held.popleft()[0]
        spare.synchronize()
    event = spare if spare is not None else torch.cuda.Event()
    event.record(consumer)
    held.append((event, tuple(reads)))


def held_updates() -> int:
    """Updates whose producer tensors are still held (tests and diagnostics)."""
    return sum(len(held) for held in _HELD.values())


# (A sweep's host cost, the reason for the helpers below: the order between the streams uses an event made once per
# producer and re-recorded, where wait_stream makes one per call, and the switch a plain set_stream pair, where the
# stream context also builds Stream objects: each torch call here is ~12-16 µs in the H200 engine's scheduler.)
# producer stream handle -> the event recorded after the producer's work so far, for both functions above.
# Re-recording an event is safe while a wait on its previous record is still queued (a wait takes the record it
# sees when it is enqueued). Few producers exist (a scheduler stream per engine), so the cache stays small.
_PRODUCER_DONE: dict[int, torch.cuda.Event] = {}


def _producer_done(producer: torch.cuda.Stream) -> torch.cuda.Event:
    event = _PRODUCER_DONE.get(producer.cuda_stream)
    if event is None:
        if len(_PRODUCER_DONE) >= _MAX_CACHED_STREAMS:
            _PRODUCER_DONE.clear()
        event = _PRODUCER_DONE[producer.cuda_stream] = torch.cuda.Event()
    return event


def _on_stream(stream: torch.cuda.Stream, current: torch.cuda.Stream, fn: Callable[[], T]) -> T:
    """``fn()`` with ``stream`` current, then ``current`` (the caller's current stream on that device) again."""
    if stream.device_index != torch.cuda.current_device():
        with torch.cuda.stream(stream):  # (switches the device too, and back)
            return fn()
    torch.cuda.set_stream(stream)  # (set_stream also makes the stream's device current: it is already)
    try:
        return fn()
    finally:
        torch.cuda.set_stream(current)


def _other_consumer(producer: torch.cuda.Stream | None) -> torch.cuda.Stream | None:
    """The caller's current stream on ``producer``'s device when it is another stream than ``producer``; None when
    there is nothing to order (no producer: CPU or no engine stream yet; or the producer is current)."""
    if producer is None:
        return None
    consumer = current_stream(producer.device_index)
    return None if consumer.cuda_stream == producer.cuda_stream else consumer
