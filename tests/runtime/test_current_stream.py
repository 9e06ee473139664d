"""kvcanary.runtime.streams.current_stream: torch's current stream, its Stream object built once per raw handle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvcanary.runtime import streams


@dataclass
class FakeStream:
    cuda_stream: int
    device_index: int


@pytest.fixture
def fake_torch(monkeypatch):
    """A current raw stream per device the test sets, and a count of the (slow) Stream objects built."""
    current = {0: 0x10, 1: 0x20}
    built = []

    def slow_current_stream(index):
        built.append(index)
        return FakeStream(current[index], index)

    monkeypatch.setattr(streams, "_raw_stream", lambda index: current[index])
    monkeypatch.setattr(streams.torch.cuda, "current_stream", slow_current_stream)
    monkeypatch.setattr(streams, "_STREAMS", {})
    return current, built


def test_the_stream_object_is_built_once_per_device_and_handle(fake_torch) -> None:
    current, built = fake_torch
    first = streams.current_stream(0)
    assert first == FakeStream(0x10, 0)
    assert streams.current_stream(0) is first  # cached: no second slow read
    assert built == [0]
    current[0] = 0x30  # the engine switched streams (torch.cuda.stream(s))
    assert streams.current_stream(0) == FakeStream(0x30, 0)
    assert streams.current_stream(1) == FakeStream(0x20, 1)  # same cache, other device: its own entry
    current[0] = 0x10  # back: the first object again
    assert streams.current_stream(0) is first
    assert built == [0, 0, 1]


def test_a_handle_the_slow_read_does_not_confirm_is_not_cached(fake_torch, monkeypatch) -> None:
    current, built = fake_torch
    def unconfirmed(index):
        built.append(index)
        return FakeStream(0x99, index)

    monkeypatch.setattr(streams.torch.cuda, "current_stream", unconfirmed)
    assert streams.current_stream(0) == FakeStream(0x99, 0)  # torch's answer stands
    assert streams.current_stream(0) == FakeStream(0x99, 0)
    assert built == [0, 0]  # never cached under the raw handle it does not match


def test_the_cache_is_bounded(fake_torch) -> None:
    current, built = fake_torch
    for handle in range(streams._MAX_CACHED_STREAMS + 5):
        current[0] = 0x1000 + handle
        streams.current_stream(0)
    assert len(streams._STREAMS) <= streams._MAX_CACHED_STREAMS
