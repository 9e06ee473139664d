"""The tp=2 sweep false positive (issue 11), reproduced on a GPU: a gather of tensors that another stream owns.

sglang's scheduler keeps RadixCache node values on its scheduler stream and frees them there (a node split
replaces the value with a clone); the canary's sweep ran on the forward stream. When the forward stream lags (a
tensor-parallel rank waiting in an all-reduce), the freed block is reused by the scheduler stream before the
sweep's queued gather reads it, and the sweep verifies another request's slots. ``run_on_producer_stream``
gathers on the owning stream instead.
"""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime.streams import run_on_producer_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAG_CYCLES = 200_000_000  # ~0.1 s of torch.cuda._sleep on the consumer stream: the forward stream lags behind


def _gather_then_reuse(fixed: bool) -> tuple[list[int], list[int]]:
    """Node values made on the producer stream; a lagging consumer gathers them (on its own stream or, fixed, on
    the producer's); the producer then frees the values and reuses their blocks. Returns (expected, gathered)."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        nodes = [torch.arange(1000 + 100 * i, 1000 + 100 * i + 89, dtype=torch.int64, device="cuda") for i in range(8)]
    expected = torch.cat(nodes).tolist()  # (synchronises: the values are complete before the race starts)

    def read() -> tuple[torch.Tensor]:
        return (torch.cat(nodes),)

    with torch.cuda.stream(consumer):
        torch.cuda._sleep(LAG_CYCLES)
        (slots,) = run_on_producer_stream(producer, read) if fixed else read()
        gathered = slots.clone()  # the sweep's copy into its plan, on the consumer stream
    del slots
    nodes.clear()  # the scheduler drops the node values (a split clones them; eviction frees them) ...
    with torch.cuda.stream(producer):  # ... and its next slot copies reuse their blocks at once
        reused = [torch.full((89,), -7, dtype=torch.int64, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    del reused
    return expected, gathered.tolist()


def test_gather_on_the_producer_stream_reads_the_values_it_was_given() -> None:
    expected, gathered = _gather_then_reuse(fixed=True)
    assert gathered == expected


def test_the_race_is_real_without_it() -> None:
    """The harness reproduces the hazard: gathered on the lagging consumer stream, the values are gone."""
    expected, gathered = _gather_then_reuse(fixed=False)
    assert gathered != expected, "the caching allocator did not reuse the freed blocks; the race was not exercised"


def _update_behind_a_queued_read(ordered: bool) -> tuple[list[int], list[int]]:
    """A plan the consumer stream reads (a sweep's verify, queued behind a lag) and the producer rewrites (the
    incremental sweep plan's update from node values, kvcanary.sglang.radix_index). Returns (queued read, later
    read)."""
    from kvcanary.runtime.streams import update_on_producer_stream

    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    plan = torch.arange(4096, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()

    def update() -> None:
        plan.fill_(-7)

    with torch.cuda.stream(consumer):
        torch.cuda._sleep(LAG_CYCLES)
        queued = plan.clone()  # enqueued before the update: must see the plan as it was
        if ordered:
            update_on_producer_stream(producer, update)
        else:
            with torch.cuda.stream(producer):
                update()
        later = plan.clone()  # enqueued after it: must see the update
    torch.cuda.synchronize()
    return queued.tolist(), later.tolist()


def test_plan_update_on_the_producer_stream_is_ordered_with_the_consumer() -> None:
    queued, later = _update_behind_a_queued_read(ordered=True)
    assert queued == list(range(4096)) and later == [-7] * 4096


def test_the_plan_update_race_is_real_without_it() -> None:
    queued, _ = _update_behind_a_queued_read(ordered=False)
    assert queued != list(range(4096)), "the producer's write did not overtake the lagging read; race not exercised"
