"""kvcanary under sglang 0.5.12's piecewise CUDA graph runner (prefill), on CPU.

A REAL sglang ModelRunner (dummy-weight tiny Llama, torch_native attention) runs the scheduler's life cycle
(tests/adapters/sgl_engine.py) with kvcanary installed through its entry point. Its prefill forwards are served
by ``PiecewiseRunner``: an object whose ``can_run``, ``replay``, ``replay_prepare`` and ``warmup_compile`` ARE
``PiecewiseCudaGraphRunner``'s own methods (0.5.12), with the state its ``__init__`` builds (static buffers, capture
sizes, attention layers), and whose layer stack is compiled by sglang's own ``install_torch_compiled`` with a
backend that records each FX graph and runs it as it is (a CPU stands in for the per-piece CUDA graphs). So the
replay pads the batch to a capture size, switches attention to the ``sglang.unified_attention_with_output``
split op and calls the wrapped top-level ``model.forward`` exactly as on a GPU.

Pinned: prefill forwards served this way are planned, verified and written exactly like eager ones (same records
as an eager run of the same workload, no violation in raise mode, the padded tokens never written); they are
counted apart in the host time; the canary launches run before and after the replayed layer stack, in stream
order; capture-time forwards of the runner are never recorded; nothing of kvcanary is traced by torch.compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import random
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

from kvcanary.kernels import layout  # noqa: E402
from kvcanary.kernels.batch import BatchView, ForwardKind  # noqa: E402
from kvcanary.kernels.tags import LaunchTag  # noqa: E402
from kvcanary.runtime.config import Config  # noqa: E402
from kvcanary.runtime.installation import Group, GroupSpec, HostTime, Installation, WrapperCall  # noqa: E402
from kvcanary.runtime.manager import CanaryManager  # noqa: E402
from kvcanary.settings import Mode
from kvcanary.sglang import guards, hooks, piecewise, v0_5_12  # noqa: E402

CHUNK = 48
CAPTURE_SIZES = [4, 8, 16, 32, 64]  # a chunk of 48 tokens pads to 64


# --------------------------------------------------------------------------------------------- sglang on CPU
_CPU_ATTENTION_LIB: torch.library.Library | None = None


def register_cpu_attention_op() -> None:
    """``sglang::unified_attention_with_output`` (the split op) has a CUDA kernel only: register sglang's own
    Python body of it for CPU too (found by name: the op keeps no handle to it)."""
    global _CPU_ATTENTION_LIB
    if _CPU_ATTENTION_LIB is not None:
        return
    from sglang.srt.layers import radix_attention

    bodies = [o for o in gc.get_objects() if isinstance(o, types.FunctionType)
              and o.__name__ == "unified_attention_with_output" and o.__module__ == radix_attention.__name__]
    assert len(bodies) == 1, f"sglang's unified_attention_with_output body not found: {bodies}"
    _CPU_ATTENTION_LIB = torch.library.Library("sglang", "IMPL")
    _CPU_ATTENTION_LIB.impl("unified_attention_with_output", bodies[0], "CPU")


class RecordingBackend:
    """A torch.compile backend that keeps every FX graph and runs it unchanged (eager, on CPU)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> list[str]:
        out = []
        for gm in self.graphs:
            for node in gm.graph.nodes:
                t = node.target
                out.append(f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', t)} {t!r}")
        return out


def piecewise_runner(mr, sizes: list[int], backend: RecordingBackend | None):
    """A PiecewiseCudaGraphRunner without CUDA graphs: 0.5.12's own replay path (see the module docstring)."""
    from sglang.srt.compilation.compile import install_torch_compiled
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner, PrefillInputBuffers

    class PiecewiseRunner:
        can_run = PiecewiseCudaGraphRunner.can_run
        replay = PiecewiseCudaGraphRunner.replay
        replay_prepare = PiecewiseCudaGraphRunner.replay_prepare
        warmup_compile = PiecewiseCudaGraphRunner.warmup_compile

        def __init__(self) -> None:
            n = max(sizes)
            self.model_runner, self.device = mr, mr.device
            self.capture_num_tokens, self.max_num_tokens = sorted(sizes), n
            self.capture_hidden_mode = CaptureHiddenMode.NULL
            self.is_multimodal = False
            self.capture_return_pooled_hidden_states = not mr.is_generation
            self.attention_layers = [layer.self_attn.attn for layer in mr.model.model.layers]
            self.moe_layers = [None] * len(self.attention_layers)
            self.moe_fusions = [None] * len(self.attention_layers)
            self.quant_config = None
            self.raw_num_tokens = 0
            zeros = lambda: torch.zeros(n, dtype=torch.int64)  # noqa: E731
            self.buffers = PrefillInputBuffers(
                input_ids=zeros(), out_cache_loc=zeros(), out_cache_loc_swa=None, mamba_track_indices=None,
                mamba_track_mask=None, mamba_track_seqlens=None, positions=zeros(), input_embeds=None,
                mrope_positions=None)

    PiecewiseRunner.__name__ = PiecewiseRunner.__qualname__ = "PiecewiseCudaGraphRunner"
    runner = PiecewiseRunner()
    mr.attention_layers, mr.moe_layers, mr.moe_fusions = runner.attention_layers, runner.moe_layers, runner.moe_fusions
    if backend is not None:  # as PiecewiseCudaGraphRunner.__init__ compiles the layer stack
        install_torch_compiled(mr.model.model, fullgraph=True, backend_factory=backend)
    return runner


@contextlib.contextmanager
def runner_with_kvcanary(tmp_path, *, mode: str = "raise"):
    """A real ModelRunner + RadixCache with kvcanary installed through its entry point; hooks undone after."""
    import sglang.srt.plugins as plugins

    with pytest.MonkeyPatch.context() as mp:
        hooks_state.clear_kvcanary_env(mp)
        mp.setenv("KVCANARY_MODE", mode)
        mp.setenv("KVCANARY_VERIFY_TOKENS", "1")
        mp.setenv("KVCANARY_DRAIN_EVERY", "1")
        mp.setenv("SGLANG_PLUGINS", "kvcanary")
        sgl_engine.ensure_entry_point(tmp_path, mp)
        state = hooks_state.snapshot(hooks_state.all_targets())
        hooks_state.restore(state)
        plugins.load_plugins()
        try:
            sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), chunked_prefill_size=CHUNK)
            mr = sgl_engine.build_runner(sa)
            tree = sgl_engine.build_tree_cache(mr, sa)
            inst = hooks.installation_of(mr)
            # (no piecewise runner at init on the CPU: after_initialize dropped the wrapper's gate)
            assert inst is not None and inst.wrapper_call is None
            yield mr, tree, inst
        finally:
            hooks_state.restore(state)
            sgl_engine.destroy_distributed()


def workload(sched, seed: int = 3) -> None:
    """Requests sharing a prefix (radix hits), chunked prefills (> CHUNK tokens), mixed lengths, then decode."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 2000) for _ in range(30)]
    for i in range(14):
        tail = [rng.randrange(3, 2000) for _ in range(rng.randrange(3, 70))]
        sched.add((prefix if i % 3 else []) + tail, rng.randrange(2, 9))
        if i % 4 == 3:
            for _ in range(3):
                if not sched.idle:
                    sched.step()
    while not sched.idle:
        sched.step()


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    """The workload with prefill run eagerly: its records and counters (the runner is gone after)."""
    register_cpu_attention_op()
    with runner_with_kvcanary(tmp_path_factory.mktemp("eager")) as (mr, tree, inst):
        sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=CHUNK)
        workload(sched)
        inst.manager.flush()
        data = types.SimpleNamespace(
            forwards=list(sched.forwards), records=inst.manager.canary_buf.clone(),
            stats=dataclasses.replace(inst.manager.stats), outputs=[list(r.output_ids) for r in sched.finished],
            host=dataclasses.replace(inst.host_time))
    return data  # one ModelRunner per process at a time: this one is torn down before the piecewise one


@pytest.fixture(scope="module")
def piecewise_run(eager_run, tmp_path_factory):
    """The same workload with prefill served by the piecewise runner; the runner stays up for the module."""
    register_cpu_attention_op()
    backend = RecordingBackend()
    with runner_with_kvcanary(tmp_path_factory.mktemp("piecewise")) as (mr, tree, inst):
        pcg = piecewise_runner(mr, CAPTURE_SIZES, backend)
        mr.piecewise_cuda_graph_runner = pcg
        # sglang builds its piecewise runner inside ModelRunner.initialize, so the gate the install set stays; this
        # one comes after init, whose after_initialize dropped the gate: set it again
        inst.wrapper_call = v0_5_12.wrapper_gate(inst)
        replays = []
        real_replay = pcg.replay

        def replay(forward_batch, **kwargs):
            replays.append((len(forward_batch.input_ids), forward_batch.forward_mode.name))
            return real_replay(forward_batch, **kwargs)

        pcg.replay = replay
        sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=CHUNK)
        workload(sched)
        inst.manager.flush()
        yield types.SimpleNamespace(
            mr=mr, tree=tree, inst=inst, pcg=pcg, backend=backend, sched=sched, replays=replays,
            forwards=list(sched.forwards), records=inst.manager.canary_buf.clone(),
            stats=dataclasses.replace(inst.manager.stats), outputs=[list(r.output_ids) for r in sched.finished],
            host=dataclasses.replace(inst.host_time))


# --------------------------------------------------------------------------------------------- served like eager
def test_prefill_served_by_the_piecewise_runner_is_planned_verified_and_written_like_eager(eager_run,
                                                                                          piecewise_run) -> None:
    pw, eager = piecewise_run, eager_run
    extends = [m for m in pw.forwards if m in ("EXTEND", "MIXED")]
    assert pw.forwards == eager.forwards and pw.outputs == eager.outputs  # the same schedule, the same tokens
    assert len(pw.replays) == len(extends) >= 8  # every prefill forward was served by the piecewise runner
    assert any(n not in CAPTURE_SIZES for n, _ in pw.replays)  # ... padded to a capture size
    n = len(pw.forwards)
    for st in (pw.stats, eager.stats):  # raise mode: a violation would have stopped the run
        assert st.violations_seen == 0
        assert st.kernel_runs[LaunchTag.VERIFY] == st.kernel_runs[LaunchTag.WRITE] == n
    assert pw.stats.slot_runs == eager.stats.slot_runs  # the same entries verified, the same tokens written
    assert torch.equal(pw.records, eager.records)  # every record byte-equal, real-KV fingerprints included


def test_padded_tokens_are_never_written(piecewise_run) -> None:
    """The replay pads to the next capture size with slot 0, token 0, position 0: the write plan covers only
    the real tokens (extend_seq_lens), so the padding slot's record stays zero and every token written is real."""
    run = piecewise_run
    raw = [n for n, _ in run.replays]
    assert sum(min(s for s in CAPTURE_SIZES if s >= n) - n for n in raw) > 0  # padding happened
    assert not run.records[0].any()
    decode_tokens = sum(len(out) - 1 for out in run.outputs)  # the prefill forward samples each first token
    assert run.stats.slot_runs[LaunchTag.WRITE] == sum(raw) + decode_tokens


def test_piecewise_forwards_are_counted_apart_in_the_host_time(piecewise_run, eager_run) -> None:
    host: HostTime = piecewise_run.host
    extends = sum(m in ("EXTEND", "MIXED") for m in piecewise_run.forwards)
    decodes = piecewise_run.forwards.count("DECODE")
    assert host.forwards == len(piecewise_run.forwards)
    assert host.piecewise_forwards == extends and host.eager_forwards == decodes
    assert 0 < host.piecewise_launch_ns <= host.in_forward_ns and host.piecewise_hook_ns <= host.hook_ns
    line = host.line(1)
    assert f" piecewise={extends} " in line and "canary_us_per_piecewise_forward=" in line
    assert eager_run.host.piecewise_forwards == 0 and eager_run.host.eager_forwards == len(eager_run.forwards)


# --------------------------------------------------------------------------------------------- order, capture, trace
def test_canary_launches_run_before_and_after_the_replayed_layer_stack(piecewise_run, monkeypatch) -> None:
    """Stream order on the forward's stream: the replay's copies into the static buffers, then the check launch
    (plan + verify + the snapshot of ids/positions/slots), then the layer stack (the pieces), then write. The
    fixture's engine runs with --disable-cuda-graph, so decodes defer their writes into the next check launch (issue
    25); this extend's write is launched here all the same (only a decode defers)."""
    run, events = piecewise_run, []
    manager = run.inst.manager
    runs = manager.kernel_run_counters  # (the CPU kernels run inline: a launch has counted when its call returns)

    def launches() -> tuple[int, int]:
        return int(runs[LaunchTag.VERIFY]), int(runs[LaunchTag.WRITE])

    def record(name, fn):
        def call(*args, **kwargs):
            events.append((name, launches()))
            return fn(*args, **kwargs)
        return call

    # (the launches themselves are the wrapper's bound calls, taken when it was built: their counters say when they ran)
    monkeypatch.setattr(run.pcg, "replay_prepare", record("replay_prepare", run.pcg.replay_prepare))
    layers = run.mr.model.model
    monkeypatch.setattr(layers, "forward", record("layers", layers.forward))
    sched = run.sched
    sched.add([random.Random(9).randrange(3, 2000) for _ in range(21)], 3)
    verify0, write0 = launches()
    mode = sched.step()
    assert mode == "EXTEND" and run.replays[-1] == (21, "EXTEND")
    # replay_prepare before the check, the check before the layers, the write after them
    assert events == [("replay_prepare", (verify0, write0)), ("layers", (verify0 + 1, write0))], events
    assert launches() == (verify0 + 1, write0 + 1)
    snapshot = manager.device_state.positions_snapshot
    assert torch.equal(snapshot[:32], run.pcg.buffers.positions[:32])  # the snapshot is the static batch
    while not sched.idle:
        sched.step()
    manager.flush()
    assert manager.stats.violations_seen == 0


def test_capture_time_forwards_are_never_recorded(piecewise_run) -> None:
    """PiecewiseCudaGraphRunner.__init__ compiles and captures by calling model.forward with dummy batches under
    its context flag, outside any ModelRunner.forward: the wrapper runs nothing for them."""
    from sglang.srt.compilation.piecewise_context_manager import (
        enable_piecewise_cuda_graph,
        enable_piecewise_cuda_graph_compile,
    )

    run = piecewise_run
    manager = run.inst.manager
    before = (manager.kernel_run_counters.clone(), manager.slot_run_counters.clone(), manager.canary_buf.clone())
    host = dict(vars(run.inst.host_time))
    calls = []
    real = manager.before_forward
    manager.before_forward = lambda view: (calls.append(view), real(view))[1]
    try:
        with enable_piecewise_cuda_graph():
            run.pcg.warmup_compile(num_tokens=16)
            with enable_piecewise_cuda_graph_compile():
                run.pcg.warmup_compile(num_tokens=32)
    finally:
        del manager.before_forward
    assert calls == []
    assert torch.equal(manager.kernel_run_counters, before[0]) and torch.equal(manager.slot_run_counters, before[1])
    assert torch.equal(manager.canary_buf, before[2]) and vars(run.inst.host_time) == host


def test_nothing_of_kvcanary_is_traced_into_the_compiled_layer_stack(piecewise_run) -> None:
    targets = piecewise_run.backend.targets()
    assert piecewise_run.backend.graphs, "the layer stack was never compiled"
    assert any("unified_attention_with_output" in t for t in targets)  # the split op the pieces are cut at
    assert not [t for t in targets if "kvcanary" in t or "tvm_ffi" in t or "canary" in t]


# --------------------------------------------------------------------------------------------- the gate, units
def _cpu_installation(num_slots: int = 64) -> Installation:
    cfg = Config(mode=Mode.LOG, stats_every=0)
    r2t = torch.zeros((4, 32), dtype=torch.int32)
    r2t[1, :16] = torch.arange(1, 17, dtype=torch.int32)
    manager = CanaryManager(cfg, num_slots=num_slots, req_to_token=r2t, device="cpu", max_batch_size=4,
                            max_tokens_per_forward=32)

    def to_views(fb, ids, pos):
        n = int(ids.shape[0])
        i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return [BatchView(ForwardKind.EXTEND, ids.to(torch.int64), pos.to(torch.int64),
                          torch.arange(1, n + 1, dtype=torch.int64), i64(1), i64(0), i64(n))]

    inst = Installation(config=cfg, groups=[Group(GroupSpec("full", num_slots, ()), manager)], to_views=to_views,
                        req_to_token=r2t)
    inst.wrapper_call = piecewise.wrapper_gate(inst)
    return inst


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 8)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        return self.emb(input_ids) * positions[:, None].to(torch.float32)


def _runs(inst: Installation) -> tuple[int, int]:
    c = inst.manager.kernel_run_counters
    return int(c[LaunchTag.VERIFY]), int(c[LaunchTag.WRITE])


def test_the_gate_reads_sglangs_flags_and_the_serving_count() -> None:
    from sglang.srt.compilation.piecewise_context_manager import enable_piecewise_cuda_graph
    from sglang.srt.model_executor.breakable_cuda_graph.context import enable_breakable_cuda_graph

    inst = types.SimpleNamespace(serving=0)
    gate = piecewise.wrapper_gate(inst)
    assert gate() is WrapperCall.EAGER
    for flag in (enable_piecewise_cuda_graph, enable_breakable_cuda_graph):
        with flag():
            assert gate() is WrapperCall.SKIP  # building graphs: no ModelRunner.forward in progress
            inst.serving = 1
            assert gate() is WrapperCall.PIECEWISE  # a replay inside a real forward
            inst.serving = 0
    assert gate() is WrapperCall.EAGER


def test_the_gate_reads_sglangs_flag_globals_without_calling_sglang(monkeypatch) -> None:
    """The gate reads the two module globals sglang's ``is_in_*`` functions return: no call into sglang per
    prefill (each is a Python frame of the wrapper's host time)."""
    from sglang.srt.compilation import piecewise_context_manager
    from sglang.srt.model_executor.breakable_cuda_graph import context

    def called() -> bool:
        raise AssertionError("the gate called sglang's flag function")

    monkeypatch.setattr(piecewise_context_manager, "is_in_piecewise_cuda_graph", called)
    monkeypatch.setattr(context, "is_in_breakable_cuda_graph", called)
    inst = types.SimpleNamespace(serving=1)
    gate = piecewise.wrapper_gate(inst)
    assert gate() is WrapperCall.EAGER
    monkeypatch.setattr(piecewise_context_manager, "_in_piecewise_cuda_graph", True)
    assert gate() is WrapperCall.PIECEWISE
    monkeypatch.setattr(piecewise_context_manager, "_in_piecewise_cuda_graph", False)
    monkeypatch.setattr(context, "_in_breakable_cuda_graph", True)
    assert gate() is WrapperCall.PIECEWISE
    inst.serving = 0
    assert gate() is WrapperCall.SKIP


def test_an_sglang_without_the_flag_globals_is_refused_by_name(monkeypatch) -> None:
    from sglang.srt.model_executor.breakable_cuda_graph import context

    from kvcanary.sglang.refusal import UnsupportedSetupError

    monkeypatch.delattr(context, "_in_breakable_cuda_graph")
    with pytest.raises(UnsupportedSetupError, match="_in_breakable_cuda_graph"):
        piecewise.wrapper_gate(types.SimpleNamespace(serving=0))


def test_without_a_piecewise_runner_the_wrapper_stops_asking_the_gate() -> None:
    """After init, a runner with no piecewise runner (eager prefill, --disable-piecewise-cuda-graph) drops the gate:
    only a piecewise runner sets sglang's two flags, so every later forward is eager, and asking cost three Python
    calls per forward. The wrapper still runs the canary on each forward; a runner with one keeps its gate."""
    inst, model = _cpu_installation(), TinyModel()
    inst.wrap_model_forward(model)
    asked = []
    gate = inst.wrapper_call
    inst.wrapper_call = lambda: (asked.append(1), gate())[1]
    ids, pos = torch.arange(3, 9), torch.arange(6)
    model.forward(ids, pos, None)
    assert asked == [1] and _runs(inst) == (1, 1)
    piecewise.after_initialize(types.SimpleNamespace(piecewise_cuda_graph_runner=None, model=model), inst)
    assert inst.wrapper_call is None
    model.forward(ids, pos + 6, None)
    assert asked == [1] and _runs(inst) == (2, 2)  # not asked; the canary ran
    assert inst.host_time.eager_forwards == 2
    kept = _cpu_installation()
    pcg = type("PiecewiseCudaGraphRunner", (), {"max_num_tokens": 32, "capture_num_tokens": [8, 16, 32]})()
    piecewise.after_initialize(types.SimpleNamespace(piecewise_cuda_graph_runner=pcg, model=TinyModel()), kept)
    assert kept.wrapper_call is not None


def test_the_wrapper_only_calls_through_while_torch_compile_traces_it() -> None:
    """A caller compiled with fullgraph (as --enable-torch-compile would compile model.forward) traces the model
    alone: no kvcanary op in the graph, no canary launch when the compiled code runs. (Tracing the canary would
    fail: its launches are tvm-ffi calls dynamo cannot trace.) --enable-torch-compile stays refused at install,
    because its decode graphs would then carry no canary."""
    inst, model = _cpu_installation(), TinyModel()
    inst.wrap_model_forward(model)
    ids, pos = torch.arange(3, 9), torch.arange(6)
    model.forward(ids, pos, None)  # eager: the canary runs
    assert _runs(inst) == (1, 1)
    backend = RecordingBackend()
    out = torch.compile(model.forward, backend=backend, fullgraph=True)(ids, pos, None)
    assert torch.equal(out, TinyModel.forward(model, ids, pos, None))
    assert backend.graphs and not [t for t in backend.targets() if "kvcanary" in t or "tvm_ffi" in t]
    assert _runs(inst) == (1, 1)  # the compiled code launched nothing of the canary


def test_a_forward_replaced_by_compiling_the_top_level_model_is_wrapped_again() -> None:
    """When sglang's layer stack is the top-level model, install_torch_compiled(model) replaces model.forward (the
    wrapper) with its trampoline: after_initialize wraps the trampoline, so the replay still runs the canary
    around the compiled code, and the compiled graph holds nothing of kvcanary."""
    from sglang.srt.compilation.compile import install_torch_compiled
    from sglang.srt.compilation.piecewise_context_manager import enable_piecewise_cuda_graph

    inst, model = _cpu_installation(), TinyModel()
    inst.wrap_model_forward(model)
    backend = RecordingBackend()
    install_torch_compiled(model, fullgraph=True, backend_factory=backend)
    assert not getattr(model.forward, "kvcanary_wrapped", False)
    pcg = type("PiecewiseCudaGraphRunner", (), {"max_num_tokens": 32, "capture_num_tokens": [8, 16, 32]})()
    runner = types.SimpleNamespace(piecewise_cuda_graph_runner=pcg, model=model)
    v0_5_12.check_after_initialize(runner)
    piecewise.after_initialize(runner, inst)
    assert getattr(model.forward, "kvcanary_wrapped", False)
    ids, pos = torch.arange(3, 11), torch.arange(8)
    inst.serving = 1
    try:
        with enable_piecewise_cuda_graph():
            model.forward(ids, pos, None)  # a replay: the compiled layer stack inside the wrapper
    finally:
        inst.serving = 0
    assert backend.graphs and not [t for t in backend.targets() if "kvcanary" in t or "tvm_ffi" in t]
    assert _runs(inst) == (1, 1) and inst._piecewise_now
    inst.account_forward(forward_ns=1000, hook_ns=10)
    assert inst.host_time.piecewise_forwards == 1 and inst.host_time.eager_forwards == 0


def test_a_runner_padding_past_the_canarys_buffers_is_refused_by_name() -> None:
    inst = _cpu_installation()
    pcg = type("PiecewiseCudaGraphRunner", (), {"max_num_tokens": 4096, "capture_num_tokens": [4096]})()
    runner = types.SimpleNamespace(piecewise_cuda_graph_runner=pcg, model=TinyModel())
    with pytest.raises(guards.UnsupportedSetupError, match="pads prefill forwards to up to 4096 tokens.*32-token"):
        piecewise.after_initialize(runner, inst)


def test_canary_buffers_cover_the_largest_capture_size(tmp_path) -> None:
    sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "m"))
    assert piecewise.max_static_tokens(sa) == 0  # piecewise graphs off
    sa.disable_piecewise_cuda_graph = False
    sa.piecewise_cuda_graph_tokens = [4, 8, 2048, 512]
    assert piecewise.max_static_tokens(sa) == 2048
    assert layout.RECORD_BYTES == 32
