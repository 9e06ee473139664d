"""The EAGLE phases (5-8; integration/eagle_phases.py, run by integration/sglang_e2e.py) without a GPU: phases,
Engine arguments, environment, workloads, the test-only tail plugin (against sglang 0.5.12's own
``_draft_extend_for_prefill`` where sglang is installed), the matching of draft-pool violations to chunk tails,
the verdicts and the tables."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EAGLE = ROOT / "integration" / "eagle_phases.py"  # the file the test plugin loads in sglang's processes
SHARED_EAGLE = ROOT.parent / "shared" / "e2e" / "tiny-eagle-config.json"


def _sglang_eagle():
    """sglang 0.5.12's EAGLE worker module on this (CPU) machine, or skip (the tests/adapters shims make it import)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # as tests/adapters/conftest.py does
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT / "tests" / "adapters"))
    import _sglang_cpu_shims

    _sglang_cpu_shims.apply()
    from sglang.srt.speculative import eagle_worker_v2

    return eagle_worker_v2


def test_tiny_eagle_is_the_measured_draft(e2e, eagle) -> None:
    if not SHARED_EAGLE.exists():
        pytest.skip("../shared/e2e is not beside this checkout")
    assert eagle.TINY_EAGLE == json.loads(SHARED_EAGLE.read_text())


def test_eagle_phases(e2e, eagle, tmp_path) -> None:
    assert e2e.parse_phases("eagle-bug,eagle-fixed,eagle-soak,eagle-faults") == ["5", "6", "7", "8"]
    assert e2e.parse_phases("5,1") == ["5", "1"]
    assert set(eagle.EAGLE_FAULTS) < set(e2e.E2E_FAULTS) and "token_swap" not in eagle.EAGLE_FAULTS
    for pw in ([], ["--piecewise"]):
        args = e2e.parse_args(["--out", str(tmp_path)] + pw)
        for phase in e2e.EAGLE_PHASES.values():
            kw = e2e.engine_kwargs(phase, "m", args)
            assert kw["speculative_algorithm"] == "EAGLE" and kw["speculative_eagle_topk"] == 1
            assert (kw["speculative_num_steps"], kw["speculative_num_draft_tokens"]) == (2, 3)
            assert kw["chunked_prefill_size"] == 64 and kw["disable_piecewise_cuda_graph"] is True
            assert "disable_cuda_graph" not in kw and kw["cuda_graph_max_bs"] in (16, 32)
            draft = Path(kw["speculative_draft_model_path"])
            assert json.loads((draft / "config.json").read_text()) == eagle.TINY_EAGLE
    modes = {k: dict(p.env)[eagle.EAGLE_TAIL_ENV] for k, p in e2e.EAGLE_PHASES.items()}
    assert modes == {"5": "observe", "6": "fix", "7": "fix", "8": "fix"}
    assert [p.mode for p in e2e.EAGLE_PHASES.values()] == ["log", "log", "raise", "log"]
    own = e2e.parse_args(["--out", str(tmp_path), "--draft-model", "/models/draft"])
    assert e2e.engine_kwargs(e2e.PHASES["5"], "m", own)["speculative_draft_model_path"] == "/models/draft"
    assert "speculative_algorithm" not in e2e.engine_kwargs(e2e.PHASES["2"], "m", own)


def test_eagle_env_puts_the_tail_plugin_in_reach(e2e, eagle, tmp_path) -> None:
    base = {"PATH": "/bin", "PYTHONPATH": "/tmp/site", "KVCANARY_MODE": "raise", "SGLANG_PLUGINS": "kvcanary"}
    env = eagle.eagle_env(e2e.phase_env(e2e.PHASES["8"], str(tmp_path), base), e2e.PHASES["8"], str(tmp_path))
    plugin = tmp_path / "eagle-plugin"
    assert env["PYTHONPATH"] == f"{plugin}:/tmp/site" and env["SGLANG_PLUGINS"] == "kvcanary,kvcanary_e2e_eagle"
    assert env[eagle.EAGLE_TAIL_ENV] == "fix" and env[eagle.EAGLE_DRIVER_ENV] == str(EAGLE)
    assert env["KVCANARY_FAULT"] == ",".join(eagle.EAGLE_FAULTS) and env["KVCANARY_MODE"] == "log"
    plain = e2e.phase_env(e2e.PHASES["2"], str(tmp_path), base)
    assert eagle.eagle_env(plain, e2e.PHASES["2"], str(tmp_path)) is plain
    # the entry point sglang's load_plugins finds on that path
    sys.path.insert(0, str(plugin))
    try:
        importlib.invalidate_caches()
        eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
               if ep.name == eagle.EAGLE_PLUGIN]
        assert len(eps) == 1 and eps[0].value == "kvcanary_e2e_eagle:register"
        module = eps[0].load()
        assert callable(module)
    finally:
        sys.path.remove(str(plugin))
        sys.modules.pop("kvcanary_e2e_eagle", None)


def test_eagle_workloads(e2e, eagle) -> None:
    chunked = [r for g in eagle.make_eagle_workload("eagle-chunked") for r in g]
    assert len(chunked) == 16 and all(140 <= len(r.input_ids) <= 300 for r in chunked)  # more than two chunks
    assert len({tuple(r.input_ids[:64]) for r in chunked}) == 16  # no shared first chunk: no radix hit
    soak = eagle.make_eagle_workload("eagle-soak", max_new=(8, 32))
    st = e2e.workload_stats(soak, chunk=64)
    assert st["requests"] == 320 and st["prompt_len_max"] <= 400 and st["max_group"] <= 64
    assert st["shared_prefix_requests"] > 150 and st["exact_repeats"] > 10 and st["longer_than_chunk"] > 100
    assert sum(len(g) for g in eagle.make_eagle_workload("eagle-faults")) == 640
    spec = {"workload": "eagle-chunked", "seed": 0, "max_new": [16, 32], "requests": 640}
    assert [r.input_ids for g in e2e.phase_workload(spec) for r in g] == [r.input_ids for r in chunked]
    with pytest.raises(ValueError, match="unknown EAGLE workload"):
        eagle.make_eagle_workload("eagle-x")


def test_prefill_tails(eagle) -> None:
    seqs = [list(range(100, 300)), list(range(50)), list(range(10)) + [7, 8]]
    # row 0: chunk [64, 128) of 200 tokens; row 1: its last chunk; row 2: a resumed request (origin + output)
    assert eagle.prefill_tails([64, 0, 0], [64, 50, 11], seqs) == [(0, 127, 228), (2, 10, 8)]
    assert eagle.prefill_tails([0], [0], [[1, 2]]) == []


def _draft_worker_call(eagle_worker_v2, monkeypatch, method, *, reqs, prefix, extend, input_ids, next_ids):
    """Call ``method`` (a ``_draft_extend_for_prefill``) on a stand-in worker: returns the draft's input ids, the
    draft input's bonus tokens and whatever it printed."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    seen = {}

    def init_new(cls, batch, runner):
        seen["input_ids"] = batch.input_ids.clone()
        return types.SimpleNamespace()

    monkeypatch.setattr(ForwardBatch, "init_new", classmethod(init_new))
    bs, hidden, vocab = len(reqs), 8, 32
    runner = types.SimpleNamespace(forward=lambda fb: types.SimpleNamespace(logits_output=types.SimpleNamespace(
        next_token_logits=torch.randn(bs, vocab), hidden_states=torch.zeros(bs, hidden))))
    worker = types.SimpleNamespace(draft_runner=runner, topk=1)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, input_ids=torch.tensor(input_ids),
                                  extend_seq_lens=extend, extend_prefix_lens=prefix, reqs=reqs,
                                  seq_lens=torch.tensor([p + e for p, e in zip(prefix, extend, strict=True)]),
                                  spec_info=None)
    out = method(worker, batch, torch.zeros(sum(extend), hidden), torch.tensor(next_ids), None)
    return seen["input_ids"].tolist(), out.bonus_tokens.tolist()


def test_tail_patch_against_sglang_0_5_12(eagle, monkeypatch, capsys) -> None:
    """``observe`` feeds the draft exactly what sglang 0.5.12's method feeds (the sampled token at a non-final chunk's
    end); ``fix`` feeds the next prompt token there and nothing else differs."""
    ew = _sglang_eagle()
    original = ew.EagleDraftWorker.__dict__["_draft_extend_for_prefill"]
    prompt_a = list(range(300, 500))  # 200 tokens, this forward prefills its chunk [64, 128)
    prompt_b = list(range(600, 640))  # 40 tokens, whole
    reqs = [types.SimpleNamespace(origin_input_ids=prompt_a, output_ids=[], rid="a"),
            types.SimpleNamespace(origin_input_ids=prompt_b, output_ids=[], rid="b")]
    call = dict(reqs=reqs, prefix=[64, 0], extend=[64, 40], input_ids=prompt_a[64:128] + prompt_b,
                next_ids=[7, 9])
    ids_orig, bonus_orig = _draft_worker_call(ew, monkeypatch, original, **call)
    ids_obs, bonus_obs = _draft_worker_call(ew, monkeypatch, eagle.make_draft_extend_for_prefill("observe"), **call)
    printed_obs = capsys.readouterr().out
    ids_fix, bonus_fix = _draft_worker_call(ew, monkeypatch, eagle.make_draft_extend_for_prefill("fix"), **call)
    printed_fix = capsys.readouterr().out
    assert ids_orig == prompt_a[65:128] + [7] + prompt_b[1:] + [9]  # 0.5.12: the sampled 7 at position 127
    assert ids_obs == ids_orig and bonus_obs == bonus_orig == [7, 9]
    assert ids_fix == prompt_a[65:129] + prompt_b[1:] + [9] and bonus_fix == [7, 9]  # PR 26800: prompt_a[128]
    assert eagle.parse_tails(printed_obs) == [{"mode": "observe", "position": 127, "fed": 7, "next": 428, "sampled": 7}]
    assert eagle.parse_tails(printed_fix) == [{"mode": "fix", "position": 127, "fed": 428, "next": 428, "sampled": 7}]
    with pytest.raises(ValueError, match="observe or fix"):
        eagle.make_draft_extend_for_prefill("on")


def test_plugin_register_installs_the_patch(eagle, tmp_path, monkeypatch, capsys) -> None:
    ew = _sglang_eagle()
    original = ew.EagleDraftWorker.__dict__["_draft_extend_for_prefill"]
    root = eagle.write_eagle_plugin(str(tmp_path / "p"))
    spec = importlib.util.spec_from_file_location("kvcanary_e2e_eagle_t", Path(root) / "kvcanary_e2e_eagle.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    monkeypatch.setattr(ew.EagleDraftWorker, "_draft_extend_for_prefill", original)
    monkeypatch.delenv(eagle.EAGLE_TAIL_ENV, raising=False)
    plugin.register()
    assert ew.EagleDraftWorker.__dict__["_draft_extend_for_prefill"] is original  # no mode: nothing patched
    monkeypatch.setenv(eagle.EAGLE_TAIL_ENV, "fix")
    monkeypatch.setenv(eagle.EAGLE_DRIVER_ENV, str(EAGLE))
    monkeypatch.delitem(sys.modules, "_kvcanary_e2e_eagle", raising=False)
    plugin.register()
    plugin.register()  # idempotent
    patched = ew.EagleDraftWorker.__dict__["_draft_extend_for_prefill"]
    assert patched.e2e_eagle_tail == "fix"
    assert eagle.EAGLE_PATCHED_RE.findall(capsys.readouterr().out) == ["fix"]
    sys.modules.pop("_kvcanary_e2e_eagle", None)


def _vio(pos, stored, expected, pool="draft", reasons=("verify_token",), slot=None, step=30):
    return {"schema": "kvcanary.violation/1", "step": step, "tag": "verify", "reasons": list(reasons),
            "slot": pos + 1000 if slot is None else slot, "position": pos, "stored_token": stored,
            "expected_token": expected, "rank": {"tp_rank": 0, "pool": pool}}


def test_match_eagle(e2e, eagle) -> None:
    req = e2e.Request(list(range(3, 203)), 16, -1)  # 200 tokens: tails at 63, 127, 191
    short = e2e.Request(list(range(500, 540)), 16, -1)
    tails = [{"mode": "observe", "position": p, "fed": 9, "next": p + 4, "sampled": 9} for p in (63, 127, 191)]
    rows = [_vio(63, 9, 67), _vio(63, 9, 67, step=31), _vio(127, 9, 131)]
    m = eagle.match_eagle(rows, tails, [[req, short]])
    assert (m.detected, len(m.tails), len(m.missed), m.missed[0]["position"]) == (2, 3, 1, 191)
    assert (m.chunked_requests, m.requests_with_tail, m.requests_detected) == (1, 1, 1)
    assert m.groups[0] == ("draft", "verify_token", 1063, 63, 9, 67, 2, True) and not m.unexplained
    rows += [_vio(191, 9, 195, pool="target"), _vio(50, 1, 2), _vio(191, 9, 195, reasons=("verify_chain_hash",))]
    m = eagle.match_eagle(rows, tails, [[req]])
    assert len(m.target) == 1 and len(m.unexplained) == 2 and m.detected == 2
    fixed = [dict(t, fed=t["next"], mode="fix") for t in tails]
    m = eagle.match_eagle([], fixed, [[req]])
    assert m.tails == [] and m.requests_with_tail == 1 and m.requests_detected == 0


def test_spec_stats_line_is_the_adapters(eagle) -> None:
    from kvcanary.runtime.speculative import SpecCounters

    c = SpecCounters()
    c.add_verify(rows=4, draft_token_num=3)
    c.add_verdicts([0, 0, 1, 0], drafts_per_row=2)
    line = c.line(40, "draft", {"forwards": 40, "entries_verified": 1000, "violations": 2, "tp_rank": 0})
    pools = eagle.parse_spec_stats("noise\n[2026] INFO " + line + "\n")
    assert pools["draft"]["verify_forwards"] == 1 and pools["draft"]["drafts_written"] == 8
    assert pools["draft"]["entries_verified"] == 1000 and pools["draft"]["rolled_back"] == 7


def _dry(e2e, tmp_path, phases: str) -> Path:
    out = tmp_path / "run"
    rc = e2e.main(["--dry-run", "--phases", phases, "--out", str(out)])
    assert rc == 0, (out / "summary.md").read_text()
    return out


def test_dry_run_passes_and_prints_the_eagle_tables(e2e, tmp_path, capsys) -> None:
    out = _dry(e2e, tmp_path, "eagle-bug,eagle-fixed,eagle-soak,eagle-faults")
    text = (out / "summary.md").read_text()
    assert "| 5 eagle-bug | draft |" in text and "| 7 eagle-soak | target |" in text
    assert "| draft | verify_token |" in text and "a wrong chunk tail" in text
    assert "16 chunked requests, 16 with a chunk tail printed, 16 with a detected wrong tail" in text
    assert "| position_skew | 22 | 22 | 100 % |" in text and "RESULT: PASS" in text


@pytest.mark.parametrize("damage, why", [
    ("target", "violation(s) in the target pool"),
    ("undetected", "wrong chunk tails not detected"),
    ("unexplained", "draft-pool violation(s) no wrong chunk tail explains"),
    ("no-tails", "no wrong chunk tail observed"),
])
def test_eagle_bug_verdict_fails(e2e, tmp_path, damage, why) -> None:
    out = _dry(e2e, tmp_path, "eagle-bug")
    pdir = out / "phase5-eagle-bug"
    report = pdir / "kvc-0.jsonl"
    rows = [json.loads(x) for x in report.read_text().splitlines()]
    if damage == "target":
        rows.append(_vio(63, 1, 2, pool="target"))
    elif damage == "undetected":
        first = rows[0]["position"], rows[0]["stored_token"]
        rows = [r for r in rows if (r["position"], r["stored_token"]) != first]
    elif damage == "unexplained":
        rows.append(_vio(5, 1, 2))
    else:
        log = pdir / "worker.log"
        log.write_text("\n".join(x for x in log.read_text().splitlines() if "draft tail" not in x))
    report.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert e2e.main(["--summarize", str(out)]) == 1
    assert why in (out / "summary.md").read_text()


def test_eagle_fixed_and_soak_verdicts_fail_on_violations(e2e, tmp_path) -> None:
    out = _dry(e2e, tmp_path, "eagle-fixed,eagle-soak")
    for phase in ("phase6-eagle-fixed", "phase7-eagle-soak"):
        with open(out / phase / "kvc-0.jsonl", "a") as f:
            f.write(json.dumps(_vio(10, 1, 2)) + "\n")
    assert e2e.main(["--summarize", str(out)]) == 1
    text = (out / "summary.md").read_text()
    assert "6 eagle-fixed: violations=1" in text and "7 eagle-soak: violations=1" in text
    log = out / "phase7-eagle-soak" / "worker.log"
    log.write_text(log.read_text().replace("pool=draft", "pool=other"))
    e2e.main(["--summarize", str(out)])
    assert "no kvcanary spec stats line for the draft pool" in (out / "summary.md").read_text()
