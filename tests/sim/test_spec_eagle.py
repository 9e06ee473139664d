"""EAGLE (topk 1) speculative decoding through two real CanaryManagers (CPU kernels), checked against
the references (kvcanary.kernels.*_ref).

``EagleRig`` models sglang 0.5.12's spec-v2 step exactly where the canary can see it (what each forward writes
where, and what every later forward verifies), with a scripted accept length per row instead of a model:

* prefill chunk ``[s, e)``: target EXTEND of the prompt tokens; draft EXTEND of the same positions fed the
  next token (``tokens[s + 1 : e]`` and a tail: the next prompt token when fixed, the sampled one when
  ``bug=True``, as sglang 0.5.12's ``_draft_extend_for_prefill`` does for a non-final chunk);
* decode step of a row with committed length ``L`` and bonus token ``tokens[L]``: ``num_steps - 1`` draft DECODE
  forwards at ``L + i``; a target verify writing ``[bonus, d1 .. d_{n-1}]`` at ``L .. L + n - 1`` into the row's
  pre-allocated slots; accept ``a``; a draft extend writing the target's predictions at ``L .. L + n - 1``
  (zeros where rejected, as sglang's ``predict`` buffer holds); the committed length becomes ``L + a``;
* token check uploads like the adapter's ``ForwardBatch.init_new`` hook, optionally one step late (overlap
  scheduler); finished rows free every slot, over-allocated ones (holding rejected drafts) included, LIFO.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvcanary.kernels import hash_ref, layout
from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.layout import RealKvHashMode
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.runtime.config import Config
from kvcanary.runtime.manager import CanaryManager
from kvcanary.runtime.speculative import (
    DRAFT_TOKEN_OFFSET,
    SpecCounters,
    SpecLens,
    draft_extend_view,
    parse_spec_line,
    target_verify_view,
)
from kvcanary.settings import Mode

KV_BYTES = 32
VOCAB = 1000


def _i64(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


@dataclass
class Req:
    row: int
    prompt: list[int]
    tokens: list[int]  # the true sequence known so far (prompt, then every committed output token)
    slots: list[int] = field(default_factory=list)  # req_to_token mirror (allocated, possibly ahead of L)
    committed: int = 0  # positions whose KV is committed in both pools
    uploaded: int = 0  # tokens[:uploaded] are in the managers' token tables
    known: int = 0  # tokens the engine's request object shows (lags one step under an overlap scheduler)


class EagleRig:
    """Target and draft pools over one slot space and one req_to_token table, each with its own manager."""

    def __init__(self, *, rows: int = 6, num_slots: int = 2048, max_ctx: int = 512, draft_tokens: int = 3,
                 num_steps: int = 2, lag: bool = True, draft_offset: int = DRAFT_TOKEN_OFFSET,
                 probe_past_committed: bool = False, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.n, self.num_steps, self.lag = draft_tokens, num_steps, lag
        # A broken engine/adapter for the control: before each step, verify one position past the committed length.
        self.probe_past_committed = probe_past_committed
        self.steps_done = 0
        self.r2t = torch.zeros((rows + 1, max_ctx), dtype=torch.int32)
        self.free = list(range(1, num_slots))
        self.rng.shuffle(self.free)
        self.free_rows = list(range(rows, 0, -1))
        self.kv = {"target": torch.zeros((num_slots, KV_BYTES), dtype=torch.uint8),
                   "draft": torch.zeros((num_slots, KV_BYTES), dtype=torch.uint8)}
        config = Config(mode=Mode.LOG, real_kv=RealKvHashMode.ALL, verify_tokens=True, drain_every=1, stats_every=0,
                        ring_capacity=4096)
        self.mgr = {
            pool: CanaryManager(config, num_slots=num_slots, req_to_token=self.r2t, device="cpu",
                                max_batch_size=rows + 1, max_tokens_per_forward=4096,
                                real_kv_sources=[RealKvSource(self.kv[pool], 1, KV_BYTES, KV_BYTES)],
                                kv_token_id_vs_position_offset=(draft_offset if pool == "draft" else 0),
                                rank={"tp_rank": 0})
            for pool in ("target", "draft")
        }
        for m in self.mgr.values():
            m.mark_init_finished()  # chain-position assert on: every write must continue its seed's position
        self.lens = SpecLens(rows + 1, "cpu")
        self.counters = {"target": SpecCounters(), "draft": SpecCounters()}
        self.stale_slots_reused = 0  # slots holding a rejected draft record that another request wrote next
        self._stale: set[int] = set()

    # ------------------------------------------------------------------------------------------ engine model
    def add(self, prompt: list[int]) -> Req:
        req = Req(self.free_rows.pop(), list(prompt), list(prompt))
        req.known = len(prompt)
        return req

    def true_token(self, req: Req, pos: int) -> int:
        """The target's token at ``pos`` (generated on first use: the model's choice, unknown to the drafter)."""
        while len(req.tokens) <= pos:
            req.tokens.append(self.rng.randrange(3, VOCAB))
        return req.tokens[pos]

    def ensure_slots(self, req: Req, upto: int) -> None:
        while len(req.slots) < upto:
            slot = self.free.pop()
            if slot in self._stale:
                self.stale_slots_reused += 1
                self._stale.discard(slot)
            self.r2t[req.row, len(req.slots)] = slot
            req.slots.append(slot)

    def finish(self, req: Req) -> None:
        """Free the row and every slot (the committed ones and the over-allocated ones beyond), LIFO."""
        for slot in req.slots[req.committed:]:
            self._stale.add(slot)
        self.free.extend(reversed(req.slots))
        self.r2t[req.row].zero_()
        self.free_rows.append(req.row)

    def _upload(self, reqs: list[Req]) -> None:
        """What the adapter's ForwardBatch.init_new hook sends: each row's tokens appended since the last upload."""
        updates = [(r.row, r.uploaded, r.tokens[r.uploaded : r.known]) for r in reqs if r.known > r.uploaded]
        for r in reqs:
            r.uploaded = max(r.uploaded, r.known)
        if updates:
            for m in self.mgr.values():
                m.update_expected_tokens(updates)

    def _forward(self, pool: str, view: BatchView) -> None:
        m = self.mgr[pool]
        m.before_forward(view)
        ids, pos, loc = view.input_ids, view.positions, view.out_cache_loc
        pattern = torch.arange(KV_BYTES, dtype=torch.int64)
        salt = 7 if pool == "draft" else 3
        values = ((ids[:, None] * 131 + pos[:, None] * 17 + pattern[None, :] * salt) % 251).to(torch.uint8)
        self.kv[pool].index_copy_(0, loc, values)
        m.after_forward(view)
        m.step()

    @staticmethod
    def _extend_view(ids, positions, slots, rows, prefix, extend) -> BatchView:
        return BatchView(ForwardKind.EXTEND, _i64(ids), _i64(positions), _i64(slots), _i64(rows), _i64(prefix),
                         _i64(extend))

    # ------------------------------------------------------------------------------------------ forwards
    def prefill(self, req: Req, chunk: int, *, bug: bool = False) -> list[tuple[int, int, int]]:
        """Chunked prefill of the whole prompt; returns the draft tails sglang 0.5.12 gets wrong
        ``(position, fed token, next prompt token)`` (only with ``bug``)."""
        p_len = len(req.prompt)
        wrong = []
        for s in range(0, p_len, chunk):
            e = min(s + chunk, p_len)
            self.ensure_slots(req, e)
            self._upload([req])
            pos, slots = list(range(s, e)), req.slots[s:e]
            self._forward("target", self._extend_view(req.prompt[s:e], pos, slots, [req.row], [s], [e - s]))
            if e < p_len:
                tail = req.prompt[e]
                if bug:  # the token the target sampled after the chunk, not the next prompt token
                    tail = (req.prompt[e] + 1 + self.rng.randrange(VOCAB - 4)) % VOCAB
                    wrong.append((e - 1, tail, req.prompt[e]))
            else:
                tail = self.true_token(req, p_len)  # the first output token: the bonus of the first decode step
            self._forward("draft", self._extend_view(req.prompt[s + 1 : e] + [tail], pos, slots, [req.row], [s],
                                                     [e - s]))
            self.counters["draft"].add_draft_extend(1)
        req.committed = p_len
        req.known = p_len if self.lag else p_len + 1
        return wrong

    def step(self, reqs: list[Req], accepts: list[int]) -> None:
        """One speculative decode step of ``reqs``; row i accepts ``accepts[i]`` tokens (1 = the bonus only)."""
        n = self.n
        bs = len(reqs)
        lens = [r.committed for r in reqs]
        drafts = []
        for r, a, L in zip(reqs, accepts, lens, strict=True):
            assert 1 <= a <= n
            self.ensure_slots(r, L + 2 * n)  # sglang over-allocates ahead of the committed length
            guess = []
            for k in range(1, n):
                true = self.true_token(r, L + k)
                guess.append(true if k < a else (true + 1 + self.rng.randrange(VOCAB - 4)) % VOCAB)
            drafts.append(guess)
        rows = [r.row for r in reqs]
        self._upload(reqs)
        if self.probe_past_committed and self.steps_done:
            probe = self._extend_view([], [], [], rows, [L + 1 for L in lens], [0] * bs)
            self._forward("target", probe)
        self.steps_done += 1
        # draft decode: num_steps - 1 forwards, the i-th writes position L + i with draft i + 1
        for i in range(self.num_steps - 1):
            view = BatchView(ForwardKind.DECODE, _i64(d[i] for d in drafts), _i64(L + i for L in lens),
                             _i64(r.slots[L + i] for r, L in zip(reqs, lens, strict=True)), _i64(rows),
                             _i64(L + i for L in lens), _i64([1] * bs))
            self._forward("draft", view)
            self.counters["draft"].add_draft_decode(bs)
        # target verify: [bonus, d1 .. d_{n-1}] at L .. L + n - 1
        ids = [t for r, L, d in zip(reqs, lens, drafts, strict=True) for t in [r.tokens[L]] + d]
        pos = [L + k for L in lens for k in range(n)]
        loc = [r.slots[L + k] for r, L in zip(reqs, lens, strict=True) for k in range(n)]
        seq_lens = _i64(lens)
        self._forward("target", target_verify_view(self.lens, input_ids=_i64(ids), positions=_i64(pos),
                                                   out_cache_loc=_i64(loc), req_pool_indices=_i64(rows),
                                                   seq_lens=seq_lens))
        self.counters["target"].add_verify(bs, n)
        # accept, then the draft extend with the target's predictions (zero past the accepted ones)
        predict = []
        for r, a, L in zip(reqs, accepts, lens, strict=True):
            predict += [self.true_token(r, L + k + 1) if k < a else 0 for k in range(n)]
        self._forward("draft", draft_extend_view(input_ids=_i64(predict), positions=_i64(pos), out_cache_loc=_i64(loc),
                                                 req_pool_indices=_i64(rows), seq_lens=_i64(L + n for L in lens),
                                                 extend_seq_lens=_i64([n] * bs)))
        self.counters["draft"].add_draft_extend(bs, n - 1)
        for c in self.counters.values():
            c.add_verdicts([a - 1 for a in accepts], n - 1)
        for r, a, L in zip(reqs, accepts, lens, strict=True):
            r.committed = L + a
            for slot in r.slots[L + a : L + n]:
                self._stale.add(slot)
            # the engine learns the accepted tokens and the new bonus; with an overlap scheduler one step late
            r.known = (L + 1) if self.lag else (L + a + 1)

    # ------------------------------------------------------------------------------------------ checks
    def violations(self) -> dict[str, list]:
        for m in self.mgr.values():
            m.flush()
        return {pool: list(m.violations) for pool, m in self.mgr.items()}

    def expected_records(self, pool: str, req: Req) -> list[tuple[int, int, int, int]]:
        """(token, position, prev_hash, real_kv_hash) a one-by-one decode would leave at each committed position
        (kvcanary.kernels.*_ref): the target holds token p at p, the draft holds token p + 1 at p."""
        shift = DRAFT_TOKEN_OFFSET if pool == "draft" else 0
        src = [RealKvSource(self.kv[pool], 1, KV_BYTES, KV_BYTES)]
        out, h = [], hash_ref.chain_head_hash()
        for p in range(req.committed):
            tok = req.tokens[p + shift]
            kv_hash = hash_ref.real_kv_fingerprint(src, layout.REAL_KV_HASH_MODE_ALL, req.slots[p])
            out.append((tok, p, hash_ref.to_i64(h), hash_ref.to_i64(kv_hash)))
            h = hash_ref.chain_step(h, tok, p)
        return out

    def stored_records(self, pool: str, req: Req) -> list[tuple[int, int, int, int]]:
        buf = self.mgr[pool].canary_buf
        rec = buf[torch.tensor(req.slots[: req.committed], dtype=torch.int64)].view(torch.int64)
        return [tuple(int(x) for x in row) for row in rec[:, : layout.RECORD_FIELDS].tolist()]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _run(rig: EagleRig, *, prompts: list[int], steps: int, accept, chunk: int = 64, bug: bool = False,
         finish_every: int = 0) -> list[Req]:
    """Prefill each prompt, then ``steps`` decode steps of all rows with ``accept(step, i)`` tokens accepted."""
    rng = random.Random(99)
    reqs = [rig.add(_prompt(rng, p)) for p in prompts]
    for r in reqs:
        rig.prefill(r, chunk, bug=bug)
    for s in range(steps):
        rig.step(reqs, [accept(s, i) for i in range(len(reqs))])
        if finish_every and s % finish_every == finish_every - 1:
            done = reqs.pop(0)
            rig.finish(done)
            new = rig.add(_prompt(rng, 40 + 13 * s % 90))
            rig.prefill(new, chunk, bug=bug)
            reqs.append(new)
    return reqs


ACCEPTS = {
    "accept_all": lambda s, i: 3,
    "partial": lambda s, i: 2,
    "reject_all": lambda s, i: 1,  # only the bonus token: every draft rejected
    "mixed": lambda s, i: 1 + (s * 7 + i * 3) % 3,
}


@pytest.mark.parametrize("lag", [True, False], ids=["overlap-lag", "no-lag"])
@pytest.mark.parametrize("name", list(ACCEPTS))
def test_accepted_tokens_chain_as_if_decoded_one_by_one(name: str, lag: bool) -> None:
    rig = EagleRig(lag=lag)
    reqs = _run(rig, prompts=[70, 5, 131], steps=30, accept=ACCEPTS[name], chunk=64)
    found = rig.violations()
    assert found == {"target": [], "draft": []}
    for r in reqs:
        for pool in ("target", "draft"):
            assert rig.stored_records(pool, r) == rig.expected_records(pool, r), (pool, r.row)
    total = {"accept_all": 3, "partial": 2, "reject_all": 1}.get(name)
    if total is not None:
        assert [r.committed for r in reqs] == [p + 30 * total for p in (70, 5, 131)]


def test_rejected_drafts_never_reach_a_verify() -> None:
    """Every step rejects drafts, finished rows hand their over-allocated slots (rejected records) to new requests,
    and nothing is reported. The control below shows the same run is not blind: a verify that reaches one
    position past the committed length, where a rejected draft's record sits, is flagged."""
    rig = EagleRig(lag=False)
    _run(rig, prompts=[40, 90, 17, 64], steps=60, accept=ACCEPTS["mixed"], finish_every=7)
    assert rig.violations() == {"target": [], "draft": []}
    assert rig.counters["target"].drafts_rejected > 0
    assert rig.stale_slots_reused > 0  # slots that held rejected drafts were written by other requests

    broken = EagleRig(lag=False, probe_past_committed=True)
    reqs = _run(broken, prompts=[40, 90], steps=6, accept=ACCEPTS["partial"])
    found = broken.violations()
    assert not found["draft"]
    rejected_first = {(r.slots[p], p) for r in reqs for p in range(len(r.prompt) + 2, r.committed, 2)}
    assert {(v.slot, v.position) for v in found["target"]} == rejected_first  # the first rejected draft of each step
    assert all(v.reasons == ("verify_token",) for v in found["target"])


def test_bonus_only_steps() -> None:
    """a = 1 on every step: the verify's first token (the bonus) is the only one committed each time."""
    rig = EagleRig(lag=True, draft_tokens=4, num_steps=3)
    reqs = _run(rig, prompts=[12, 33], steps=40, accept=ACCEPTS["reject_all"])
    assert rig.violations() == {"target": [], "draft": []}
    for r in reqs:
        assert r.committed == len(r.prompt) + 40
        assert rig.stored_records("target", r) == rig.expected_records("target", r)
        assert rig.stored_records("draft", r) == rig.expected_records("draft", r)


def test_chunked_prefill_with_the_fix_is_clean() -> None:
    rig = EagleRig(lag=True)
    _run(rig, prompts=[200, 129, 64, 65], steps=12, accept=ACCEPTS["mixed"], chunk=64)
    assert rig.violations() == {"target": [], "draft": []}


def test_sglang_26329_chunk_tail_bug_is_flagged_in_the_draft_pool_only() -> None:
    """sglang 0.5.12 feeds the draft the sampled token at the end of a non-final prefill chunk: the draft record
    at the chunk's last position holds the wrong next token. The draft pool's token check (offset 1) flags exactly
    those positions (verify_token, stored = fed, expected = the next prompt token); the target pool stays clean."""
    rig = EagleRig(lag=True)
    rng = random.Random(5)
    reqs, wrong = [], {}
    for p_len in (200, 150, 64, 65):
        req = rig.add(_prompt(rng, p_len))
        for pos, fed, nxt in rig.prefill(req, 64, bug=True):
            wrong[(req.slots[pos], pos)] = (fed, nxt)
        reqs.append(req)
    for s in range(5):
        rig.step(reqs, [ACCEPTS["mixed"](s, i) for i in range(len(reqs))])
    found = rig.violations()
    assert found["target"] == []
    assert len(wrong) == 3 + 2 + 0 + 1  # non-final chunks of 200, 150, 64, 65 tokens
    seen = {(v.slot, v.position) for v in found["draft"]}
    assert seen == set(wrong)
    for v in found["draft"]:
        assert v.reasons == ("verify_token",)
        assert (v.stored_token, v.expected_token) == wrong[(v.slot, v.position)]


def test_draft_pool_needs_the_token_shift() -> None:
    """Without the shift the draft pool's token check compares the draft record at p (token p + 1) with token p."""
    rig = EagleRig(lag=False, draft_offset=0)
    _run(rig, prompts=[30], steps=3, accept=ACCEPTS["accept_all"])
    found = rig.violations()
    assert found["target"] == []
    assert found["draft"] and all(v.reasons == ("verify_token",) for v in found["draft"])


def test_an_engine_that_commits_a_rejected_draft_is_caught() -> None:
    """The canary still sees KV bugs under speculation: an engine that counts one rejected draft as accepted (its
    committed length one too long) leaves the wrong token at that position, and the next verify flags it."""
    rig = EagleRig(lag=False)
    reqs = _run(rig, prompts=[50], steps=2, accept=ACCEPTS["partial"])
    r = reqs[0]
    r.committed += 1  # the engine's bug: position committed - 1 holds the rejected draft d_2
    r.tokens = r.tokens[: r.committed]  # ... and it believes that token was the target's
    rig.true_token(r, r.committed)
    r.known = r.committed + 1
    rig.step(reqs, [2])
    found = rig.violations()
    assert found["target"] and {v.position for v in found["target"]} == {r.committed - 3}
    assert all("verify_token" in v.reasons for v in found["target"])


def test_spec_counters() -> None:
    rig = EagleRig(lag=False)
    _run(rig, prompts=[10, 20], steps=4, accept=lambda s, i: 1 + i)  # row 0 accepts the bonus only, row 1 one draft
    t, d = rig.counters["target"], rig.counters["draft"]
    assert t.verify_forwards == 4 and t.drafts_written == 4 * 2 * 2
    assert t.drafts_accepted == 4 and t.drafts_rejected == 4 * 4 - 4 and t.rolled_back == 16 - 4
    assert d.draft_decode_forwards == 4 and d.draft_extend_forwards == 2 + 4
    assert d.drafts_written == 4 * 2 + 4 * 2 * 2 and d.rolled_back == d.drafts_written - 4
    assert d.superseded == 4 * 2  # the draft-decode records, rewritten by each step's draft extend
    early = SpecCounters()
    early.add_verify(rows=2, draft_token_num=3)
    assert early.rolled_back == 0  # nothing counted as rolled back before the engine's verdict arrives
    early.add_verdicts([1, 0], drafts_per_row=2)
    assert early.rolled_back == early.drafts_rejected == 3
    line = t.line(12, "target", {"violations": 0})
    fields = parse_spec_line("INFO x " + line)
    assert fields["pool"] == "target" and fields["step"] == 12 and fields["rolled_back"] == 12
    assert fields["drafts_rejected"] == 12 and fields["violations"] == 0
    rec = t.record(12, "target", {"tp_rank": 0, "pool": "target"})
    assert rec["schema"] == "kvcanary.spec/1" and rec["counters"]["verify_forwards"] == 4
    assert t.due(20, 10) and not t.due(20, 10) and not t.due(21, 10) and not t.due(30, 0)


def test_spec_lens() -> None:
    lens = SpecLens(4, "cpu")
    prefix, extend = lens.target_verify(torch.tensor([5, 9], dtype=torch.int32), 6)
    assert prefix.tolist() == [5, 9] and prefix.dtype == torch.int64 and extend.tolist() == [3, 3]
    again = lens.target_verify(torch.tensor([1, 1, 1], dtype=torch.int32), 9)[1]
    assert again.data_ptr() == extend.data_ptr()  # one buffer per draft count: stable under CUDA graphs
    with pytest.raises(ValueError, match="same number of draft tokens"):
        lens.target_verify(torch.tensor([1, 2]), 5)
    with pytest.raises(ValueError, match="max_batch_size"):
        lens.target_verify(torch.zeros(5, dtype=torch.int64), 10)
    prefix, extend = SpecLens.draft_extend(torch.tensor([8, 13]), torch.tensor([3, 3], dtype=torch.int32))
    assert prefix.tolist() == [5, 10] and extend.tolist() == [3, 3]
