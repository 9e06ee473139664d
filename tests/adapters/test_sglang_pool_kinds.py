"""kvcanary on the pools sglang 0.5.12 builds for issue 29/30's configs, in a REAL ModelRunner on CPU.

One engine per case, kvcanary activated through its entry point (KVCANARY_MODE=raise, token check, sweep):

* ``mla``: integration/models/deepseek-v2-mla-tiny (DeepseekV2ForCausalLM): ``MLATokenToKVPool``, one group whose
  real-KV sources are the latent ``kv_buffer`` of the first and last layer (576 bf16 = 1,152 bytes a token);
* ``swa``: integration/models/gpt-oss-swa-tiny (GptOssForCausalLM, window 64 - 1 = 63): ``SWAKVPool`` with
  ``SWATokenToKVPoolAllocator`` and ``SWARadixCache``: a full group and a swa group holding the pool's
  ``full_to_swa_index_mapping`` (the LUT) and the window, sources on each sub-pool's K/V;
* ``page64``: the tiny Llama with ``page_size`` 64 (page 1 and 16 are in test_sglang_e2e.py).

Each drives >= 150 forwards through sglang's own ScheduleBatch/ForwardBatch/ModelRunner.forward (radix prefix hits,
chunked extend, decode; for swa, decode past the window so sglang's ``maybe_evict_swa`` frees slots that left it)
with no violation, then flips one real-KV byte of a live slot and expects ``verify_real_kv_hash`` on that slot.
What the CPU cannot run as shipped (torch_native's MLA prefill, gpt-oss's sinks) goes through sgl_models' shims.
"""

from __future__ import annotations

import collections
import importlib.util
import random
import re
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sgl_models  # noqa: E402

from kvcanary.kernels import layout  # noqa: E402
from kvcanary.kernels.tags import LaunchTag  # noqa: E402
from kvcanary.report import CanaryViolationError  # noqa: E402
from kvcanary.runtime import faults  # noqa: E402
from kvcanary.sglang import hooks  # noqa: E402

FORWARDS = 150
SWEEP_INTERVAL = 7


@pytest.fixture(params=["mla", "swa", "page64", "fp8"])
def engine(request, tmp_path, monkeypatch):
    import sglang.srt.plugins as plugins

    kind = request.param
    hooks_state.clear_kvcanary_env(monkeypatch)
    for k, v in (("KVCANARY_MODE", "raise"), ("KVCANARY_VERIFY_TOKENS", "1"),
                 ("KVCANARY_SWEEP_INTERVAL", str(SWEEP_INTERVAL)), ("SGLANG_PLUGINS", "kvcanary")):
        monkeypatch.setenv(k, v)
    sgl_engine.ensure_entry_point(tmp_path, monkeypatch)
    sgl_models.install_cpu_attention_shims(monkeypatch)
    import sglang.srt.eplb.expert_location as expert_location  # MoE models set it once per process: reset after

    monkeypatch.setattr(expert_location, "_global_expert_location_metadata", None)
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)
    plugins.load_plugins()
    try:
        common = dict(chunked_prefill_size=48, max_total_tokens=2048, max_running_requests=48)
        if kind == "mla":
            sa = sgl_models.server_args(sgl_models.MLA_MODEL, tmp_path / "mla", **common)
        elif kind == "swa":
            sa = sgl_models.server_args(sgl_models.SWA_MODEL, tmp_path / "swa", **common)
        elif kind == "fp8":
            sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), kv_cache_dtype="fp8_e4m3",
                                        **common)
        else:
            sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), page_size=64,
                                        **dict(common, max_total_tokens=4096))
        mr = sgl_engine.build_runner(sa)
        tree = sgl_models.build_tree_cache(mr, sa)
        inst = hooks.installation_of(mr)
        assert inst is not None
        yield types.SimpleNamespace(kind=kind, mr=mr, tree=tree, inst=inst, sa=sa)
    finally:
        hooks_state.restore(state)
        sgl_engine.destroy_distributed()


def _drive(sched, rng, prefix, forwards: int, max_new: int) -> None:
    while len(sched.forwards) < forwards:
        in_flight = sched._rid - len(sched.finished)  # (MiniScheduler has no retraction: stay inside the pool)
        if len(sched.waiting) < 2 and in_flight < 12 and rng.random() < 0.3:
            tail = [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 70))]
            sched.add((prefix if rng.random() < 0.7 else []) + tail, rng.randrange(3, max_new))
        if not sched.idle:
            sched.step()


def _check_groups(engine) -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool, groups = engine.mr.token_to_kv_pool, engine.inst.groups
    if engine.kind == "mla":
        assert type(pool) is MLATokenToKVPool and (pool.kv_lora_rank, pool.qk_rope_head_dim) == (512, 64)
        assert [g.spec.name for g in groups] == ["full"]
        ptrs = {s.tensor.data_ptr() for s in groups[0].spec.sources}
        assert ptrs == {pool.kv_buffer[0].data_ptr(), pool.kv_buffer[-1].data_ptr()}
        assert all(s.num_bytes_per_token == 576 * 2 for s in groups[0].spec.sources)
    elif engine.kind == "swa":
        assert type(pool) is SWAKVPool and type(engine.tree).__name__ == "SWARadixCache"
        assert engine.mr.sliding_window_size == sgl_models.config(sgl_models.SWA_MODEL)["sliding_window"] - 1
        full, swa = groups
        assert (full.spec.name, swa.spec.name) == ("full", "swa")
        assert swa.spec.full_to_swa_index_mapping is pool.full_to_swa_index_mapping is not None
        assert swa.spec.swa_window_size == engine.mr.sliding_window_size and swa.spec.loc == "swa"
        assert full.spec.num_slots == pool.full_kv_pool.size + 1 and swa.spec.num_slots == pool.swa_kv_pool.size + 1
        assert {s.tensor.data_ptr() for s in full.spec.sources} <= {
            b.data_ptr() for b in pool.full_kv_pool.k_buffer + pool.full_kv_pool.v_buffer}
        assert {s.tensor.data_ptr() for s in swa.spec.sources} <= {
            b.data_ptr() for b in pool.swa_kv_pool.k_buffer + pool.swa_kv_pool.v_buffer}
    elif engine.kind == "fp8":  # sglang stores fp8 K/V as uint8 bytes: the fingerprint hashes one byte per element
        assert type(pool) is MHATokenToKVPool and pool.dtype == torch.float8_e4m3fn
        assert pool.k_buffer[0].dtype == torch.uint8 and [g.spec.name for g in groups] == ["full"]
        src = groups[0].spec.sources[0]
        assert src.num_bytes_per_token == pool.head_num * pool.head_dim
    else:
        assert type(pool) is MHATokenToKVPool and pool.page_size == 64
        assert [g.spec.name for g in groups] == ["full"] and groups[0].spec.num_slots == pool.size + 64


def test_pool_kind_clean_run_then_real_kv_flip(engine, capsys) -> None:
    _check_groups(engine)
    assert engine.inst.manager.has_sweep_source()  # (under an SWARadixCache too: its full slots are walked)
    mr, inst = engine.mr, engine.inst
    rng = random.Random(7)
    # page 64: the radix cache matches whole pages only, so the shared prefix spans two of them
    prefix = [rng.randrange(3, 2000) for _ in range(140 if engine.kind == "page64" else 40)]
    sched = sgl_engine.MiniScheduler(mr, engine.tree, chunk_size=48)
    max_new = 100 if engine.kind == "swa" else 15  # swa: decode past the 63-token window
    swa_free0 = mr.token_to_kv_pool_allocator.swa_available_size() if engine.kind == "swa" else None
    freed = 0
    if engine.kind == "swa":  # count the slots sglang's maybe_evict_swa hands back while requests still run
        alloc = mr.token_to_kv_pool_allocator
        orig = alloc.free_swa

        def free_swa(idx):
            nonlocal freed
            freed += int(idx.numel())
            return orig(idx)

        alloc.free_swa = free_swa
    _drive(sched, rng, prefix, FORWARDS, max_new)
    for g in inst.groups:
        g.manager.flush()
    modes = collections.Counter(sched.forwards)
    n = len(sched.forwards)
    stats = {g.spec.name: g.manager.stats for g in inst.groups}
    with capsys.disabled():
        print(f"\n{engine.kind}: pool={type(mr.token_to_kv_pool).__name__} forwards={n} modes={dict(modes)} "
              f"radix_tokens={sched.cached_tokens} finished={len(sched.finished)} swa_freed={freed} " + " ".join(
                  f"{k}: verified={s.slot_runs[LaunchTag.VERIFY]} written={s.slot_runs[LaunchTag.WRITE]} "
                  f"swept={s.slot_runs[LaunchTag.SWEEP]} violations={s.violations_seen}" for k, s in stats.items()))
    assert modes["EXTEND"] > 0 and modes["DECODE"] > 0 and sched.cached_tokens > 0 and sched.chunked_steps > 0
    for name, st in stats.items():
        assert st.violations_seen == 0, name
        assert st.kernel_runs[LaunchTag.VERIFY] == n and st.kernel_runs[LaunchTag.WRITE] == n, name
        assert st.slot_runs[LaunchTag.VERIFY] > 0, name
        # the full group is swept (an SWARadixCache's full slots too); the swa group is not
        assert (st.slot_runs[LaunchTag.SWEEP] > 0) == (name == "full"), name
    for g in inst.groups:  # every group's decode appends rode its own token mail, applied by its own check launches
        mail = g.manager.token_table.mail
        assert mail is not None and mail.posted > 0 and mail.full == 0, g.spec.name
        assert int(g.manager.device_state.state[layout.STATE_TOKEN_MAIL_READ]) == mail.written, g.spec.name
    if engine.kind == "swa":
        assert freed > 0, "no slot left the window (maybe_evict_swa freed nothing)"
        assert swa_free0 is not None

    # a real-KV byte flip on a live slot of a running request (for swa: in the swa sub-pool, through the LUT)
    while sched.chunked_req is not None or not sched.running or sched.running.is_empty():
        sched.add([rng.randrange(3, 2000) for _ in range(20)], 30)
        sched.step()
    req = next(r for r in sched.running.reqs if len(r.origin_input_ids) + len(r.output_ids) > 4)
    r2t = mr.req_to_token_pool.req_to_token
    full_slot = int(r2t[req.req_pool_idx, len(req.origin_input_ids) + len(req.output_ids) - 2])
    group = inst.groups[-1]
    slot = full_slot
    if engine.kind == "swa":
        slot = int(mr.token_to_kv_pool.full_to_swa_index_mapping[full_slot])
        assert slot > 0
    inj = faults.flip_real_kv(group.spec.sources[0], slot, byte=3)
    with pytest.raises(CanaryViolationError) as exc:
        for _ in range(group.manager.config.drain_every + 1):
            sched.step()
    with capsys.disabled():
        print(f"{engine.kind} flip: {inj.detail} -> {exc.value.violations[0].log_line()}")
    assert {v.slot for v in exc.value.violations} == {slot}
    assert all(v.reasons == ("verify_real_kv_hash",) for v in exc.value.violations)
    # an SWAKVPool numbers its slots per group: the report says which (the flip is in the swa group's K/V)
    expect_group = {"group": "swa"} if engine.kind == "swa" else {}
    assert all({k: v for k, v in (v.rank or {}).items() if k == "group"} == expect_group
               for v in exc.value.violations)
    if engine.kind == "swa":
        assert " group=swa" in exc.value.violations[0].log_line()


@pytest.mark.parametrize("engine", ["swa"], indirect=True)
def test_swa_cached_idle_corruption_is_swept(engine, capsys) -> None:
    """Under an SWARadixCache a full-pool K/V byte of a slot only the prefix cache holds (no running request maps
    it) changes: the sweep of the full group, walking the tree's full slots, reports it (before, the sweep was off
    under an SWARadixCache and this class went unseen)."""
    from kvcanary.sglang import radix

    rng = random.Random(11)
    sched = sgl_engine.MiniScheduler(engine.mr, engine.tree, chunk_size=48)
    _drive(sched, rng, [rng.randrange(3, 2000) for _ in range(40)], 80, 100)  # past the window: tombstones
    mr, inst = engine.mr, engine.inst
    full = inst.groups[0].manager
    full.flush()
    assert full.stats.violations_seen == 0 and full.stats.slot_runs[LaunchTag.SWEEP] > 0  # swept clean first
    r2t = mr.req_to_token_pool.req_to_token
    mapped = set()
    if sched.running is not None:
        for r in sched.running.reqs:
            mapped.update(r2t[r.req_pool_idx, : len(r.origin_input_ids) + len(r.output_ids)].tolist())
    idle = [s for s in radix.idle_cached_slots(engine.tree) if s > 0 and s not in mapped]
    assert idle, "the SWARadixCache holds no idle cached slot"
    slot = rng.choice(idle)
    source = inst.groups[0].spec.sources[0]  # the full group's (the sweep's) K/V
    inj = faults.flip_cached_idle(source, slot, byte=3)
    try:
        with pytest.raises(CanaryViolationError) as exc:
            for _ in range(3 * (SWEEP_INTERVAL + inst.manager.config.drain_every)):
                if sched.idle:  # forwards that share no prefix with the cache: only the sweep reads the slot
                    sched.add([rng.randrange(3, 2000) for _ in range(20)], 30)
                sched.step()
    finally:
        faults.flip_cached_idle(source, slot, byte=3, undo=True)
    with capsys.disabled():
        print(f"swa cached idle: {inj.detail} -> {exc.value.violations[0].log_line()}")
    assert {v.slot for v in exc.value.violations} == {slot}
    assert all(v.reasons == ("verify_real_kv_hash",) for v in exc.value.violations)
    assert any(v.tag_name == "sweep" for v in exc.value.violations)
    assert all((v.rank or {}).get("group") == "full" for v in exc.value.violations)



def test_speculative_decoding_over_an_mla_or_window_pool_is_refused_by_name(engine) -> None:
    """EAGLE is followed on MHA pools; over an MLA pool (DeepSeek's NEXTN) or a sliding-window pool it has not run, so
    the install refuses it naming the flag (hooks.install calls this with the runner's server args)."""
    from kvcanary.sglang import pools, speculative, v0_5_12
    from kvcanary.sglang.refusal import UnsupportedSetupError

    pool = engine.mr.token_to_kv_pool
    kind = pools.pool_kind(pool, v0_5_12.POOL_CLASSES)
    assert kind == {"mla": "mla", "swa": "swa"}.get(engine.kind, "mha")
    eagle = types.SimpleNamespace(speculative_algorithm="EAGLE")
    speculative.check_pool_kind(kind, type(pool).__name__, types.SimpleNamespace(speculative_algorithm=None))
    if kind == "mha":  # paged, fp8
        speculative.check_pool_kind(kind, type(pool).__name__, eagle)
        return
    what = {"mla": "an MLA KV pool (MLATokenToKVPool)", "swa": "a sliding-window KV pool (SWAKVPool)"}[engine.kind]
    with pytest.raises(UnsupportedSetupError, match=r"--speculative-algorithm EAGLE\) over " + re.escape(what)):
        speculative.check_pool_kind(kind, type(pool).__name__, eagle)


def test_the_0_5_23_adapter_refuses_the_pools_it_has_not_run(engine) -> None:
    """MLA and sliding-window pools have run with kvcanary on sglang 0.5.12 only: the 0.5.23 version module (its
    pool classes are at the same paths) refuses them by name instead of installing on 0.5.12's proof."""
    from kvcanary.sglang import v0_5_23
    from kvcanary.sglang.refusal import UnsupportedSetupError

    pool = engine.mr.token_to_kv_pool
    config = engine.inst.manager.config
    if engine.kind in ("page64", "fp8"):
        assert [g.name for g in v0_5_23.pool_groups(pool, config)] == ["full"]
        return
    with pytest.raises(UnsupportedSetupError, match=f"KV pool {type(pool).__name__} has not been run with kvcanary "
                                                    "on sglang 0.5.23"):
        v0_5_23.pool_groups(pool, config, sliding_window_size=engine.mr.sliding_window_size)


def test_page_tail_observer_tells_a_previous_occupants_tail_from_an_unwritten_one(monkeypatch, capsys) -> None:
    """Phase 26's observer (integration/pool_phases.py, PR 35401), before a forward on pages of 4: row 1's last page
    tail holds another request's slot ids (stale, PR 35401's case), row 2's holds 0 (never written: not the bug; the
    H200 warm-up printed only such tails as 'stale', 2026-12-02)."""
    import sys
    from pathlib import Path

    from sglang.srt.model_executor.model_runner import ModelRunner

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
    import pool_phases

    seen = []
    monkeypatch.setattr(ModelRunner, "forward", lambda self, fb, *a, **k: seen.append(fb) or "ran")
    pool_phases.install("page-tail")
    r2t = torch.zeros(4, 16, dtype=torch.int32)
    r2t[1, :6] = torch.arange(40, 46)  # seq_len 6 on pages of 4: the last page 44..47, its tail positions 6, 7
    r2t[1, 6:8] = torch.tensor([77, 78])  # a previous occupant's slots
    r2t[2, :5] = torch.arange(20, 25)  # seq_len 5: tail positions 5..7 never written (0)
    runner = types.SimpleNamespace(page_size=4, is_draft_worker=False,
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=r2t))
    fb = types.SimpleNamespace(req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([6, 5]))
    assert ModelRunner.forward(runner, fb) == "ran" and seen == [fb]
    out = capsys.readouterr().out
    assert "[e2e-pool] page-tail: forward=1 stale_entries=2 row=1 seq_len=6 position=6 value=77 expected=46" in out
    r2t[1, 6:8] = 0  # the same batch with row 1's tail cleared: nothing stale, only unwritten entries
    for _ in range(pool_phases.PRINT_EVERY - 1):
        ModelRunner.forward(runner, fb)
    total = capsys.readouterr().out.strip().splitlines()[-1]
    assert total == (f"[e2e-pool] page-tail-total: forwards={pool_phases.PRINT_EVERY} stale_entries=2 "
                     f"stale_forwards=1 stale_rows=1 unwritten_entries={3 + 5 * (pool_phases.PRINT_EVERY - 1)}")


def test_protect_refuses_a_pool_of_several_groups(engine) -> None:
    """Protect mode acts on one slot numbering (the full pool's, the prefix cache's); an SWAKVPool's window group
    numbers its own: refused by name (with --disable-radix-cache too, where the SWARadixCache refusal does not
    apply). One-group pools pass this check."""
    from kvcanary.sglang import protect

    if engine.kind != "swa":
        protect.check_single_group([engine.inst])
        return
    with pytest.raises(protect.ProtectRefused, match=r"KVCANARY_MODE=protect with a KV pool of 2 groups \(full, swa"):
        protect.check_single_group([engine.inst])
