"""The EAGLE retraction phases (integration/eagle_phases.py; 15 eagle-retract, 16 eagle-retract-fixed; sglang PR 28254)
without a GPU: phases and Engine arguments, the workload, the ``fix_prompt`` tail mode (PR 26800 alone), the
matching of draft-pool violations to output-region chunk tails, the verdicts, the dry run and its tables."""

from __future__ import annotations

import json
import types

import pytest
from test_sglang_e2e_eagle import _draft_worker_call, _sglang_eagle, _vio


def test_retract_phases(e2e, eagle, tmp_path) -> None:
    assert e2e.parse_phases("eagle-retract,eagle-retract-fixed") == ["15", "16"]
    args = e2e.parse_args(["--out", str(tmp_path)])
    for key, mode in (("15", "fix_prompt"), ("16", "fix")):
        phase = e2e.PHASES[key]
        assert dict(phase.env)[eagle.EAGLE_TAIL_ENV] == mode and phase.temperature == 1.0 and phase.mode == "log"
        kw = e2e.engine_kwargs(phase, "m", args)
        assert kw["speculative_algorithm"] == "EAGLE" and kw["speculative_eagle_topk"] == 1
        assert kw["chunked_prefill_size"] == 64 and kw["max_total_tokens"] == 3072
        assert kw["schedule_conservativeness"] == 0.05 and kw["random_seed"] == 0
        env = eagle.eagle_env(e2e.phase_env(phase, str(tmp_path), {"PATH": "/bin"}), phase, str(tmp_path))
        assert env[eagle.EAGLE_TAIL_ENV] == mode and env["KVCANARY_VERIFY_TOKENS"] == "1"
    assert all(p.temperature == 0.0 for k, p in e2e.PHASES.items() if k not in ("15", "16"))


def test_retract_workload(e2e, eagle) -> None:
    groups = eagle.make_eagle_workload("eagle-retract", max_new=(200, 320))
    reqs = [r for g in groups for r in g]
    assert [len(g) for g in groups] == [16, 16] and all(40 <= len(r.input_ids) <= 120 for r in reqs)
    assert any(len(r.input_ids) > 64 for r in reqs) and all(200 <= r.max_new_tokens <= 320 for r in reqs)
    spec = {"workload": "eagle-retract", "seed": 0, "max_new": [200, 320]}
    assert [r.input_ids for g in e2e.phase_workload(spec) for r in g] == [r.input_ids for r in reqs]


def test_fix_prompt_mode_against_sglang_0_5_12(eagle, monkeypatch, capsys) -> None:
    """A resumed request (40-token prompt, 60 output tokens) whose chunk [0, 64) ends in its output region and a
    fresh request whose chunk ends in its prompt: ``fix_prompt`` corrects the prompt tail only (PR 26800), ``fix``
    both (PR 28254); sglang 0.5.12 corrects neither."""
    ew = _sglang_eagle()
    original = ew.EagleDraftWorker.__dict__["_draft_extend_for_prefill"]
    prompt_a, out_a = list(range(300, 340)), list(range(900, 960))
    prompt_b = list(range(600, 700))
    reqs = [types.SimpleNamespace(origin_input_ids=prompt_a, output_ids=out_a, rid="a"),
            types.SimpleNamespace(origin_input_ids=prompt_b, output_ids=[], rid="b")]
    seq_a = prompt_a + out_a
    call = dict(reqs=reqs, prefix=[0, 0], extend=[64, 64], input_ids=seq_a[:64] + prompt_b[:64], next_ids=[7, 9])
    ids_orig, _ = _draft_worker_call(ew, monkeypatch, original, **call)
    assert ids_orig == seq_a[1:64] + [7] + prompt_b[1:64] + [9]
    ids, bonus = _draft_worker_call(ew, monkeypatch, eagle.make_draft_extend_for_prefill("fix_prompt"), **call)
    assert ids == seq_a[1:64] + [7] + prompt_b[1:65] and bonus == [7, 9]
    assert eagle.parse_tails(capsys.readouterr().out) == [
        {"mode": "fix_prompt", "position": 63, "fed": 7, "next": seq_a[64], "sampled": 7, "region": "output"},
        {"mode": "fix_prompt", "position": 63, "fed": prompt_b[64], "next": prompt_b[64], "sampled": 9}]
    ids, _ = _draft_worker_call(ew, monkeypatch, eagle.make_draft_extend_for_prefill("fix"), **call)
    assert ids == seq_a[1:65] + prompt_b[1:65]
    assert [t.get("region") for t in eagle.parse_tails(capsys.readouterr().out)] == ["output", None]
    with pytest.raises(ValueError, match="fix_prompt"):
        eagle.make_draft_extend_for_prefill("28254")


def _tail(pos, fed, nxt, region="output"):
    t = {"mode": "fix_prompt", "position": pos, "fed": fed, "next": nxt, "sampled": fed}
    return dict(t, region=region) if region else t


def test_match_eagle_retract(eagle) -> None:
    tails = [_tail(63, 9, 500), _tail(91, 8, 501), _tail(127, 7, 7), _tail(27, 40, 40, region=None)]
    rows = [_vio(63, 9, 500), _vio(63, 9, 500, step=31), _vio(91, 8, 501)]
    m = eagle.match_eagle_retract(rows, tails)
    assert (m.output_tails, len(m.wrong), m.detected, m.prompt_tails) == (3, 2, 2, 1)
    assert not (m.missed or m.unexplained or m.target or m.prompt_wrong)
    assert m.pools["draft"] == {"rows": 3, "slots": 2, "verify_token": 3, "other": 0}
    assert m.positions == {63: {"tails": 1, "wrong": 1, "violations": 1, "detected": 1},
                           91: {"tails": 1, "wrong": 1, "violations": 1, "detected": 1},
                           127: {"tails": 1, "wrong": 0, "violations": 0, "detected": 0}}
    assert eagle.verdict_eagle_retract(m, "fix_prompt", retractions=3, violations=3) == []
    # a violation at the right place with the wrong token, one with another reason, one in the target pool
    rows += [_vio(63, 10, 500), _vio(91, 8, 501, reasons=("verify_token", "verify_chain_hash")),
             _vio(91, 8, 501, pool="target")]
    m = eagle.match_eagle_retract(rows, tails + [_tail(155, 1, 2), _tail(27, 3, 4, region=None)])
    assert len(m.unexplained) == 2 and len(m.target) == 1 and [t["position"] for t in m.missed] == [155]
    why = eagle.verdict_eagle_retract(m, "fix_prompt", retractions=0, violations=6)
    assert why == ["no retraction happened (shrink max_total_tokens)",
                   "1 prompt-region tail(s) fed wrong (PR 26800's fix not applied?)",
                   "1 violation(s) in the target pool", "1/3 wrong output-region tails not detected",
                   "2 draft-pool violation(s) no wrong output-region tail explains"]
    fixed = eagle.match_eagle_retract([], [dict(t, fed=t["next"]) for t in tails])
    assert eagle.verdict_eagle_retract(fixed, "fix", retractions=2, violations=0) == []
    assert eagle.verdict_eagle_retract(eagle.match_eagle_retract([], []), "fix", 2, 0) == [
        "no chunk tail in a resumed request's output region (PR 28254's path not exercised)"]
    assert "no wrong output-region tail observed" in " ".join(eagle.verdict_eagle_retract(fixed, "fix_prompt", 2, 0))


def _dry(e2e, tmp_path):
    out = tmp_path / "run"
    rc = e2e.main(["--dry-run", "--phases", "eagle-retract,eagle-retract-fixed", "--out", str(out)])
    assert rc == 0, (out / "summary.md").read_text()
    return out


def test_dry_run_passes_and_prints_the_retract_tables(e2e, tmp_path) -> None:
    out = _dry(e2e, tmp_path)
    text = (out / "summary.md").read_text()
    assert "| 15 eagle-retract | OK | 0.0 | 32/32 |" in text and "| 16 eagle-retract-fixed | OK |" in text
    assert ("15 eagle-retract: retractions 3; chunk tails in resumed requests' output region 5, fed a wrong token 5, "
            "detected 5; prompt-region tails 2 (fed wrong 0)") in text
    assert "| 15 eagle-retract: pool | violation rows |" in text and "| draft | 10 | 5 | 10 | 0 |" in text
    assert "| 15 eagle-retract: position |" in text and "| 55 | 1 | 1 | 1 | 1 |" in text
    assert "16 eagle-retract-fixed: retractions 3; chunk tails in resumed requests' output region 5, fed a wrong " \
           "token 0" in text
    assert "RESULT: PASS" in text


@pytest.mark.parametrize("damage, why", [
    ("target", "violation(s) in the target pool"),
    ("undetected", "wrong output-region tails not detected"),
    ("unexplained", "draft-pool violation(s) no wrong output-region tail explains"),
    ("no-retraction", "no retraction happened"),
])
def test_retract_verdict_fails(e2e, tmp_path, damage, why) -> None:
    out = _dry(e2e, tmp_path)
    pdir = out / "phase15-eagle-retract"
    report = pdir / "kvc-0.jsonl"
    rows = [json.loads(x) for x in report.read_text().splitlines()]
    if damage == "target":
        rows.append(_vio(63, 1, 2, pool="target"))
    elif damage == "undetected":
        rows = [r for r in rows if r["position"] != rows[0]["position"]]
    elif damage == "unexplained":
        rows.append(_vio(5, 1, 2))
    else:
        saved = json.loads((out / "summary.json").read_text())
        saved["results"]["15"]["retractions"] = 0
        (out / "summary.json").write_text(json.dumps(saved))
        log = pdir / "worker.log"
        log.write_text("\n".join(x for x in log.read_text().splitlines() if "Retract requests" not in x))
    report.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert e2e.main(["--summarize", str(out)]) == 1
    assert why in (out / "summary.md").read_text()


def test_retract_fixed_verdict_fails_on_a_violation(e2e, tmp_path) -> None:
    out = _dry(e2e, tmp_path)
    with open(out / "phase16-eagle-retract-fixed" / "kvc-0.jsonl", "a") as f:
        f.write(json.dumps(_vio(63, 1, 2)) + "\n")
    assert e2e.main(["--summarize", str(out)]) == 1
    assert "16 eagle-retract-fixed: violations=1" in (out / "summary.md").read_text()
