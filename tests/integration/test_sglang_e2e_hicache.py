"""integration/sglang_e2e.py's HiCache phases (integration/hicache_phases.py) without sglang: the workload's
pressure on the device pool, the facts shared with kvcanary, the verdicts, and a dry run end to end."""

from __future__ import annotations

import subprocess
import sys

DRIVER_DIR = __import__("pathlib").Path(__file__).resolve().parents[2] / "integration"


def test_host_tier_classes_match_kvcanary(core) -> None:
    from kvcanary.runtime import faults

    assert core.HOST_TIER_FAULTS == faults.HOST_TIER_CLASSES
    for c in core.HOST_TIER_FAULTS:
        assert tuple(core.EXPECTED_REASONS[c]) == tuple(faults.EXPECTED_REASONS[c])


def test_the_workload_overflows_the_device_pool_and_reuses_prefixes(e2e) -> None:
    hp = e2e.hicache_phases
    groups = hp.hicache_workload(0)
    reqs = [r for g in groups for r in g]
    assert len(reqs) == 48 * 8 and max(len(g) for g in groups) == 48
    # the last round's prompts alone are ~7x the device pool: prefixes must leave it and come back
    longest = {}
    for ids, _ in reqs:
        longest[tuple(ids[:50])] = max(longest.get(tuple(ids[:50]), 0), len(ids))
    assert sum(longest.values()) > 5 * hp.DEVICE_TOKENS
    # every round after the first extends the conversation's previous prompt (a prefix hit once cached)
    prompts = [ids for ids, _ in reqs]
    extended = sum(any(len(p) < len(q) and q[: len(p)] == p for q in prompts) for p in prompts)
    assert extended >= 48 * 7
    assert hp.hicache_workload(0) == groups and hp.hicache_workload(1) != groups


def test_the_stats_line_counts_parse(e2e, core) -> None:
    hp = e2e.hicache_phases
    log = ("kvcanary stats: step=50 forwards=50 tokens_written=1 entries_verified=2 entries_swept=3 violations=0 "
           "lost=0 host_backed_up=10 host_loaded=4\nkvcanary stats: step=100 forwards=100 tokens_written=1 "
           "entries_verified=2 entries_swept=3 violations=0 lost=0 host_backed_up=20 host_loaded=9\n")
    assert hp.host_tier_counts(log) == (20, 9)
    assert hp.host_tier_counts("kvcanary stats: step=1 forwards=1 violations=0 lost=0") is None
    assert core.parse_stats(log)["forwards"] == 100  # the older pattern still reads the line


def test_a_clean_phase_fails_on_outputs_violations_or_too_few_loads(e2e) -> None:
    hp = e2e.hicache_phases
    off = [[1, 2], [3, 4]]
    row = {"status": "OK", "requests_ok": 2, "requests_sent": 2, "host_loaded": hp.MIN_LOADED, "violations": 0,
           "outputs_digest": hp.outputs_digest(off)}
    assert hp.verdict("clean", row, off) == []
    assert hp.verdict("clean", dict(row, outputs_digest=hp.outputs_digest([[1, 2], [3, 5]]), outputs_differ=1),
                      off) == ["greedy outputs differ from hicache-off in 1 requests"]
    assert hp.verdict("clean", dict(row, violations=3), off) == ["violations=3"]
    assert hp.verdict("clean", dict(row, host_loaded=10), off) == [f"host_loaded 10 < {hp.MIN_LOADED}"]
    assert "HiCache not followed" in hp.verdict("clean", dict(row, host_loaded=None), off)[0]
    assert hp.verdict("race", dict(row, violations=3), off) == []  # the race phase reports what it saw


def test_dry_run_of_the_hicache_phases(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(DRIVER_DIR / "sglang_e2e.py"), "--dry-run", "--phases",
                           "hicache-off,hicache-clean,hicache-writeback,hicache-faults,hicache-race,hicache-race-fixed",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = "| 10 hicache-clean | write_through | 384/384 | 12345 | 900 | 2500000 | 31000 | 24000 | 0 (0) | yes | PASS |"
    assert row in proc.stdout
    assert "| load_wrong_slots | 8 | 8 | 1..1 |" in proc.stdout and "RESULT: PASS" in proc.stdout
