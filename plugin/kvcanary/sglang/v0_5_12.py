"""Everything kvcanary knows about sglang 0.5.12: hook targets and their parameters, attribute names, the
forward-mode mapping, the KV pool adapters, the prefix-cache walk and the install guards (SPEC §6).

A later sglang version gets a sibling module with the same public names (``register_hooks``, ``TARGETS``,
``batch_view``, ``pool_groups``, ``check_supported``, ``radix_sweep_source``, ``install``).
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvcanary.batch import BatchView, ForwardKind
from kvcanary.config import Config
from kvcanary.manager import CanaryManager
from kvcanary.sglang.common import (
    Group,
    GroupSpec,
    HookTargetError,
    Installation,
    UnsupportedSetupError,
    installations,
    parse_real_kv_layers,
    remember,
    resolve_layers,
    token_major_source,
)

logger = logging.getLogger("kvcanary.sglang")

SGLANG_VERSION = "0.5.12"

_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
T_INIT_MEMORY_POOL = f"{_MR}.init_memory_pool"
T_FORWARD = f"{_MR}.forward"
T_INITIALIZE = f"{_MR}.initialize"
T_POPULATE = "sglang.srt.model_executor.cuda_graph_runner.DecodeInputBuffers.populate_from_forward_batch"
T_INIT_CACHE = "sglang.srt.managers.scheduler.Scheduler.init_cache_with_memory_pool"
T_FB_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
STARTUP_FAILURE_TARGET = f"{_MR}.__init__"

# The attribute of a ModelRunner that holds its Installation.
INSTALL_ATTR = "_kvcanary"

# sglang ForwardMode name -> kvcanary ForwardKind. Anything else is refused (EAGLE target-verify / draft-extend,
# split prefill, prebuilt, dLLM) until the adapter supports it.
FORWARD_MODES: dict[str, ForwardKind] = {
    "EXTEND": ForwardKind.EXTEND,
    "DECODE": ForwardKind.DECODE,
    "MIXED": ForwardKind.MIXED,
    "IDLE": ForwardKind.IDLE,
}


@dataclass(frozen=True)
class Target:
    dotted: str
    hook_type: str  # HookType member name
    params: tuple[str, ...]  # parameter names the hook relies on (the first is self/cls)
    classmethod: bool = False


def _hook_table() -> list[tuple[Target, Callable]]:
    return [
        (Target(T_INIT_MEMORY_POOL, "AFTER", ("self", "pre_model_load_memory")), after_init_memory_pool),
        (Target(T_FORWARD, "AROUND", ("self", "forward_batch")), around_forward),
        (Target(T_INITIALIZE, "AFTER", ("self", "pre_model_load_memory")), after_initialize),
        (Target(T_POPULATE, "AFTER", ("self", "forward_batch", "raw_bs", "raw_num_token", "bs")), after_populate),
        (Target(T_INIT_CACHE, "AFTER", ("self",)), after_init_cache),
        (Target(T_FB_INIT_NEW, "AFTER", ("cls", "batch", "model_runner"), classmethod=True), after_forward_batch_init),
    ]


# ----------------------------------------------------------------------------------------------- targets
def resolve_target(target: Target) -> Callable:
    """The callable behind ``target``, checked: exists, is callable, has the expected parameters (and is a
    classmethod when expected). Raises HookTargetError naming the target."""
    obj_path, attr = target.dotted.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(obj_path)
    except Exception as exc:
        raise HookTargetError(f"sglang hook target {target.dotted}: cannot import {obj_path}: {exc}") from exc
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if raw is None:
        raw = getattr(owner, attr, None)
    if raw is None:
        raise HookTargetError(f"sglang hook target {target.dotted}: {obj_path} has no attribute {attr!r}")
    if target.classmethod:
        if not isinstance(raw, classmethod):
            raise HookTargetError(f"sglang hook target {target.dotted}: expected a classmethod, got {type(raw).__name__}")
        fn = raw.__func__
    else:
        fn = raw
    if not callable(fn):
        raise HookTargetError(f"sglang hook target {target.dotted}: not callable ({type(fn).__name__})")
    params = list(inspect.signature(fn).parameters)
    missing = [p for p in target.params if p not in params]
    if missing or params[: 1] != [target.params[0]]:
        raise HookTargetError(
            f"sglang hook target {target.dotted}: expected parameters {list(target.params)}, found {params} "
            f"(missing: {missing or [target.params[0]]})"
        )
    return fn


def register_hooks() -> None:
    """Validate the configuration, verify every target, register the hooks (sglang's load_plugins applies them)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    config = Config.from_env()
    parse_real_kv_layers()
    _fault_plan_from_env()
    table = _hook_table()
    for target, _ in table:
        resolve_target(target)
    for target, hook in table:
        if any(h is hook for _, h, _ in HookRegistry._hooks.get(target.dotted, [])):
            continue  # registered already in this process
        HookRegistry.register(target.dotted, hook, HookType[target.hook_type])
    logger.info("kvcanary: SGLang %s adapter registered %d hooks; %s", SGLANG_VERSION, len(table), config.describe())


def _fault_plan_from_env():
    try:
        from kvcanary.faults import FaultPlan
    except ImportError:  # pragma: no cover - faults ships with kvcanary
        return None
    return FaultPlan.from_env()


# ----------------------------------------------------------------------------------------------- guards
def check_supported(server_args) -> None:
    """Refuse setups kvcanary cannot protect on 0.5.12, naming the setting to change."""
    own = getattr(server_args, "kv_canary", None)  # later sglang versions: --kv-canary none|log|raise
    if own not in (None, False, "none", "off", ""):
        raise UnsupportedSetupError(
            f"sglang's own KV canary is enabled (--kv-canary {own}); kvcanary does not install twice: "
            "drop --kv-canary or unset KVCANARY_MODE"
        )
    if not getattr(server_args, "disable_piecewise_cuda_graph", True):
        raise UnsupportedSetupError(
            "piecewise CUDA graph is on (the default for prefill in sglang 0.5.12); kvcanary cannot run inside it: "
            "pass --disable-piecewise-cuda-graph"
        )
    if getattr(server_args, "enable_torch_compile", False):
        raise UnsupportedSetupError(
            "--enable-torch-compile compiles model.forward, which kvcanary wraps; remove --enable-torch-compile"
        )
    if getattr(server_args, "enable_pdmux", False):
        raise UnsupportedSetupError(
            "split prefill (--enable-pdmux) calls model.forward_split_prefill, which bypasses kvcanary; "
            "remove --enable-pdmux"
        )
    algo = getattr(server_args, "speculative_algorithm", None)
    if algo:
        topk = getattr(server_args, "speculative_eagle_topk", None) or 1
        if topk > 1:
            raise UnsupportedSetupError(
                f"EAGLE with --speculative-eagle-topk {topk} builds a draft tree, which breaks the canary's "
                "linear chain: set --speculative-eagle-topk 1"
            )
        raise UnsupportedSetupError(
            f"speculative decoding (--speculative-algorithm {algo}) is not supported by the kvcanary sglang "
            f"{SGLANG_VERSION} adapter yet: remove --speculative-algorithm or unset KVCANARY_MODE"
        )


def check_after_initialize(runner) -> None:
    if getattr(runner, "piecewise_cuda_graph_runner", None) is not None:
        raise UnsupportedSetupError(
            "a piecewise CUDA graph runner was built; kvcanary cannot run inside it: pass --disable-piecewise-cuda-graph"
        )


# ----------------------------------------------------------------------------------------------- pools
def pool_groups(pool, config: Config, *, sliding_window_size: int | None = None,
                layers: Sequence[int] | None = None) -> list[GroupSpec]:
    """The KV groups of an sglang 0.5.12 token-to-KV pool, with their real-KV sources.

    MHA (incl. subclasses with the same buffers): K and V of the chosen layers; MLA (incl. NSA): the latent
    ``kv_buffer`` of the chosen layers; SWA: a full group over ``full_kv_pool`` and a swa group over
    ``swa_kv_pool`` with ``full_to_swa_index_mapping`` and the window. Anything else: NotImplementedError
    naming the class.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    layers = parse_real_kv_layers() if layers is None else tuple(layers)
    want_sources = config.real_kv_mode != 0

    def slots_of(p) -> int:
        return int(p.size) + int(p.page_size)

    def mha_sources(p, what: str):
        if not want_sources:
            return ()
        idx = resolve_layers(layers, len(p.k_buffer), 2, what)
        n = slots_of(p)
        out = []
        for i in idx:
            out += [token_major_source(p.k_buffer[i], n, p.page_size), token_major_source(p.v_buffer[i], n, p.page_size)]
        return tuple(out)

    name = type(pool).__name__
    try:
        if isinstance(pool, SWAKVPool):
            full, swa = pool.full_kv_pool, pool.swa_kv_pool
            lut = pool.full_to_swa_index_mapping
            if lut is None:
                raise NotImplementedError(f"kvcanary: {name} has no full_to_swa_index_mapping registered")
            window = int(sliding_window_size or 0)
            if window <= 0:
                raise NotImplementedError(f"kvcanary: {name} without a sliding window size")
            return [
                GroupSpec("full", slots_of(full), mha_sources(full, f"{name}.full_kv_pool")),
                GroupSpec("swa", slots_of(swa), mha_sources(swa, f"{name}.swa_kv_pool"), window, lut, loc="swa"),
            ]
        if isinstance(pool, MLATokenToKVPool):
            srcs: tuple = ()
            if want_sources:
                idx = resolve_layers(layers, len(pool.kv_buffer), 1, name)
                srcs = tuple(token_major_source(pool.kv_buffer[i], slots_of(pool), pool.page_size) for i in idx)
            return [GroupSpec("full", slots_of(pool), srcs)]
        if isinstance(pool, MHATokenToKVPool) and hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
            return [GroupSpec("full", slots_of(pool), mha_sources(pool, name))]
    except ValueError as exc:
        if "KVCANARY_" in str(exc):
            raise
        raise NotImplementedError(f"kvcanary: KV pool {name}: its buffers cannot be fingerprinted: {exc}") from exc
    raise NotImplementedError(
        f"kvcanary: KV pool {name} is not supported by the sglang {SGLANG_VERSION} adapter "
        "(supported: MHATokenToKVPool, MLATokenToKVPool, SWAKVPool)"
    )


# ----------------------------------------------------------------------------------------------- batches
def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 else t.to(torch.int64)


class BatchConverter:
    """ForwardBatch (0.5.12) → one BatchView per group. Graph-capturable: device ops on static views only."""

    def __init__(self, groups: Sequence[GroupSpec], max_batch_size: int, device: torch.device) -> None:
        self.groups = list(groups)
        self.ones = torch.ones(max_batch_size, dtype=torch.int64, device=device)
        self.empty = torch.zeros(0, dtype=torch.int64, device=device)

    def __call__(self, fb, input_ids: torch.Tensor, positions: torch.Tensor) -> list[BatchView]:
        base = batch_view(fb, input_ids, positions, self.ones, self.empty)
        views = []
        for g in self.groups:
            if g.loc == "swa":
                loc = getattr(fb, "out_cache_loc_swa", None)
                if loc is None or loc.shape[0] != base.num_tokens:
                    loc = g.full_to_swa_index_mapping[base.out_cache_loc]
                views.append(BatchView(base.kind, base.input_ids, base.positions, _i64(loc),
                                       base.req_pool_indices, base.prefix_lens, base.extend_lens))
            else:
                views.append(base)
        return views


def batch_view(fb, input_ids: torch.Tensor, positions: torch.Tensor, ones: torch.Tensor,
               empty: torch.Tensor) -> BatchView:
    """One sglang 0.5.12 ForwardBatch as a BatchView (SPEC §4.3 mode table)."""
    mode = fb.forward_mode
    kind = FORWARD_MODES.get(getattr(mode, "name", str(mode)))
    if kind is None:
        raise NotImplementedError(
            f"kvcanary: forward mode {getattr(mode, 'name', mode)} is not supported by the sglang {SGLANG_VERSION} "
            f"adapter (supported: {', '.join(FORWARD_MODES)})"
        )
    if kind is ForwardKind.IDLE:
        rows = fb.req_pool_indices if fb.req_pool_indices is not None else empty
        rows = _i64(rows)
        zeros = torch.zeros_like(rows)
        return BatchView(kind, empty, empty, empty, rows, zeros, zeros)
    if input_ids is None:
        raise NotImplementedError("kvcanary: forwards without input_ids (input_embeds only) are not supported")
    rows = _i64(fb.req_pool_indices)
    if kind is ForwardKind.DECODE:
        bs = rows.shape[0]
        prefix = _i64(positions)[:bs]
        extend = ones[:bs]
    else:
        prefix = _i64(fb.extend_prefix_lens)
        extend = _i64(fb.extend_seq_lens)
    return BatchView(kind, _i64(input_ids), _i64(positions), _i64(fb.out_cache_loc), rows, prefix, extend)


# ----------------------------------------------------------------------------------------------- prefix cache
def radix_sweep_source(tree_cache) -> Callable | None:
    """(slots, prevs, positions) of every slot the RadixCache holds, or None for a cache kvcanary cannot walk."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    inner = getattr(tree_cache, "inner", None) or getattr(tree_cache, "tree_cache", None)
    if not isinstance(tree_cache, RadixCache) and isinstance(inner, RadixCache):
        tree_cache = inner
    if not isinstance(tree_cache, RadixCache):
        return None

    def source() -> tuple[list[int], list[int], list[int]]:
        slots: list[int] = []
        prevs: list[int] = []
        positions: list[int] = []
        stack = [(tree_cache.root_node, 0, -1)]
        while stack:
            node, depth, prev = stack.pop()
            for child in list(node.children.values()):
                if child.value is None:  # evicted (to host, or gone): so is its subtree
                    continue
                values = child.value.tolist()
                p = prev
                for i, slot in enumerate(values):
                    slots.append(int(slot))
                    prevs.append(p)
                    positions.append(depth + i)
                    p = int(slot)
                stack.append((child, depth + len(values), p))
        return slots, prevs, positions

    return source


# ----------------------------------------------------------------------------------------------- install
def install(runner) -> Installation:
    """Build the managers for the runner's pools and wrap its ``model.forward`` (called after init_memory_pool)."""
    existing = getattr(runner, INSTALL_ATTR, None)
    if existing is not None:
        return existing
    config = Config.from_env()
    server_args = runner.server_args
    check_supported(server_args)
    pool = runner.token_to_kv_pool
    specs = pool_groups(pool, config, sliding_window_size=getattr(runner, "sliding_window_size", None))
    r2t = runner.req_to_token_pool.req_to_token
    device = r2t.device
    max_bs = max(int(runner.req_to_token_pool.size) + 1, int(getattr(server_args, "cuda_graph_max_bs", 0) or 0))
    rank = {"tp_rank": int(getattr(runner, "tp_rank", 0))}
    if int(getattr(runner, "pp_size", 1) or 1) > 1:
        rank["pp_rank"] = int(getattr(runner, "pp_rank", 0))
    groups = []
    for spec in specs:
        manager = CanaryManager(
            config,
            num_slots=spec.num_slots,
            req_to_token=r2t,
            device=device,
            max_batch_size=max_bs,
            max_tokens_per_forward=max(spec.num_slots, max_bs),
            real_kv_sources=spec.sources,
            swa_window_size=spec.swa_window_size,
            full_to_swa_index_mapping=spec.full_to_swa_index_mapping,
            rank=rank,
        )
        groups.append(Group(spec, manager))
    inst = Installation(
        config=config,
        groups=groups,
        to_views=BatchConverter(specs, max_bs, device),
        req_to_token=r2t,
        fault_plan=_fault_plan_from_env(),
    )
    inst.wrap_model_forward(runner.model)
    setattr(runner, INSTALL_ATTR, inst)
    remember(inst)
    logger.info(
        "kvcanary: installed on %s (%s) with %d group(s): %s", type(pool).__name__, device, len(groups),
        ", ".join(f"{g.spec.name}: {g.spec.num_slots} slots, {len(g.spec.sources)} real-KV source(s)" for g in groups),
    )
    return inst


def installation_of(runner) -> Installation | None:
    return getattr(runner, INSTALL_ATTR, None)


# ----------------------------------------------------------------------------------------------- hooks
def after_init_memory_pool(result, self, *args, **kwargs):
    install(self)
    return result


def after_initialize(result, self, *args, **kwargs):
    inst = installation_of(self)
    if inst is not None:
        check_after_initialize(self)
        inst.mark_init_finished()
    return result


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def around_forward(original, self, forward_batch, *args, **kwargs):
    inst = installation_of(self)
    if inst is None or _capturing(inst.req_to_token.device):
        return original(self, forward_batch, *args, **kwargs)
    mode = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
    if mode not in FORWARD_MODES:
        raise NotImplementedError(
            f"kvcanary: forward mode {mode} is not supported by the sglang {SGLANG_VERSION} adapter "
            f"(supported: {', '.join(FORWARD_MODES)})"
        )
    inst.host_before(lambda i, step: inject_fault(i, step, forward_batch))
    out = original(self, forward_batch, *args, **kwargs)
    inst.host_after()
    return out


def after_populate(result, self, *args, forward_batch=None, raw_bs=None, raw_num_token=None, bs=None, **kwargs):
    """0.5.12 leaves padded rows' req_pool_indices and positions stale: zero them (row 0 is the padding row)."""
    if raw_bs is not None and bs is not None and bs > raw_bs:
        self.req_pool_indices[raw_bs:].zero_()
    if raw_num_token is not None:
        self.positions[raw_num_token:].zero_()
    return result


def after_init_cache(result, self, *args, **kwargs):
    tree = getattr(self, "tree_cache", None)
    r2t_pool = getattr(self, "req_to_token_pool", None)
    for inst in installations():
        if r2t_pool is not None and inst.req_to_token is not getattr(r2t_pool, "req_to_token", None):
            continue
        source = radix_sweep_source(tree) if tree is not None else None
        if source is None:
            if inst.config.sweep_interval > 0:
                logger.warning("kvcanary: prefix cache %s cannot be swept (supported: RadixCache); sweep off",
                               type(tree).__name__)
        else:
            inst.set_sweep_source(source)
            logger.info("kvcanary: sweep source: %s", type(tree).__name__)
    return result


def after_forward_batch_init(result, cls, batch, model_runner, *args, **kwargs):
    inst = installation_of(model_runner)
    if inst is None or not inst.verify_tokens:
        return result
    for req in getattr(batch, "reqs", None) or ():
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            continue
        inst.set_expected_tokens(int(row), list(req.origin_input_ids) + list(req.output_ids))
    return result


# ----------------------------------------------------------------------------------------------- faults
def inject_fault(inst: Installation, step: int, fb) -> None:
    """KVCANARY_FAULT in a real engine: inject the class the plan picks for this step into live state."""
    from kvcanary import faults

    cls = inst.fault_plan.pick(step)
    mode = getattr(fb.forward_mode, "name", "")
    if mode not in ("EXTEND", "DECODE", "MIXED") or fb.req_pool_indices is None:
        return
    rows = fb.req_pool_indices.tolist()
    if mode == "DECODE":
        prefixes = fb.positions.tolist()[: len(rows)]
    else:
        prefixes = fb.extend_prefix_lens.tolist()
    live = [(r, p) for r, p in zip(rows, prefixes) if r > 0 and p >= 2]
    r2t = inst.req_to_token
    if cls == faults.REQ_TO_TOKEN_REDIRECT and live:
        row, prefix = live[0]
        other = int(r2t[row, 0])
        inst.injections.append(faults.redirect_req_to_token(r2t, row, prefix - 1, other, step=step))
    elif cls == faults.REAL_KV_FLIP and live and inst.groups[0].spec.sources:
        row, prefix = live[0]
        slot = int(r2t[row, prefix - 1])
        inst.injections.append(faults.flip_real_kv(inst.groups[0].spec.sources[0], slot, step=step))
    elif cls == faults.POSITION_SKEW and fb.positions.numel():
        inst.injections.append(faults.skew_position(fb.positions, 0, 1, out_cache_loc=fb.out_cache_loc, step=step))
    elif cls == faults.TOKEN_SWAP and fb.input_ids.numel() >= 2:
        ids = fb.input_ids.tolist()
        j = next((k for k in range(1, len(ids)) if ids[k] != ids[0]), None)
        if j is not None:
            inst.injections.append(faults.swap_tokens(fb.input_ids, 0, j, out_cache_loc=fb.out_cache_loc, step=step))
    elif cls == faults.CACHED_IDLE_CORRUPTION and inst.manager._sweep_source is not None and inst.groups[0].spec.sources:
        live_slots = {int(s) for r, p in zip(rows, prefixes) if r > 0 for s in r2t[r, :p].tolist()}
        idle = [s for s in inst.manager._sweep_source()[0] if s not in live_slots]
        if idle:
            inst.injections.append(faults.flip_cached_idle(inst.groups[0].spec.sources[0], idle[0], step=step))
    else:
        logger.warning("kvcanary: fault %s cannot be injected at step %d in this batch (%s); skipped", cls, step, mode)


TARGETS: tuple[Target, ...] = tuple(t for t, _ in _hook_table())
