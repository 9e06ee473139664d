"""PinnedChannel on CUDA: a copy started behind queued work reads the values that work leaves, on the stream current
at the start; the host never waits for it (the event says when it landed)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime.pump import PinnedChannel

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copy_behind_queued_work_reads_what_that_work_wrote() -> None:
    dev = torch.device("cuda")
    channel = PinnedChannel(8, torch.int64, dev)
    src = torch.zeros(6, dtype=torch.int64, device=dev)
    meta = torch.zeros(2, dtype=torch.int64, device=dev)
    for round_ in range(3):  # the buffers and events are reused
        torch.cuda._sleep(100_000_000)  # the writes below run well after start() returns
        src.fill_(10 + round_)
        meta.fill_(20 + round_)
        channel.start(src, meta[:1], step=round_)
        assert not channel.ready()  # still queued behind the sleep: start did not wait for it
        channel.event.synchronize()
        assert channel.ready()
        assert channel.take_segments() == [[10 + round_] * 6, [20 + round_]]
        assert not channel.busy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compute_stream_copy_runs_on_the_stream_current_at_start() -> None:
    dev = torch.device("cuda")
    channel = PinnedChannel(4, torch.int64, dev)
    engine_stream = torch.cuda.Stream()
    src = torch.zeros(4, dtype=torch.int64, device=dev)
    engine_stream.wait_stream(torch.cuda.current_stream())  # src's zero fill first
    with torch.cuda.stream(engine_stream):  # an engine's forward stream (sglang's overlap scheduler has one)
        torch.cuda._sleep(100_000_000)
        src.fill_(5)
        channel.start(src, step=1)
    assert not channel.ready()
    engine_stream.synchronize()
    assert channel.ready() and channel.take() == [5] * 4
