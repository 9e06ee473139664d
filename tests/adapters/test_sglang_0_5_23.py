"""The sglang 0.5.23 adapter (kvcanary.sglang.v0_5_23) against a REAL sglang 0.5.23 on CPU.

Runs only where sglang 0.5.23 is installed (.ci/run's second venv: requirements-sglang-0.5.23-cpu.txt; in the
0.5.12 venv this module is skipped). Hook targets resolve on the real classes (and the 0.5.12 ones that moved do
not); register() is cheap, idempotent and needs no ModelRunner; sglang's own --kv-canary and the unified pool are
refused by name on the real ServerArgs; then a real 0.5.23 ModelRunner, kvcanary activated through its entry point,
runs >= 200 forwards (radix reuse through the real UnifiedRadixCache, chunked prefill, rows reused) with nothing
reported, and a req_to_token redirect and a K-byte flip are each reported with the expected reason.
"""

from __future__ import annotations

import collections
import importlib.util
import random
import textwrap
import time
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)
from importlib.metadata import version as _installed  # noqa: E402

if not _installed("sglang").startswith("0.5.23"):
    pytest.skip(f"sglang {_installed('sglang')} installed; these tests need sglang 0.5.23 "
                "(pip install --no-deps -r requirements-sglang-0.5.23-cpu.txt)", allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine_0_5_23 as engine  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

import kvcanary.sglang as kvcanary_sglang  # noqa: E402
from kvcanary.kernels.tags import LaunchTag  # noqa: E402
from kvcanary.report import CanaryViolationError  # noqa: E402
from kvcanary.runtime import faults  # noqa: E402
from kvcanary.sglang import contract, v0_5_23  # noqa: E402
from kvcanary.sglang.guards import UnsupportedSetupError  # noqa: E402
from kvcanary.sglang.hooks import hooks_for, installation_of  # noqa: E402
from kvcanary.sglang.targets import HookTargetError, Target, resolve_target  # noqa: E402

FORWARDS = 210
SWEEP_INTERVAL = 7
ALL_TARGETS = [t.dotted for t in v0_5_23.TARGETS] + [v0_5_23.STARTUP_FAILURE_TARGET]


@pytest.fixture
def hooks(monkeypatch):
    """Fresh HookRegistry and unpatched 0.5.23 targets before and after the test; no KVCANARY_* variables."""
    hooks_state.clear_kvcanary_env(monkeypatch)
    state = hooks_state.snapshot(ALL_TARGETS)
    hooks_state.restore(state)
    yield state
    hooks_state.restore(state)


# --------------------------------------------------------------------------------------------- version, targets
def test_installed_sglang_selects_the_0_5_23_module_which_satisfies_the_contract() -> None:
    assert kvcanary_sglang.version_module() is v0_5_23
    assert contract.contract_problems(v0_5_23) == []
    assert "after_populate" not in v0_5_23.HOOK_TARGETS  # 0.5.23's buffer registry zeroes padded rows itself


def _target_id(t: Target) -> str:
    return ".".join(t.dotted.rsplit(".", 2)[-2:])


@pytest.mark.parametrize("target", v0_5_23.TARGETS, ids=_target_id)
def test_hook_target_resolves_on_the_real_0_5_23_class(target) -> None:
    import inspect

    params = list(inspect.signature(resolve_target(target)).parameters)
    assert params[0] == target.params[0] and set(target.params) <= set(params), (target.dotted, params)


@pytest.mark.parametrize("dotted", [
    "sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool",  # -> alloc_memory_pool
    "sglang.srt.managers.scheduler.Scheduler.init_cache_with_memory_pool",  # -> kv_cache_builder.build_kv_cache
    "sglang.srt.model_executor.cuda_graph_runner.DecodeInputBuffers.populate_from_forward_batch",  # moved
])
def test_0_5_12_targets_that_moved_fail_naming_them(dotted) -> None:
    with pytest.raises(HookTargetError, match=dotted.rsplit(".", 1)[0].rsplit(".", 1)[-1]):
        resolve_target(Target(dotted, "AFTER", ("self",)))


def test_facts_the_adapter_relies_on() -> None:
    """The 0.5.23 facts of issue 16 the module is written against, read off the real classes."""
    import dataclasses

    from sglang.srt.model_executor.cuda_graph_buffer_registry import PaddingPolicy, build_decode_registry
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.runner_utils.buffers import DecodeInputBuffers, PrefillInputBuffers  # noqa: F401

    fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert {"kv_loc_plan", "out_cache_loc_virtual", "out_cache_loc_is_physical", "req_pool_indices_cpu",
            "rids_int"} <= fields
    assert not {"req_to_token_pool", "token_to_kv_pool", "attn_backend", "out_cache_loc_swa"} & fields
    assert "out_cache_loc_swa" not in {f.name for f in dataclasses.fields(DecodeInputBuffers)}
    registry = build_decode_registry(device=torch.device("cpu"), max_bs=4, max_num_token=4, seq_len_fill_value=1,
                                     cache_loc_dtype=torch.int64, enable_mamba_track=False, is_encoder_decoder=False,
                                     encoder_len_fill_value=0, enable_num_token_non_padded=False,
                                     require_gathered_buffer=False, enable_prefill_cp=False,
                                     require_mlp_tp_gather=False, attn_tp_sharded_fn=lambda n: False, num_dp_ranks=1)
    for name in ("req_pool_indices", "positions", "out_cache_loc"):
        assert registry.get_slot(name).padding_policy is PaddingPolicy.ZERO, name


# --------------------------------------------------------------------------------------------- register
def test_register_is_cheap_idempotent_and_needs_no_model_runner(hooks, monkeypatch) -> None:
    """0.5.23 runs load_plugins() in the DP controller and the detokenizer too: register() builds nothing (no
    installation, no device memory) and a second call registers nothing twice."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvcanary.sglang.installed import runner_states

    monkeypatch.setenv("KVCANARY_MODE", "log")
    before = len(runner_states())
    t0 = time.perf_counter()
    kvcanary_sglang.register()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    kvcanary_sglang.register()
    second = time.perf_counter() - t0
    assert len(runner_states()) == before
    assert all(len(HookRegistry._hooks[t.dotted]) == 1 for t in v0_5_23.TARGETS)
    assert v0_5_23.STARTUP_FAILURE_TARGET not in HookRegistry._hooks
    assert first < 5.0 and second < 5.0, (first, second)  # sglang's modules are imported by now: no build, no I/O
    HookRegistry.apply_hooks()
    for t in v0_5_23.TARGETS:
        assert hooks_state.is_patched(t.dotted), t.dotted


def test_mode_off_registers_nothing(hooks, monkeypatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("KVCANARY_MODE", "off")
    kvcanary_sglang.register()
    assert not any(t.dotted in HookRegistry._hooks for t in v0_5_23.TARGETS)


# --------------------------------------------------------------------------------------------- guards
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return engine.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def test_own_kv_canary_on_the_real_server_args_is_refused_by_name(model_dir) -> None:
    for mode in ("log", "raise"):
        sa = engine.server_args(model_dir, kv_canary=mode)
        with pytest.raises(UnsupportedSetupError, match=rf"sglang's own KV canary is enabled \(--kv-canary {mode}\)"):
            v0_5_23.check_supported(sa)
    v0_5_23.check_supported(engine.server_args(model_dir, kv_canary="none"))  # its default: nothing refused


def test_unified_pool_is_refused_by_name(model_dir) -> None:
    sa = engine.server_args(model_dir, enable_unified_memory=True)
    with pytest.raises(UnsupportedSetupError, match="--enable-unified-memory.*physical slot"):
        v0_5_23.check_supported(sa)
    translating = types.SimpleNamespace(kv_index_translator=types.SimpleNamespace(is_translating=True))
    with pytest.raises(UnsupportedSetupError, match="virtual slot ids"):
        v0_5_23.runner_parts(translating)


def test_request_view_reads_0_5_23_requests() -> None:
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid="0", origin_input_text="", origin_input_ids=array("q", [5, 6, 7]),
              sampling_params=SamplingParams(max_new_tokens=4))
    batch = types.SimpleNamespace(reqs=[req])
    (view,) = v0_5_23.batch_requests(batch)
    assert v0_5_23.batch_requests(batch)[0] is view  # one view per Req: the token mirror's identity check holds
    assert view.req_pool_idx is None and list(view.origin_input_ids) == [5, 6, 7]
    req.kv.req_pool_idx = 3
    req.extend_end = 2
    assert view.req_pool_idx == 3 and view.is_chunked == 1


# --------------------------------------------------------------------------------------------- real engine
@pytest.fixture(scope="module")
def real_engine(model_dir):
    """A real 0.5.23 ModelRunner (page 1) with kvcanary installed through its entry point and load_plugins()."""
    import sglang.srt.plugins as plugins

    mp = pytest.MonkeyPatch()
    tmp = model_dir.parent / "entry"
    tmp.mkdir(exist_ok=True)
    hooks_state.clear_kvcanary_env(mp)
    mp.setenv("KVCANARY_MODE", "raise")
    mp.setenv("KVCANARY_VERIFY_TOKENS", "1")
    mp.setenv("KVCANARY_SWEEP_INTERVAL", str(SWEEP_INTERVAL))
    mp.setenv("SGLANG_PLUGINS", "kvcanary")
    import sgl_engine

    sgl_engine.ensure_entry_point(tmp, mp)
    state = hooks_state.snapshot(ALL_TARGETS)
    hooks_state.restore(state)
    t0 = time.perf_counter()
    plugins.load_plugins()  # discovers kvcanary through the entry point, registers and applies its hooks
    try:
        for t in v0_5_23.TARGETS:
            assert hooks_state.is_patched(t.dotted), t.dotted
        sa = engine.server_args(model_dir, chunked_prefill_size=48)
        mr = engine.build_runner(sa)
        tree = engine.build_tree_cache(mr, sa)

        class Scheduler:  # what Scheduler.__init__ leaves behind for the after_init_cache hook (weakly referenced)
            tree_cache = tree
            req_to_token_pool = mr.req_to_token_pool
            schedule_stream = None

        scheduler = Scheduler()
        hooks_for(v0_5_23).after_init_cache(None, scheduler)
        inst = installation_of(mr)
        assert inst is not None and inst.manager.has_sweep_source()
        with pytest.MonkeyPatch.context():
            print(f"\n0.5.23 runner + canary up in {time.perf_counter() - t0:.1f} s "
                  f"({type(mr.token_to_kv_pool).__name__}, {type(tree).__name__}/{type(tree.tree_core).__name__})")
        yield types.SimpleNamespace(mr=mr, tree=tree, inst=inst, scheduler=scheduler)
    finally:
        hooks_state.restore(state)
        engine.destroy_distributed()
        mp.undo()


def _drive(sched, rng, prefix, forwards: int) -> None:
    while len(sched.forwards) < forwards:
        if len(sched.waiting) < 2 and rng.random() < 0.3:
            tail = [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 70))]
            sched.add((prefix if rng.random() < 0.7 else []) + tail, rng.randrange(3, 15))
        if not sched.idle:
            sched.step()


def _live_row(sched, min_prefix: int):
    for req in sched.running.reqs:
        n = len(req.origin_input_ids) + len(req.output_ids) - 1
        if req.kv.req_pool_idx and n >= min_prefix:
            return req, n
    raise AssertionError("no running request long enough")


def _steps_until_raise(sched, manager) -> None:
    for _ in range(manager.config.drain_every + 1):
        sched.step()


def _start_running(sched, rng) -> None:
    sched.waiting.clear()
    while sched.chunked_req is not None or not sched.running or sched.running.is_empty():
        sched.add([rng.randrange(3, 2000) for _ in range(20)], 30)
        sched.step()


def test_real_0_5_23_engine_clean_run_then_detections(real_engine, capsys) -> None:
    mr, tree, inst = real_engine.mr, real_engine.tree, real_engine.inst
    rng = random.Random(1)
    prefix = [rng.randrange(3, 2000) for _ in range(40)]
    sched = engine.MiniScheduler(mr, tree, chunk_size=48)
    t0 = time.perf_counter()
    _drive(sched, rng, prefix, FORWARDS)
    manager = inst.manager
    manager.flush()
    st = manager.stats
    modes = collections.Counter(sched.forwards)
    n = len(sched.forwards)
    with capsys.disabled():
        print(textwrap.dedent(f"""
            sglang 0.5.23 forwards={n} in {time.perf_counter() - t0:.1f} s modes={dict(modes)}
            prefix_tokens_from_radix={sched.cached_tokens} chunked={sched.chunked_steps} finished={len(sched.finished)}
            reused_req_rows={len(sched.reused_rows)} violations={st.violations_seen}
            kernel_runs verify={st.kernel_runs[LaunchTag.VERIFY]} write={st.kernel_runs[LaunchTag.WRITE]}
              sweep={st.kernel_runs[LaunchTag.SWEEP]}
            slot_runs verified={st.slot_runs[LaunchTag.VERIFY]} written={st.slot_runs[LaunchTag.WRITE]}
              swept={st.slot_runs[LaunchTag.SWEEP]}"""))
    assert n >= 200 and modes["EXTEND"] > 0 and modes["DECODE"] > 0
    assert sched.cached_tokens > 0 and sched.chunked_steps > 0
    assert len(sched.finished) > 10 and sched.reused_rows
    assert st.violations_seen == 0 and manager.violations == []
    assert st.forwards == n == inst.steps
    assert st.kernel_runs[LaunchTag.VERIFY] == n and st.kernel_runs[LaunchTag.WRITE] == n
    assert st.kernel_runs[LaunchTag.SWEEP] == n // SWEEP_INTERVAL and st.slot_runs[LaunchTag.SWEEP] > 0
    assert st.slot_runs[LaunchTag.VERIFY] > 0

    # 1. req_to_token redirect: point a live (row, position) of a running request at another live slot.
    _start_running(sched, rng)
    req, _ = _live_row(sched, 4)
    r2t = mr.req_to_token_pool.req_to_token
    row, pos = int(req.kv.req_pool_idx), 1
    original = int(r2t[row, pos])
    inj = faults.redirect_req_to_token(r2t, row, pos, int(r2t[row, 2]))
    with pytest.raises(CanaryViolationError) as exc:
        _steps_until_raise(sched, manager)
    reasons = {name for v in exc.value.violations for name in v.reasons}
    with capsys.disabled():
        print("redirect:", inj.detail, "->", exc.value.violations[0].log_line())
    assert "verify_chain_hash" in reasons and any(v.slot in inj.slots for v in exc.value.violations)
    r2t[row, pos] = original
    engine.abort_running(sched)

    # 2. K-byte flip on a live slot (layer-0 K, inside the PARTIAL window).
    _start_running(sched, rng)
    req, _ = _live_row(sched, 4)
    slot = int(r2t[int(req.kv.req_pool_idx), 2])
    k_source = inst.groups[0].spec.sources[0]
    assert k_source.tensor.data_ptr() == mr.token_to_kv_pool.k_buffer[0].data_ptr()
    # The last forward may have deferred its write (no CUDA graph: issue 25), which fingerprints the K/V when it runs:
    # launched first, as the fault layer does before it injects.
    assert manager.defer_writes
    inst.flush_pending_writes()
    inj = faults.flip_real_kv(k_source, slot, byte=3)
    with pytest.raises(CanaryViolationError) as exc:
        _steps_until_raise(sched, manager)
    with capsys.disabled():
        print("flip:", inj.detail, "->", exc.value.violations[0].log_line())
    assert {v.slot for v in exc.value.violations} == {slot}
    assert all(v.reasons == ("verify_real_kv_hash",) for v in exc.value.violations)


def test_unified_radix_sweep_matches_its_tree_and_runs_on_the_scheduler_stream(real_engine, monkeypatch) -> None:
    """The sweep source walks UnifiedRadixCache through its tree core (every FULL slot, its predecessor, its
    position) inside run_on_producer_stream with the scheduler's schedule_stream."""
    walk = real_engine.tree.tree_core.walk_for_kv_canary(unlocked_only=False, swa_resident_only=False)
    if len(walk.slot_indices) == 0:  # run alone: fill the tree first
        rng = random.Random(5)
        sched = engine.MiniScheduler(real_engine.mr, real_engine.tree, chunk_size=48)
        _drive(sched, rng, [rng.randrange(3, 2000) for _ in range(40)], 20)
    seen = []

    def on_producer(producer, read):
        seen.append(producer)
        return read()

    monkeypatch.setattr(v0_5_23, "run_on_producer_stream", on_producer)
    source = v0_5_23.sweep_source(real_engine.tree, v0_5_23.scheduler_stream_of(real_engine.scheduler))
    slots, prevs, positions = source()
    walk = real_engine.tree.tree_core.walk_for_kv_canary(unlocked_only=False, swa_resident_only=False)
    assert seen == [None]  # CPU: no CUDA stream
    assert slots.dtype == prevs.dtype == positions.dtype == torch.int64
    assert torch.equal(slots, walk.slot_indices) and torch.equal(prevs, walk.prev_slot_indices)
    assert torch.equal(positions, walk.positions) and len(slots) > 0
    assert int(positions.min()) == 0 and bool((prevs[positions == 0] == -1).all())


def test_e2e_driver_engine_kwargs_are_valid_0_5_23_server_args(model_dir) -> None:
    """integration/sglang_e2e.py builds its Engine arguments with 0.5.12's names; translated for 0.5.23 they are
    accepted by the real 0.5.23 ServerArgs (which refuses unknown names) and mean the same."""
    import importlib.util
    import pathlib
    import sys

    from sglang.srt.server_args import ServerArgs

    path = pathlib.Path(__file__).resolve().parents[2] / "integration" / "sglang_e2e.py"
    spec = importlib.util.spec_from_file_location("kvcanary_sglang_e2e_driver", path)
    driver = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = driver  # its dataclasses look their module up there
    spec.loader.exec_module(driver)
    kw = dict(model_path=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
              attention_backend="torch_native", sampling_backend="pytorch", mem_fraction_static=0.5,
              max_total_tokens=1024, chunked_prefill_size=48, dtype="bfloat16", random_seed=0, log_level="info",
              decode_log_interval=1000, disable_piecewise_cuda_graph=True, cuda_graph_max_bs=64,
              max_running_requests=64)
    with pytest.raises(TypeError):
        ServerArgs(**kw)  # 0.5.12's names as they are
    assert driver.version_engine_kwargs(kw, "0.5.12") is kw
    sa = ServerArgs(**driver.version_engine_kwargs(kw, _installed("sglang")))
    assert sa.cuda_graph_backend_prefill == "disabled" and sa.cuda_graph_max_bs_decode == 64
