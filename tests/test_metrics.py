"""kvcanary.report.metrics: the canary's counters appear in a Prometheus scrape under sglang's names and labels, fed by
deltas from the managers (counters only go up, several managers never double count), in-process
(``generate_latest``) and in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` + ``MultiProcessCollector``, what
sglang's ``/metrics`` serves); without prometheus_client one INFO line says metrics are off."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvcanary.kernels import layout
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import Violation, metrics
from kvcanary.runtime.manager import CanaryStats

prometheus_client = pytest.importorskip("prometheus_client", reason="the test extra installs prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

R = layout.FailReason
LABELS = {"model_name": "tiny-llama", "tp_rank": "1", "pp_rank": "0", "dp_rank": ""}
NAMES = ("forwards_total", "entries_verified_total", "entries_swept_total", "tokens_written_total",
         "violations_total", "lost_rows_total", "health_errors_total")


@dataclass
class FakeReporter:
    total_lost: int = 0
    total_health_errors: int = 0


@dataclass(eq=False)
class FakeManager:
    """What the metrics read of a CanaryManager: stats, reporter totals, the violations it reported."""

    stats: CanaryStats = field(default_factory=CanaryStats)
    reporter: FakeReporter = field(default_factory=FakeReporter)
    violations: list[Violation] = field(default_factory=list)

    def advance(self, forwards: int, verified: int, swept: int, written: int, lost: int = 0, health: int = 0,
                violations: tuple[int, ...] = ()) -> None:
        s = self.stats
        runs = list(s.slot_runs)
        runs[LaunchTag.VERIFY] += verified
        runs[LaunchTag.SWEEP] += swept
        runs[LaunchTag.WRITE] += written
        s.slot_runs, s.forwards = tuple(runs), s.forwards + forwards
        self.reporter.total_lost += lost
        self.reporter.total_health_errors += health
        for bits in violations:
            self.violations.append(Violation.from_row([int(LaunchTag.VERIFY), 3, 1, 5, -1, 0, 0, int(bits)], step=1))


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, keyed by (sample name, sorted labels)."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(samples: dict, name: str, **extra: str) -> float:
    return samples[(metrics.PREFIX + name, tuple(sorted({**LABELS, **extra}.items())))]


def test_every_counter_with_sglangs_names_and_labels() -> None:
    registry = CollectorRegistry()
    m = metrics.CanaryMetrics(LABELS, registry)
    mgr = FakeManager()
    mgr.advance(8, 100, 40, 16, lost=2, health=1,
                violations=(R.VERIFY_CHAIN_HASH | R.VERIFY_POSITION, R.VERIFY_REAL_KV_HASH))
    m.update(mgr)
    s = scrape(registry)
    assert sample(s, "forwards_total") == 8
    assert sample(s, "entries_verified_total") == 100
    assert sample(s, "entries_swept_total") == 40
    assert sample(s, "tokens_written_total") == 16
    assert sample(s, "lost_rows_total") == 2
    assert sample(s, "health_errors_total") == 1
    assert sample(s, "violations_total", reason="verify_chain_hash") == 1
    assert sample(s, "violations_total", reason="verify_position") == 1
    assert sample(s, "violations_total", reason="verify_real_kv_hash") == 1
    # speculative decoding did not feed it: no sample at all
    assert not [k for k in s if k[0].startswith(metrics.PREFIX + "drafts_rolled_back")]
    text = generate_latest(registry).decode()
    assert re.search(r"^# TYPE sglang:kv_canary_entries_verified(_total)? counter$", text, re.MULTILINE), text
    assert ('sglang:kv_canary_entries_verified_total{dp_rank="",model_name="tiny-llama",pp_rank="0",tp_rank="1"} 100.0'
            in text)


def test_deltas_only_go_up_and_managers_do_not_double_count() -> None:
    registry = CollectorRegistry()
    m = metrics.CanaryMetrics(LABELS, registry)
    a, b = FakeManager(), FakeManager()
    a.advance(8, 100, 0, 10, violations=(R.VERIFY_TOKEN,))
    b.advance(8, 50, 0, 10)
    for _ in range(3):  # repeated updates without progress add nothing
        m.observe([a, b])
    a.advance(8, 20, 5, 2, lost=4, violations=(R.VERIFY_TOKEN, R.WRITE_POSITION))
    m.observe([a, b])
    s = scrape(registry)
    assert sample(s, "forwards_total") == 24
    assert sample(s, "entries_verified_total") == 170
    assert sample(s, "entries_swept_total") == 5
    assert sample(s, "tokens_written_total") == 22
    assert sample(s, "lost_rows_total") == 4
    assert sample(s, "violations_total", reason="verify_token") == 2
    assert sample(s, "violations_total", reason="write_position") == 1
    # a second metrics object over the same labels (another runner of the process) shares the children
    other = metrics.CanaryMetrics(LABELS, registry)
    c = FakeManager()
    c.advance(1, 1, 0, 1)
    other.update(c)
    assert sample(scrape(registry), "forwards_total") == 25


def test_record_counts_that_moved_without_the_forward_count_are_added_too() -> None:
    """Every count is compared, not only the forward count: records swept or verified by a read of the same step
    (the forward count unchanged) reach the counters at that update, not one drain later."""
    registry = CollectorRegistry()
    m = metrics.CanaryMetrics(LABELS, registry)
    mgr = FakeManager()
    mgr.advance(8, 100, 0, 16)
    m.update(mgr)
    mgr.advance(0, 0, 40, 0)  # a sweep read at the same step
    m.update(mgr)
    s = scrape(registry)
    assert (sample(s, "forwards_total"), sample(s, "entries_swept_total")) == (8, 40)


def test_drafts_rolled_back_only_when_fed() -> None:
    registry = CollectorRegistry()
    m = metrics.CanaryMetrics(LABELS, registry)
    spec = object()
    m.update_drafts(spec, 0)
    assert not [k for k in scrape(registry) if "drafts_rolled_back" in k[0]]
    m.update_drafts(spec, 7)
    m.update_drafts(spec, 7)
    m.update_drafts(spec, 9)
    assert sample(scrape(registry), "drafts_rolled_back_total") == 9
    m.update_drafts(spec, 5)  # the total dipped (late verdicts) and grows back: only a new high counts
    m.update_drafts(spec, 11)
    assert sample(scrape(registry), "drafts_rolled_back_total") == 11


def test_labels_from_rank() -> None:
    assert metrics.labels_from({"tp_rank": 1, "pp_rank": 0}, "m") == {"model_name": "m", "tp_rank": "1",
                                                                        "pp_rank": "0"}
    assert metrics.labels_from({"tp_rank": 0, "dp_rank": 2, "attn_dp_rank": 5}) == {"tp_rank": "0", "dp_rank": "2"}
    assert metrics.labels_from(None) == {}
    with pytest.raises(ValueError, match="unknown keys"):
        metrics.CanaryMetrics({"pool": "draft"}, CollectorRegistry())


def test_a_failing_update_is_logged_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    m = metrics.CanaryMetrics(LABELS, CollectorRegistry())
    with caplog.at_level(logging.ERROR, logger="kvcanary.report.metrics"):
        m.observe([object()])  # not a manager
        m.observe([object()])
    assert len([r for r in caplog.records if "metrics update failed" in r.getMessage()]) == 1


def test_real_manager_feeds_the_counters() -> None:
    """A real CPU CanaryManager in the serving simulator, with a real KV flip: the scrape matches its own numbers."""
    from kvcanary.runtime import faults
    from kvcanary.sim import SimConfig, build_sim

    registry = CollectorRegistry()
    m = metrics.CanaryMetrics({"tp_rank": "0"}, registry)
    sim = build_sim(SimConfig(seed=5, num_pages=256), mode="log", sweep_interval=4)
    for _ in range(40):
        sim.step()
        m.observe([sim.mgr])
    req = next(r for r in sim.running if r.kv_len > 2)
    faults.flip_real_kv(sim.sources[0], req.slots[0], 0, 0xFF)
    for _ in range(3):
        sim.step()
    sim.mgr.flush()
    m.observe([sim.mgr])
    m.flush([sim.mgr])  # the volume counters observe left for later (what Installation.close does)
    s = scrape(registry)
    labels = (("tp_rank", "0"),)  # only the labels given
    stats = sim.mgr.stats
    assert s[(metrics.PREFIX + "entries_verified_total", labels)] == stats.slot_runs[LaunchTag.VERIFY] > 0
    assert s[(metrics.PREFIX + "entries_swept_total", labels)] == stats.slot_runs[LaunchTag.SWEEP] > 0
    assert s[(metrics.PREFIX + "tokens_written_total", labels)] == stats.slot_runs[LaunchTag.WRITE] > 0
    assert s[(metrics.PREFIX + "forwards_total", labels)] == stats.forwards == 43
    flips = sum("verify_real_kv_hash" in v.reasons for v in sim.mgr.violations)
    assert flips >= 1
    key = (metrics.PREFIX + "violations_total", tuple(sorted((*labels, ("reason", "verify_real_kv_hash")))))
    assert s[key] == flips


MULTIPROC_WRITER = textwrap.dedent("""
    import sys
    from kvcanary.report import metrics
    from kvcanary.runtime.manager import CanaryStats
    from kvcanary.report import Violation

    class Reporter:
        total_lost, total_health_errors = 5, 2

    class Manager:
        stats = CanaryStats(forwards=16, slot_runs=(300, 32, 64, 0))
        reporter = Reporter()
        violations = [Violation.from_row([0, 3, 1, 5, -1, 0, 0, 1], step=9)]

    m = metrics.metrics_for({"tp_rank": int(sys.argv[1]), "pp_rank": 0}, "tiny-llama")
    m.observe([Manager()])
    import prometheus_client.values
    assert "MultiProcess" in prometheus_client.values.ValueClass.__qualname__, prometheus_client.values.ValueClass
""")


def test_multiprocess_mode_is_what_sglangs_metrics_endpoint_serves(tmp_path: Path) -> None:
    """Two scheduler-like processes write under PROMETHEUS_MULTIPROC_DIR; the collector sglang mounts on /metrics
    reads both, each with its tp_rank."""
    import kvcanary

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    package_parent = str(Path(kvcanary.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    for rank in (0, 1):
        proc = subprocess.run([sys.executable, "-c", MULTIPROC_WRITER, str(rank)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(tmp_path.glob("counter_*.db")), list(tmp_path.iterdir())
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    s = scrape(registry)
    for rank in ("0", "1"):
        base = (("model_name", "tiny-llama"), ("pp_rank", "0"), ("tp_rank", rank))
        assert s[(metrics.PREFIX + "forwards_total", base)] == 16
        assert s[(metrics.PREFIX + "entries_verified_total", base)] == 300
        assert s[(metrics.PREFIX + "tokens_written_total", base)] == 32
        assert s[(metrics.PREFIX + "entries_swept_total", base)] == 64
        assert s[(metrics.PREFIX + "lost_rows_total", base)] == 5
        assert s[(metrics.PREFIX + "health_errors_total", base)] == 2
        with_reason = tuple(sorted((*base, ("reason", "verify_chain_hash"))))
        assert s[(metrics.PREFIX + "violations_total", with_reason)] == 1


def test_without_prometheus_client_one_info_line(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    monkeypatch.setattr(metrics, "_by_labels", {})
    monkeypatch.setattr(metrics, "_off_logged", False)
    with caplog.at_level(logging.INFO, logger="kvcanary.report.metrics"):
        first = metrics.metrics_for({"tp_rank": 0})
        second = metrics.metrics_for({"tp_rank": 1})
    assert isinstance(first, metrics.NoMetrics) and isinstance(second, metrics.NoMetrics)
    first.observe([FakeManager()])  # a no-op
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcanary.report.metrics"]
    assert lines == ["kvcanary: metrics are off (prometheus_client is not installed; pip install 'kvcanary[metrics]')"]


def _installation(mode: str, drain_every: int = 1):
    """A real CPU manager inside an Installation (the adapter's per-runner glue), with one 6-token request."""
    import torch

    from kvcanary.kernels.batch import BatchView, ForwardKind
    from kvcanary.runtime.config import Config
    from kvcanary.runtime.installation import Group, GroupSpec, Installation
    from kvcanary.runtime.manager import CanaryManager
    from kvcanary.settings import Mode

    config = Config(mode=Mode(mode), stats_every=0, drain_every=drain_every)
    r2t = torch.zeros((2, 16), dtype=torch.int32)
    mgr = CanaryManager(config, num_slots=32, req_to_token=r2t, device="cpu", max_batch_size=1,
                        max_tokens_per_forward=8, rank={"tp_rank": 3})
    inst = Installation(config=config, groups=[Group(GroupSpec("full", 32, ()), mgr)], to_views=lambda *a: [],
                        req_to_token=r2t)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731

    def forward(pos: int, n: int) -> None:
        r2t[1, pos:pos + n] = torch.arange(pos + 1, pos + n + 1, dtype=torch.int32)
        batch = BatchView(ForwardKind.EXTEND if n > 1 else ForwardKind.DECODE, i64(list(range(100, 100 + n))),
                          i64(list(range(pos, pos + n))), i64(list(range(pos + 1, pos + n + 1))), i64([1]),
                          i64([pos]), i64([n]))
        mgr.before_forward(batch)
        mgr.after_forward(batch)
        inst.host_after()

    return inst, mgr, r2t, forward


def test_installation_host_after_feeds_the_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter's wiring: the first host_after builds the process metrics from the manager's rank and the
    installation's model_name; every host_after adds the managers' deltas."""
    from kvcanary.runtime import installation

    registry = CollectorRegistry()
    asked = []

    def fake_metrics_for(rank, model_name=None):  # noqa: ANN001, ANN202
        asked.append((dict(rank), model_name))  # (publish_interval_s=0: every feed reaches the scrape at once)
        return metrics.CanaryMetrics(metrics.labels_from(rank, model_name), registry, publish_interval_s=0)

    monkeypatch.setattr(installation, "metrics_for", fake_metrics_for)
    inst, mgr, _, forward = _installation("log")
    inst.model_name = "tiny-llama"
    forward(0, 4)
    for pos in range(4, 8):
        forward(pos, 1)
    assert asked == [({"tp_rank": 3}, "tiny-llama")]  # built once
    s = scrape(registry)
    labels = (("model_name", "tiny-llama"), ("tp_rank", "3"))
    assert s[(metrics.PREFIX + "forwards_total", labels)] == mgr.stats.forwards == 5
    assert s[(metrics.PREFIX + "tokens_written_total", labels)] == mgr.stats.slot_runs[LaunchTag.WRITE] == 8
    assert s[(metrics.PREFIX + "entries_verified_total", labels)] == mgr.stats.slot_runs[LaunchTag.VERIFY] > 0


def test_the_metrics_are_built_when_init_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the metrics (prometheus_client's import, the collectors' registration: 11-17 ms in the H200 engine)
    happens when init finishes, not in the first serving forward's host_after, which paid it before; once."""
    from kvcanary.runtime import installation

    asked = []

    def fake_metrics_for(rank, model_name=None):  # noqa: ANN001, ANN202
        asked.append(model_name)
        return metrics.CanaryMetrics(metrics.labels_from(rank, model_name), CollectorRegistry(), publish_interval_s=0)

    monkeypatch.setattr(installation, "metrics_for", fake_metrics_for)
    inst, _, _, forward = _installation("log")
    inst.model_name = "tiny-llama"
    inst.mark_init_finished()
    assert asked == ["tiny-llama"] and inst.metrics is not None
    built = inst.metrics
    forward(0, 4)
    forward(4, 1)
    assert asked == ["tiny-llama"] and inst.metrics is built


def test_host_after_feeds_the_metrics_only_after_a_drain_read() -> None:
    """The counts the metrics read move only when a manager's drain reads: host_after skips observe otherwise, and
    feeds a new metrics object at once."""
    registry = CollectorRegistry()
    inst, mgr, _, forward = _installation("log", drain_every=4)
    fed_at = []

    class Counting(metrics.CanaryMetrics):
        def observe(self, managers) -> None:  # noqa: ANN001
            fed_at.append(mgr.steps)
            super().observe(managers)

    inst.metrics = Counting({"tp_rank": "3"}, registry, publish_interval_s=0)
    forward(0, 4)
    for pos in range(4, 12):
        forward(pos, 1)
    assert fed_at == [1, 3, 7]  # the first host_after, then the steps whose drain read a status copy
    assert scrape(registry)[(metrics.PREFIX + "forwards_total", (("tp_rank", "3"),))] == mgr.stats.forwards == 7
    inst.metrics = Counting({"tp_rank": "3"}, CollectorRegistry())
    forward(12, 1)
    assert fed_at[-1] == 10


def test_raise_mode_counts_the_violation_before_the_error_propagates() -> None:
    from kvcanary.report import CanaryViolationError

    registry = CollectorRegistry()
    inst, mgr, r2t, forward = _installation("raise")
    inst.metrics = metrics.CanaryMetrics({"tp_rank": "3"}, registry)
    forward(0, 4)
    r2t[1, 2] = 9  # redirect position 2 to a slot nobody wrote
    with pytest.raises(CanaryViolationError):
        forward(4, 1)
    s = scrape(registry)
    assert s[(metrics.PREFIX + "violations_total", (("reason", "verify_chain_hash"), ("tp_rank", "3")))] >= 1


def test_each_registry_keeps_its_own_counters() -> None:
    """Registries come and go (tests, embedders): a new one must never get a freed one's counters (same id())."""
    for n in range(20):
        registry = CollectorRegistry()
        labels = {"tp_rank": str(n)} if n % 2 else {"model_name": "m", "tp_rank": str(n)}
        m = metrics.CanaryMetrics(labels, registry)
        mgr = FakeManager()
        mgr.advance(n + 1, 0, 0, 0)
        m.update(mgr)
        assert scrape(registry)[(metrics.PREFIX + "forwards_total", tuple(sorted(labels.items())))] == n + 1
        del registry, m


def test_observe_adds_alert_counts_at_once_and_volume_counts_once_per_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the serving loop pays per drain read: violations, lost rows and health errors reach the counters at the
    read that found them; forwards and entries at most once per publish_interval_s (each inc is a lock, a file write
    in multiprocess mode), exactly (nothing lost, nothing twice) at the next round, and at flush."""
    now = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    registry = CollectorRegistry()
    m = metrics.CanaryMetrics(LABELS, registry, publish_interval_s=1.0)
    mgr = FakeManager()
    mgr.advance(8, 100, 0, 16)
    m.observe([mgr])  # the first feed: at once
    assert sample(scrape(registry), "forwards_total") == 8
    now[0] += 0.5
    mgr.advance(8, 100, 0, 8)
    m.observe([mgr])  # inside the interval, nothing alarming: left for later
    s = scrape(registry)
    assert (sample(s, "forwards_total"), sample(s, "entries_verified_total")) == (8, 100)
    mgr.advance(8, 50, 0, 8, lost=3)
    m.observe([mgr])  # a lost row: everything at once
    s = scrape(registry)
    assert (sample(s, "forwards_total"), sample(s, "entries_verified_total"), sample(s, "lost_rows_total"),
            sample(s, "tokens_written_total")) == (24, 250, 3, 32)
    mgr.advance(8, 10, 0, 0, violations=(R.VERIFY_TOKEN,))
    m.observe([mgr])
    s = scrape(registry)
    assert (sample(s, "forwards_total"), sample(s, "violations_total", reason="verify_token")) == (32, 1)
    mgr.advance(8, 10, 0, 0, health=1)
    m.observe([mgr])
    assert sample(scrape(registry), "health_errors_total") == 1
    mgr.advance(8, 10, 0, 0)
    now[0] += 0.4
    m.observe([mgr])
    assert sample(scrape(registry), "forwards_total") == 40
    now[0] += 0.6  # the interval since the last round is over
    mgr.advance(8, 10, 0, 0)
    m.observe([mgr])
    assert sample(scrape(registry), "forwards_total") == 56
    mgr.advance(8, 10, 0, 0)
    m.observe([mgr])
    assert sample(scrape(registry), "forwards_total") == 56
    m.flush([mgr])
    s = scrape(registry)
    assert (sample(s, "forwards_total"), sample(s, "entries_verified_total")) == (64, 300)


def test_installation_close_adds_what_observe_left_for_later() -> None:
    registry = CollectorRegistry()
    inst, mgr, _, forward = _installation("log")
    inst.metrics = metrics.CanaryMetrics({"tp_rank": "3"}, registry, publish_interval_s=3600)
    forward(0, 4)
    for pos in range(4, 8):
        forward(pos, 1)
    key = (metrics.PREFIX + "forwards_total", (("tp_rank", "3"),))
    assert scrape(registry)[key] == 1  # the first feed only
    inst.close()
    assert scrape(registry)[key] == mgr.stats.forwards == 5


def test_forget_default_metrics_lets_the_next_labels_name_the_counters() -> None:
    """The first label set of the default registry fixes the label names; after ``forget_default_metrics`` the next
    one does (and the old counters are gone from the scrape)."""
    from prometheus_client import REGISTRY

    first = metrics.metrics_for({"tp_rank": 0})
    assert first.labels == {"tp_rank": "0"}
    assert metrics.metrics_for({"tp_rank": 0}, "m").labels == {"tp_rank": "0"}  # model_name not exported
    metrics.forget_default_metrics()
    assert REGISTRY.get_sample_value(metrics.PREFIX + "forwards_total", {"tp_rank": "0"}) is None
    assert metrics.metrics_for({"tp_rank": 0}, "m").labels == {"model_name": "m", "tp_rank": "0"}
