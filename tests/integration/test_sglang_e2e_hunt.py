"""integration/sglang_e2e.py's hunt phases (17-20, integration/hunt_phases.py; issue 27 item 5) without a GPU: the
phases and their Engine arguments, the schedules (shared prefixes, aborts and their retries, exact repeats), the
observer lines and trigger counts, the verdicts, the dry run and its table, and phases 15-16's violation ring."""

from __future__ import annotations

import json

import pytest

KINDS = ("overlap-cached", "spec-abort", "determ-radix", "hicache-hostfree")


@pytest.fixture(scope="module")
def hunt(e2e):
    return e2e.hunt_phases


def test_hunt_phases_and_engines(e2e, eagle, hunt, tmp_path) -> None:
    assert e2e.parse_phases("hunt-overlap-cached,hunt-spec-abort,hunt-determ-radix,hunt-hicache-hostfree") == \
        ["17", "18", "19", "20"]
    args = e2e.parse_args(["--out", str(tmp_path)])
    for key, kind in zip(("17", "18", "19", "20"), KINDS, strict=True):
        phase = e2e.PHASES[key]
        assert hunt.hunt_kind(phase) == kind and phase.mode == "log" and phase.temperature == 0.0
        kw = e2e.engine_kwargs(phase, "m", args)
        env = hunt.hunt_env(eagle.eagle_env(e2e.phase_env(phase, str(tmp_path), {"PATH": "/bin"}), phase,
                                            str(tmp_path)), phase, str(tmp_path))
        assert env[hunt.HUNT_ENV] == kind and env["KVCANARY_VERIFY_TOKENS"] == "1"
        assert env[hunt.HUNT_DRIVER_ENV].endswith("hunt_phases.py")
        assert (tmp_path / "hunt-plugin" / f"{hunt.HUNT_PLUGIN}.py").is_file()
        assert "disable_overlap_schedule" not in kw and not kw.get("disable_radix_cache")
        if kind == "spec-abort":  # EAGLE topk 1 (kvcanary refuses NGRAM), the 26329 fix patched in, the draft
            assert eagle.is_eagle(phase) and kw["speculative_algorithm"] == "EAGLE"
            assert kw["speculative_eagle_topk"] == 1 and kw["speculative_draft_model_path"]
            assert env[eagle.EAGLE_TAIL_ENV] == "fix"
        else:
            assert not eagle.is_eagle(phase) and "speculative_algorithm" not in kw
        if kind == "determ-radix":
            assert kw["enable_deterministic_inference"] is True and kw["attention_backend"] == "triton"
            assert kw["chunked_prefill_size"] == 512 and max(len(r["input_ids"])
                                                          for r in hunt.make_schedule(kind)) <= 512
        if kind == "hicache-hostfree":
            assert kw["enable_hierarchical_cache"] and kw["hicache_write_policy"] == "write_back"
            assert kw["hicache_ratio"] == 2.0


def test_schedules(hunt) -> None:
    oc = hunt.make_schedule("overlap-cached")
    assert len(oc) == 96 and [r["input_ids"] for r in oc[:32]] == [r["input_ids"] for r in oc[32:64]]
    sa = hunt.make_schedule("spec-abort")
    shared = [r for r in sa if "-s" in r["name"] and not r["retry_of"]]
    prefix = shared[0]["input_ids"][: hunt.SHARED_PREFIX_ABORT]
    assert all(r["input_ids"][: hunt.SHARED_PREFIX_ABORT] == prefix for r in shared)
    aborted = {r["name"]: r for r in sa if r["abort_after"] is not None}
    assert sorted({r["abort_after"] for r in aborted.values()}) == list(hunt.ABORT_AFTER_S) and len(aborted) == 8
    retries = [r for r in sa if r["retry_of"]]
    assert len(retries) == 8
    for r in retries:  # a retry re-sends its aborted request's own prompt, after the abort
        src = aborted[r["retry_of"]]
        assert r["input_ids"] == src["input_ids"] and r["at"] > src["abort_after"] and r["wave"] == src["wave"]
    dr = hunt.make_schedule("determ-radix")
    assert all(r["input_ids"][:64] == dr[0]["input_ids"][:64] for r in dr)
    firsts = {(tuple(r["input_ids"]), r["max_new"]) for r in dr if "-d" in r["name"]}
    assert all((tuple(r["input_ids"]), r["max_new"]) in firsts for r in dr if "-r" in r["name"])
    hf = hunt.make_schedule("hicache-hostfree")
    assert len(hf) == 384 and hunt.WAVE_GAP_S["hicache-hostfree"] is None
    with pytest.raises(ValueError):
        hunt.make_schedule("ngram")


def test_observer_lines_and_triggers(hunt) -> None:
    log = ("[e2e-hunt] overlap-cached: rid=a position=40 fresh_slot=9 tree_slot=3 launched_decode=1 overlap=1\n"
           "[e2e-hunt] overlap-cached: rid=b position=41 fresh_slot=10 tree_slot=4 launched_decode=0 overlap=1\n"
           "[e2e-hunt] spec-abort: rid=c running=1 waiting=0 chunked=0\n"
           "[e2e-hunt] spec-abort: rid=d running=0 waiting=1 chunked=0\n"
           "[e2e-hunt] hicache-hostfree: freed=256 loading_freed=64 loading=300\n")
    lines = hunt.parse_hunt_lines(log)
    assert lines["overlap-cached"][0]["fresh_slot"] == 9 and lines["overlap-cached"][1]["rid"] == "b"
    assert hunt.trigger_count("overlap-cached", lines, {})[0] == 1
    assert hunt.trigger_count("spec-abort", lines, {"retries_ok": 8})[0] == 1
    assert hunt.trigger_count("spec-abort", lines, {"retries_ok": 0})[0] == 0  # no retry: not the trigger
    n, why = hunt.trigger_count("hicache-hostfree", lines, {})
    assert n == 1 and "64 host slots" in why
    assert hunt.trigger_count("determ-radix", {}, {"prefix_hits_exact_64": 5})[0] == 5


def test_verdicts(hunt) -> None:
    base = {"status": "OK", "entries_verified": 10, "requests_ok": 10, "requests_sent": 12, "aborts_sent": 2,
            "violations": 0, "lost": 0, "health_errors": 0, "kvcanary_errors": 0}
    assert hunt.verdict("spec-abort", base, 3) == ("CLEAN", [])
    assert hunt.verdict("spec-abort", base, 0)[0] == "NOT TRIGGERED"
    assert hunt.verdict("spec-abort", dict(base, violations=4), 3)[0] == "CAUGHT"
    assert hunt.verdict("overlap-cached", dict(base, violations=1), 3)[0] == "FALSE POSITIVE"
    assert hunt.verdict("determ-radix", dict(base, lost=5), 3) == ("FAIL", ["lost=5"])
    assert hunt.verdict("determ-radix", dict(base, entries_verified=0), 3)[0] == "FAIL"
    assert hunt.verdict("determ-radix", dict(base, status="SKIPPED"), 3)[0] == "FAIL"
    assert hunt.verdict("determ-radix", dict(base, requests_ok=9), 3)[0] == "FAIL"


def test_summarize_requests_repeats(hunt) -> None:
    sched = hunt.make_schedule("determ-radix")
    records = [{"name": r["name"], "retry_of": None, "max_new": r["max_new"], "prompt_len": len(r["input_ids"]),
                "abort_sent": False, "output_len": r["max_new"], "cached_tokens": 64 if r["wave"] else 0,
                "finish": "length", "output_ids": [1] * r["max_new"]} for r in sched]
    rep = next(x for x in records if "-r" in x["name"])
    rep["output_ids"] = [2] * rep["max_new"]
    res: dict = {}
    hunt.summarize_requests(records, res, "determ-radix")
    assert res["requests_ok"] == res["requests_sent"] == 60 and res["repeats"] == 12
    assert res["repeats_differ"] == 1 and res["prefix_hits_exact_64"] == 50
    assert "output_ids" not in json.dumps(res["hunt_requests"])


def test_dry_run_hunt(e2e, tmp_path, capsys) -> None:
    out = tmp_path / "dry"
    assert e2e.main(["--dry-run", "--phases", "17,18,19,20", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| hunt phase | upstream |" in text
    for key, kind in zip(("17", "18", "19", "20"), KINDS, strict=True):
        assert f"| {key} hunt-{kind} | {e2e.hunt_phases.KINDS[kind][0]} |" in text
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert [r["verdict"] for r in summary["hunt"]] == ["CLEAN"] * 4 and summary["pass"]
    assert summary["hunt"][1]["aborts_sent"] == 8


def test_no_phase_raises_the_violation_ring(e2e) -> None:
    """A wrong draft slot is found again by every later draft forward of its request. Before 802b3cc the default
    1,024-row ring lost 1,643 of those rows on the H200 and phases 15-16 raised it; since, the check launch keeps the
    rows appended after the host's acknowledgement (phase 15 with the default ring: 6,052 rows, 0 lost), so every
    phase runs with the default ring, as users do."""
    assert all("KVCANARY_RING_CAPACITY" not in dict(p.env) for p in e2e.PHASES.values())
