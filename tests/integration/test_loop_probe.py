"""integration/loop_probe.py (the driver's --loop-probe) without a GPU: the measured window, the per-iteration
table, the host-speed normalisation and the plugin it writes (its patches of sglang's classes:
tests/adapters/test_loop_probe_install.py). The ``probe`` fixture is in conftest.py."""

from __future__ import annotations

import os

import pytest


def _line(probe, t: float, pid: int, **counts) -> str:
    c = dict.fromkeys(probe.FIELDS, 0)
    c.update(counts)
    return f"[e2e-probe] t={t:.3f} pid={pid} " + " ".join(f"{k}={v}" for k, v in c.items())


def test_window_is_the_difference_across_the_measured_workload_per_scheduler(probe) -> None:
    text = "\n".join([
        _line(probe, 10.0, 7, iters=25, run_ns=1000),  # warm-up
        _line(probe, 11.0, 7, iters=50, run_ns=3000),  # last before the start: the base
        f"{probe.WINDOW_START}11.500",
        _line(probe, 12.0, 7, iters=75, run_ns=6000),
        _line(probe, 13.0, 7, iters=100, run_ns=9000, evsync_ns=400, evsync_n=2),
        _line(probe, 12.5, 8, iters=25, run_ns=100),  # a second rank (tp): no line before the start
        f"{probe.WINDOW_END}13.200",
        _line(probe, 20.0, 7, iters=125, run_ns=99999),  # after the workload (next warm-up): not counted
    ])
    w = probe.parse_window(text)
    assert w["iters"] == 50 + 25 and w["run_ns"] == 6000 + 100 and w["evsync_n"] == 2
    per = probe.per_iteration(w)
    assert per["run_us"] == pytest.approx(6100 / 75 / 1e3)
    assert per["iters"] == 75


def test_no_window_without_lines_or_start(probe) -> None:
    assert probe.parse_window("nothing here") is None
    assert probe.parse_window(_line(probe, 1.0, 1, iters=25)) is None  # no measured-workload stamp


def test_render_one_row_per_engine(probe) -> None:
    w = dict.fromkeys(probe.FIELDS, 0)
    w.update(iters=10, decode_n=8, loop_ns=25_000_000, gpu_ns=1_000_000, gpu_n=10)
    lines = probe.render([("off-1", probe.per_iteration(w)), ("log-1", probe.per_iteration(w))])
    rows = [ln for ln in lines if ln.startswith("| off-1") or ln.startswith("| log-1")]
    assert len(rows) == 2
    assert "| 10 (8) | 2500.0 |" in rows[0] and "| 100.0 |" in rows[0]  # loop µs, GPU µs per forward
    assert probe.render([]) == []


def test_plugin_env_and_entry_point(probe, tmp_path) -> None:
    env = probe.probe_env({"PYTHONPATH": "/x", "SGLANG_PLUGINS": "kvcanary"}, str(tmp_path / "p"))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "p"), "/x"]
    assert env[probe.PROBE_ENV] == "1" and env["SGLANG_PLUGINS"] == f"kvcanary,{probe.PLUGIN}"
    ep = (tmp_path / "p" / f"{probe.PLUGIN}-0.0.0.dist-info" / "entry_points.txt").read_text()
    assert f"{probe.PLUGIN} = {probe.PLUGIN}:register" in ep


def test_driver_engine_args(e2e) -> None:
    assert e2e.parse_engine_args(["disable_overlap_schedule=true", "cuda_graph_max_bs=8", "x=abc"]) == {
        "disable_overlap_schedule": True, "cuda_graph_max_bs": 8, "x": "abc"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        e2e.parse_engine_args(["novalue"])


def test_pairs_divide_out_the_engines_host_speed(probe) -> None:
    """A log Engine on a host 20 % slower in every canary-free step, plus 100 µs of canary per iteration in
    run_batch: the raw ratio mixes both, the normalized one shows only the canary."""
    off = {"recv_us": 100.0, "next_us": 600.0, "result_us": 450.0, "sample_us": 2.0, "run_us": 1300.0,
           "loop_us": 2452.0}
    log = {k: v * 1.2 for k, v in off.items()}
    log["run_us"] += 100.0
    log["loop_us"] += 100.0
    n = probe.normalized_pair(off, log)
    assert n["speed"] == pytest.approx(1.2)
    assert n["canary_us"] == pytest.approx(100.0)
    assert n["ratio"] == pytest.approx(2452.0 * 1.2 / (2452.0 * 1.2 + 100.0))
    assert n["raw_ratio"] < n["ratio"]
    lines = probe.render([("off-1", {**off, **_counts()}), ("log-1", {**log, **_counts()})])
    assert any(ln.startswith("| 1 | 1.200 |") for ln in lines)
    assert any(ln.startswith("| median (min–max) |") for ln in lines)


def _counts() -> dict:
    return dict(iters=10, decode_n=8, evsync_n=0, sync_n=0, fbg_us=0.0, init_us=0.0, evsync_us=0.0, sync_us=0.0,
                gpu_us=0.0, gap_us=0.0)


def test_gpu_spans_split_into_decode_and_prefill_forwards(probe) -> None:
    w = dict.fromkeys(probe.FIELDS, 0)
    w.update(iters=10, gpu_ns=10 * 2_000_000 + 0, gpu_n=10, gpu_decode_ns=8 * 1_500_000, gpu_decode_n=8)
    w["gpu_ns"] = 8 * 1_500_000 + 2 * 4_000_000
    per = probe.per_iteration(w)
    assert per["gpu_decode_us"] == pytest.approx(1500.0)
    assert per["gpu_extend_us"] == pytest.approx(4000.0)
    assert per["gpu_us"] == pytest.approx(2000.0)
    old = {k: v for k, v in w.items() if not k.startswith("gpu_decode") and not k.startswith("kvc_gpu")}
    assert probe.per_iteration(old)["gpu_extend_us"] == pytest.approx(2000.0)  # a line of an older probe


class _FakeEvent:
    """A CUDA event of the fake clock: record() stamps it, elapsed_time() gives ms between two stamps."""

    clock = [0.0]

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self, stream=None) -> None:
        self.at = self.clock[0]

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end) -> float:
        return end.at - self.at


def test_device_timing_of_kvcanarys_eager_launches(probe, monkeypatch) -> None:
    """With E2E_LOOP_PROBE_KVC_DEVICE=1 each eager before/after_forward is bracketed by an event pair (outside its
    host timer); calls made during a graph capture are not (their replays never come back to Python)."""
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(probe, "PROBE", probe.Probe())

    def launch(self) -> str:
        _FakeEvent.clock[0] += 0.25  # the launch's device work: 250 µs of the fake clock
        return "launched"

    timed = probe._device_timed(launch)
    assert timed(None) == "launched" and timed.e2e_probe_device
    capturing[0] = True
    assert timed(None) == "launched"  # captured: not timed
    probe.PROBE.collect()
    assert probe.PROBE.c["kvc_gpu_n"] == 1 and probe.PROBE.c["kvc_gpu_ns"] == 250_000
    assert probe.per_iteration(dict(probe.PROBE.c, iters=1))["kvc_gpu_us"] == pytest.approx(250.0)


def test_device_timing_is_off_by_default(probe, monkeypatch) -> None:
    monkeypatch.delenv(probe.DEVICE_ENV, raising=False)
    monkeypatch.setattr(probe, "KVCANARY_PIECES", ())  # (patch no kvcanary class in this process)
    monkeypatch.setattr(probe, "KVCANARY_REPORTED_PIECES", ())
    calls = []
    monkeypatch.setattr(probe, "_patch", lambda module, cls_name, name, wrap, marker: calls.append((name, wrap)) or 1)
    assert probe.install_kvcanary_pieces() == 0 and calls == []
    monkeypatch.setenv(probe.DEVICE_ENV, "1")
    assert probe.install_kvcanary_pieces() == 2
    assert calls == [("before_forward", probe._device_timed), ("after_forward", probe._device_timed)]


def test_a_reported_piece_adds_the_host_time_kvcanary_measured(probe, monkeypatch) -> None:
    """The batch hook's time comes from what it hands Installation.account_batch_init (one frame bound into sglang's
    hook registry: no class patch could time it), added once per call, the method still called."""
    seen = []

    class Installation:
        def account_batch_init(self, ns: int) -> None:
            seen.append(ns)

    wrapped = probe._reported(Installation.account_batch_init, "kvc_batch_ns")
    before = probe.PROBE.c["kvc_batch_ns"]
    wrapped(Installation(), 7_000)
    wrapped(Installation(), 5_000)
    assert probe.PROBE.c["kvc_batch_ns"] - before == 12_000 and seen == [7_000, 5_000]
    assert wrapped.e2e_probe == "kvc_batch_ns"


def test_patch_wraps_a_method_once_and_skips_what_is_missing(probe, monkeypatch) -> None:
    import types

    mod = types.ModuleType("_probe_patch_target")

    class Target:
        def work(self) -> int:
            return 7

    mod.Target = Target
    monkeypatch.setitem(__import__("sys").modules, "_probe_patch_target", mod)

    def wrap(fn):
        def wrapper(*args):
            return fn(*args) + 1
        wrapper.marked = True
        return wrapper

    assert probe._patch("_probe_patch_target", "Target", "work", wrap, "marked")
    assert not probe._patch("_probe_patch_target", "Target", "work", wrap, "marked")  # wrapped already
    assert Target().work() == 8
    assert not probe._patch("_probe_patch_target", "Target", "absent", wrap, "marked")
    assert not probe._patch("_probe_patch_target", "Missing", "work", wrap, "marked")
    assert not probe._patch("_no_such_module_here", "Target", "work", wrap, "marked")


def test_every_kvcanary_piece_names_a_method_of_this_kvcanary(probe) -> None:
    """The probe skips a piece a kvcanary version lacks (older wheels), so a name it misspells or a method a refactor
    moved would time nothing without a word: every piece must resolve in the kvcanary of this checkout."""
    import importlib

    for module, cls, method, counter in probe.KVCANARY_PIECES:
        owner = importlib.import_module(module)
        owner = owner if cls is None else getattr(owner, cls)  # (None: a function the module calls by name)
        assert callable(getattr(owner, method, None)), f"{module}.{cls}.{method}"
        assert counter in probe.FIELDS, counter
