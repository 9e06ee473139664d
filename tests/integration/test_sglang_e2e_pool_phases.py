"""Dry runs of issue 29/30's driver phases (24-28, integration/pool_phases.py) and the driver pieces they use:
the fault classes chosen with --kvcanary-env, the sweep-off allowance under an SWARadixCache, the test plugin."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))  # pool_phases



def test_dry_run_of_phases_24_to_28_passes(e2e, tmp_path, capsys) -> None:
    d = e2e
    rc = d.main(["--dry-run", "--phases", "ident-off,ident-on,hunt-page-tail,hunt-swa-race,hunt-swa-race-fixed",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["phase"]: r for r in json.loads((tmp_path / "summary.json").read_text())["summary"]["pool"]}
    assert rows["25 ident-on"]["outputs"] == {"compared": 640, "differ": 0, "first_differ": []}
    assert rows["26 hunt-page-tail"]["verdict"] == "CLEAN" and rows["26 hunt-page-tail"]["triggers"] == 31
    assert rows["27 hunt-swa-race"]["triggers"] == 50 or rows["27 hunt-swa-race"]["triggers"] == 57
    assert rows["28 hunt-swa-race-fixed"]["verdict"] == "CLEAN"
    assert "| 26 hunt-page-tail | sglang PR 35401 |" in out


def test_ident_on_fails_when_an_output_differs(e2e, pool, tmp_path) -> None:
    d = e2e
    off = {"status": "OK", "requests_sent": 2, "requests_ok": 2, "outputs": [[1, 2], [3, 4]]}
    on = dict(off, outputs=[[1, 2], [3, 5]])
    pdir = tmp_path / "p25"
    pdir.mkdir()
    (pdir / "worker.log").write_text("kvcanary stats: step=9 forwards=9 tokens_written=9 entries_verified=2000000 "
                                     "entries_swept=9 violations=0 lost=0\n")
    s = pool.summarize_pool(d.PHASES["25"], str(pdir), on, {"24": off})
    assert s["verdict"] == "FAIL" and any("1 of 2 greedy outputs differ from those" in w for w in s["why"])


def test_phases_engine_and_env(e2e) -> None:
    d = e2e
    args = d.parse_args(["--phases", "26,27", "--model", "integration/models/gpt-oss-swa-tiny"])
    kw = d.engine_kwargs(d.PHASES["26"], args.model, args)
    assert kw["page_size"] == 16 and kw["schedule_conservativeness"] == 0.05
    kw24 = d.engine_kwargs(d.PHASES["24"], args.model, args)
    assert (kw24["max_running_requests"], kw24["schedule_policy"]) == (1, "fcfs")  # shapes follow the workload
    assert dict(d.PHASES["27"].env)["E2E_POOL"] == "swa-race"
    assert dict(d.PHASES["28"].env)["E2E_POOL"] == "swa-race-fix"


def test_pool_plugin_is_written_only_when_asked(e2e, pool, tmp_path) -> None:
    d = e2e
    env = pool.pool_env({"PATH": "/bin"}, d.PHASES["2"], str(tmp_path))
    assert "E2E_POOL" not in env and not (tmp_path / "pool-plugin").exists()
    args = d.parse_args(["--test-lift-kv-dtype"])
    env = pool.pool_env({"PATH": "/bin"}, d.PHASES["2"], str(tmp_path), pool.run_pool_switches(args))
    assert env["E2E_POOL"] == "lift-kv-dtype" and env["PYTHONPATH"].startswith(str(tmp_path / "pool-plugin"))
    assert (tmp_path / "pool-plugin" / "kvcanary_e2e_pool.py").exists()
    env = pool.pool_env(d.phase_env(d.PHASES["26"], str(tmp_path), base={}), d.PHASES["26"], str(tmp_path))
    assert env["E2E_POOL"] == "page-tail" and os.path.isabs(env["E2E_POOL_PHASES_FILE"])
    # a run-wide switch joins the phase's own, once
    args = d.parse_args(["--test-pool-switch", "swa-lock-fix", "--test-pool-switch", "page-tail"])
    env = pool.pool_env(d.phase_env(d.PHASES["26"], str(tmp_path), base={}), d.PHASES["26"], str(tmp_path),
                        pool.run_pool_switches(args))
    assert env["E2E_POOL"] == "page-tail,swa-lock-fix"
    with pytest.raises(SystemExit):
        d.parse_args(["--test-pool-switch", "no-such-switch"])


def test_a_switch_tally_in_a_clean_phase_is_summarized_and_rendered(e2e) -> None:
    log = ("[e2e-pool] swa-lock-fix: branch1=1 events=1 inserts=40 slots=12\n"
           "[e2e-pool] swa-lock-fix: branch1=2 branch2=1 events=3 fixed=3 inserts=90 slots=30\n"
           "kvcanary stats: step=9 forwards=9 tokens_written=9 entries_verified=2000000 entries_swept=9 "
           "violations=0 lost=0\n")
    s = e2e.summarize_phase(e2e.PHASES["2"], {"status": "OK", "requests_sent": 1, "requests_ok": 1}, log, [])
    assert s["pool_switches"] == {"swa-lock-fix": {"branch1": 2, "branch2": 1, "events": 3, "fixed": 3,
                                                   "inserts": 90, "slots": 30}}
    s["phase"] = "2"
    text = e2e.render({"phases": [s]})
    assert "- phase 2: test-only switch `swa-lock-fix`: branch1=2 branch2=1 events=3 fixed=3 inserts=90 slots=30" \
        in text


def test_fault_classes_follow_the_kvcanary_env_override_and_sweep_off_is_allowed(e2e) -> None:
    d = e2e
    assert d.fault_classes("KVCANARY_FAULT=real_kv_flip,token_swap KVCANARY_X=1") == ("real_kv_flip", "token_swap")
    assert d.fault_classes("") is None
    log = ("WARNING kvcanary: prefix cache ChunkCache cannot be swept (supported: RadixCache, SWARadixCache with "
           "--page-size 1); "
           "sweep off\n")
    s = d.summarize_phase(d.PHASES["2"], {"status": "OK", "requests_sent": 1, "requests_ok": 1}, log +
                          "kvcanary stats: step=9 forwards=9 tokens_written=9 entries_verified=2000000 "
                          "entries_swept=0 violations=0 lost=0\n", [])
    assert s["sweep_off"] == "ChunkCache" and d.verdict_clean(s) == (True, [])


def test_a_sweep_off_by_the_setting_is_not_judged_one_that_never_ran_is(e2e) -> None:
    """The eager setups of issue 25 run with KVCANARY_SWEEP_INTERVAL=0: their clean phase failed on "sweep never
    ran" although every manager said it was started with the sweep off."""
    d = e2e
    stats = ("kvcanary stats: step=9 forwards=9 tokens_written=9 entries_verified=2000000 entries_swept=0 "
             "violations=0 lost=0\n")

    def manager_line(interval: int) -> str:
        return (f"kvcanary: manager on cuda:0: 8193 slots; kvcanary config: mode=raise real_kv=partial "
                f"sweep_interval={interval} ring_capacity=1024 stats_every=1000\n")

    ok = {"status": "OK", "requests_sent": 1, "requests_ok": 1}
    off = d.summarize_phase(d.PHASES["1"], ok, manager_line(0) + stats, [])
    assert off["sweep_off"] == "sweep_interval=0" and d.verdict_clean(off) == (True, [])
    on = d.summarize_phase(d.PHASES["1"], ok, manager_line(10) + stats, [])
    assert on["sweep_off"] is None and d.verdict_clean(on) == (False, ["sweep never ran"])
    # an EAGLE pool's two managers: one with the sweep on is enough to judge it
    both = d.summarize_phase(d.PHASES["1"], ok, manager_line(0) + manager_line(10) + stats, [])
    assert d.verdict_clean(both) == (False, ["sweep never ran"])


def test_lift_switch_drops_only_the_kv_dtype_refusal() -> None:
    import pool_phases

    from kvcanary.sglang import audit

    before = audit.refused_rows
    try:
        pool_phases.install("lift-kv-dtype")
        fields = {r.field for r in audit.refused_rows()}
        assert "kv_cache_dtype" not in fields and "enable_pdmux" in fields
        assert len(audit.refused_rows()) == len(before()) - 1
    finally:
        audit.refused_rows = before


def test_swa_lock_phases_match_violations_against_the_freed_slots(e2e, pool, tmp_path) -> None:
    """Phases 29/30: the observer's slot files are read back, and phase 29's evidence says how many violated slots
    are among the full slots sglang freed under a full lock (the match that ties the violations to the bug)."""
    import pool_phases as pp

    d = e2e
    pdir = tmp_path / "p29"
    pdir.mkdir()
    for pid, slots in ((11, [5, 6, 7]), (12, [7, 9])):
        (pdir / pp.SWA_LOCK_FILE.format(pid=pid)).write_text(json.dumps({"event": 1, "branch": 1, "slots": slots})
                                                             + "\n")
    (pdir / "worker.log").write_text("kvcanary stats: step=9 forwards=9 tokens_written=9 entries_verified=2000000 "
                                     "entries_swept=9 violations=3 lost=0\n")
    rows = [{"schema": "kvcanary.violation/1", "slot": s, "step": 4} for s in (5, 6, 40)]
    (pdir / "kvc-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = {"status": "OK", "requests_sent": 2, "requests_ok": 2}
    s = pool.summarize_pool(d.PHASES["29"], str(pdir), res, {})
    assert s["triggers"] == 2 and s["verdict"] == "CAUGHT"
    assert s["evidence"] == ("2 inserts (2 Branch 1) freed 5 full slots (4 distinct) of a full-locked SWA tombstone; "
                             "2 of the 3 distinct violated slots are among them")
    assert pp.swa_lock_evidence("swa-lock-fix", [{"slots": [3], "branch": 2}], {3, 4}) == (
        1, "1 inserts (1 Branch 2) freed 1 full slots (1 distinct) of a full-locked SWA tombstone (the fix patched "
           "in: every such free undone); 1 of the 2 distinct violated slots are among them")
    assert dict(d.PHASES["30"].env)["E2E_POOL"] == "swa-lock-fix"
    env = pool.pool_env(d.phase_env(d.PHASES["29"], str(pdir), base={}), d.PHASES["29"], str(pdir))
    assert env["E2E_POOL"] == "swa-lock" and env["E2E_POOL_DIR"] == str(pdir)


def test_stats_of_a_two_group_pool_are_summed(e2e, core) -> None:
    """An SWAKVPool's two managers print one stats line each at the same step: the phase's counters are both."""
    log = ("kvcanary stats: step=20 forwards=20 tokens_written=5 entries_verified=50 entries_swept=7 violations=0 "
           "lost=0\n"
           "kvcanary stats: step=40 forwards=40 tokens_written=26249 entries_verified=2223470 entries_swept=206723 "
           "violations=2 lost=1\n"
           "kvcanary stats: step=40 forwards=40 tokens_written=26249 entries_verified=206326 entries_swept=0 "
           "violations=3 lost=0\n")
    assert core.parse_stats(log) == {"step": 40, "forwards": 40, "tokens_written": 26249, "entries_verified": 2429796,
                                     "entries_swept": 206723, "violations": 5, "lost": 1}
    assert core.parse_stats(log.split("\n", 1)[0])["entries_verified"] == 50
