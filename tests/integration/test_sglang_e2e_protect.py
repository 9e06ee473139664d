"""integration/sglang_e2e.py's protect phases (integration/protect_phases.py, issue 26) without sglang: the facts
shared with kvcanary, the phases' settings (phase 3's faults in protect mode), the worker's per-request loop on a
fake Engine, the action matching, the verdicts, and a dry run end to end."""

from __future__ import annotations

import asyncio
import json

import pytest

KEYS = ("21", "22", "23")


def test_facts_match_kvcanary(e2e) -> None:
    from kvcanary.runtime import protect

    pp = e2e.protect_phases
    assert pp.ACTION_SCHEMA == protect.ACTION_SCHEMA
    assert pp.ABORT_PREFIX == protect.ABORT_MESSAGE_PREFIX
    assert set(pp.REQUEST_ACTIONS) == {protect.RECOMPUTE, protect.ABORT, protect.MISSED} and pp.EVICT == protect.EVICT
    stats = protect.ProtectStats(recomputed=3, aborted=1, missed=2, nodes_evicted=4, slots_evicted=9,
                                 tokens_discarded=7, tokens_sent=5, window_forwards_max=8, window_tokens_max=6)
    log = "x\n" + stats.line(100) + "\n" + protect.ProtectStats(recomputed=1).line(50)
    assert pp.parse_protect_line(log) == dict(step=50, recomputed=1, aborted=0, missed=0, nodes_evicted=0,
                                              slots_evicted=0, nodes_deferred=0, tokens_discarded=0, tokens_sent=0,
                                              window_forwards_max=0, window_tokens_max=0)
    assert pp.parse_protect_line(stats.line(100))["window_forwards_max"] == 8
    assert pp.parse_protect_line("nothing") is None
    assert set(pp.REQUEST_CLASSES) | {"cached_idle_corruption"} == set(e2e.E2E_FAULTS)


def test_phases_are_phase_3_in_protect_mode(e2e) -> None:
    faults = dict(e2e.PHASES["3"].env)
    assert [e2e.PHASES[k].name for k in KEYS] == ["protect-clean", "protect", "protect-hold"]
    assert e2e.parse_phases("protect-clean,protect,protect-hold") == list(KEYS)
    for key in KEYS:
        phase = e2e.PHASES[key]
        env = e2e.phase_env(phase, "/r", base={"KVCANARY_MODE": "log", "KVCANARY_FAULT": "x"})
        assert env["KVCANARY_MODE"] == "protect" and phase.graphs and phase.temperature == 0.0
        assert phase.max_total_tokens == e2e.PHASES["3"].max_total_tokens and phase.max_new == e2e.PHASES["3"].max_new
        kw = e2e.engine_kwargs(phase, "m", e2e.parse_args(["--phases", key]))
        assert kw["cuda_graph_max_bs"] == 64 and "disable_cuda_graph" not in kw
        assert "disable_overlap_schedule" not in kw and "enable_hierarchical_cache" not in kw  # sglang's defaults
        if key == "21":
            assert "KVCANARY_FAULT" not in env and "KVCANARY_PROTECT_HOLD" not in env
            continue
        assert {k: env[k] for k in faults} == faults  # the same classes, cadence, seed and sweep as phase 3
        assert ("KVCANARY_PROTECT_HOLD" in env) == (key == "23")
    assert e2e.PHASES["23"].env[-1] == ("KVCANARY_PROTECT_HOLD", "1")
    # three phases within the H200 recipe's budget of 420 s (each capped; ~80 s warm)
    assert sum(e2e.PHASES[k].cap_s for k in KEYS) <= 420


def test_the_worker_spec_marks_protect_phases(e2e, tmp_path) -> None:
    specs = []

    def runner(cmd, env, log_path, timeout):
        specs.append((json.load(open(cmd[-1])), env))
        return 0

    args = e2e.parse_args(["--out", str(tmp_path), "--budget", "420", "--phases", "1,21,23"])
    e2e.run_phases(args, runner=runner)
    by = {s["phase"]: (s, env) for s, env in specs}
    assert by["21"][0]["protect"] and by["23"][0]["protect"] and not by["1"][0]["protect"]
    assert by["23"][1]["KVCANARY_PROTECT_HOLD"] == "1" and by["23"][0]["workload"] == "protect"
    groups = e2e.phase_workload(by["23"][0])
    assert sum(len(g) for g in groups) == 640  # phase 3's workload


class _HTTPException(Exception):
    def __init__(self, status_code, detail):
        super().__init__(status_code, detail)
        self.status_code, self.detail = status_code, detail


class _FakeEngine:
    """Engine.async_generate on a loop: request 1 is aborted by kvcanary (sglang raises it), request 3 by
    something else, the rest complete."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.rids = []

    async def async_generate(self, input_ids, rid, sampling_params):
        self.rids.append(rid)
        await asyncio.sleep(0)
        i = int(rid.rsplit("-", 1)[1])
        if i == 1:
            raise _HTTPException(500, "kvcanary: KV cache integrity violation found in this request's KV ...")
        n = sampling_params["max_new_tokens"] - (1 if i == 3 else 0)
        return {"output_ids": [i] * n, "meta_info": {"completion_tokens": n, "cached_tokens": 2,
                                                      "finish_reason": {"type": "length", "length": n}}}


def test_the_worker_keeps_each_requests_output_and_ending(e2e) -> None:
    pp = e2e.protect_phases
    groups = [[e2e.Request([5] * 9, 4, -1), e2e.Request([6] * 9, 4, -1)],
              [e2e.Request([7] * 9, 3, -1), e2e.Request([8] * 9, 5, -1)]]
    engine, res, saves = _FakeEngine(), {"status": "RUNNING", "errors": []}, []
    pp.run_workload(engine, groups, {"deadline": 1e18, "temperature": 0.0}, res, lambda: saves.append(1))
    engine.loop.close()
    assert [r.rsplit("-", 1)[1] for r in engine.rids] == ["0", "1", "2", "3"] and len(saves) == 3
    assert res["requests_sent"] == 4 and res["requests_ok"] == 2 and res["named_aborts"] == 1
    assert res["outputs"] == [[0] * 4, [], [2] * 3, [3] * 4]
    assert len(res["errors"]) == 1 and res["errors"][0].startswith("request 3: 4/5 tokens")
    assert res["rids"] == engine.rids and res["status"] == "RUNNING"
    assert "output_ids" not in res["protect_requests"][0]
    # the deadline: no group sent
    res = {"status": "RUNNING", "errors": []}
    engine = _FakeEngine()
    pp.run_workload(engine, groups, {"deadline": 0}, res, lambda: None)
    engine.loop.close()
    assert res["status"] == "TRUNCATED" and res["requests_sent"] == 0


def _action(action, step, slots, violation_step=None, rid=None, window=None, tokens=0, sent=0):
    return {"schema": "kvcanary.action/1", "action": action, "step": step, "slots": slots, "request_id": rid,
            "violation_step": violation_step, "window_forwards": window, "tokens_over_bad_kv": tokens,
            "tokens_sent": sent, "nodes_evicted": 1 if action == "evict" else 0, "rank": {"tp_rank": 0}}


def test_an_action_acts_on_an_injection_by_slot_and_step(e2e) -> None:
    pp = e2e.protect_phases
    inj = {"fault": "real_kv_flip", "step": 100, "slots": [7], "rank": {"tp_rank": 0}}
    swap = {"fault": "token_swap", "step": 100, "slots": [9], "rank": {"tp_rank": 0}}
    assert pp.acted_on([inj], [_action("recompute", 108, [7], 101)])  # found by the verify, acted a drain later
    assert not pp.acted_on([inj], [_action("recompute", 99, [7], 98)])  # before the injection
    assert not pp.acted_on([inj], [_action("recompute", 400, [7], 380)])  # a later violation on the reused slot
    assert not pp.acted_on([inj], [_action("recompute", 108, [8], 101)])  # another slot
    assert not pp.acted_on([inj], [dict(_action("recompute", 108, [7], 101), rank={"tp_rank": 1})])
    assert pp.acted_on([inj], [_action("evict", 104, [5, 6, 7])])
    assert pp.acted_on([swap], [_action("recompute", 190, [9], 180)])  # seen when the row is verified again
    # one action for a request hit twice before protect acted: its first violation's step, both injections' slots
    # (H200 phase 22, 2026-12-02: 8 injections counted as not acted on)
    assert pp.acted_on([inj], [_action("recompute", 104, [3, 7], 95)])


def _row(**kw):
    row = {"phase": "23 protect-hold", "status": "OK", "requests_ok": 4, "requests_sent": 4, "named_aborts": 0,
           "errors": [], "lost": 0, "health_errors": 0, "kvcanary_errors": 0, "entries_verified": 10,
           "violations": 5, "unexplained": 0, "differ_acted": [], "differ_untouched": [], "requests_missed": [],
           "classes": {c: {"injections": 12, "detected": 12, "acted": 12, "how": {"recompute": 12}}
                       for c in ("req_to_token_redirect", "real_kv_flip", "cached_idle_corruption", "token_swap",
                                 "position_skew")}}
    row.update(kw)
    return row


@pytest.mark.parametrize("kind, change, why", [
    ("hold", {}, None),
    ("hold", {"requests_ok": 3, "named_aborts": 1}, None),  # an abort by kvcanary's name completes the request
    ("hold", {"requests_ok": 3}, "3/4 requests completed"),
    ("hold", {"errors": ["request 2: 0/4 tokens"], "requests_ok": 3}, "engine errors=1"),
    ("hold", {"health_errors": 1}, "health_errors=1"),
    ("hold", {"differ_acted": [2]}, "1 recomputed request(s) finished with an output that differs"),
    ("hold", {"differ_untouched": [3]}, "1 request(s) protect never acted on finished with an output that differs"),
    ("hold", {"requests_missed": [1]}, "finished before protect acted (missed) with the window closed"),
    ("protect", {"differ_acted": [2], "requests_missed": [2]}, None),  # without hold: counted, not judged
    ("protect", {"unexplained": 2}, "2 violation(s) on slots no injection touched"),
    ("protect", {"classes": {"token_swap": {"injections": 12, "detected": 12, "acted": 0, "how": {}}}},
     "token_swap: no action record names its slots"),
    ("protect", {"classes": {"real_kv_flip": {"injections": 12, "detected": 12, "acted": 11, "how": {}}}},
     "real_kv_flip: 11/12 detected injections acted on"),
    ("protect", {"classes": {"cached_idle_corruption": {"injections": 12, "detected": 12, "acted": 3, "how": {}}}},
     None),  # the sweep's node may be gone before the drain: one eviction is enough
    ("protect", {"classes": {"position_skew": {"injections": 4, "detected": 4, "acted": 4, "how": {}}}},
     "position_skew: 4 injections < 10"),
    ("clean", {"violations": 0, "classes": None, "actions": {}}, None),
    ("clean", {"violations": 0, "classes": None, "actions": {"recompute": 1}}, "protect acted without a fault"),
])
def test_verdicts(e2e, kind, change, why) -> None:
    got = e2e.protect_phases.verdict(kind, _row(**change), True)
    if why is None:
        assert got == []
    else:
        assert any(why in w for w in got), got


def test_summary_counts_outputs_and_the_window(e2e) -> None:
    pp = e2e.protect_phases
    rows = [_action("recompute", 20, [7], 12, "t-0", 8, 8), _action("missed", 30, [8], 27, "t-2", 3, 3, 3),
            _action("evict", 31, [9, 10])]
    reqs = [{"index": i, "max_new": 2, "output_len": 2} for i in range(4)]
    res = {"outputs": [[1, 1], [2, 2], [0, 0], [4, 5]], "rids": ["t-0", "t-1", "t-2", "t-3"],
           "protect_requests": reqs, "named_aborts": 0}
    clean = {"outputs": [[1, 1], [2, 2], [3, 3], [4, 4]]}
    s = pp.summarize("protect", {}, rows, res, clean, None, (), "")
    assert s["actions"] == {"recompute": 1, "missed": 1, "evict": 1} and s["nodes_evicted"] == 1
    assert s["window_forwards"] == {"n": 2, "min": 3, "median": 5.5, "max": 8}
    assert s["requests_recomputed"] == 1 and s["requests_missed"] == [2] and s["tokens_sent_over_bad_kv"] == 3
    assert s["differ_acted"] == [2] and s["differ_untouched"] == [3] and s["finished_over_bad_kv"] == [2, 3]
    assert pp.summarize("protect", {}, rows, res, None, None, (), "")["outputs_compared"] is False


def test_dry_run_protect(e2e, tmp_path, capsys) -> None:
    out = tmp_path / "dry"
    assert e2e.main(["--dry-run", "--phases", "protect-clean,protect,protect-hold", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| protect phase | hold |" in text and "| 23 protect-hold: fault class |" in text
    assert "| 21 protect-clean | no | 640/640 | 0 | 0 | 0 | 0 | - | - | - | (reference) | PASS |" in text
    summary = json.loads((out / "summary.json").read_text())["summary"]
    rows = {r["phase"]: r for r in summary["protect"]}
    assert [r["verdict"] for r in rows.values()] == ["PASS"] * 3 and summary["pass"]
    nohold, hold = rows["22 protect"], rows["23 protect-hold"]
    assert len(nohold["requests_missed"]) == 2 and nohold["finished_over_bad_kv"] == nohold["requests_missed"]
    assert nohold["window_forwards"]["max"] > 0 and hold["window_forwards"]["max"] == 0
    assert hold["finished_over_bad_kv"] == [] and not hold["differ_acted"] and not hold["differ_untouched"]
    for r in (nohold, hold):
        assert all(x["acted"] == x["injections"] == 12 for x in r["classes"].values())
        assert r["protect_line"]["window_forwards_max"] == 8
    # the summary is rebuilt from the folder alone
    assert e2e.main(["--summarize", str(out)]) == 0
    # without protect-clean the fault phases have nothing to compare with
    out2 = tmp_path / "dry2"
    assert e2e.main(["--dry-run", "--phases", "protect-hold", "--out", str(out2)]) == 1
    assert "no outputs of protect-clean to compare with" in capsys.readouterr().out


def test_missing_results_fail(e2e, tmp_path) -> None:
    for key in KEYS:
        (tmp_path / f"phase{key}-{e2e.PHASES[key].name}").mkdir()
    summary = e2e.build_summary(str(tmp_path), list(KEYS), {}, 420, 0, {})
    assert [r["verdict"] for r in summary["protect"]] == ["FAIL"] * 3 and not summary["pass"]
    assert "status SKIPPED" in summary["protect"][0]["why"]
    assert e2e.render(summary).endswith("RESULT: FAIL")
