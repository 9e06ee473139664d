"""sglang PR 28254 (open upstream) on REAL sglang 0.5.12 ModelRunners on CPU: an EAGLE request retracted after it
produced output tokens is re-prefilled from ``origin_input_ids + output_ids`` in chunks, and at a chunk tail inside
the output region the draft is fed the freshly sampled token instead of the request's own next output token.

The runners, the kvcanary installation and sglang's spec-v2 step are test_sglang_eagle.py's (``eagle``,
``MiniEagle``). What is added here:

* the tail method: the e2e driver's ``_draft_extend_for_prefill`` in mode ``fix_prompt`` (sglang 0.5.12's method
  with PR 26800's correction only: a tail whose next token is a prompt token is fed that token, past the prompt the
  sampled one, the path PR 28254 fixes) or ``fix`` (both corrections); both print every tail they feed, marked
  ``region=output`` past the prompt;
* retraction with sglang's own code: ``ScheduleBatch.release_req`` (the per-request body of
  ``ScheduleBatch.retract_decode``: ``release_kv_cache(req, tree_cache, is_insert=False)``, the tree-cache eviction,
  ``Req.reset_for_retract``), on the last running requests first, as ``retract_decode`` picks them under
  speculative decoding; the request leaves the running list as ``filter_batch`` drops it. ``retract_decode`` itself
  is not called: it needs a decode batch prepared by the scheduler (sampling info, verify futures) that MiniEagle
  does not build, and its choice of how many to retract is a pool-pressure decision this test makes explicitly;
* resume with sglang's own code: ``Req.init_next_round_input`` (``fill_ids = origin_input_ids + output_ids``),
  ``maybe_cache_unfinished_req`` between chunks, ``ScheduleBatch.prepare_for_extend``, chunks of 64 tokens (the
  first one shorter, as when it shares the step's 64-token budget with other requests, which the scheduler's
  ``PrefillAdder`` splits);
* sampling at temperature 1.0: each resumed chunk's next token is drawn by sglang's own torch sampler
  (``sglang.srt.layers.sampler.sampling_from_probs_torch``, the path sglang takes for temperature-only sampling
  with the pytorch backend and no per-request seed) from ``softmax(logits / 1.0)``, torch seeded. The request's own
  output tokens are what its decode steps committed; a fresh sample at the tail differs from the committed token
  (the test asserts it does at every output-region tail here), which is what temperature > 0 does on a GPU and
  greedy does not (a greedy re-prefill re-derives the committed token).
"""

from __future__ import annotations

import os
import random

import pytest
import test_sglang_eagle as base
import torch
from test_sglang_eagle import eagle  # noqa: F401,F811  (the fixture: target + EAGLE draft runners, kvcanary loaded)

from kvcanary.sglang import hooks

TEMPERATURE = 1.0


class ResumingEagle(base.MiniEagle):
    """MiniEagle with retraction and resume (see the module docstring)."""

    def __init__(self, env, *, tail_mode: str) -> None:
        super().__init__(env, fixed_tail=True)
        self.draft_extend_for_prefill = base._driver().make_draft_extend_for_prefill(tail_mode)
        self.retracted: list = []
        self.resumed_tails: list[tuple[int, int, int, str]] = []  # (position, fed, request's next token, region)

    def _new_req(self, prompt: list[int], max_new: int):
        req = super()._new_req(prompt, max_new)
        req.sampling_params.temperature = TEMPERATURE  # (what the request asked for; the sampling is ours)
        return req

    def retract_last(self) -> None:
        """sglang's retraction of the last running request (retract_decode under speculative decoding)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self._flush_outputs()
        req = self.running[-1]
        req.kv_committed_len = self.committed.pop(id(req))
        batch = ScheduleBatch.init_new(
            reqs=list(self.running), req_to_token_pool=self.target.req_to_token_pool,
            token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree, model_config=self.target.model_config,
            enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.EAGLE)
        batch.release_req(len(self.running) - 1, len(self.running) - 1, self.env.sa)
        assert req.is_retracted and req.kv_committed_len == 0 and req.output_ids
        self.running.pop()
        del self.bonus[id(req)], self.hidden[id(req)]
        self.retracted.append(req)

    def resume(self, req, first_chunk: int = base.CHUNK) -> None:
        """The retracted request prefilled again, ``origin_input_ids + output_ids`` in chunks, sampled at 1.0."""
        from sglang.srt.layers.sampler import sampling_from_probs_torch

        seq = list(req.origin_input_ids) + list(req.output_ids)

        def sample(logits: torch.Tensor) -> torch.Tensor:
            return sampling_from_probs_torch(torch.softmax(logits.float() / TEMPERATURE, dim=-1)).to(torch.int64)

        def on_tail(end: int, fed: int) -> None:
            region = "output" if end >= len(req.origin_input_ids) else "prompt"
            self.resumed_tails.append((end - 1, fed, seq[end], region))

        self.prefill_chunks(req, seq, first_budget=first_chunk, sample=sample, on_tail=on_tail)


def _run_28254(env, *, tail_mode: str) -> ResumingEagle:
    """Three requests (prompts of 100, 40 and 70 tokens: 100's first chunk ends in its prompt, PR 26800's region)
    decode 24 steps (~48 output tokens each); the last two are retracted (KV pressure), the first decodes on alone;
    then both resume with a first chunk shorter than 64 (60 and 30 tokens: the rest of a 64-token budget the step
    shares with other requests), so that each output-region tail's next token is a draft token the request accepted
    (not the dummy target's frequent 0), and all decode 6 more steps, so that the re-prefilled draft records are read
    again (and verified)."""
    torch.manual_seed(28254)
    rng = random.Random(28254)
    eng = ResumingEagle(env, tail_mode=tail_mode)
    for n in (100, 40, 70):
        eng.prefill([rng.randrange(3, 2048) for _ in range(n)], max_new=256)
    accepts = lambda s, i: 1 + (s + i) % base.N_DRAFT  # noqa: E731
    for s in range(24):
        eng.step([accepts(s, i) for i in range(len(eng.running))])
    eng.retract_last()
    eng.retract_last()
    for s in range(4):
        eng.step([accepts(s, 0)])
    b, c = eng.retracted[1], eng.retracted[0]  # (retracted from the back: c first)
    eng.resume(b, first_chunk=60)
    eng.resume(c, first_chunk=30)
    for s in range(6):
        eng.step([accepts(s, i) for i in range(len(eng.running))])
    for runner in (env.target, env.draft):
        hooks.installation_of(runner).manager.flush()
    return eng


def _violations(env) -> list[dict]:
    return [r for r in base._report(env.report) if r["schema"] == "kvcanary.violation/1"]


def _assert_caught(eng: ResumingEagle, rows: list[dict]) -> None:
    """kvcanary's verdict on PR 28254: draft-pool verify_token at exactly the wrong output-region tails (stored = the
    token fed, expected = the request's own output token), nothing in the target pool."""
    wrong = {(p, fed, nxt) for p, fed, nxt, region in eng.resumed_tails if region == "output" and fed != nxt}
    assert [r for r in rows if r["rank"]["pool"] == "target"] == []
    got = {(r["position"], r["stored_token"], r["expected_token"]) for r in rows if r["rank"]["pool"] == "draft"}
    assert got == wrong
    assert rows and all(r["reasons"] == ["verify_token"] for r in rows)


@pytest.mark.parametrize("eagle", [{"KVCANARY_VERIFY_TOKENS": "1"}, {"KVCANARY_VERIFY_TOKENS": "0"}],
                         ids=["token-check", "token-check-off"], indirect=True)
def test_pr_28254_resumed_output_region_tail_is_caught_in_the_draft_pool(eagle, capsys) -> None:  # noqa: F811
    """PR 26800's fix applied, PR 28254's not: the resumed requests' output-region chunk tails feed the draft the
    sampled token; kvcanary's draft pool reports exactly those. With the token check off nothing is reported, and
    the same assertion fails."""
    eng = _run_28254(eagle, tail_mode="fix_prompt")
    printed = base._driver().parse_tails(capsys.readouterr().out)
    lens = {id(r): len(r.origin_input_ids) for r in eng.retracted}
    assert len(eng.retracted) == 2 and all(r.retraction_count == 1 for r in eng.retracted)
    assert all(len(r.output_ids) > 40 for r in eng.retracted)
    output = [(p, fed, nxt) for p, fed, nxt, region in eng.resumed_tails if region == "output"]
    prompt = [(p, fed, nxt) for p, fed, nxt, region in eng.resumed_tails if region == "prompt"]
    assert [p for p, _, _ in output] == [59, 93] and [p for p, _, _ in prompt] == [29]  # 40 + 62, 70 + 60 tokens
    assert all(fed != nxt for _, fed, nxt in output)  # temperature 1.0: the fresh sample is not the request's token
    assert all(p + 1 >= min(lens.values()) for p, _, _ in output)
    # the driver's observer printed each tail it fed: output-region ones with the sampled token, prompt ones fixed
    assert {(t["position"], t["fed"], t["next"]) for t in printed if t.get("region") == "output"} == set(output)
    assert all(t["fed"] == t["next"] for t in printed if t.get("region") != "output")
    rows = _violations(eagle)
    if os.environ["KVCANARY_VERIFY_TOKENS"] == "1":
        _assert_caught(eng, rows)
        got = sorted({(r["position"], r["stored_token"], r["expected_token"]) for r in rows})
        with capsys.disabled():
            print(f"\nPR 28254 on sglang 0.5.12 (+ PR 26800): 2 requests retracted and resumed; output-region tails "
                  f"(position, fed, request's token) {output}; draft-pool violation rows {len(rows)} at "
                  f"(position, stored, expected) {got}; target-pool rows 0")
    else:
        assert rows == []  # the bug happened (output above), kvcanary's token check was off: nothing caught
        with pytest.raises(AssertionError):
            _assert_caught(eng, rows)


def test_pr_28254_with_the_fix_nothing_is_reported(eagle, capsys) -> None:  # noqa: F811
    """Both fixes (``origin_input_ids + output_ids`` at every tail): the same run, the output-region tails fed the
    request's own tokens, nothing reported, both pools verified."""
    eng = _run_28254(eagle, tail_mode="fix")
    printed = base._driver().parse_tails(capsys.readouterr().out)
    assert len(eng.retracted) == 2
    assert [t["position"] for t in printed if t.get("region") == "output"] == [59, 93]
    assert all(t["fed"] == t["next"] for t in printed)
    assert any(t["sampled"] != t["next"] for t in printed if t.get("region") == "output")  # the fix mattered
    assert base._report(eagle.report) and _violations(eagle) == []
    t, d = (hooks.installation_of(r) for r in (eagle.target, eagle.draft))
    assert t.manager.stats.slot_runs[0] > 0 and d.manager.stats.slot_runs[0] > 0
