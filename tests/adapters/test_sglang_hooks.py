"""The SGLang adapter's entry point, hook targets, guards, pools and batch conversion on a real sglang 0.5.12."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

import kvcanary.sglang as kvcanary_sglang  # noqa: E402
from kvcanary.kernels.real_kv import RealKvSource  # noqa: E402
from kvcanary.runtime.config import Config  # noqa: E402
from kvcanary.runtime.manager import CanaryManager  # noqa: E402
from kvcanary.settings import Mode
from kvcanary.sglang import (  # noqa: E402
    contract,
    fault_injection,
    guards,
    installed,
    pools,
    register,
    targets,
    tokens,
    v0_5_12,
)
from kvcanary.sglang import hooks as adapter_hooks  # noqa: E402


@pytest.fixture
def hooks(monkeypatch):
    """Fresh HookRegistry and unpatched sglang targets before and after the test; no KVCANARY_* variables."""
    hooks_state.clear_kvcanary_env(monkeypatch)
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)
    yield state
    hooks_state.restore(state)


@pytest.fixture(scope="module")
def server_args(tmp_path_factory):
    return sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path_factory.mktemp("tiny-llama")))


# --------------------------------------------------------------------------------------------- targets
@pytest.mark.parametrize("target", v0_5_12.TARGETS,
                         ids=lambda t: t.dotted.rsplit(".", 2)[-2] + "." + t.dotted.rsplit(".", 1)[-1])
def test_hook_target_resolves_with_expected_parameters(target) -> None:
    import inspect

    fn = targets.resolve_target(target)
    assert callable(fn)
    params = list(inspect.signature(fn).parameters)
    assert params[0] == target.params[0]
    assert set(target.params) <= set(params), (target.dotted, params)


def test_missing_target_fails_naming_it() -> None:
    bogus = targets.Target(v0_5_12._MR + ".no_such_method", "AFTER", ("self",))
    with pytest.raises(targets.HookTargetError, match="ModelRunner.no_such_method"):
        targets.resolve_target(bogus)
    renamed = targets.Target(v0_5_12.T_FORWARD, "AROUND", ("self", "forward_batch", "not_a_param"))
    with pytest.raises(targets.HookTargetError, match="ModelRunner.forward.*not_a_param"):
        targets.resolve_target(renamed)


# --------------------------------------------------------------------------------------------- versions
@pytest.mark.parametrize("row", kvcanary_sglang.SUPPORTED, ids=lambda r: r.module.rsplit(".", 1)[-1])
def test_every_supported_version_module_satisfies_the_contract(row) -> None:
    import importlib

    module = importlib.import_module(row.module)
    assert contract.contract_problems(module) == []
    contract.check_version_module(module)
    assert module.VERSION_RANGE == row.versions
    table = adapter_hooks.hooks_for(module).table
    assert [t for t, _ in table] == list(module.TARGETS)
    assert all(callable(h) for _, h in table) and table is adapter_hooks.hooks_for(module).table  # built once


def test_contract_check_names_what_a_module_misses() -> None:
    broken = types.ModuleType("kvcanary_broken_version")
    for name in contract._FUNCTIONS:
        setattr(broken, name, getattr(v0_5_12, name))
    broken.SGLANG_VERSION, broken.VERSION_RANGE, broken.STARTUP_FAILURE_TARGET = "0.5.11", ">=0.5.12", "x.y"
    broken.HOOK_TARGETS = {k: t for k, t in v0_5_12.HOOK_TARGETS.items() if k != "around_forward"}
    broken.TARGETS = v0_5_12.TARGETS
    broken.FORWARD_MODES = {"EXTEND": "extend"}
    broken.PROTECT_HOOK_TARGETS = {"protect_bogus": v0_5_12.TARGETS[0]}
    broken.batch_view = lambda fb, input_ids: None
    del broken.radix_cache, broken.sweep_source  # (no member the hooks read is optional)
    problems = "\n".join(contract.contract_problems(broken))
    for expected in ("SGLANG_VERSION 0.5.11 is outside VERSION_RANGE >=0.5.12",
                     "missing required hook(s) ['around_forward']",
                     "TARGETS: expected HOOK_TARGETS' values", "FORWARD_MODES", "batch_view: expected parameters",
                     "radix_cache: missing", "sweep_source: missing", "RADIX_CACHE_CLASS: expected a str",
                     "PROTECT_HOOK_TARGETS: unknown hook(s) ['protect_bogus']"):
        assert expected in problems, (expected, problems)
    with pytest.raises(TypeError, match="does not satisfy the contract"):
        contract.check_version_module(broken)


def test_version_modules_state_only_what_differs_from_the_base() -> None:
    """0.5.12's reading is the base's: its module states its targets and the members bound to its version string;
    0.5.23 states what moved (and the pool kinds it has run: MHA). Protect mode's hook names are ProtectHooks'
    methods."""
    from kvcanary.sglang import base, protect, v0_5_23

    own = {name for name in base.__all__ if getattr(v0_5_12, name) is not getattr(base, name)}
    assert own == {"PROTECT_HOOK_TARGETS"}, own
    own = {name for name in base.__all__ if getattr(v0_5_23, name) is not getattr(base, name)}
    assert own == {"check_after_initialize", "runner_parts", "runner_ranks", "batch_requests", "sweep_source",
                   "wrapper_gate", "max_static_tokens", "RADIX_NODE_HOOKS", "POOL_CLASSES"}, own
    assert v0_5_23.POOL_CLASSES.followed == {"mha"}  # (its pool class names are the base's)
    assert not v0_5_23.PROTECT_HOOK_TARGETS
    with pytest.raises(protect.ProtectRefused, match="supported on sglang 0.5.12 only"):
        protect.hooks_for(v0_5_23)
    assert set(v0_5_12.PROTECT_HOOK_TARGETS) == set(contract.PROTECT_HOOK_NAMES)
    assert all(callable(getattr(protect.ProtectHooks, name)) for name in contract.PROTECT_HOOK_NAMES)
    for name in contract.HOOK_NAMES:
        assert callable(getattr(adapter_hooks.AdapterHooks, name)), name


@pytest.mark.parametrize("version", ["0.5.12", "0.5.12.post1", "0.5.12+cpu"])
def test_supported_versions_select_their_module(version) -> None:
    assert kvcanary_sglang.module_name_for(version) == "kvcanary.sglang.v0_5_12"


@pytest.mark.parametrize("version", ["0.5.20", "0.5.13rc1", "0.5.11", "0.5.12rc1", "0.5.24", "unknown"])
def test_unsupported_version_is_refused_by_name_with_the_supported_range(version) -> None:
    with pytest.raises(kvcanary_sglang.UnsupportedVersionError,
                       match=rf"sglang {version} is not supported .*supported: sglang>=0\.5\.12,<0\.5\.13, "
                             r"sglang>=0\.5\.23,<0\.5\.24"):
        kvcanary_sglang.module_name_for(version)


def test_register_refuses_an_unsupported_sglang_and_stops_startup(hooks, monkeypatch) -> None:
    """No fallback to the nearest version module: its hook targets may have moved. The refusal is also raised
    from ModelRunner.__init__ (sglang's plugin loader swallows plugin errors), registered once however often
    register() runs."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("KVCANARY_MODE", "log")
    monkeypatch.setattr(kvcanary_sglang, "_sglang_version", lambda: "0.5.20")
    for _ in range(2):
        with pytest.raises(kvcanary_sglang.UnsupportedVersionError, match="sglang 0.5.20 is not supported"):
            register()
    assert not any(HookRegistry._hooks.get(t.dotted) for t in v0_5_12.TARGETS)
    assert len(HookRegistry._hooks[v0_5_12.STARTUP_FAILURE_TARGET]) == 1
    HookRegistry.apply_hooks()
    assert hooks_state.is_patched(v0_5_12.STARTUP_FAILURE_TARGET)


# --------------------------------------------------------------------------------------------- register
def test_register_patches_every_target_through_apply_hooks(hooks, monkeypatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("KVCANARY_MODE", "log")
    register()
    HookRegistry.apply_hooks()
    for t in v0_5_12.TARGETS:
        assert hooks_state.is_patched(t.dotted), t.dotted
    assert not hooks_state.is_patched(v0_5_12.STARTUP_FAILURE_TARGET)
    register()  # a second call in the same process registers nothing twice
    assert all(len(HookRegistry._hooks[t.dotted]) == 1 for t in v0_5_12.TARGETS)


@pytest.mark.parametrize("mode", [None, "off", " OFF "])
def test_mode_unset_or_off_patches_nothing(hooks, monkeypatch, caplog, mode) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    if mode is not None:
        monkeypatch.setenv("KVCANARY_MODE", mode)
    with caplog.at_level(logging.INFO, logger="kvcanary.sglang"):
        register()
    HookRegistry.apply_hooks()
    assert not any(HookRegistry._hooks.get(t) for t in hooks_state.all_targets())
    assert not any(hooks_state.is_patched(t) for t in hooks_state.all_targets())
    assert [r.getMessage() for r in caplog.records if r.name == "kvcanary.sglang"] == [
        "kvcanary: KVCANARY_MODE is unset or off; the SGLang plugin installs nothing"
    ]


def test_entry_point_is_listed() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    if "kvcanary" not in eps:
        pytest.skip("kvcanary is not pip-installed in this environment (pip install -e .)")
    assert eps["kvcanary"] == "kvcanary.sglang:register"


@pytest.mark.parametrize(
    "var,value",
    [("KVCANARY_MODE", "loud"), ("KVCANARY_SWEEP_INTERVAL", "-3"), ("KVCANARY_REAL_KV_LAYERS", "0,last"),
     ("KVCANARY_FAULT", "nonsense")],
)
def test_bad_value_stops_startup_naming_the_variable(hooks, monkeypatch, server_args, var, value) -> None:
    """load_plugins() swallows plugin errors, so register() also makes ModelRunner construction fail."""
    import sglang.srt.plugins as plugins

    if var != "KVCANARY_MODE":
        monkeypatch.setenv("KVCANARY_MODE", "raise")
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        register()
    hooks_state.restore(hooks)
    monkeypatch.setenv("SGLANG_PLUGINS", "kvcanary")
    entry_points = __import__("importlib.metadata").metadata.entry_points(group="sglang.srt.plugins")
    if "kvcanary" not in {ep.name for ep in entry_points}:
        pytest.skip("kvcanary entry point not installed")
    plugins.load_plugins()  # logs the error, does not raise
    assert hooks_state.is_patched(v0_5_12.STARTUP_FAILURE_TARGET)
    with pytest.raises(ValueError, match=f"kvcanary refused to start: {var}"):
        sgl_engine.build_runner(server_args)


# --------------------------------------------------------------------------------------------- guards
GUARDS = [
    ("torch_compile", {"enable_torch_compile": True}, "remove --enable-torch-compile"),
    ("split_prefill", {"enable_pdmux": True}, "remove --enable-pdmux"),
    ("eagle_topk", {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 4}, "--speculative-eagle-topk 1"),
    # EAGLE topk 1 is covered
    ("speculative", {"speculative_algorithm": "STANDALONE"}, "remove --speculative-algorithm"),
    ("own_canary", {"kv_canary": "log"}, "drop --kv-canary"),
]


@pytest.mark.parametrize("changes,setting", [(c, s) for _, c, s in GUARDS], ids=[g[0] for g in GUARDS])
def test_guard_refuses_at_install_naming_the_setting(server_args, monkeypatch, changes, setting) -> None:
    monkeypatch.setenv("KVCANARY_MODE", "raise")
    sa = dataclasses.replace(server_args)
    for k, v in changes.items():
        setattr(sa, k, v)
    v0_5_12.check_supported(server_args)  # the test setup itself is accepted
    runner = types.SimpleNamespace(server_args=sa, token_to_kv_pool=None)
    with pytest.raises(guards.UnsupportedSetupError, match=setting.replace("-", r"\-")):
        adapter_hooks.hooks_for(v0_5_12).install(runner)  # refused before anything is built
    assert not hasattr(runner, installed.INSTALL_ATTR) and not hasattr(runner, installed.RUNNER_STATE_ATTR)


def test_piecewise_cuda_graph_is_not_refused(server_args) -> None:
    """sglang 0.5.12's default (piecewise CUDA graphs serve prefill) installs; the canary runs around each replay
    (tests/adapters/test_sglang_piecewise.py)."""
    sa = dataclasses.replace(server_args)
    sa.disable_piecewise_cuda_graph = False
    v0_5_12.check_supported(sa)
    for name in guards.KNOWN_PIECEWISE_RUNNERS:
        v0_5_12.check_after_initialize(types.SimpleNamespace(piecewise_cuda_graph_runner=type(name, (), {})()))


# --------------------------------------------------------------------------------------------- deferred writes
@pytest.mark.parametrize(("changes", "role", "defers"), [
    ({}, None, True),  # --disable-cuda-graph (the tests' engines): every forward runs the wrapper eagerly
    ({"disable_cuda_graph": False}, None, False),  # decode graphs replay the captured check: no call to launch in
    ({"disable_cuda_graph": False, "disable_piecewise_cuda_graph": False}, None, False),
    ({"disable_piecewise_cuda_graph": False}, None, True),  # a piecewise replay runs inside the eager wrapper
    ({"speculative_algorithm": "EAGLE"}, "target", False),  # draft and verify graph replays
    ({"speculative_algorithm": "EAGLE"}, "draft", False),
    ({"speculative_algorithm": "EAGLE"}, None, False),
], ids=["no_cuda_graph", "cuda_graph", "cuda_and_piecewise_graphs", "piecewise_graph", "eagle_target", "eagle_draft",
        "speculative"])
def test_writes_are_deferred_only_where_no_graph_replays_the_model(server_args, changes, role, defers) -> None:
    """Issue 25: sglang's runners defer each forward's write into the next forward's check launch only when no CUDA
    graph replays the model and never in an EAGLE pool."""
    from kvcanary.sglang.speculative import DRAFT_ROLE, TARGET_ROLE

    sa = dataclasses.replace(server_args)
    for k, v in changes.items():
        setattr(sa, k, v)
    assert server_args.disable_cuda_graph  # (the module's engine setup)
    pool_role = {"target": TARGET_ROLE, "draft": DRAFT_ROLE, None: None}[role]
    assert adapter_hooks.defers_writes(sa, pool_role) is defers


@pytest.mark.parametrize("disable_cuda_graph", [True, False], ids=["no_cuda_graph", "cuda_graph"])
def test_an_installation_defers_writes_from_init_finished_on(hooks, monkeypatch, server_args,
                                                            disable_cuda_graph: bool) -> None:
    """The install decides (Installation.defer_writes); the managers defer from mark_init_finished on (warm-up and
    capture are over), and their eager forwards then leave the write pending for the next forward's launch."""
    monkeypatch.setenv("KVCANARY_MODE", "log")
    mr = sgl_engine.build_runner(server_args)  # (no kvcanary hooks registered: installed by hand below)
    try:
        mr.server_args = dataclasses.replace(server_args)
        mr.server_args.disable_cuda_graph = disable_cuda_graph
        inst = adapter_hooks.hooks_for(v0_5_12).install(mr)
        assert inst.defer_writes is disable_cuda_graph
        assert not inst.manager.defer_writes  # not during warm-up and capture
        inst.mark_init_finished()
        assert all(g.manager.defer_writes is disable_cuda_graph for g in inst.groups)
    finally:
        sgl_engine.destroy_distributed()


def test_unknown_piecewise_runner_found_after_initialize_is_refused_by_name() -> None:
    runner = types.SimpleNamespace(piecewise_cuda_graph_runner=type("FutureGraphRunner", (), {})())
    with pytest.raises(guards.UnsupportedSetupError, match="FutureGraphRunner.*--disable-piecewise-cuda-graph"):
        v0_5_12.check_after_initialize(runner)


# --------------------------------------------------------------------------------------------- pools
def _mha(page_size: int, layers: int = 3):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=64, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=8,
                            layer_num=layers, device="cpu", enable_memory_saver=False)


def _cfg(real_kv: str = "partial"):
    from kvcanary.runtime.config import Config

    return Config.from_env({"KVCANARY_MODE": "raise", "KVCANARY_REAL_KV": real_kv})


@pytest.mark.parametrize("page_size", [1, 16])
def test_mha_pool_gives_k_and_v_of_first_and_last_layer(page_size) -> None:
    pool = _mha(page_size)
    (group,) = v0_5_12.pool_groups(pool, _cfg(), layers=(0, -1))
    assert group.name == "full" and group.num_slots == 64 + page_size and group.full_to_swa_index_mapping is None
    expected = [pool.k_buffer[0], pool.v_buffer[0], pool.k_buffer[2], pool.v_buffer[2]]
    assert [s.tensor.data_ptr() for s in group.sources] == [t.data_ptr() for t in expected]
    for s in group.sources:
        assert (s.page_size, s.num_bytes_per_token, s.read_bytes) == (1, 32, 32)
        assert s.num_slots == 64 + page_size


def test_real_kv_layers_variable(monkeypatch) -> None:
    pool = _mha(1)
    monkeypatch.setenv("KVCANARY_REAL_KV_LAYERS", "1")
    (group,) = v0_5_12.pool_groups(pool, _cfg())
    assert [s.tensor.data_ptr() for s in group.sources] == [pool.k_buffer[1].data_ptr(), pool.v_buffer[1].data_ptr()]
    monkeypatch.setenv("KVCANARY_REAL_KV_LAYERS", "0,1,2")
    with pytest.raises(ValueError, match="KVCANARY_REAL_KV_LAYERS: 3 layer"):
        v0_5_12.pool_groups(pool, _cfg())
    monkeypatch.setenv("KVCANARY_REAL_KV_LAYERS", "5")
    with pytest.raises(ValueError, match="KVCANARY_REAL_KV_LAYERS: layer 5 is out of range"):
        v0_5_12.pool_groups(pool, _cfg())
    monkeypatch.delenv("KVCANARY_REAL_KV_LAYERS")
    (group,) = v0_5_12.pool_groups(pool, _cfg("none"))
    assert group.sources == ()


@pytest.mark.parametrize("raw", ["0,1_0", "\u0661", "0,-\u0661", "0x1", "0,last"])
def test_real_kv_layers_are_ascii_integers(raw) -> None:
    with pytest.raises(ValueError, match="^KVCANARY_REAL_KV_LAYERS: expected a comma-separated list"):
        pools.parse_real_kv_layers({"KVCANARY_REAL_KV_LAYERS": raw})
    assert pools.parse_real_kv_layers({"KVCANARY_REAL_KV_LAYERS": " 0, -1 ,+2"}) == (0, -1, 2)


def test_known_variable_is_not_warned_about(caplog) -> None:
    from kvcanary.runtime.config import Config

    with caplog.at_level(logging.WARNING):
        Config.from_env({"KVCANARY_MODE": "log", "KVCANARY_REAL_KV_LAYERS": "0"})
    assert "KVCANARY_REAL_KV_LAYERS" not in caplog.text


def test_mla_pool_gives_the_latent_buffer() -> None:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(size=64, page_size=16, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=16,
                            layer_num=2, device="cpu", enable_memory_saver=False)
    (group,) = v0_5_12.pool_groups(pool, _cfg(), layers=(0, -1))
    assert group.num_slots == 80
    assert [s.tensor.data_ptr() for s in group.sources] == [pool.kv_buffer[0].data_ptr(), pool.kv_buffer[1].data_ptr()]
    assert group.sources[0].num_bytes_per_token == 48 * 2


def test_swa_pool_gives_full_and_swa_groups_with_the_lut() -> None:
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1], enable_kvcache_transpose=False,
                     device="cpu")
    lut = torch.zeros(66, dtype=torch.int64)
    lut[-1] = -1
    pool.register_mapping(lut)
    full, swa = v0_5_12.pool_groups(pool, _cfg(), sliding_window_size=8, layers=(0, -1))
    assert (full.name, full.num_slots, full.swa_window_size, full.loc) == ("full", 65, 0, "full")
    assert (swa.name, swa.num_slots, swa.swa_window_size, swa.loc) == ("swa", 33, 8, "swa")
    assert swa.full_to_swa_index_mapping is lut
    assert [s.tensor.data_ptr() for s in full.sources] == [pool.full_kv_pool.k_buffer[0].data_ptr(),
                                                           pool.full_kv_pool.v_buffer[0].data_ptr()]
    assert len(swa.sources) == 4 and swa.sources[0].tensor.data_ptr() == pool.swa_kv_pool.k_buffer[0].data_ptr()


def test_unsupported_pool_is_refused_naming_the_class() -> None:
    class DoubleSparseTokenToKVPool:
        size, page_size = 8, 1

    with pytest.raises(NotImplementedError, match="KV pool DoubleSparseTokenToKVPool is not supported"):
        v0_5_12.pool_groups(DoubleSparseTokenToKVPool(), _cfg())


# --------------------------------------------------------------------------------------------- batches
def _i64(*v):
    return torch.tensor(v, dtype=torch.int64)


def test_forward_modes_map_to_batch_views() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    ones, empty = torch.ones(8, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    dec = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=_i64(3, 0), out_cache_loc=_i64(9, 0))
    v = v0_5_12.batch_view(dec, _i64(5, 6), _i64(7, 0), ones, empty)
    assert v.kind.name == "DECODE" and v.prefix_lens.tolist() == [7, 0] and v.extend_lens.tolist() == [1, 1]
    ext = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=_i64(1, 2),
                                out_cache_loc=_i64(4, 5, 6),
                                extend_prefix_lens=torch.tensor([3, 0], dtype=torch.int32),
                                extend_seq_lens=torch.tensor([1, 2], dtype=torch.int32))
    v = v0_5_12.batch_view(ext, _i64(1, 2, 3), _i64(3, 0, 1), ones, empty)
    # sglang's int32 lengths are handed on as they are (the check launch reads int32 or int64: no conversion)
    assert v.prefix_lens is ext.extend_prefix_lens and v.extend_lens is ext.extend_seq_lens
    assert v.prefix_lens.tolist() == [3, 0] and v.extend_lens.tolist() == [1, 2]
    v.validate()
    mixed = types.SimpleNamespace(**{**vars(ext), "forward_mode": ForwardMode.MIXED})
    assert v0_5_12.batch_view(mixed, _i64(1, 2, 3), _i64(3, 0, 1), ones, empty).kind.name == "MIXED"
    idle = types.SimpleNamespace(forward_mode=ForwardMode.IDLE, req_pool_indices=empty, out_cache_loc=empty)
    v = v0_5_12.batch_view(idle, empty, empty, ones, empty)
    assert v.kind.name == "IDLE" and v.num_tokens == 0 and v.batch_size == 0


def test_batch_view_of_binds_a_mode_table() -> None:
    """batches.batch_view_of: the version's table bound once; each enum member's kind is looked up once, anything else
    by name on every call, and a mode missing from the table is refused every time (naming it)."""
    import enum

    from kvcanary.kernels.batch import ForwardKind
    from kvcanary.sglang import batches

    class Mode(enum.IntEnum):
        DECODE = 2
        SPLIT_PREFILL = 9

    view = batches.batch_view_of({"DECODE": ForwardKind.DECODE}, "9.9")
    ones, empty = torch.ones(8, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    for mode in (Mode.DECODE, Mode.DECODE, types.SimpleNamespace(name="DECODE")):
        fb = types.SimpleNamespace(forward_mode=mode, req_pool_indices=_i64(3, 1), out_cache_loc=_i64(9, 8))
        v = view(fb, _i64(5, 6), _i64(7, 4), ones, empty)
        assert v.kind is ForwardKind.DECODE and v.extend_lens.tolist() == [1, 1] and v.prefix_lens.tolist() == [7, 4]
    for _ in range(2):
        with pytest.raises(NotImplementedError, match=r"mode SPLIT_PREFILL is not supported by the sglang 9\.9"):
            view(types.SimpleNamespace(forward_mode=Mode.SPLIT_PREFILL), None, None, ones, empty)
    fb = types.SimpleNamespace(forward_mode=Mode.DECODE, req_pool_indices=_i64(3), out_cache_loc=_i64(9))
    v = batches.batch_view_of({"DECODE": ForwardKind.DECODE}, "9.9")(fb, _i64(5), _i64(7), ones, empty)
    assert v.kind is ForwardKind.DECODE and v.positions.tolist() == [7]


@pytest.mark.parametrize("mode", ["TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2", "SPLIT_PREFILL", "PREBUILT"])
def test_unsupported_forward_modes_are_refused(mode) -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = types.SimpleNamespace(forward_mode=ForwardMode[mode])
    with pytest.raises(NotImplementedError, match=f"forward mode {mode} is not supported"):
        v0_5_12.batch_view(fb, None, None, None, None)
    raising = types.SimpleNamespace(req_to_token=torch.zeros(1, 1, dtype=torch.int32), stopped=None,
                                    keeps_serving=lambda exc, where: False)  # (raise mode's answer)
    with pytest.raises(NotImplementedError, match=mode):
        adapter_hooks.hooks_for(v0_5_12).around_forward(lambda *a, **k: None, _runner(raising), fb)
    stopped: list[str] = []  # log mode: the canary stops on the runner, the forward is served
    logging_inst = types.SimpleNamespace(req_to_token=torch.zeros(1, 1, dtype=torch.int32), stopped=None,
                                         keeps_serving=lambda exc, where: stopped.append(str(exc)) or True)
    served = adapter_hooks.hooks_for(v0_5_12).around_forward(lambda *a, **k: "served",
                                                             _runner(logging_inst), fb)
    assert served == "served"
    assert len(stopped) == 1 and mode in stopped[0]


def test_populated_padding_is_planned_as_padding(hooks, monkeypatch) -> None:
    """0.5.12's populate leaves the padded rows' req_pool_indices and positions an earlier fill's, and their
    out_cache_loc 0; the hook zeroes nothing (no EAGLE pool), and the plan gives those rows no verify entry and no
    write: the stale rows point at a request row whose slots hold other records, and no violation is found."""
    from sglang.srt.model_executor.cuda_graph_runner import DecodeInputBuffers
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("KVCANARY_MODE", "log")
    register()
    HookRegistry.apply_hooks()
    bufs = DecodeInputBuffers.create(
        device=torch.device("cpu"), max_bs=4, max_num_token=4, hidden_size=8, vocab_size=16, dtype=torch.bfloat16,
        dp_size=1, pp_size=1, is_encoder_decoder=False, require_mlp_tp_gather=False, seq_len_fill_value=1,
        encoder_len_fill_value=0, num_tokens_per_bs=1, cache_loc_dtype=torch.int64, enable_mamba_track=False,
    )

    def fb(rows, positions):
        n = len(rows)
        return types.SimpleNamespace(
            input_ids=torch.arange(n), req_pool_indices=_i64(*rows),
            seq_lens=torch.tensor(positions, dtype=torch.int32) + 1,
            out_cache_loc=torch.arange(1, n + 1), positions=_i64(*positions), mrope_positions=None, encoder_lens=None,
            ngram_embedding_info=None, mamba_track_indices=None, mamba_track_mask=None, out_cache_loc_swa=None,
            seq_lens_cpu=None, num_token_non_padded=None,
        )

    common_kwargs = dict(seq_len_fill_value=1, require_gathered_buffer=False, num_tokens_per_bs=1,
                         nsa_enable_prefill_cp=False, enable_num_token_non_padded_flag=False)
    bufs.populate_from_forward_batch(forward_batch=fb([5, 6, 7, 8], [10, 11, 12, 13]), raw_bs=4, raw_num_token=4, bs=4,
                                     **common_kwargs)
    bufs.populate_from_forward_batch(forward_batch=fb([1, 2], [0, 0]), raw_bs=2, raw_num_token=2, bs=4,
                                     **common_kwargs)
    assert bufs.req_pool_indices.tolist() == [1, 2, 7, 8]  # stale
    assert bufs.positions.tolist() == [0, 0, 12, 13]
    assert bufs.out_cache_loc.tolist() == [1, 2, 0, 0]

    r2t = torch.zeros((9, 32), dtype=torch.int32)
    r2t[7:9] = 3  # the finished requests' rows: slot 3 holds none of their records
    kv = torch.zeros((16, 32), dtype=torch.uint8)
    mgr = CanaryManager(Config(mode=Mode.LOG, drain_every=1), num_slots=16, req_to_token=r2t, device="cpu",
                        max_batch_size=4, max_tokens_per_forward=16, real_kv_sources=[RealKvSource(kv, 1, 32, 32)])
    graph_batch = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=bufs.req_pool_indices,
                                        out_cache_loc=bufs.out_cache_loc)
    ones, empty = torch.ones(4, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    batch = v0_5_12.batch_view(graph_batch, bufs.input_ids[:4], bufs.positions[:4], ones, empty)
    mgr.before_forward(batch)
    mgr.after_forward(batch)
    mgr.step()
    assert mgr.violations == []
    assert mgr.device_state.write_plan.write_offsets.tolist() == [0, 1, 2, 2, 2]  # no write for the padded rows


def test_graph_input_zeroing_counts_as_the_forwards_canary_time(monkeypatch) -> None:
    """after_populate runs inside ModelRunner.forward (before a decode graph's replay): its launches are the canary's
    host time of that forward (hook time), not the forward's own."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    ah = adapter_hooks.AdapterHooks(v0_5_12)
    ah.zero_graph_padding = True  # (what install sets for an EAGLE pool)
    recorded: dict[str, int] = {}
    inst = types.SimpleNamespace(
        req_to_token=torch.zeros(1, 1, dtype=torch.int32), serving=0, stopped=None, host_after=lambda: None,
        account_forward=lambda forward_ns, hook_ns: recorded.update(f=forward_ns, h=hook_ns))
    runner = _runner(inst)
    bufs = types.SimpleNamespace(req_pool_indices=torch.arange(1, 5), positions=torch.arange(1, 5))
    fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE)

    def forward(runner, forward_batch):  # ModelRunner.forward: fills a bs-4 graph's buffers for 2 rows, replays
        ah.after_populate(None, bufs, forward_batch=forward_batch, raw_bs=2, raw_num_token=2, bs=4)

    clock = itertools.count(0, 1000)  # every clock read is 1 us after the one before
    monkeypatch.setattr(adapter_hooks.time, "perf_counter_ns", lambda: next(clock))
    ah.around_forward(forward, runner, fb)
    assert bufs.req_pool_indices.tolist() == [1, 2, 0, 0] and bufs.positions.tolist() == [1, 2, 3, 4]
    # reads: t0=0, t1=1000, populate 2000..3000, t2=4000, t3=5000: hooks 1000 + 1000, populate 1000
    assert recorded == {"f": 5000, "h": 3000}
    ah.around_forward(lambda runner, forward_batch: None, runner, fb)  # a forward without a graph replay
    assert recorded["h"] == 2000  # the last forward's populate time is not carried over


def test_fault_injection_can_be_limited_to_one_rank(monkeypatch) -> None:
    monkeypatch.setenv("KVCANARY_FAULT", "real_kv_flip")
    assert fault_injection.fault_plan_for_rank(0) is not None  # no KVCANARY_FAULT_RANK: every rank injects
    monkeypatch.setenv("KVCANARY_FAULT_RANK", "1")
    assert fault_injection.fault_plan_for_rank(0) is None
    plan = fault_injection.fault_plan_for_rank(1)
    assert plan is not None and plan.rank == 1


def test_expected_token_updates_send_only_what_each_row_gained() -> None:
    """Token check in the real engine: per forward, each row sends what its request appended since the last
    forward (one token per decode row), and the whole row again when it holds another request or its tokens
    were rewritten. (The H200 run measured 0.9-4.3 ms of host time per forward when every row was re-sent.)"""
    mirror: dict = {}
    r1 = types.SimpleNamespace(req_pool_idx=1, origin_input_ids=[5, 6, 7], output_ids=[])
    r2 = types.SimpleNamespace(req_pool_idx=2, origin_input_ids=[9], output_ids=[4])
    assert tokens.expected_token_updates(mirror, [r1, r2]) == [(1, 0, [5, 6, 7]), (2, 0, [9, 4])]
    assert tokens.expected_token_updates(mirror, [r1, r2]) == []  # nothing new (a chunked prefill, a lagging row)
    r1.output_ids.append(8)
    r2.output_ids.append(3)
    assert tokens.expected_token_updates(mirror, [r1, r2]) == [(1, 3, [8]), (2, 2, [3])]
    r3 = types.SimpleNamespace(req_pool_idx=1, origin_input_ids=[1, 2], output_ids=[])  # row 1 reused
    assert tokens.expected_token_updates(mirror, [r3]) == [(1, 0, [1, 2])]
    r2.output_ids[-1] = 30  # rewritten tokens: the whole row again
    assert tokens.expected_token_updates(mirror, [r2]) == [(2, 0, [9, 4, 30])]
    r2.output_ids[:] = []  # shorter than what was sent: the whole row again
    assert tokens.expected_token_updates(mirror, [r2]) == [(2, 0, [9])]


def test_mode_name_reads_an_enum_members_name_once() -> None:
    """A forward asks for its mode's name three times (forward hook, BatchConverter, batch hook): an enum member's
    name (a descriptor) is read once and remembered by the member's identity; IntEnum members equal as ints (or
    an int itself) keep their own names."""
    import enum

    from kvcanary.sglang.batches import mode_name

    reads: list[str] = []

    class Mode(enum.IntEnum):
        DECODE = 2

        @property
        def name(self) -> str:  # type: ignore[override]
            reads.append(self._name_)
            return self._name_

    class Other(enum.IntEnum):
        TARGET_VERIFY = 2

    for _ in range(3):
        assert mode_name(types.SimpleNamespace(forward_mode=Mode.DECODE)) == "DECODE"
    assert reads == ["DECODE"]
    assert mode_name(types.SimpleNamespace(forward_mode=Other.TARGET_VERIFY)) == "TARGET_VERIFY"
    assert mode_name(types.SimpleNamespace(forward_mode=2)) == "2"


def _populate(ah, bufs, raw_bs: int, bs: int, per_bs: int, value: int) -> None:
    """sglang's fill of a graph's buffers (the real rows, nothing past them), then the hook after it."""
    bufs.req_pool_indices[:raw_bs] = value
    bufs.positions[: raw_bs * per_bs] = value
    ah.after_populate(None, bufs, raw_bs=raw_bs, raw_num_token=raw_bs * per_bs, bs=bs, num_tokens_per_bs=per_bs)


def test_graph_input_zeroing_leaves_every_replays_padded_rows_zero() -> None:
    """With an EAGLE pool, whatever sequence of batch and graph sizes, the padded rows' req_pool_indices a replay's
    graph reads are zero (a larger earlier fill's rows, and whatever capture left)."""
    ah = adapter_hooks.AdapterHooks(v0_5_12)
    ah.zero_graph_padding = True
    bufs = types.SimpleNamespace(req_pool_indices=torch.arange(1, 9), positions=torch.arange(1, 17))  # capture's
    for step, (raw_bs, bs, per_bs) in enumerate(((2, 4, 1), (4, 4, 1), (1, 4, 1), (2, 4, 1), (3, 8, 2), (8, 8, 2),
                                                 (2, 4, 1), (2, 8, 1))):
        _populate(ah, bufs, raw_bs, bs, per_bs, 100 + step)
        assert bufs.req_pool_indices[raw_bs:bs].tolist() == [0] * (bs - raw_bs), step
    assert bufs.positions.tolist() == [107] * 2 + [105] * 14  # never zeroed: the plan skips row 0's rows
    other = types.SimpleNamespace(req_pool_indices=torch.ones(8, dtype=torch.int64),
                                  positions=torch.ones(16, dtype=torch.int64))
    ah.after_populate(None, other, raw_bs=2, raw_num_token=2, bs=4)  # another runner's buffers
    assert other.req_pool_indices.tolist() == [1, 1, 0, 0, 1, 1, 1, 1]


def test_without_an_eagle_pool_the_hook_zeroes_nothing(monkeypatch) -> None:
    """No zeroing launch on any replay (the plan recognises the padded rows by their out_cache_loc)."""
    ah = adapter_hooks.AdapterHooks(v0_5_12)
    bufs = types.SimpleNamespace(req_pool_indices=torch.arange(1, 9), positions=torch.arange(1, 9))
    zeroed: list[list[int]] = []
    real_zero = torch.Tensor.zero_

    def counted_zero(view):
        zeroed.append(view.tolist())
        return real_zero(view)

    monkeypatch.setattr(torch.Tensor, "zero_", counted_zero)
    for raw_bs in (3, 4, 2, 3, 1):
        _populate(ah, bufs, raw_bs, 4, 1, 9)
    assert zeroed == []
    assert bufs.req_pool_indices.tolist() == [9, 9, 9, 9, 5, 6, 7, 8]


def test_with_an_eagle_pool_every_replays_whole_padding_is_zeroed() -> None:
    """With an EAGLE pool in the process sglang also fills the buffers where after_populate does not see it (a
    replay that skips the attention backend's init): no tracking, the whole padding of every replay is zeroed."""
    ah = adapter_hooks.AdapterHooks(v0_5_12)
    ah.zero_graph_padding = True  # (what install sets for an EAGLE pool)
    bufs = types.SimpleNamespace(req_pool_indices=torch.zeros(8, dtype=torch.int64),
                                 positions=torch.zeros(8, dtype=torch.int64))
    for _ in range(2):
        bufs.req_pool_indices.copy_(torch.arange(1, 9))  # written behind the hook's back
        ah.after_populate(None, bufs, raw_bs=2, raw_num_token=2, bs=4)
        assert bufs.req_pool_indices.tolist() == [1, 2, 0, 0, 5, 6, 7, 8]




def _runner(inst) -> types.SimpleNamespace:
    """A stand-in ModelRunner with ``inst`` installed (and a RunnerState over it, as AdapterHooks.install keeps)."""
    state = installed.RunnerState(inst, token_upload=getattr(inst, "expected_token_upload", lambda: None)())
    return types.SimpleNamespace(**{installed.INSTALL_ATTR: inst, installed.RUNNER_STATE_ATTR: state})


class _StandInInstallation:
    """What the hooks ask of an Installation when kvcanary's part fails: log mode keeps serving, raise mode not."""

    def __init__(self, keeps: bool) -> None:
        self.keeps, self.stopped, self.calls = keeps, None, []

    def keeps_serving(self, exc: Exception, where: str) -> bool:
        self.calls.append((type(exc).__name__, where))
        if self.keeps:
            self.stopped = where
        return self.keeps


def test_a_failing_graph_input_zeroing_stops_the_canary_not_serving_in_log_mode(monkeypatch) -> None:
    """after_populate runs inside sglang's graph replay: an error there must not reach sglang in log mode (every
    installation stops: the buffers are a graph runner's), and stands in raise mode."""
    ah = adapter_hooks.AdapterHooks(v0_5_12)
    ah.zero_graph_padding = True
    broken = types.SimpleNamespace(req_pool_indices=None)  # slicing it raises TypeError
    insts = [_StandInInstallation(True), _StandInInstallation(True)]
    monkeypatch.setattr(adapter_hooks, "runner_states", lambda: [types.SimpleNamespace(inst=i) for i in insts])
    assert ah.after_populate("result", broken, raw_bs=2, raw_num_token=2, bs=4) == "result"
    assert all(i.stopped and i.calls == [("TypeError", "filling a graph's input buffers (padded rows)")]
               for i in insts)
    raising = types.SimpleNamespace(inst=_StandInInstallation(False))
    monkeypatch.setattr(adapter_hooks, "runner_states", lambda: [raising])
    with pytest.raises(TypeError):
        ah.after_populate("result", broken, raw_bs=2, raw_num_token=2, bs=4)


def test_a_strided_out_cache_loc_is_read_as_its_values() -> None:
    """sglang 0.5.12's EAGLE draft decode hands the forward ``out_cache_loc[i]`` of a permuted ``[steps, bs]`` view
    (stride ``steps``). The batch view makes it dense, so the check launch takes it and the records land on those
    slots. Before, the launch refused it by name (``out_cache_loc: expected a contiguous tensor``) on the draft
    runner's first forward, and the scheduler died (2026-12-01, EAGLE phase 5 on the H200)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    steps, bs = 2, 3
    every_step = torch.arange(11, 11 + steps * bs).reshape(bs, 1, steps).permute(2, 0, 1).reshape(steps, -1)
    loc = every_step[1]  # what draft_forward sets for step 1
    assert not loc.is_contiguous()
    fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=_i64(1, 2, 3), out_cache_loc=loc)
    ids, pos = _i64(7, 8, 9), _i64(0, 0, 0)
    view = v0_5_12.batch_view(fb, ids, pos, torch.ones(4, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert view.out_cache_loc.is_contiguous() and view.out_cache_loc.tolist() == loc.tolist() == [12, 14, 16]
    mgr = CanaryManager(Config(mode=Mode.RAISE, drain_every=1), num_slots=32, req_to_token=torch.zeros(
        (4, 8), dtype=torch.int32), device="cpu", max_batch_size=4, max_tokens_per_forward=8)
    mgr.before_forward(view)
    mgr.after_forward(view)
    assert mgr.step() == []
    records = mgr.canary_buf.view(torch.int64)  # (token, position, prev_hash, real_kv_hash) per slot
    assert records[[12, 14, 16], 0].tolist() == [7, 8, 9] and records[[12, 14, 16], 1].tolist() == [0, 0, 0]
    assert records[[11, 13, 15], 0].tolist() == [0, 0, 0]  # the other step's slots: untouched


def test_log_mode_an_error_in_the_forward_hook_or_batch_hook_stops_the_canary_not_serving(monkeypatch) -> None:
    """around_forward: host_after raising in log mode returns the forward's output and stops kvcanary on the runner
    (later forwards call straight through); the batch hook then does nothing. Raise mode re-raises."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from kvcanary.runtime.installation import Group, GroupSpec, Installation

    def installation(mode: Mode) -> Installation:
        cfg = Config(mode=mode, stats_every=0)
        r2t = torch.zeros((4, 8), dtype=torch.int32)
        manager = CanaryManager(cfg, num_slots=16, req_to_token=r2t, device="cpu", max_batch_size=4,
                                max_tokens_per_forward=8)
        return Installation(config=cfg, groups=[Group(GroupSpec("full", 16, ()), manager)], to_views=lambda *a: [],
                            req_to_token=r2t)

    ah = adapter_hooks.AdapterHooks(v0_5_12)
    fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE)
    calls = []

    def original(runner, forward_batch):
        calls.append(forward_batch)
        return "out"

    def broken() -> None:
        raise RuntimeError("drain failed")

    inst = installation(Mode.LOG)
    monkeypatch.setattr(inst, "host_after", broken)
    runner = _runner(inst)
    assert ah.around_forward(original, runner, fb) == "out"
    assert inst.stopped is not None and "drain failed" in inst.stopped
    monkeypatch.setattr(inst, "host_after", lambda: pytest.fail("kvcanary ran after it stopped"))
    assert ah.around_forward(original, runner, fb) == "out" and len(calls) == 2
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[types.SimpleNamespace(req_pool_idx=99,
                                                                                                 rid="r")])
    assert ah.after_forward_batch_init("result", None, batch, runner) == "result"  # (row 99 would raise: skipped)
    fresh = installation(Mode.LOG)  # the batch hook's own error (row 99 is outside the table) stops it too
    assert ah.after_forward_batch_init("result", None, batch, _runner(fresh)) == "result"
    assert fresh.stopped is not None and "batch hook" in fresh.stopped and "row 99" in fresh.stopped

    inst = installation(Mode.RAISE)
    monkeypatch.setattr(inst, "host_after", broken)
    with pytest.raises(RuntimeError, match="drain failed"):
        ah.around_forward(original, _runner(inst), fb)
    assert inst.stopped is None


def test_request_rows_reads_both_columns_and_leaves_out_requests_without_either() -> None:
    ns = types.SimpleNamespace
    full = [ns(req_pool_idx=3, rid="a"), ns(req_pool_idx=5, rid=7)]
    assert adapter_hooks.request_rows(full) == ([3, 5], ["a", 7])
    mixed = [ns(req_pool_idx=3, rid="a"), ns(req_pool_idx=None, rid="b"), ns(req_pool_idx=4, rid=None),
             ns(rid="c"), ns(req_pool_idx=6, rid="d")]
    assert adapter_hooks.request_rows(mixed) == ([3, 6], ["a", "d"])
    assert adapter_hooks.request_rows([]) == ([], [])


@pytest.mark.parametrize(("mode", "attributed"), [("EXTEND", True), ("MIXED", True), ("DECODE", False),
                                                  ("IDLE", False), ("TARGET_VERIFY", False),
                                                  ("DRAFT_EXTEND_V2", False)])
def test_writer_attribution_runs_for_the_batches_that_bring_new_requests(mode: str, attributed: bool) -> None:
    """A request enters through a prefill (EXTEND, MIXED); a decode, a verify and a draft extend hold requests
    already assigned, so their batches pay no per-row attribution, and without the token check their requests are
    not even read (a call per batch from the engine's cold caches)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    calls, reads = [], []
    manager = types.SimpleNamespace(assign_requests=lambda rows, rids: calls.append((rows, rids)))
    inst = types.SimpleNamespace(stopped=None, groups=[types.SimpleNamespace(manager=manager)], verify_tokens=False,
                                 account_batch_init=lambda ns: None)

    class Batch:
        forward_mode = ForwardMode[mode]

        @property
        def reqs(self):
            reads.append(1)
            return [types.SimpleNamespace(req_pool_idx=3, rid="a")]

    ah = adapter_hooks.AdapterHooks(v0_5_12)
    assert ah.after_forward_batch_init("result", None, Batch(), _runner(inst)) == "result"
    assert calls == ([([3], ["a"])] if attributed else [])
    assert len(reads) == (1 if attributed else 0)


@pytest.mark.parametrize("fault", ["", "real_kv_flip"])
def test_the_fault_injection_layer_is_registered_only_with_kvcanary_fault(monkeypatch, fault: str) -> None:
    """Without KVCANARY_FAULT the registered hooks are the plain AdapterHooks (the serving path checks no fault plan
    and has no injection code); with it, the fault-injection layer over the same targets."""
    from kvcanary.sglang import fault_hooks, targets

    hooks_state.clear_kvcanary_env(monkeypatch)
    monkeypatch.setenv("KVCANARY_MODE", "log")
    if fault:
        monkeypatch.setenv("KVCANARY_FAULT", fault)
    registered = []
    monkeypatch.setattr(targets, "register_hooks", registered.extend)
    kvcanary_sglang._register_version(v0_5_12)
    owners = {type(hook.__self__) for _, hook in registered}
    assert owners == ({fault_hooks.FaultInjectingHooks} if fault else {adapter_hooks.AdapterHooks})
    assert [t for t, _ in registered] == list(v0_5_12.TARGETS)
    plain = adapter_hooks.AdapterHooks(v0_5_12)
    assert plain.fault_injection(None, 0, None) is None  # an installation of the plain hooks never injects


def test_batch_facts_is_called_only_where_a_layer_gathers_them() -> None:
    """The plain hooks make no batch_facts call per batch (a call from cold caches is ~5 µs of the engine's host
    time); the fault layer, which overrides it, still makes it (its injection tests read the facts it gathers)."""
    from kvcanary.sglang import v0_5_12
    from kvcanary.sglang.fault_hooks import FaultInjectingHooks

    assert adapter_hooks.AdapterHooks(v0_5_12)._has_batch_facts is False
    assert FaultInjectingHooks(v0_5_12)._has_batch_facts is True
