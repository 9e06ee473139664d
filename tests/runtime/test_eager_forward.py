"""The model.forward wrapper's eager hot path (``Installation.to_arrays``): a real forward of one group launches the
check with the batch's arrays as the engine holds them and the write with its cached arguments, through the
manager's bound calls. It must leave exactly what the general path (a BatchView, ``before_forward`` /
``after_forward``) leaves, and hand every batch it cannot launch to the general path, which names the error."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.kernels.tags import LaunchTag
from kvcanary.runtime.config import Config
from kvcanary.runtime.device_state import EagerLaunches
from kvcanary.runtime.installation import Group, GroupSpec, Installation
from kvcanary.runtime.manager import CanaryManager
from kvcanary.settings import Mode

SLOTS, ROWS, CTX = 64, 4, 16


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class Batch(types.SimpleNamespace):
    """An engine's batch: the check's arrays as the engine holds them, and its kind (what to_views reads)."""


def _to_views(fb, ids, pos) -> list[BatchView]:
    return [BatchView(fb.kind, ids, pos, fb.out_cache_loc.contiguous(), fb.rows, fb.prefix, fb.extend)]


def _to_arrays(fb, positions):
    if fb.kind is ForwardKind.IDLE:
        return None
    return fb.rows, fb.prefix, fb.extend, fb.out_cache_loc


class Model(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        return input_ids * 2 + positions


def _installation(mode: Mode = Mode.LOG, *, hot_path: bool = True) -> tuple[Installation, Model, torch.Tensor]:
    cfg = Config(mode=mode, stats_every=0)
    r2t = torch.zeros((ROWS, CTX), dtype=torch.int32)
    kv = torch.zeros((SLOTS, 16), dtype=torch.uint8)
    manager = CanaryManager(cfg, num_slots=SLOTS, req_to_token=r2t, device="cpu", max_batch_size=ROWS,
                            max_tokens_per_forward=CTX, real_kv_sources=[RealKvSource(kv, 1, 16, 16)])
    inst = Installation(config=cfg, groups=[Group(GroupSpec("full", SLOTS, ()), manager)], to_views=_to_views,
                        to_arrays=_to_arrays if hot_path else None, req_to_token=r2t)
    model = Model()
    inst.wrap_model_forward(model)
    return inst, model, kv


def _forward(inst: Installation, model: Model, fb: Batch, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A real forward, as an adapter's forward hook runs it: serving, then the host half."""
    inst.serving += 1
    try:
        out = model.forward(ids, pos, fb)
    finally:
        inst.serving -= 1
    inst.host_after()
    return out


def _requests(inst: Installation, model: Model, kv: torch.Tensor) -> None:
    """Row 1: a 4-token prefill, then 3 decodes; row 2 joins with a 3-token prefill at the second decode (MIXED-like
    extend). The model writes each token's KV byte, as an engine would."""
    r2t = inst.req_to_token
    r2t[1, :7] = torch.arange(1, 8, dtype=torch.int32)
    r2t[2, :3] = torch.arange(20, 23, dtype=torch.int32)
    steps = [
        Batch(kind=ForwardKind.EXTEND, rows=_i64([1]), prefix=torch.tensor([0], dtype=torch.int32),
              extend=torch.tensor([4], dtype=torch.int32), out_cache_loc=_i64([1, 2, 3, 4]),
              ids=_i64([11, 12, 13, 14]), pos=_i64([0, 1, 2, 3])),
        Batch(kind=ForwardKind.DECODE, rows=_i64([1]), prefix=_i64([4]), extend=_i64([1]), out_cache_loc=_i64([5]),
              ids=_i64([15]), pos=_i64([4])),
        Batch(kind=ForwardKind.EXTEND, rows=_i64([1, 2]), prefix=_i64([5, 0]), extend=_i64([1, 3]),
              out_cache_loc=_i64([6, 20, 21, 22]), ids=_i64([16, 31, 32, 33]), pos=_i64([5, 0, 1, 2])),
        Batch(kind=ForwardKind.IDLE, rows=_i64([]), prefix=_i64([]), extend=_i64([]), out_cache_loc=_i64([]),
              ids=_i64([]), pos=_i64([])),
        Batch(kind=ForwardKind.DECODE, rows=_i64([1, 2]), prefix=_i64([6, 3]), extend=_i64([1, 1]),
              out_cache_loc=_i64([7, 23]), ids=_i64([17, 34]), pos=_i64([6, 3])),
    ]
    r2t[2, 3] = 23
    for fb in steps:
        kv[fb.out_cache_loc] = fb.ids.to(torch.uint8)[:, None]
        assert torch.equal(_forward(inst, model, fb, fb.ids, fb.pos), fb.ids * 2 + fb.pos)


def _state(inst: Installation) -> tuple[torch.Tensor, ...]:
    m = inst.manager
    return (m.canary_buf.clone(), m.slot_attribution.clone(), m.device_state.state.clone(),
            m.device_state.input_ids_snapshot.clone())


def test_the_hot_path_leaves_what_the_general_path_leaves(monkeypatch) -> None:
    hot, hot_model, hot_kv = _installation()
    general, general_model, general_kv = _installation(hot_path=False)
    calls = []
    real = hot.manager.before_forward
    monkeypatch.setattr(hot.manager, "before_forward", lambda view, **kw: (calls.append(view.kind), real(view, **kw)))
    _requests(hot, hot_model, hot_kv)
    _requests(general, general_model, general_kv)
    # only the idle batch (to_arrays leaves it to the general path) went through before_forward
    assert calls == [ForwardKind.IDLE]
    for a, b in zip(_state(hot), _state(general), strict=True):
        assert torch.equal(a, b)
    runs = hot.manager.kernel_run_counters
    assert (int(runs[LaunchTag.VERIFY]), int(runs[LaunchTag.WRITE])) == (5, 5)
    assert hot.manager.flush() == [] and general.manager.flush() == []
    assert hot.host_time.eager_forwards == general.host_time.eager_forwards == 5
    assert hot.host_time.in_forward_ns > 0


def test_the_hot_path_defers_decode_writes_as_the_general_path_does(monkeypatch) -> None:
    """Deferral on (issue 25): the hot path records each decode's write for the next check launch (no write call) and
    launches an extend's at once, as the general path does; after a flush both leave what no deferral leaves."""
    hot, hot_model, hot_kv = _installation()
    general, general_model, general_kv = _installation(hot_path=False)
    plain, plain_model, plain_kv = _installation()
    for inst in (hot, general):
        inst.manager.set_defer_writes(True)
    writes = []
    launches = hot.manager.eager_launches()

    def write(*args):
        writes.append(int(args[0].shape[0]))
        launches.write(*args)

    monkeypatch.setattr(hot.manager, "eager_launches", lambda: EagerLaunches(
        launches.check, write, launches.write_arguments, launches.write_arguments_of, launches.pending))
    hot_model.forward = hot_model.forward.__wrapped__  # (unwrap, so the wrapper is rebuilt with the spied write)
    hot.wrap_model_forward(hot_model)
    _requests(hot, hot_model, hot_kv)
    _requests(general, general_model, general_kv)
    _requests(plain, plain_model, plain_kv)
    assert writes == [4, 4]  # the two extends; the decodes' writes went with the next check launch
    assert hot.manager.pending_write == general.manager.pending_write == 2  # the last decode's, pending
    for inst in (hot, general, plain):
        assert inst.manager.flush() == []
    for a, b, c in zip(_state(hot), _state(general), _state(plain), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_hot_path_detects_what_the_general_path_detects() -> None:
    """A byte of slot 2's K flipped between two forwards: the next decode's verify (the hot path's check) finds it."""
    inst, model, kv = _installation()
    _requests(inst, model, kv)
    kv[2, 0] ^= 0xFF
    inst.req_to_token[1, 7] = 8
    fb = Batch(kind=ForwardKind.DECODE, rows=_i64([1]), prefix=_i64([7]), extend=_i64([1]), out_cache_loc=_i64([8]))
    _forward(inst, model, fb, _i64([18]), _i64([7]))
    assert [(v.slot, v.reasons) for v in inst.manager.flush()] == [(2, ("verify_real_kv_hash",))]


def test_a_forward_outside_serving_takes_the_general_path(monkeypatch) -> None:
    """A model.forward call outside a real forward (a graph capture: the wrapper cannot know it is not capturing)."""
    inst, model, kv = _installation()
    calls = []
    real = inst.manager.before_forward
    monkeypatch.setattr(inst.manager, "before_forward", lambda view, **kw: (calls.append(kw), real(view, **kw)))
    fb = Batch(kind=ForwardKind.EXTEND, rows=_i64([1]), prefix=_i64([0]), extend=_i64([2]), out_cache_loc=_i64([1, 2]))
    model.forward(_i64([5, 6]), _i64([0, 1]), fb)
    assert calls == [{"capturing": None}]  # (the general path asks the device)


def test_a_batch_the_check_refuses_is_launched_by_the_general_path() -> None:
    """A strided out_cache_loc (sglang's EAGLE draft decode hands one): the bound check refuses it before enqueueing
    anything, and the general path launches the batch's dense view: one check, one write."""
    inst, model, kv = _installation()
    inst.req_to_token[1, :2] = torch.tensor([1, 3], dtype=torch.int32)
    strided = torch.arange(1, 5, dtype=torch.int64)[::2]
    fb = Batch(kind=ForwardKind.EXTEND, rows=_i64([1]), prefix=_i64([0]), extend=_i64([2]), out_cache_loc=strided)
    _forward(inst, model, fb, _i64([5, 6]), _i64([0, 1]))
    runs = inst.manager.kernel_run_counters
    assert (int(runs[LaunchTag.VERIFY]), int(runs[LaunchTag.WRITE])) == (1, 1)
    assert inst.stopped is None and inst.manager.flush() == []


@pytest.mark.parametrize("mode", [Mode.RAISE, Mode.LOG])
def test_a_malformed_batch_is_named_by_the_general_path(mode: Mode, caplog) -> None:
    inst, model, kv = _installation(mode)
    fb = Batch(kind=ForwardKind.EXTEND, rows=torch.tensor([1], dtype=torch.int16), prefix=_i64([0]), extend=_i64([2]),
               out_cache_loc=_i64([1, 2]))
    ids, pos = _i64([5, 6]), _i64([0, 1])
    if mode is Mode.RAISE:
        with pytest.raises(TypeError, match="BatchView: req_pool_indices: expected dtype int64 or int32"):
            _forward(inst, model, fb, ids, pos)
        return
    with caplog.at_level(logging.ERROR, logger="kvcanary.runtime.installation"):
        assert torch.equal(_forward(inst, model, fb, ids, pos), ids * 2 + pos)
    assert inst.stopped is not None and "req_pool_indices" in inst.stopped and "before the forward" in inst.stopped


def _failing_write(manager: CanaryManager, monkeypatch, fails: list[str]) -> None:
    """The manager's bound write raises once per entry of ``fails`` (as a launch error would)."""
    launches = manager.eager_launches()

    def write(*args):
        if fails:
            raise RuntimeError(fails.pop(0))
        launches.write(*args)

    monkeypatch.setattr(manager, "eager_launches", lambda: EagerLaunches(
        launches.check, write, launches.write_arguments, launches.write_arguments_of, launches.pending))


def test_a_failed_write_is_made_again_through_the_manager(monkeypatch) -> None:
    cfg = Config(mode=Mode.LOG, stats_every=0)
    r2t = torch.zeros((ROWS, CTX), dtype=torch.int32)
    manager = CanaryManager(cfg, num_slots=SLOTS, req_to_token=r2t, device="cpu", max_batch_size=ROWS,
                            max_tokens_per_forward=CTX)
    _failing_write(manager, monkeypatch, ["bound write failed"])
    inst = Installation(config=cfg, groups=[Group(GroupSpec("full", SLOTS, ()), manager)], to_views=_to_views,
                        to_arrays=_to_arrays, req_to_token=r2t)
    model = Model()
    inst.wrap_model_forward(model)
    r2t[1, :2] = torch.tensor([1, 2], dtype=torch.int32)
    fb = Batch(kind=ForwardKind.EXTEND, rows=_i64([1]), prefix=_i64([0]), extend=_i64([2]), out_cache_loc=_i64([1, 2]))
    _forward(inst, model, fb, _i64([5, 6]), _i64([0, 1]))
    runs = manager.kernel_run_counters
    assert (int(runs[LaunchTag.VERIFY]), int(runs[LaunchTag.WRITE])) == (1, 1)  # written once, by the retry
    assert inst.stopped is None and manager.flush() == []


def test_a_write_that_fails_again_stops_the_canary_in_log_mode(monkeypatch) -> None:
    inst, model, kv = _installation()
    manager = inst.manager

    def broken(num_tokens: int) -> None:
        raise RuntimeError("write launch failed")

    _failing_write(manager, monkeypatch, ["bound write failed"])
    monkeypatch.setattr(manager, "write_tokens", broken)
    model = Model()
    inst.wrap_model_forward(model)  # (a new model: the wrapper takes the failing launches)
    fb = Batch(kind=ForwardKind.EXTEND, rows=_i64([1]), prefix=_i64([0]), extend=_i64([2]), out_cache_loc=_i64([1, 2]))
    ids, pos = _i64([5, 6]), _i64([0, 1])
    assert torch.equal(_forward(inst, model, fb, ids, pos), ids * 2 + pos)
    assert inst.stopped is not None and "after the forward" in inst.stopped and "write launch failed" in inst.stopped


@pytest.mark.parametrize("kind", [ForwardKind.IDLE, ForwardKind.EXTEND])
def test_the_models_own_error_runs_the_model_once(kind: ForwardKind) -> None:
    """A model that raises, in a batch the general path takes (idle) and in one the hot path launches: the error
    reaches the caller after one call of the model (the hot path never falls back to the general path after the
    model ran, nor retries what the general path raised)."""
    inst, model, kv = _installation(Mode.RAISE)
    calls = []

    class Broken(Model):
        def forward(self, input_ids, positions, forward_batch):
            calls.append(forward_batch)
            raise RuntimeError("the model failed")

    broken = Broken()
    inst.wrap_model_forward(broken)
    empty = kind is ForwardKind.IDLE
    fb = Batch(kind=kind, rows=_i64([] if empty else [1]), prefix=_i64([] if empty else [0]),
               extend=_i64([] if empty else [2]), out_cache_loc=_i64([] if empty else [1, 2]))
    ids, pos = _i64([] if empty else [5, 6]), _i64([] if empty else [0, 1])
    inst.serving += 1
    try:
        with pytest.raises(RuntimeError, match="the model failed"):
            broken.forward(ids, pos, fb)
    finally:
        inst.serving -= 1
    assert len(calls) == 1
