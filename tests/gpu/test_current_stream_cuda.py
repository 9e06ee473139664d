"""kvcanary.runtime.streams.current_stream on CUDA: the same stream as torch.cuda.current_stream, under stream switches,
and an event recorded on it orders after the work queued there (the token table's and the drain's stagings rely on
it)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime.streams import current_stream

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_matches_torch_under_stream_switches() -> None:
    index = torch.cuda.current_device()
    assert current_stream(index) == torch.cuda.current_stream(index)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(index) == side
        assert current_stream(index).cuda_stream == side.cuda_stream
    assert current_stream(index) == torch.cuda.current_stream(index)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_event_recorded_on_it_waits_for_the_queued_work() -> None:
    index = torch.cuda.current_device()
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        event.record(current_stream(index))
    assert not event.query()  # behind the sleep on the side stream, not on the default stream
    event.synchronize()
    assert event.query()
