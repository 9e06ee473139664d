"""The tp=2 sweep false positive (issue 11), reproduced on a GPU: a gather of tensors that another stream owns.

sglang's scheduler keeps RadixCache node values on its scheduler stream and frees them there (a node split
replaces the value with a clone); the canary's sweep ran on the forward stream. When the forward stream lags (a
tensor-parallel rank waiting in an all-reduce), the freed block is reused by the scheduler stream before the
sweep's queued gather reads it, and the sweep verifies another request's slots. ``run_on_producer_stream``
gathers on the owning stream instead; ``update_after_producer`` (the incremental plan's update) reads on the
consumer stream after the producer's queued work and holds the tensors it reads until it has run.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvcanary.runtime.streams import run_on_producer_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAG_CYCLES = 200_000_000  # ~0.1 s of torch.cuda._sleep on the consumer stream: the forward stream lags behind


def _consumer_reads_freed_values(consume) -> tuple[list[int], list[int]]:
    """Node values made on the producer (scheduler) stream; ``consume(producer, nodes)`` enqueues a read of them on the
    lagging consumer (forward) stream and returns the tensor it fills there; the producer then drops the values and its
    next allocations reuse their blocks at once (a split clones node values, eviction frees them). Returns (the
    values, what the consumer got)."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        nodes = [torch.arange(1000 + 100 * i, 1000 + 100 * i + 89, dtype=torch.int64, device="cuda") for i in range(8)]
    expected = torch.cat(nodes).tolist()  # (synchronises: the values are complete before the race starts)
    with torch.cuda.stream(consumer):
        torch.cuda._sleep(LAG_CYCLES)
        got = consume(producer, nodes)
    nodes.clear()
    with torch.cuda.stream(producer):
        reused = [torch.full((89,), -7, dtype=torch.int64, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    del reused
    return expected, got.tolist()


def _gather(fixed: bool):
    """The walk source's gather (kvcanary.sglang.radix): on the producer stream when ``fixed``, then the sweep's copy
    into its plan on the consumer stream."""
    def consume(producer, nodes):
        def read() -> tuple[torch.Tensor]:
            return (torch.cat(nodes),)

        (slots,) = run_on_producer_stream(producer, read) if fixed else read()
        return slots.clone()
    return consume


def _plan_update(hold: bool):
    """The incremental sweep plan's update (kvcanary.sglang.radix_index) on the consumer stream, holding the node values
    it reads when ``hold``."""
    from kvcanary.runtime.streams import update_after_producer

    def consume(producer, nodes):
        plan = torch.zeros(8 * 89, dtype=torch.int64, device="cuda")
        update_after_producer(producer, lambda: torch.cat(nodes, out=plan), list(nodes) if hold else [])
        return plan
    return consume


def test_gather_on_the_producer_stream_reads_the_values_it_was_given() -> None:
    expected, gathered = _consumer_reads_freed_values(_gather(fixed=True))
    assert gathered == expected


def test_the_race_is_real_without_it() -> None:
    """The harness reproduces the hazard: gathered on the lagging consumer stream, the values are gone."""
    expected, gathered = _consumer_reads_freed_values(_gather(fixed=False))
    assert gathered != expected, "the caching allocator did not reuse the freed blocks; the race was not exercised"


def test_plan_update_holds_the_producer_tensors_it_reads() -> None:
    expected, got = _consumer_reads_freed_values(_plan_update(hold=True))
    assert got == expected


def test_the_freed_tensor_race_is_real_without_the_hold() -> None:
    expected, got = _consumer_reads_freed_values(_plan_update(hold=False))
    assert got != expected, "the caching allocator did not reuse the freed blocks; the race was not exercised"


def test_plan_update_reads_after_the_producer_and_is_ordered_on_the_consumer() -> None:
    """Reads queued on the consumer before the update see the plan as it was, later ones the update; the update sees
    what the producer wrote before the call, however late the producer runs."""
    from kvcanary.runtime.streams import update_after_producer

    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    plan = torch.arange(4096, dtype=torch.int64, device="cuda")
    source = torch.zeros(4096, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(LAG_CYCLES)  # the producer lags now
        source.fill_(-7)
    with torch.cuda.stream(consumer):
        queued = plan.clone()
        update_after_producer(producer, lambda: plan.copy_(source), [source])
        later = plan.clone()
    torch.cuda.synchronize()
    assert queued.tolist() == list(range(4096)) and later.tolist() == [-7] * 4096


def _producer_wait_s(update_call) -> tuple[float, float]:
    """With the consumer (forward) stream lagging, ``update_call(producer, update, reads)`` from the consumer, then the
    engine's next work on the producer (scheduler) stream. Returns (host seconds until that work completed, until
    everything completed): the first is far below the second unless the producer waited for the consumer."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    node = torch.arange(64, dtype=torch.int64, device="cuda")
    plan = torch.zeros(64, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(consumer):
        torch.cuda._sleep(LAG_CYCLES)
        update_call(producer, lambda: plan.copy_(node), [node])
    with torch.cuda.stream(producer):
        scratch = torch.ones(64, dtype=torch.int64, device="cuda")
        scratch.add_(1)  # the engine's next work on its scheduler stream
        producer_next = torch.cuda.Event()
        producer_next.record(producer)
    producer_next.synchronize()
    producer_s = time.perf_counter() - start
    torch.cuda.synchronize()
    return producer_s, time.perf_counter() - start


def _old_update_on_producer_stream(producer, update, reads) -> None:
    """The update as it was until 2026-12-02: on the producer, after a wait for the consumer's work so far."""
    del reads
    consumer = torch.cuda.current_stream()
    consumer_done, producer_done = torch.cuda.Event(), torch.cuda.Event()
    consumer_done.record(consumer)
    producer.wait_event(consumer_done)
    with torch.cuda.stream(producer):
        update()
    producer_done.record(producer)
    consumer.wait_event(producer_done)


def test_the_producer_never_waits_for_the_consumer() -> None:
    """Regression (issue 28): the update used to run on the producer stream after a wait for the consumer, so work the
    engine queued on its scheduler stream next waited for the forward in flight (~10 ms of decode TTFT, 8B shape)."""
    from kvcanary.runtime.streams import update_after_producer

    producer_s, total_s = _producer_wait_s(update_after_producer)
    assert producer_s < total_s / 2, f"the producer's next work waited: {producer_s:.4f} s of {total_s:.4f} s"


def test_the_old_update_made_the_producer_wait() -> None:
    """The harness sees the wait: with the old update the producer's next work completes only after the lag."""
    producer_s, total_s = _producer_wait_s(_old_update_on_producer_stream)
    assert producer_s > total_s / 2, f"no wait seen ({producer_s:.4f} s of {total_s:.4f} s): the harness is blind"
