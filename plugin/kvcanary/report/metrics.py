"""Prometheus counters for the canary, exposed the way SGLang exposes its own metrics.

SGLang (``--enable-metrics``) sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the scheduler processes and serves
``/metrics`` from the HTTP server through ``prometheus_client.multiprocess.MultiProcessCollector``: every process
writes its samples to files in that directory and the server adds them up. kvcanary's counters go the same way.
``prometheus_client`` is imported only when the first :class:`CanaryMetrics` is built (inside a scheduler process,
after sglang set the variable), so in multiprocess mode its values land in those files and appear on sglang's own
``/metrics``; without the variable they go to the process's default registry.

Counters (``<what>_total``; labels ``model_name``, ``tp_rank``, ``pp_rank``, ``dp_rank`` where known):

* ``sglang:kv_canary_forwards_total``: forward steps the canary ran in;
* ``sglang:kv_canary_entries_verified_total`` / ``..._entries_swept_total``: canary records checked by the
  per-forward verify / the prefix-cache sweep;
* ``sglang:kv_canary_tokens_written_total``: records written (one per KV slot a forward filled);
* ``sglang:kv_canary_violations_total`` with a ``reason`` label: violations reported, once per reason each carries
  (a violation with two reasons counts under both; their sum can exceed the number of violations);
* ``sglang:kv_canary_lost_rows_total``: violation rows the ring overflowed and could not keep;
* ``sglang:kv_canary_health_errors_total``: health errors (a launch that should run showed no progress);
* ``sglang:kv_canary_drafts_rolled_back_total``: draft records a speculative-decoding engine left past a
  committed length (only when the adapter feeds it; absent otherwise);
* ``sglang:kv_canary_requests_recomputed_total`` / ``..._requests_aborted_total``: requests protect mode
  (``KVCANARY_MODE=protect``, :mod:`kvcanary.runtime.protect`) recomputed from their tokens or aborted with a named
  finish reason after a violation (absent in the other modes).

The counters are fed by deltas from what each manager already keeps (``CanaryManager.stats``, its reporter's totals
and the violations it reported), so a counter only goes up and nothing is counted twice when several managers (KV
groups, a draft pool, several runners of a process) feed the same labels. Without ``prometheus_client`` (install
``kvcanary[metrics]``) :func:`metrics_for` logs one INFO line and returns a no-op.

What the serving loop pays (:meth:`CanaryMetrics.observe`, after every drain read): the alert counters (violations,
lost rows, health errors) are added at once; the volume counters (forwards, entries verified / swept, tokens
written) at most once per ``publish_interval_s`` (1 s), since each ``inc`` takes a lock and, in multiprocess mode,
writes a file-backed value: three of them per drain read were ~20 µs of a CPU-bound scheduler's host time. A scrape
(every few seconds) sees those at most that much behind; :meth:`CanaryMetrics.flush` (the installation's
``close``) adds what is left.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcanary.kernels.tags import LaunchTag

logger = logging.getLogger(__name__)

PREFIX = "sglang:kv_canary_"
LABEL_KEYS: tuple[str, ...] = ("model_name", "tp_rank", "pp_rank", "dp_rank")
REASON_LABEL = "reason"
# Seconds between two additions of the volume counters by observe (see the module docstring): far below a scrape
# interval, far above a forward.
PUBLISH_INTERVAL_S = 1.0

# name (without the prefix) -> help text
COUNTERS: Mapping[str, str] = {
    "forwards_total": "Forward steps the kvcanary KV-cache canary ran in.",
    "entries_verified_total": "Canary records checked by the per-forward verify (every running request's prefix).",
    "entries_swept_total": "Canary records checked by the periodic prefix-cache sweep.",
    "tokens_written_total": "Canary records written (one per KV slot a forward filled).",
    "violations_total": "KV-cache integrity violations reported, by reason (a violation counts once per reason).",
    "lost_rows_total": "Violation rows the canary's ring overflowed and could not keep.",
    "health_errors_total": "Canary health errors (a launch that should run showed no progress, or the canary stopped "
                           "on a runner after an error of its own in log mode).",
    "drafts_rolled_back_total": "Speculative-decoding draft records left past a committed length.",
    "requests_recomputed_total": "Requests kvcanary's protect mode recomputed from their tokens after a violation.",
    "requests_aborted_total": "Requests kvcanary's protect mode aborted (named finish reason) after a violation.",
}
# Fed by protect mode only (kvcanary.runtime.protect; CanaryMetrics.add_actions): absent from a scrape in other modes.
ACTION_COUNTERS: tuple[str, ...] = ("requests_recomputed_total", "requests_aborted_total")


@dataclass
class _Seen:
    """What one manager had reported at the last update (the deltas are measured from here)."""

    # forwards, entries verified, entries swept, tokens written, lost rows, health errors (CanaryMetrics._children)
    counts: tuple[int, ...] = (0, 0, 0, 0, 0, 0)
    violations: int = 0  # len(manager.violations) already counted


_VERIFY, _SWEEP, _WRITE = int(LaunchTag.VERIFY), int(LaunchTag.SWEEP), int(LaunchTag.WRITE)  # (plain int indexes)
_LOST, _HEALTH = 4, 5  # the alert counts' places in _Seen.counts


def _counts_of(manager: Any) -> tuple[int, ...]:
    """A manager's counts in :class:`_Seen` order, as Python ints."""
    stats, reporter = manager.stats, manager.reporter
    runs = stats.slot_runs
    return (int(stats.forwards), int(runs[_VERIFY]), int(runs[_SWEEP]), int(runs[_WRITE]), int(reporter.total_lost),
            int(reporter.total_health_errors))


class _Families:
    """The counter families of one registry, created once per process (a name may be registered only once)."""

    def __init__(self, registry: Any, labelnames: tuple[str, ...]) -> None:
        from prometheus_client import Counter  # after PROMETHEUS_MULTIPROC_DIR is set: see the module docstring

        kwargs = {} if registry is None else {"registry": registry}
        self.labelnames = labelnames
        self.counters = {
            name: Counter(PREFIX + name, doc, [*labelnames, REASON_LABEL] if name == "violations_total" else labelnames,
                          **kwargs)
            for name, doc in COUNTERS.items()
        }


# Keyed by the registry object itself (an id() could be reused by a later registry once one is freed).
_families_by_registry: weakref.WeakKeyDictionary[Any, _Families] = weakref.WeakKeyDictionary()
_default_families: _Families | None = None  # registry None: prometheus_client's default registry
_families_lock = threading.Lock()


def _families(registry: Any, labelnames: tuple[str, ...]) -> _Families:
    global _default_families
    with _families_lock:
        if registry is None:
            if _default_families is None:
                _default_families = _Families(None, labelnames)
            return _default_families
        fam = _families_by_registry.get(registry)
        if fam is None:
            fam = _families_by_registry[registry] = _Families(registry, labelnames)
        return fam


def labels_from(rank: Mapping[str, Any] | None, model_name: str | None = None) -> dict[str, str]:
    """SGLang's metric labels from a rank dict (``tp_rank``, ``pp_rank``, ``dp_rank``) and the served model name;
    keys that are not known are left out."""
    out = {}
    if model_name:
        out["model_name"] = str(model_name)
    for key in LABEL_KEYS[1:]:
        if rank and rank.get(key) is not None:
            out[key] = str(rank[key])
    return out


class CanaryMetrics:
    """The canary's counters for one label set, fed from managers by deltas (module docstring).

    Args:
        labels: label values (keys from ``LABEL_KEYS``). The first label set of a registry fixes its label names
            (all of a process's runners have the same keys); a later set's missing keys are exported as ``""``.
        registry: a ``prometheus_client.CollectorRegistry``; None: the default registry (in multiprocess mode,
            the directory files).

        publish_interval_s: :meth:`observe` adds the volume counters at most this often (0: at every call).

    Raises ``ImportError`` without ``prometheus_client`` (use :func:`metrics_for`, which does not).
    """

    def __init__(self, labels: Mapping[str, str], registry: Any = None, *,
                 publish_interval_s: float = PUBLISH_INTERVAL_S) -> None:
        unknown = set(labels) - set(LABEL_KEYS)
        if unknown:
            raise ValueError(f"CanaryMetrics: labels: unknown keys {sorted(unknown)}; expected some of {LABEL_KEYS}")
        fam = _families(registry, tuple(k for k in LABEL_KEYS if k in labels))
        if set(labels) - set(fam.labelnames):
            logger.debug("kvcanary: metrics: labels %s not exported (the registry's label names are %s)",
                         sorted(set(labels) - set(fam.labelnames)), fam.labelnames)
        self.labels = {k: str(labels.get(k, "")) for k in fam.labelnames}
        c = fam.counters
        self._counters = c
        self._forwards = c["forwards_total"].labels(**self.labels)
        self._verified = c["entries_verified_total"].labels(**self.labels)
        self._swept = c["entries_swept_total"].labels(**self.labels)
        self._written = c["tokens_written_total"].labels(**self.labels)
        self._lost = c["lost_rows_total"].labels(**self.labels)
        self._health = c["health_errors_total"].labels(**self.labels)
        # in the order of _Seen.counts and _counts_of
        self._children = (self._forwards, self._verified, self._swept, self._written, self._lost, self._health)
        self._by_reason: dict[str, Any] = {}
        self._drafts: Any = None  # created on the first draft count: absent on engines without speculation
        self._drafts_seen: dict[int, int] = {}
        self._actions: dict[str, Any] = {}  # protect mode's counters, created on first use (ACTION_COUNTERS)
        self._seen: weakref.WeakKeyDictionary[Any, _Seen] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._broken = False
        self.publish_interval_s = publish_interval_s
        self._next_publish = 0.0  # time.monotonic() from which observe adds the volume counters again

    def _violation(self, reason: str) -> Any:
        child = self._by_reason.get(reason)
        if child is None:
            child = self._by_reason[reason] = self._counters["violations_total"].labels(**self.labels, reason=reason)
        return child

    def update(self, manager: Any) -> None:
        """Add what ``manager`` counted since the last update (its ``stats``, its reporter's ``total_lost`` and
        ``total_health_errors``, the violations it reported). Cheap when nothing changed: integer compares, and a
        counter is touched only when its count moved (``inc`` takes a lock)."""
        counts = _counts_of(manager)
        violations = manager.violations
        seen = self._seen.get(manager)
        # The counters move only when the manager drains (every KVCANARY_DRAIN_EVERY forwards): most calls end here.
        if seen is not None and counts == seen.counts and len(violations) == seen.violations:
            return
        with self._lock:
            seen = self._seen.get(manager)
            if seen is None:
                seen = self._seen[manager] = _Seen()
            for child, value, old in zip(self._children, counts, seen.counts, strict=True):
                if value > old:
                    child.inc(value - old)
            seen.counts = counts  # (a lower value: the source restarted; count from there)
            if len(violations) < seen.violations:
                seen.violations = 0
            for v in violations[seen.violations:]:
                for reason in v.reasons:
                    self._violation(reason).inc()
            seen.violations = len(violations)

    def update_drafts(self, source: Any, rolled_back: int) -> None:
        """Add the growth of ``rolled_back`` (a running total kept by ``source``, e.g. speculative-decoding
        counters) to ``drafts_rolled_back_total``. Only a new high counts: a total that dips (a verdict that
        arrives a step late) and grows back is not counted twice."""
        with self._lock:
            high = self._drafts_seen.get(id(source), 0)
            if rolled_back > high:
                if self._drafts is None:
                    self._drafts = self._counters["drafts_rolled_back_total"].labels(**self.labels)
                self._drafts.inc(rolled_back - high)
                self._drafts_seen[id(source)] = int(rolled_back)

    def add_actions(self, *, recomputed: int = 0, aborted: int = 0) -> None:
        """Protect mode: ``recomputed`` more requests recomputed, ``aborted`` more aborted (``requests_*_total``).
        Never raises (a metrics failure must not stop serving)."""
        if self._broken:
            return
        try:
            with self._lock:
                for name, count in (("requests_recomputed_total", recomputed), ("requests_aborted_total", aborted)):
                    if count > 0:
                        child = self._actions.get(name)
                        if child is None:
                            child = self._actions[name] = self._counters[name].labels(**self.labels)
                        child.inc(count)
        except Exception:  # noqa: BLE001 - see observe
            self._fail()

    def observe(self, managers: Iterable[Any]) -> None:
        """The serving loop's feed (after a drain read): :meth:`update` for each manager whose alert counts
        (violations, lost rows, health errors) moved or that was never fed, and for every manager once
        ``publish_interval_s`` passed since the last such round (module docstring). Never raises (a metrics failure
        must not stop serving: it is logged once and the metrics stop)."""
        if self._broken:
            return
        try:
            now = time.monotonic()
            volume_due = now >= self._next_publish
            if volume_due:
                self._next_publish = now + self.publish_interval_s
            for manager in managers:
                if volume_due or self._alerts_moved(manager):
                    self.update(manager)
        except Exception:  # noqa: BLE001 - see the docstring
            self._fail()

    def flush(self, managers: Iterable[Any]) -> None:
        """:meth:`update` for each manager (whatever :meth:`observe` left for later); never raises."""
        if self._broken:
            return
        try:
            for manager in managers:
                self.update(manager)
        except Exception:  # noqa: BLE001 - see observe
            self._fail()

    def _fail(self) -> None:
        self._broken = True
        logger.exception("kvcanary: metrics update failed; kvcanary metrics are off from here on")

    def _alerts_moved(self, manager: Any) -> bool:
        """Whether ``manager`` reported a violation, a lost row or a health error since its last update (or was
        never fed)."""
        seen = self._seen.get(manager)
        if seen is None:
            return True
        reporter = manager.reporter
        counts = seen.counts
        return (len(manager.violations) != seen.violations or reporter.total_lost != counts[_LOST]
                or reporter.total_health_errors != counts[_HEALTH])


class NoMetrics:
    """What :func:`metrics_for` returns without ``prometheus_client``: every call does nothing."""

    labels: dict[str, str] = {}

    def update(self, manager: Any) -> None:
        return None

    def update_drafts(self, source: Any, rolled_back: int) -> None:
        return None

    def add_actions(self, *, recomputed: int = 0, aborted: int = 0) -> None:
        return None

    def observe(self, managers: Iterable[Any]) -> None:
        return None

    def flush(self, managers: Iterable[Any]) -> None:
        return None


_by_labels: dict[tuple[tuple[str, str], ...], CanaryMetrics | NoMetrics] = {}
_off_logged = False


def metrics_for(rank: Mapping[str, Any] | None, model_name: str | None = None) -> CanaryMetrics | NoMetrics:
    """The process's :class:`CanaryMetrics` for these labels (one per label set, built on first use in the default
    registry), or a :class:`NoMetrics` after one INFO line when ``prometheus_client`` is not installed. Never
    raises."""
    global _off_logged
    labels = labels_from(rank, model_name)
    key = tuple(sorted(labels.items()))
    found = _by_labels.get(key)
    if found is not None:
        return found
    try:
        import prometheus_client  # noqa: F401 - only to know whether it is there
    except ImportError:
        if not _off_logged:
            _off_logged = True
            logger.info("kvcanary: metrics are off (prometheus_client is not installed; "
                        "pip install 'kvcanary[metrics]')")
        found = NoMetrics()
    else:
        try:
            found = CanaryMetrics(labels)
        except Exception:  # noqa: BLE001 - metrics must never stop serving (e.g. a name registered by someone else)
            logger.exception("kvcanary: metrics could not be registered; kvcanary metrics are off")
            found = NoMetrics()
    _by_labels[key] = found
    return found


def forget_default_metrics() -> None:
    """Take kvcanary's counters out of prometheus_client's default registry and forget the process's
    :func:`metrics_for` results, so that the next label set registers them anew (its keys fixing the label names).
    For tests, which build runners with different labels in one process; an installation that still holds a
    :class:`CanaryMetrics` keeps counting into counters no scrape sees."""
    global _default_families
    with _families_lock:
        families, _default_families = _default_families, None
    if families is not None:
        from prometheus_client import REGISTRY

        for counter in families.counters.values():
            try:
                REGISTRY.unregister(counter)
            except KeyError:  # (unregistered already)
                pass
    _by_labels.clear()
