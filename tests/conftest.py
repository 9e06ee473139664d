"""Test isolation for what kvcanary keeps per process."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _default_registry_metrics_per_test():
    """Each test leaves no kvcanary counters in prometheus_client's default registry.

    Why: the first label set a process registers fixes the counters' label names (kvcanary.report.metrics: one
    family per name and registry), so an Installation a unit test builds without a model name (labels ``tp_rank``
    only, or none) changed what a later test that scrapes sglang's labels found: that test passed or failed by the
    order the files ran in.
    """
    from kvcanary.report.metrics import forget_default_metrics

    yield
    forget_default_metrics()
