"""Log mode: an error inside kvcanary's part of a forward never stops serving. The installation stops (one ERROR line,
``stopped`` says where and why) and every later forward runs without the canary; raise mode re-raises."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.tags import LaunchTag
from kvcanary.runtime.config import Config
from kvcanary.runtime.installation import Group, GroupSpec, Installation
from kvcanary.runtime.manager import CanaryManager
from kvcanary.settings import Mode


def _i64(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def _installation(mode: Mode, *, strided_slots: bool, **config) -> Installation:
    """One CPU manager behind the model.forward wrapper; ``strided_slots``: the views hand the launch a strided
    out_cache_loc, which it refuses by name (ValueError), as it did sglang's EAGLE draft decode's. ``config``: more
    Config fields."""
    cfg = Config(mode=mode, **{"stats_every": 0, **config})
    r2t = torch.zeros((4, 32), dtype=torch.int32)
    manager = CanaryManager(cfg, num_slots=64, req_to_token=r2t, device="cpu", max_batch_size=4,
                            max_tokens_per_forward=32)

    def to_views(fb, ids, pos):
        n = int(ids.shape[0])
        slots = torch.arange(1, 2 * n + 1, dtype=torch.int64)
        slots = slots[::2] if strided_slots else slots[:n]
        return [BatchView(ForwardKind.EXTEND, ids.to(torch.int64), pos.to(torch.int64), slots, _i64(1), _i64(0),
                          _i64(n))]

    return Installation(config=cfg, groups=[Group(GroupSpec("full", 64, ()), manager)], to_views=to_views,
                        req_to_token=r2t)


class Model(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        return input_ids * 2 + positions


def _launches(inst: Installation) -> tuple[int, int]:
    runs = inst.manager.kernel_run_counters
    return int(runs[LaunchTag.VERIFY]), int(runs[LaunchTag.WRITE])


def test_log_mode_stops_the_canary_and_serves_on(caplog) -> None:
    inst, model = _installation(Mode.LOG, strided_slots=True), Model()
    inst.wrap_model_forward(model)
    ids, pos = torch.arange(3, 7), torch.arange(4)
    with caplog.at_level(logging.ERROR, logger="kvcanary.runtime.installation"):
        assert torch.equal(model.forward(ids, pos, None), ids * 2 + pos)  # the model's own output
        assert torch.equal(model.forward(ids, pos, None), ids * 2 + pos)
    assert inst.stopped is not None and "out_cache_loc" in inst.stopped and "before the forward" in inst.stopped
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors  # once, with the traceback; once as a health error (the alert channel)
    assert "serving goes on without the canary" in errors[0]
    assert errors[1].startswith("kvcanary health: kvcanary stopped")
    assert inst.manager.reporter.total_health_errors == 1  # (what the health-errors counter is fed from)
    assert _launches(inst) == (0, 0)  # nothing launched after it stopped


def test_the_stop_is_a_health_record_in_the_report(tmp_path) -> None:
    """With KVCANARY_REPORT, the stop is one kvcanary.health/1 line (``kvcanary report`` and health alerts see it)."""
    import json

    from kvcanary.report import Reporter

    inst, model = _installation(Mode.LOG, strided_slots=True), Model()
    path = tmp_path / "kvc.jsonl"
    inst.manager.reporter = Reporter(Mode.LOG, str(path), rank={"tp_rank": 0})
    inst.wrap_model_forward(model)
    model.forward(torch.arange(3, 7), torch.arange(4), None)
    inst.manager.reporter.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["schema"] for r in records] == ["kvcanary.health/1"]
    assert "stopped on this runner" in records[0]["message"] and "out_cache_loc" in records[0]["message"]


def test_raise_mode_reraises_the_same_error() -> None:
    inst, model = _installation(Mode.RAISE, strided_slots=True), Model()
    inst.wrap_model_forward(model)
    with pytest.raises(ValueError, match="out_cache_loc"):
        model.forward(torch.arange(3, 7), torch.arange(4), None)
    assert inst.stopped is None


def test_an_error_after_the_forward_returns_the_models_output(monkeypatch) -> None:
    """The write launch failing (here: a manager that raises) leaves the forward's output as it was."""
    inst, model = _installation(Mode.LOG, strided_slots=False), Model()
    inst.wrap_model_forward(model)
    ids, pos = torch.arange(3, 7), torch.arange(4)
    model.forward(ids, pos, None)
    assert _launches(inst) == (1, 1) and inst.stopped is None

    def broken(view) -> None:
        raise RuntimeError("write launch failed")

    monkeypatch.setattr(inst.manager, "after_forward", broken)
    assert torch.equal(model.forward(ids, pos, None), ids * 2 + pos)
    assert inst.stopped is not None and "after the forward" in inst.stopped and "write launch failed" in inst.stopped
    model.forward(ids, pos, None)
    assert _launches(inst) == (2, 1)  # the failed forward's check ran; nothing after it stopped


def test_keeps_serving_is_false_outside_log_mode() -> None:
    for mode in (Mode.RAISE, Mode.OFF):
        inst = _installation(Mode.LOG, strided_slots=False)
        inst.config = inst.config.replace(mode=mode)
        assert inst.keeps_serving(RuntimeError("x"), "somewhere") is False and inst.stopped is None


def test_the_stop_reaches_the_health_errors_counter() -> None:
    """The installation's metrics get the stop at once (its host_after, which feeds them, no longer runs)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvcanary.report.metrics import PREFIX, CanaryMetrics

    registry = prometheus_client.CollectorRegistry()
    inst, model = _installation(Mode.LOG, strided_slots=True), Model()
    inst.metrics = CanaryMetrics({"tp_rank": "0"}, registry)
    inst.wrap_model_forward(model)
    model.forward(torch.arange(3, 7), torch.arange(4), None)
    assert registry.get_sample_value(PREFIX + "health_errors_total", {"tp_rank": "0"}) == 1.0


def _primed_installation(mode: Mode, source) -> Installation:
    """An installation that sweeps every 4 forwards, given ``source`` as its sweep source."""
    inst = _installation(mode, strided_slots=False, sweep_interval=4)
    inst.set_sweep_source(source)
    return inst


def test_a_sweep_source_that_fails_its_priming_stops_the_canary_in_log_mode() -> None:
    """The source is asked once when it is set (the first sweep's one-off work, at start-up): in log mode a source
    that raises there stops kvcanary on the runner, as a failing sweep would, and start-up goes on; raise mode
    re-raises."""
    def broken():
        raise RuntimeError("the prefix cache is gone")

    inst = _primed_installation(Mode.LOG, broken)
    assert inst.stopped is not None and "priming the prefix-cache sweep" in inst.stopped
    assert "the prefix cache is gone" in inst.stopped
    with pytest.raises(RuntimeError, match="the prefix cache is gone"):
        _primed_installation(Mode.RAISE, broken)


def test_the_priming_is_not_in_the_first_host_time_line(caplog) -> None:
    """The priming's walk (a source that walks its cache on its first call only, as the incremental one does)
    happens at start-up: the first ``kvcanary host time`` line, after the first sweep, counts one sweep and no
    walk."""
    class Source:
        walks = 0

        def __call__(self):
            self.walks = 1
            return [], [], []

    source = Source()
    inst = _installation(Mode.LOG, strided_slots=False, sweep_interval=4, stats_every=4)
    inst.mark_init_finished()
    inst.set_sweep_source(source)
    assert source.walks == 1  # primed
    with caplog.at_level(logging.INFO, logger="kvcanary.runtime.installation"):
        for _ in range(4):
            inst.host_after()
            inst.account_forward(1000, 100)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcanary host time")]
    assert " sweeps=1 sweep_walks=1 " not in line and " sweeps=1 sweep_walks=0 " in line, line
