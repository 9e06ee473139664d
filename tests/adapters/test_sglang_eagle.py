"""EAGLE (topk 1, spec v2) through kvcanary in REAL sglang 0.5.12 ModelRunners on CPU.

A target runner (tiny Llama) and an EAGLE draft runner (``is_draft_worker``, one-layer ``LlamaForCausalLMEagle``,
its own KV pool over the target's slot space and ``req_to_token``) are built by sglang itself, with kvcanary
loaded through its entry point. ``MiniEagle`` then runs sglang's spec-v2 step on them the way
``EAGLEWorkerV2`` does, every forward through the real ``ModelRunner.forward`` with real ``ForwardBatch``
objects in the real modes: chunked prefill (target EXTEND, then the draft EXTEND built by sglang 0.5.12's own
``EagleDraftWorker._draft_extend_for_prefill``, or by the corrected method of the e2e driver), draft DECODE,
TARGET_VERIFY and DRAFT_EXTEND_V2, slots over-allocated ahead and freed by sglang's ``release_kv_cache``.

What cannot run on a CPU, and how it is covered here: sglang's Triton kernels (draft cache-location assignment,
tree building, greedy verify) are replaced by the equivalent torch ops (topk 1: a linear chain, the accept length
scripted per step); the draft CUDA-graph replays (which bypass ``ModelRunner.forward``) are driven through the
patched ``replay`` methods with a stand-in graph runner; torch_native attention cannot compute TARGET_VERIFY
(it reads extend lengths sglang does not set for it), so the test's backend computes that forward as the
equivalent causal extend (the canary reads only what sglang sets).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import random
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

from kvcanary.runtime.speculative import DRAFT_TOKEN_OFFSET, SpecCounters  # noqa: E402
from kvcanary.sglang import hooks, installed, speculative, v0_5_12  # noqa: E402
from kvcanary.sglang.guards import UnsupportedSetupError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64
N_DRAFT = 3  # speculative_num_draft_tokens (the bonus + 2 drafts)
STEPS = 2  # speculative_num_steps


def _driver():
    """integration/eagle_phases.py, the e2e driver's EAGLE family (its corrected _draft_extend_for_prefill, the
    upstream fix; the tail observer's line parser; ``TINY_EAGLE``, the one-layer draft config the e2e runs use)."""
    name = "sglang_e2e_eagle_phases"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "integration" / "eagle_phases.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _verify_on_cpu(backend) -> None:
    """torch_native attention computing TARGET_VERIFY as the causal extend it is for topk 1 (draft tokens after
    seq_lens committed ones); every other mode unchanged."""
    base = type(backend)

    class VerifyOnCpu(base):
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            fb = copy.copy(forward_batch)
            bs = fb.seq_lens.shape[0]
            n = q.shape[0] // bs
            fb.extend_prefix_lens = fb.seq_lens
            fb.extend_seq_lens = torch.full_like(fb.seq_lens, n)
            fb.seq_lens = fb.seq_lens + n
            return super().forward_extend(q, k, v, layer, fb, save_kv_cache)

    backend.__class__ = VerifyOnCpu


@pytest.fixture
def eagle(tmp_path, monkeypatch, request):
    """The two runners; indirect parametrisation may pass KVCANARY_* settings that replace the defaults below."""
    import sglang.srt.plugins as plugins
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.model_executor.model_runner import ModelRunner

    hooks_state.clear_kvcanary_env(monkeypatch)
    env = {"KVCANARY_MODE": "log", "KVCANARY_VERIFY_TOKENS": "1", "KVCANARY_DRAIN_EVERY": "1",
           "KVCANARY_STATS_EVERY": "5", "KVCANARY_LOG_REPEAT_WINDOW": "0",
           "KVCANARY_REPORT": str(tmp_path / "kvc-{rank}.jsonl"), "SGLANG_PLUGINS": "kvcanary"}
    env.update(getattr(request, "param", None) or {})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sgl_engine.ensure_entry_point(tmp_path, monkeypatch)
    # EAGLE turns on the KV pool's move kernel, whose warm-up is a Triton launch (no CPU driver): skip the warm-up.
    monkeypatch.setattr(memory_pool.MHATokenToKVPool, "_init_kv_copy_and_warmup",
                        lambda self: setattr(self, "_kv_copy_config", None))
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)
    plugins.load_plugins()
    try:
        for t in v0_5_12.TARGETS:
            assert hooks_state.is_patched(t.dotted), t.dotted
        draft_dir = tmp_path / "tiny-eagle"
        draft_dir.mkdir()
        (draft_dir / "config.json").write_text(json.dumps(_driver().TINY_EAGLE))
        sa = sgl_engine.server_args(
            sgl_engine.write_model_dir(tmp_path / "tiny-llama"), speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(draft_dir), speculative_num_steps=STEPS, speculative_eagle_topk=1,
            speculative_num_draft_tokens=N_DRAFT, chunked_prefill_size=CHUNK, disable_radix_cache=True,
            max_total_tokens=2048)
        assert not sa.disable_overlap_schedule  # spec v2 (EAGLEWorkerV2)
        target = sgl_engine.build_runner(sa)
        draft = ModelRunner(
            model_config=ModelConfig.from_server_args(sa, model_path=str(draft_dir), is_draft_model=True),
            mem_fraction_static=0.05, gpu_id=0, tp_rank=0, tp_size=1, moe_ep_rank=0, moe_ep_size=1, pp_rank=0,
            pp_size=1, nccl_port=sgl_engine.free_port(), server_args=sa, is_draft_worker=True,
            req_to_token_pool=target.req_to_token_pool, token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
            memory_pool_config=target.memory_pool_config,
        )
        tree = sgl_engine.build_tree_cache(target, sa)  # a ChunkCache (no prefix sharing in this test)
        _verify_on_cpu(target.attn_backend)
        yield types.SimpleNamespace(sa=sa, target=target, draft=draft, tree=tree, report=tmp_path / "kvc-0.jsonl")
    finally:
        hooks_state.restore(state)
        sgl_engine.destroy_distributed()


class MiniEagle:
    """sglang 0.5.12's EAGLEWorkerV2 step on two real ModelRunners (see the module docstring)."""

    def __init__(self, env, *, fixed_tail: bool) -> None:
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        self.env = env
        self.target, self.draft, self.tree = env.target, env.draft, env.tree
        self.r2t = self.target.req_to_token_pool.req_to_token
        self.alloc = self.target.token_to_kv_pool_allocator
        # the draft worker as far as _draft_extend_for_prefill reads it
        self.worker = types.SimpleNamespace(draft_runner=self.draft, topk=1)
        original = EagleDraftWorker.__dict__["_draft_extend_for_prefill"]
        self.fixed_tail = fixed_tail
        self.draft_extend_for_prefill = _driver().make_draft_extend_for_prefill("fix") if fixed_tail else original
        self.rng = random.Random(0)
        self.running: list = []
        self.bonus: dict[int, int] = {}  # id(req) -> its next token (position committed), not in the KV yet
        self.committed: dict[int, int] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # id(req) -> target hidden state the next draft step consumes
        self.lagging: list = []  # (req, tokens): output tokens the scheduler appends one step late (overlap)
        self.modes: dict[str, list[str]] = {"target": [], "draft": []}
        self.wrong_tails: list[tuple[int, int, int]] = []  # (position, fed, next prompt token) sglang 0.5.12 fed

    # ------------------------------------------------------------------------------------------ helpers
    def _new_req(self, prompt: list[int], max_new: int):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
        sp.normalize(None)
        req = Req(rid=f"r{self.rng.randrange(1 << 30)}", origin_input_text="", origin_input_ids=list(prompt),
                  sampling_params=sp, vocab_size=self.target.model_config.vocab_size)
        req.logprob_start_len = -1
        return req

    def _forward(self, runner, mwb):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        fb = ForwardBatch.init_new(mwb, runner)  # (kvcanary's hook uploads the rows' tokens here)
        self.modes["draft" if runner is self.draft else "target"].append(fb.forward_mode.name)
        return runner.forward(fb).logits_output

    def _flush_outputs(self) -> None:
        """The scheduler processes the previous step's result after launching the next one (overlap)."""
        for req, toks in self.lagging:
            req.output_ids.extend(toks)
        self.lagging = []

    # ------------------------------------------------------------------------------------------ prefill
    def prefill(self, prompt: list[int], max_new: int) -> None:
        req = self._new_req(prompt, max_new)

        def on_tail(end: int, fed: int) -> None:  # what 0.5.12 feeds the draft at a non-final chunk's last position
            if not self.fixed_tail:
                self.wrong_tails.append((end - 1, fed, prompt[end]))

        self.prefill_chunks(req, prompt, on_tail=on_tail)

    def prefill_chunks(self, req, seq: list[int], *, first_budget: int = CHUNK,
                       sample: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       on_tail: Callable[[int, int], None] | None = None) -> None:
        """Prefill ``seq`` (the request's tokens: a prompt, or a resumed request's prompt and output) in chunks of
        CHUNK tokens (the first ``first_budget``), each the target's EXTEND and the draft's extend built by
        ``draft_extend_for_prefill``, the way sglang's scheduler runs a chunked prefill; ``sample`` turns the
        target's logits into the next token (default greedy); ``on_tail(end, fed)`` sees each non-final chunk's end
        and the token sampled there. The request then runs (committed ``len(seq)``)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        budget, first = first_budget, True
        while True:
            if first:
                req.init_next_round_input(self.tree)
                first = False
            else:
                maybe_cache_unfinished_req(req, self.tree, chunked=True)
                req.init_next_round_input()
            assert req.fill_ids[: len(seq)] == seq
            extend = len(req.fill_ids) - len(req.prefix_indices)
            chunked = extend > budget
            req.set_extend_input_len(min(extend, budget))
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
            batch = ScheduleBatch.init_new(
                reqs=[req], req_to_token_pool=self.target.req_to_token_pool, token_to_kv_pool_allocator=self.alloc,
                tree_cache=self.tree, model_config=self.target.model_config, enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            mwb = batch.get_model_worker_batch()
            mwb.capture_hidden_mode = CaptureHiddenMode.FULL
            out = self._forward(self.target, mwb)
            logits = out.next_token_logits
            next_ids = sample(logits) if sample is not None else torch.argmax(logits, dim=-1)
            if chunked and on_tail is not None:
                on_tail(len(req.fill_ids), int(next_ids[0]))
            mwb.capture_hidden_mode = CaptureHiddenMode.LAST
            mwb.spec_algorithm = SpeculativeAlgorithm.EAGLE
            self.modes["draft"].append("EXTEND")
            nxt = self.draft_extend_for_prefill(self.worker, mwb, out.hidden_states, next_ids, None)
            budget = CHUNK
            if not chunked:
                break
        self.committed[id(req)] = len(seq)
        self.bonus[id(req)] = int(next_ids[0])
        self.hidden[id(req)] = nxt.hidden_states[-1:].clone()
        req.kv_committed_len = req.kv_allocated_len = len(seq)
        self.lagging.append((req, [int(next_ids[0])]))
        self.running.append(req)

    # ------------------------------------------------------------------------------------------ decode
    def step(self, accepts: list[int]) -> None:
        """One spec-v2 decode step of every running request; row i commits ``accepts[i]`` tokens (1..N_DRAFT)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        reqs = self.running
        bs = len(reqs)
        lens = [self.committed[id(r)] for r in reqs]
        for r, L in zip(reqs, lens, strict=True):  # over-allocate ahead, as prepare_for_decode does
            need = L + 2 * N_DRAFT - r.kv_allocated_len
            if need > 0:
                slots = self.alloc.alloc(need)
                self.r2t[r.req_pool_idx, r.kv_allocated_len : r.kv_allocated_len + need] = slots.to(torch.int32)
                r.kv_allocated_len += need
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        base = dict(reqs=reqs, req_pool_indices=rows, spec_algorithm=SpeculativeAlgorithm.EAGLE, sampling_info=None,
                    return_logprob=False, top_logprobs_nums=None, token_ids_logprobs=None, global_num_tokens=None,
                    global_num_tokens_for_logprob=None, is_extend_in_batch=False, can_run_dp_cuda_graph=False,
                    tbo_split_seq_index=None, global_forward_mode=None, seq_lens_cpu=None,
                    extend_logprob_start_lens=None, orig_seq_lens=None)
        # draft decode (num_steps - 1 forwards): position L, the first draft
        d1 = [self.rng.randrange(3, 2048) for _ in reqs]
        hidden = torch.cat([self.hidden[id(r)] for r in reqs])
        spec = EagleDraftInput(hidden_states=hidden, capture_hidden_mode=CaptureHiddenMode.LAST)
        spec.positions = torch.tensor(lens, dtype=torch.int64)
        mwb = _mwb(base, forward_mode=ForwardMode.DECODE, input_ids=torch.tensor(d1),
                   seq_lens=torch.tensor(lens) + 1,  # attention over L + 1 keys (the draft backend adds the step)
                   out_cache_loc=torch.stack([self.r2t[r.req_pool_idx, L].long()
                                              for r, L in zip(reqs, lens, strict=True)]),
                   spec_info=spec, capture_hidden_mode=CaptureHiddenMode.LAST)
        self._flush_outputs()
        out = self._forward(self.draft, mwb)
        d2 = torch.argmax(out.next_token_logits, dim=-1).tolist()
        # target verify: [bonus, d1, d2] at L .. L + 2
        ids = [t for r, a, b in zip(reqs, d1, d2, strict=True) for t in (self.bonus[id(r)], a, b)]
        pos = torch.tensor([L + k for L in lens for k in range(N_DRAFT)])
        loc = torch.cat([self.r2t[r.req_pool_idx, L : L + N_DRAFT].long() for r, L in zip(reqs, lens, strict=True)])
        vin = EagleVerifyInput(draft_token=torch.tensor(ids), custom_mask=None, positions=pos, retrieve_index=None,
                               retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None,
                               spec_steps=STEPS, topk=1, draft_token_num=N_DRAFT,
                               capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=sum(lens), seq_lens_cpu=None)
        mwb = _mwb(base, forward_mode=ForwardMode.TARGET_VERIFY, input_ids=torch.tensor(ids),
                   seq_lens=torch.tensor(lens), out_cache_loc=loc, spec_info=vin,
                   capture_hidden_mode=CaptureHiddenMode.FULL)
        out = self._forward(self.target, mwb)
        predict = torch.argmax(out.next_token_logits, dim=-1).view(bs, N_DRAFT)
        target_hidden = out.hidden_states
        # the verdict (scripted accept lengths): the committed tokens are the verify's first a inputs, the new bonus
        # the target's prediction after them; predict holds zeros past the accepted ones (sglang's buffer)
        fill = torch.zeros(bs, N_DRAFT, dtype=torch.int64)
        for i, (r, a) in enumerate(zip(reqs, accepts, strict=True)):
            chain = ids[i * N_DRAFT : i * N_DRAFT + N_DRAFT]
            fill[i, : a - 1] = torch.tensor(chain[1:a], dtype=torch.int64)
            fill[i, a - 1] = predict[i, a - 1]
            self.lagging.append((r, chain[1:a] + [int(predict[i, a - 1])]))
            self.bonus[id(r)] = int(predict[i, a - 1])
        # draft extend after the verify (DRAFT_EXTEND_V2): seq_lens counts the N_DRAFT new tokens
        spec = EagleDraftInput(hidden_states=target_hidden, num_tokens_per_req=STEPS + 1,
                               num_tokens_for_logprob_per_req=STEPS + 1)
        mwb = _mwb(base, forward_mode=ForwardMode.DRAFT_EXTEND_V2, input_ids=fill.view(-1),
                   seq_lens=torch.tensor(lens) + N_DRAFT, out_cache_loc=loc, spec_info=spec,
                   extend_seq_lens=[N_DRAFT] * bs, extend_prefix_lens=list(lens), extend_num_tokens=bs * N_DRAFT,
                   capture_hidden_mode=CaptureHiddenMode.FULL)
        out = self._forward(self.draft, mwb)
        for i, (r, a, L) in enumerate(zip(reqs, accepts, lens, strict=True)):
            self.committed[id(r)] = L + a
            self.hidden[id(r)] = out.hidden_states[i * N_DRAFT + a - 1 : i * N_DRAFT + a].clone()
        # EAGLEWorkerV2.on_verify_complete_cpu (the scheduler's host copy of the accept lengths, one step late)
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

        worker = types.SimpleNamespace(target_worker=types.SimpleNamespace(model_runner=self.target),
                                       draft_worker=self.worker, adaptive_controller=None)
        EAGLEWorkerV2.on_verify_complete_cpu(worker, [a - 1 for a in accepts])

    def finish_first(self) -> None:
        """The first running request finishes: sglang frees its committed and over-allocated slots and its row."""
        from sglang.srt.mem_cache.common import release_kv_cache

        self._flush_outputs()
        req = self.running.pop(0)
        req.kv_committed_len = self.committed.pop(id(req))
        release_kv_cache(req, self.tree)


def _mwb(base: dict, **kw):
    from sglang.srt.managers.schedule_batch import ModelWorkerBatch

    names = {f.name for f in dataclasses.fields(ModelWorkerBatch)}
    args = {k: v for k, v in {**base, **kw}.items() if k in names}
    defaults = {f.name: None for f in dataclasses.fields(ModelWorkerBatch) if f.name not in args
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return ModelWorkerBatch(**defaults, **args)


def _report(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _run(env, *, fixed_tail: bool, accepts, steps: int = 8) -> MiniEagle:
    rng = random.Random(1)
    eng = MiniEagle(env, fixed_tail=fixed_tail)
    for n in (150, 70, 40):
        eng.prefill([rng.randrange(3, 2048) for _ in range(n)], max_new=64)
    for s in range(steps):
        eng.step([accepts(s, i) for i in range(len(eng.running))])
        if s == steps // 2:
            eng.finish_first()
            eng.prefill([rng.randrange(3, 2048) for _ in range(130)], max_new=64)
    for runner in (env.target, env.draft):
        hooks.installation_of(runner).manager.flush()
    return eng


def test_installs_one_manager_per_pool_and_draft_replays_step_it(eagle) -> None:
    """One installation per runner (target, draft: their own canary buffers over one slot space, the draft's token
    shift, no fault injection into the draft pool, pool=... rank keys). The draft decode and draft-extend CUDA-graph
    replays bypass ModelRunner.forward: the patched replay methods step the draft installation (drain, health,
    stats) and count the drafts; the draft-extend replay first zeroes the padded rows' stale req_pool_indices."""
    t, d = hooks.installation_of(eagle.target), hooks.installation_of(eagle.draft)
    assert t is not None and d is not None and t.req_to_token is d.req_to_token
    assert t.manager.reporter.rank == {"tp_rank": 0, "pool": "target"}
    assert d.manager.reporter.rank == {"tp_rank": 0, "pool": "draft"}
    assert d.manager.kv_token_id_vs_position_offset == DRAFT_TOKEN_OFFSET
    assert t.manager.kv_token_id_vs_position_offset == 0
    assert t.manager.canary_buf is not d.manager.canary_buf and t.manager.num_slots == d.manager.num_slots
    assert installed.runner_state_of(eagle.draft).faults is None
    # an EAGLE pool's token appends are launched (its draft steps do not check each forward's mail: no token mail)
    assert all(m.token_table is None or m.token_table.mail is None for m in (t.manager, d.manager))
    # no deferred writes in an EAGLE pool (issue 25): its draft and verify graph replays run the captured check
    # with no call that could launch a pending write
    assert not t.defer_writes and not d.defer_writes and not t.manager.defer_writes and not d.manager.defer_writes
    assert speculative.spec_of(eagle.target).role.pool == "target"
    assert speculative.spec_of(eagle.draft).role.pool == "draft"
    assert set(speculative.forward_modes(eagle.draft, v0_5_12.FORWARD_MODES)) == {
        "EXTEND", "DECODE", "MIXED", "IDLE", "DRAFT_EXTEND_V2"}
    assert "TARGET_VERIFY" in speculative.forward_modes(eagle.target, v0_5_12.FORWARD_MODES)

    # the draft graph replays (a stand-in graph runner; the real replay needs captured CUDA graphs)
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

    inst = hooks.installation_of(eagle.draft)
    state = speculative.spec_of(eagle.draft)
    steps0 = inst.steps
    fake = types.SimpleNamespace(model_runner=eagle.draft, max_bs=8,
                                 buffers=types.SimpleNamespace(req_pool_indices=torch.arange(8)))
    fb = types.SimpleNamespace(batch_size=3)
    with pytest.raises(AttributeError):  # the patched replay calls the real one, which needs captured graphs
        EAGLEDraftCudaGraphRunner.replay(fake, fb)
    assert state.counters.draft_decode_forwards == 0  # an exception: nothing counted
    calls = []
    out = speculative.around_draft_replay(lambda g, f: calls.append(f) or "out", fake, fb)
    assert out == "out" and calls == [fb] and inst.steps == steps0 + 1
    assert state.counters.draft_decode_forwards == STEPS - 1 and state.counters.drafts_written == 3 * (STEPS - 1)
    out = speculative.around_draft_extend_replay(lambda g, f: "out2", fake, fb)
    assert out == "out2" and inst.steps == steps0 + 2
    assert fake.buffers.req_pool_indices.tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert state.counters.draft_extend_forwards == 1

    def copy_rows(g, f):  # what the real replay does: only the real rows are copied
        g.buffers.req_pool_indices[: f.batch_size].copy_(torch.arange(10, 10 + f.batch_size))

    speculative.around_draft_extend_replay(copy_rows, fake, types.SimpleNamespace(batch_size=5))
    assert fake.buffers.req_pool_indices.tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    speculative.around_draft_extend_replay(copy_rows, fake, types.SimpleNamespace(batch_size=2))
    assert fake.buffers.req_pool_indices.tolist() == [10, 11, 0, 0, 0, 0, 0, 0]  # the larger replay's rows zeroed
    # at a steady batch size nothing is zeroed (nothing launched): a value planted past the rows stays
    fake.buffers.req_pool_indices[6] = 99
    speculative.around_draft_extend_replay(copy_rows, fake, types.SimpleNamespace(batch_size=2))
    assert fake.buffers.req_pool_indices.tolist() == [10, 11, 0, 0, 0, 0, 99, 0]
    assert state.counters.draft_extend_forwards == 4
    assert hooks_state.is_patched(v0_5_12.T_DRAFT_EXTEND_REPLAY)
    assert EAGLEDraftExtendCudaGraphRunner.replay.__wrapped__ is not None


def test_sglang_0_5_12_chunk_tail_bug_is_caught_in_the_draft_pool(eagle, capsys) -> None:
    """sglang 0.5.12's own _draft_extend_for_prefill on real runners: each non-final chunk's last draft record
    holds the sampled token; the draft pool reports exactly those (verify_token, stored = fed, expected = next
    prompt token, pool=draft); the target pool reports nothing."""
    eng = _run(eagle, fixed_tail=False, accepts=lambda s, i: 1 + (s + i) % N_DRAFT)
    rows = [r for r in _report(eagle.report) if r["schema"] == "kvcanary.violation/1"]
    assert set(eng.modes["target"]) == {"EXTEND", "TARGET_VERIFY"}
    assert set(eng.modes["draft"]) == {"EXTEND", "DECODE", "DRAFT_EXTEND_V2"}
    assert len(eng.wrong_tails) == 2 + 1 + 2  # 150 tokens: 2 non-final chunks, 70: 1, 130: 2
    wrong = {(p, fed, nxt) for p, fed, nxt in eng.wrong_tails if fed != nxt}
    assert wrong
    assert [r for r in rows if r["rank"]["pool"] == "target"] == []
    got = {(r["position"], r["stored_token"], r["expected_token"]) for r in rows if r["rank"]["pool"] == "draft"}
    assert got == wrong
    assert all(r["reasons"] == ["verify_token"] for r in rows)
    from kvcanary.report import Violation

    first = rows[0]
    line = Violation.from_row([first["kernel_kind"], first["slot"], first["position"], first["stored_token"],
                               first["expected_token"], int(first["stored_chain_hash"], 16), first["expected_aux"],
                               first["fail_reason_bits"]], step=first["step"], rank=first["rank"]).log_line()
    with capsys.disabled():
        print(f"\nsglang 0.5.12 chunk tails fed to the draft: {len(eng.wrong_tails)} ({len(wrong)} wrong); draft-pool "
              f"violation rows {len(rows)} at positions {sorted({p for p, _, _ in got})}; target-pool rows 0\n{line}")


def test_with_the_upstream_fix_nothing_is_reported(eagle) -> None:
    eng = _run(eagle, fixed_tail=True, accepts=lambda s, i: 1 + (s * 2 + i) % N_DRAFT)
    assert _report(eagle.report) and [r for r in _report(eagle.report) if r["schema"] == "kvcanary.violation/1"] == []
    t, d = (hooks.installation_of(r) for r in (eagle.target, eagle.draft))
    assert t.manager.stats.slot_runs[0] > 0 and d.manager.stats.slot_runs[0] > 0  # both pools verified
    st, sd = speculative.spec_of(eagle.target).counters, speculative.spec_of(eagle.draft).counters
    before = dataclasses.replace(sd)
    speculative.count_forward(speculative.spec_of(eagle.draft), types.SimpleNamespace(  # a capture warm-up batch
        forward_mode=types.SimpleNamespace(name="DECODE"), batch_size=16, rids=None))
    assert sd == before
    verifies = eng.modes["target"].count("TARGET_VERIFY")
    assert st.verify_forwards == verifies == 8 and sd.draft_decode_forwards == 8
    assert st.drafts_accepted == sd.drafts_accepted > 0 and st.drafts_rejected > 0
    assert st.rolled_back == st.drafts_written - st.drafts_accepted
    records = [r for r in _report(eagle.report) if r["schema"] == "kvcanary.spec/1"]
    assert {r["pool"] for r in records} == {"target", "draft"}
    if hasattr(t.metrics, "labels"):  # prometheus_client installed: both pools feed drafts_rolled_back_total
        from prometheus_client import REGISTRY

        value = REGISTRY.get_sample_value("sglang:kv_canary_drafts_rolled_back_total", dict(t.metrics.labels))
        assert value is not None and value >= st.rolled_back + sd.rolled_back > 0


@pytest.mark.parametrize("change, match", [
    (dict(speculative_eagle_topk=4), "draft tree"),
    (dict(speculative_algorithm="STANDALONE"), "not covered"),
    (dict(disable_overlap_schedule=True), "spec-v1"),
    (dict(speculative_adaptive=True), "speculative-adaptive"),
    (dict(enable_multi_layer_eagle=True), "multi-layer"),
])
def test_uncovered_speculative_setups_are_refused(tmp_path, change, match) -> None:
    draft_dir = tmp_path / "tiny-eagle"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps(_driver().TINY_EAGLE))
    ok = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), speculative_algorithm="EAGLE",
                                speculative_draft_model_path=str(draft_dir), speculative_num_steps=STEPS,
                                speculative_eagle_topk=1, speculative_num_draft_tokens=N_DRAFT)
    sa = copy.copy(ok)
    for k, v in change.items():
        setattr(sa, k, v)
    with pytest.raises(UnsupportedSetupError, match=match):
        v0_5_12.check_supported(sa)
    v0_5_12.check_supported(ok)  # EAGLE topk 1 on spec v2 passes
    with pytest.raises(UnsupportedSetupError, match="covered by kvcanary on sglang 0.5.12 only"):
        speculative.check_speculative(ok, "0.5.23")


class _StandInInstallation:
    metrics = None

    def __init__(self, keeps: bool) -> None:
        self.keeps, self.stopped, self.calls = keeps, None, []

    def keeps_serving(self, exc: Exception, where: str) -> bool:
        self.calls.append(where)
        if self.keeps:
            self.stopped = where
        return self.keeps


def _runner_with_state(inst, counters) -> types.SimpleNamespace:
    state = types.SimpleNamespace(inst=inst, counters=counters, draft_token_num=4, num_steps=3)
    return types.SimpleNamespace(**{speculative.SPEC_ATTR: state})


def test_a_failing_verify_verdict_hook_stops_the_canary_not_serving_in_log_mode() -> None:
    """on_verify_complete_cpu is a scheduler hook: an error in kvcanary's counting must not reach sglang in log mode
    (that runner's canary stops, the other runner still counts); raise mode's stands."""

    class Broken:
        def add_verdicts(self, *args) -> None:
            raise RuntimeError("counting failed")

    log_inst, ok_inst = _StandInInstallation(True), _StandInInstallation(True)
    counted = SpecCounters()
    target = _runner_with_state(log_inst, Broken())
    draft = _runner_with_state(ok_inst, counted)
    worker = types.SimpleNamespace(target_worker=types.SimpleNamespace(model_runner=target),
                                   draft_worker=types.SimpleNamespace(draft_runner=draft))
    assert speculative.after_verify_complete("result", worker, [1, 3]) == "result"
    assert log_inst.calls == ["after a verify (speculative counters, metrics)"] and log_inst.stopped
    assert ok_inst.calls == [] and counted.drafts_accepted == 4
    speculative.after_verify_complete("result", worker, [2])  # a stopped runner is skipped, not asked again
    assert len(log_inst.calls) == 1 and counted.drafts_accepted == 6
    raising = _runner_with_state(_StandInInstallation(False), Broken())
    worker = types.SimpleNamespace(target_worker=types.SimpleNamespace(model_runner=raising), draft_worker=None)
    with pytest.raises(RuntimeError, match="counting failed"):
        speculative.after_verify_complete("result", worker, [1])


def test_a_failing_draft_extend_padding_zeroing_stops_the_canary_not_serving_in_log_mode() -> None:
    """The draft-extend replay's padded rows are zeroed before sglang's replay: an error there must not reach sglang
    in log mode (the replay runs, without the canary's host half); raise mode's stands."""
    inst = _StandInInstallation(True)
    runner = _runner_with_state(inst, SpecCounters())
    graph_runner = types.SimpleNamespace(model_runner=runner, buffers=types.SimpleNamespace(req_pool_indices=None))
    replays = []
    out = speculative.around_draft_extend_replay(lambda g, f: replays.append(f) or "out", graph_runner,
                                                 types.SimpleNamespace(batch_size=2))
    assert out == "out" and len(replays) == 1
    assert inst.calls == ["before a draft-extend graph replay (padded rows)"] and inst.stopped
    raising = _runner_with_state(_StandInInstallation(False), SpecCounters())
    graph_runner = types.SimpleNamespace(model_runner=raising, buffers=types.SimpleNamespace(req_pool_indices=None))
    with pytest.raises(AttributeError):  # (None has no shape)
        speculative.around_draft_extend_replay(lambda g, f: "out", graph_runner, types.SimpleNamespace(batch_size=2))
