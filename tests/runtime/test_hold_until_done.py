"""``kvcanary.runtime.streams.update_after_producer``'s hold, on the CPU with stand-in events and streams: the
producer tensors an update read stay referenced until an event recorded after it completes, completed events are
recorded again rather than made anew, and a consumer that many updates behind is waited for, never outgrown.
The CUDA behaviour (the allocator's reuse, the order of the two streams) is tests/gpu/test_sweep_streams.py's."""

from __future__ import annotations

import weakref

import pytest
import torch

from kvcanary.runtime import streams


class FakeEvent:
    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.done = False
        self.records = 0
        self.synchronized = 0

    def record(self, stream=None) -> None:
        self.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.device_index = 0
        self.waited: list[FakeEvent] = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class Held:  # a stand-in producer tensor that a weak reference can follow
    pass


@pytest.fixture()
def fake_cuda(monkeypatch):
    FakeEvent.made = 0
    consumer, producer = FakeStream(1), FakeStream(2)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(streams, "_HELD", {})
    monkeypatch.setattr(streams, "_PRODUCER_DONE", {})
    monkeypatch.setattr(streams, "current_stream", lambda index: consumer)
    return consumer, producer


def test_reads_are_held_until_the_event_after_the_update_completes(fake_cuda) -> None:
    consumer, producer = fake_cuda
    ran = []
    node = Held()
    ref = weakref.ref(node)
    streams.update_after_producer(producer, lambda: ran.append(1), [node])
    del node
    assert ran == [1] and ref() is not None and streams.held_updates() == 1
    assert consumer.waited and not producer.waited  # the consumer waits for the producer, never the other way
    event = streams._HELD[consumer.cuda_stream][0][0]
    event.done = True
    streams.update_after_producer(producer, lambda: None, [])  # the next update drops what completed ...
    assert ref() is None and streams.held_updates() == 1
    assert FakeEvent.made == 2  # (the producer's order event, one hold event: recorded again, not made anew)


def test_a_consumer_that_many_updates_behind_is_waited_for(fake_cuda) -> None:
    consumer, producer = fake_cuda
    for _ in range(streams._MAX_HELD):
        streams.update_after_producer(producer, lambda: None, [Held()])
    assert streams.held_updates() == streams._MAX_HELD
    oldest = streams._HELD[consumer.cuda_stream][0][0]
    streams.update_after_producer(producer, lambda: None, [Held()])
    assert oldest.synchronized == 1 and streams.held_updates() == streams._MAX_HELD


def test_no_producer_or_the_producer_current_runs_the_update_as_is(fake_cuda) -> None:
    consumer, _ = fake_cuda
    ran = []
    streams.update_after_producer(None, lambda: ran.append("none"), [Held()])
    streams.update_after_producer(consumer, lambda: ran.append("same"), [Held()])
    assert ran == ["none", "same"] and streams.held_updates() == 0 and not consumer.waited
