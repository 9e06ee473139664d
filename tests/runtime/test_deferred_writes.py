"""Deferred writes (issue 25, ``CanaryManager.set_defer_writes``): an eager forward's write is recorded by
``after_forward`` (a decode's: one token a row) and run by the next ``before_forward``'s check launch.

* Same outcome: a simulator run with sweeps, a host KV tier (backups and load-backs), ``rewrite_last_forward`` after
  a position skew, ``poll`` and ``flush`` leaves the same records, attribution, host-tier rows, counters and
  violations with deferral on as off.
* Never lost: ``flush``, ``close``, ``poll``, a second deferred write, a refused batch (kept pending), turning
  deferral off, the sweep, the host tier, a writer-serial upload and ``mark_init_finished`` launch a pending write
  first (or keep it for the next launch); a capture that begins with a write pending is refused.
"""

from __future__ import annotations

import pytest
import torch
from one_request import OneRequest

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.tags import LaunchTag
from kvcanary.settings import Mode
from kvcanary.sim.engine import SimConfig, Simulator, build_sim

W = LaunchTag.WRITE


# ---------------------------------------------------------------------------------------------- same outcome
class Events:
    """A simulator hook: every 9th forward skews a decode token's position by one (the chain-position assert
    reports the write) and, after the forward, puts it back and rewrites the forward's records with the true
    position (``rewrite_last_forward``, as the sglang fault layer's undo does); ``poll`` every 5th forward; counts
    the forwards whose write was left pending."""

    def __init__(self) -> None:
        self.skewed: tuple[int, int] | None = None
        self.rewrites = self.pending_after_step = 0

    def __call__(self, point: str, sim: Simulator) -> None:
        mgr, batch = sim.mgr, sim.batch
        if point == "pre_forward" and sim.step_no % 9 == 0 and batch.kind is ForwardKind.DECODE and batch.num_tokens:
            i = batch.num_tokens - 1
            self.skewed = (i, int(batch.positions[i]))
            batch.positions[i] += 1
        elif point == "pre_step" and self.skewed is not None:
            i, position = self.skewed
            batch.positions[i] = position
            mgr.rewrite_last_forward(batch, {i: position})
            self.skewed = None
            self.rewrites += 1
        elif point == "post_step":
            self.pending_after_step += mgr.pending_write >= 0
            if sim.step_no % 5 == 0:
                mgr.poll()


def _run(defer: bool) -> tuple[Simulator, Events]:
    events = Events()
    # (a small device pool: pages are evicted to the host tier and loaded back within the run)
    sim = build_sim(SimConfig(seed=12, page_size=16, num_pages=128, host_pages=256), mode="log", sweep_interval=4,
                    hook=events, defer_writes=defer)
    for _ in range(300):
        sim.step()
        if sim.step_no == 150:
            sim.mgr.flush()
    sim.mgr.flush()
    return sim, events


def _violations(sim: Simulator) -> list[tuple]:
    return [(v.kernel_kind, v.slot, v.position, v.reasons, v.step, v.request_row, v.written_step, v.writer_rid, v.via,
             v.stored_chain_hash, v.expected_aux) for v in sim.mgr.violations]


def test_deferral_on_and_off_give_the_same_records_counters_and_violations() -> None:
    (off, off_events), (on, on_events) = _run(False), _run(True)
    assert not off.mgr.defer_writes and on.mgr.defer_writes
    assert on_events.pending_after_step > 100 and off_events.pending_after_step == 0  # writes were deferred
    # the run reached what deferral must not change
    assert on.stats["host_backups"] > 0 and on.stats["load_backs"] > 0
    assert on.mgr.stats.sweeps > 20 and on_events.rewrites > 3
    assert any("write_position" in v.reasons for v in on.mgr.violations)
    assert on.stats == off.stats  # the same engine run
    for name in ("canary_buf", "slot_attribution", "kernel_run_counters", "slot_run_counters", "row_serials"):
        assert torch.equal(getattr(on.mgr, name), getattr(off.mgr, name)), name
    assert torch.equal(on.mgr.device_state.forward_counter, off.mgr.device_state.forward_counter)
    assert torch.equal(on.mgr.host_tier.records, off.mgr.host_tier.records)
    assert torch.equal(on.mgr.host_tier.attribution, off.mgr.host_tier.attribution)
    assert _violations(on) == _violations(off)
    assert on.mgr.pending_write == -1


# ---------------------------------------------------------------------------------------------- never lost
def _deferring(**config: object) -> OneRequest:
    one = OneRequest(Mode.LOG, **config)
    one.mgr.mark_init_finished()
    one.mgr.set_defer_writes(True)
    return one


def _written(one: OneRequest) -> int:
    return int(one.mgr.kernel_run_counters[W])


def test_after_forward_defers_and_the_next_forward_launches_it() -> None:
    one = _deferring()
    one.forward(4)  # a prefill (4 tokens, one row): written at once (the check launch defers a decode's only)
    assert one.mgr.pending_write == -1 and _written(one) == 1
    one.forward(1)  # a decode: deferred
    assert one.mgr.pending_write == 1 and _written(one) == 1
    assert not one.mgr.canary_buf[5].any()  # nothing written yet
    one.forward(1)  # its check launch runs the decode's write, then verifies that prefix
    assert one.mgr.pending_write == 1 and _written(one) == 2
    assert one.mgr.canary_buf[1:6].any(1).all()
    assert one.mgr.flush() == [] and one.mgr.violations == []


def _pending_decode() -> OneRequest:
    """A prefill of 3 tokens (slots 1-3, written at once), then a decode (slot 4) whose write is pending."""
    one = _deferring()
    one.forward(3)
    one.forward(1)
    assert one.mgr.pending_write == 1 and _written(one) == 1
    return one


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _decode(position: int) -> BatchView:
    """The one request's decode at ``position`` (slot position + 1, as OneRequest lays them out)."""
    return BatchView(ForwardKind.DECODE, _t([500 + position]), _t([position]), _t([position + 1]), _t([1]),
                     _t([position]), _t([1]))


@pytest.mark.parametrize("how", ["flush", "close", "poll", "sweep", "set_defer_writes", "mark_init_finished"])
def test_a_pending_write_is_launched_before(how: str) -> None:
    one = _pending_decode()
    if how == "sweep":
        one.mgr.sweep([1, 2, 3, 4], [-1, 1, 2, 3], [0, 1, 2, 3])  # verifies the record the write stores: after it
    elif how == "set_defer_writes":
        one.mgr.set_defer_writes(False)
    else:
        getattr(one.mgr, how)()
    assert one.mgr.pending_write == -1 and _written(one) == 2
    assert one.mgr.canary_buf[1:5].any(1).all()
    one.mgr.flush()
    assert one.mgr.violations == []  # the sweep saw the records, not empty slots


def test_a_second_deferred_write_launches_the_first() -> None:
    one = _pending_decode()
    one.mgr.device_state.defer_write(1)  # (an after_forward again, with no check between)
    assert one.mgr.pending_write == 1 and _written(one) == 2


def test_host_tier_copies_follow_the_pending_write() -> None:
    one = _deferring()
    one.mgr.attach_host_tier(8)
    one.forward(2)
    one.forward(1)
    assert one.mgr.pending_write == 1
    one.mgr.backup_to_host([1, 2, 3], [3, 4, 5])  # the records of the forward just run: written first
    assert _written(one) == 2
    assert torch.equal(one.mgr.host_tier.records[3:6], one.mgr.canary_buf[1:4]) and one.mgr.canary_buf[1:4].any()
    one.forward(1)
    assert one.mgr.pending_write == 1
    one.mgr.load_from_host([3], [9])
    assert one.mgr.pending_write == -1 and _written(one) == 3


def test_a_new_writer_serial_waits_for_the_pending_write() -> None:
    """The write attributes its records through row_serials: a row's new request must not take over the records of
    the forward before it."""
    one = _deferring()
    one.mgr.assign_requests([1], ["first"])
    one.forward(2)
    one.forward(1)  # slot 3: pending
    assert one.mgr.pending_write == 1
    one.mgr.assign_requests([1], ["second"])  # a new request in row 1 (uploads its serial)
    one.mgr.flush()
    serial = int(one.mgr.slot_attribution[3, 1])
    assert one.mgr.writer_id(serial) == "first"


def test_rewrite_last_forward_writes_the_forward_first_then_again() -> None:
    one = _pending_decode()
    one.mgr.rewrite_last_forward(_decode(3), {})
    # the forward's own write, then the rewrite (launched at once, not deferred)
    assert one.mgr.pending_write == -1 and _written(one) == 3


def test_a_capture_with_a_write_pending_is_refused() -> None:
    one = _pending_decode()
    state = one.mgr.device_state.state.clone()
    batch = _decode(4)
    with pytest.raises(RuntimeError, match="deferred write of 1 tokens is pending while a CUDA graph is being"):
        one.mgr.before_forward(batch, capturing=True)
    assert one.mgr.pending_write == 1 and torch.equal(one.mgr.device_state.state, state)  # kept, nothing launched
    one.mgr.flush_pending_write()  # what the adapter should have done
    one.mgr.before_forward(batch, capturing=True)
    one.mgr.after_forward(batch)
    assert one.mgr.pending_write == -1 and _written(one) == 3  # a captured forward never defers its write


def test_a_forward_that_is_not_new_launches_the_pending_write_first_and_writes_at_once() -> None:
    one = _pending_decode()
    batch = _decode(3)  # the last forward again (an adapter re-planning it)
    one.mgr.before_forward(batch, new_forward=False)
    assert one.mgr.pending_write == -1 and _written(one) == 2
    one.mgr.after_forward(batch)
    assert one.mgr.pending_write == -1 and _written(one) == 3


def test_a_refused_batch_keeps_the_pending_write() -> None:
    """A batch the check launch refuses enqueues nothing: the write stays pending for the next launch."""
    one = _pending_decode()
    # the check refuses it (positions longer than the tokens)
    bad = BatchView(ForwardKind.DECODE, _t([504]), _t([4, 5]), _t([5]), _t([1]), _t([4]), _t([1]))
    with pytest.raises(ValueError):
        one.mgr.before_forward(bad)
    assert one.mgr.pending_write == 1 and _written(one) == 1
    one.forward(1)  # its launch runs the pending write; its own is deferred
    assert one.mgr.pending_write == 1 and _written(one) == 2
    # tvm-ffi cannot even pass it (a list): nothing ran either
    bad = BatchView(ForwardKind.DECODE, _t([505]), [5], _t([6]), _t([1]), _t([5]), _t([1]))
    with pytest.raises((TypeError, ValueError)):
        one.mgr.before_forward(bad)
    assert one.mgr.pending_write == 1 and _written(one) == 2
    one.mgr.flush()
    assert _written(one) == 3 and one.mgr.violations == []


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
def test_deferral_on_cuda_gives_the_same_records_and_refuses_a_capture() -> None:
    """The simulator run above on CUDA, on a side stream (every launch, the nested deferred write and the flushes
    included, on the current stream), with deferral on and off: the same outcome. Then a real graph capture that
    begins with a write pending is refused before anything is captured."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runs = {}
    for defer in (False, True):
        events = Events()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            sim = build_sim(SimConfig(seed=12, page_size=16, num_pages=128, host_pages=256), mode="log",
                            sweep_interval=4, hook=events, defer_writes=defer, device="cuda")
            for _ in range(120):
                sim.step()
            sim.mgr.flush()
        runs[defer] = sim
    off, on = runs[False], runs[True]
    assert on.stats == off.stats and on.stats["host_backups"] > 0
    for name in ("canary_buf", "slot_attribution", "kernel_run_counters", "slot_run_counters"):
        assert torch.equal(getattr(on.mgr, name), getattr(off.mgr, name)), name
    assert sorted(_violations(on)) == sorted(_violations(off))

    mgr = on.mgr
    for _ in range(50):  # until a decode's write is left pending
        on.step()
        if mgr.pending_write >= 0:
            break
    pending = mgr.pending_write
    assert pending >= 0
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="pending while a CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            mgr.before_forward(on.batch)  # (asks the device: capturing)
    assert mgr.pending_write == pending
    mgr.flush()
    assert mgr.pending_write == -1
