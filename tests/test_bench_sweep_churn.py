"""benchmarks/bench_sweep_churn.py (the incremental sweep under a serving engine's prefix-cache churn, on a real sglang
0.5.12 RadixCache): a short run of the sources side by side, each checked against a walk of the tree at its end."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if importlib.util.find_spec("sglang") is None or not importlib.metadata.version("sglang").startswith("0.5.12"):
    pytest.skip("needs sglang 0.5.12 (pip install --no-deps -r requirements-sglang-cpu.txt)", allow_module_level=True)


def test_the_sources_side_by_side(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("bench_sweep_churn", ROOT / "benchmarks" / "bench_sweep_churn.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        sources = "follow,walk" + (",follow@96fc4c0" if shutil.which("git") and (ROOT / ".git").exists() else "")
        out = tmp_path / "out.json"
        assert bench.main(["--forwards", "240", "--intervals", "3", "--rounds", "1", "--sources", sources,
                           "--json", str(out)]) == 0
    finally:
        sys.modules.pop(spec.name, None)
    results = {r["source"]: r for r in json.loads(out.read_text())}
    follow = results["follow"]
    assert follow["sweeps"] == 80 and follow["entries_per_sweep"] > 1000 and follow["ops_per_sweep"] > 0
    assert follow["walks"] == 1 and follow["walk_reasons"]["first"] == 1 and follow["compactions"] >= 1
    assert results["walk"]["entries_per_sweep"] == follow["entries_per_sweep"]  # the same seeded workload
