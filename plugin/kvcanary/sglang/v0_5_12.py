"""Everything kvcanary knows about sglang 0.5.12: hook targets and their parameters, attribute names, the
forward-mode mapping, the KV pool adapters, the prefix-cache walk and the install guards (SPEC §6).

A later sglang version gets a sibling module with the same public names (``register_hooks``, ``TARGETS``,
``batch_view``, ``pool_groups``, ``check_supported``, ``radix_sweep_source``, ``install``).
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
import random
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvcanary.batch import BatchView, ForwardKind
from kvcanary.config import Config
from kvcanary.manager import CanaryManager
from kvcanary.report import Reporter
from kvcanary.streams import run_on_producer_stream
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

# Most verify-plan entries per forward the adapter allocates beyond 3 x the pool's slots (64 MiB of plan).
VERIFY_CAPACITY_CAP = 1 << 21

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


def _fault_plan_for_rank(rank: int):
    """The fault plan this rank runs: none when KVCANARY_FAULT_RANK names another rank."""
    plan = _fault_plan_from_env()
    if plan is not None and not plan.applies_to(rank):
        logger.info("kvcanary: fault injection is for rank %d; rank %d injects nothing", plan.rank, rank)
        return None
    return plan


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
def _radix_cache(tree_cache):
    """The RadixCache behind sglang's prefix cache (itself, or the one a wrapper holds), or None."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    inner = getattr(tree_cache, "inner", None) or getattr(tree_cache, "tree_cache", None)
    if not isinstance(tree_cache, RadixCache) and isinstance(inner, RadixCache):
        tree_cache = inner
    return tree_cache if isinstance(tree_cache, RadixCache) else None


def _cached_nodes(tree_cache):
    """(node, depth, parent) of every RadixCache node that holds slots (``value`` not None and not empty), parents
    before children; an evicted node's subtree is skipped. ``parent`` is None under the root."""
    stack = [(tree_cache.root_node, 0, None)]
    while stack:
        node, depth, parent = stack.pop()
        for child in list(node.children.values()):
            value = child.value
            if value is None or value.shape[0] == 0:  # evicted (to host, or gone): so is its subtree
                continue
            yield child, depth, parent
            stack.append((child, depth + int(value.shape[0]), child))


def radix_sweep_source(tree_cache, producer_stream: Callable[[], torch.cuda.Stream | None] | None = None
                       ) -> Callable | None:
    """(slots, prevs, positions) of every slot the RadixCache holds, or None for a cache kvcanary cannot walk.

    ``producer_stream()`` returns the stream the tree's node values live on (sglang's scheduler stream), or None
    (CPU, or the event loop has not started): the gather runs there, because the scheduler frees and reuses node
    value blocks on that stream while the sweep's caller (the forward stream) may still lag behind
    (:mod:`kvcanary.streams`).
    """
    tree_cache = _radix_cache(tree_cache)
    if tree_cache is None:
        return None

    def gather() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Node values are int64 slot tensors on the KV device: gather them there (one cat), never read them on
        # the host (a .tolist() per node would be one device sync per node). Only depths and lengths, host
        # facts of the tree, build the positions.
        slot_parts: list[torch.Tensor] = []
        prev_parts: list[torch.Tensor] = []
        depths: list[int] = []
        lengths: list[int] = []
        last: dict[int, torch.Tensor] = {}  # id(node) -> its last slot, a 1-element view (the children's prev)
        head = None  # [-1] on the values' device: the predecessor of a first-level node
        for node, depth, parent in _cached_nodes(tree_cache):
            value = node.value if node.value.dtype == torch.int64 else node.value.to(torch.int64)
            if parent is None:
                if head is None or head.device != value.device:
                    head = torch.full((1,), -1, dtype=torch.int64, device=value.device)
                prev = head
            else:
                prev = last[id(parent)]
            last[id(node)] = value[-1:]
            slot_parts.append(value)
            prev_parts += [prev, value[:-1]]
            depths.append(depth)
            lengths.append(int(value.shape[0]))
        if not slot_parts:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty
        lens = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(sum(lengths), dtype=torch.int64) + torch.repeat_interleave(
            torch.tensor(depths, dtype=torch.int64) - starts, lens)
        return torch.cat(slot_parts), torch.cat(prev_parts), positions

    def source() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        producer = producer_stream() if producer_stream is not None else None
        return run_on_producer_stream(producer, gather)

    return source


# ----------------------------------------------------------------------------------------------- install
def runner_ranks(runner) -> tuple[dict[str, int], int]:
    """The rank keys every violation of ``runner`` carries, and the ``{rank}`` value of its KVCANARY_REPORT path.

    Keys (sglang 0.5.12 ``ModelRunner`` attributes): ``tp_rank`` always; ``pp_rank`` when ``pp_size`` > 1;
    ``attn_dp_rank`` (``runner.dp_rank``) with ``--enable-dp-attention`` and ``dp_size`` > 1; ``dp_rank``
    (``runner.dp_rank``: the replica of ``--dp-size N`` without DP attention, or ``SGLANG_DP_RANK``) when it is
    set and not the only replica's 0.

    ``{rank}`` is the process's index among all TP/PP/DP scheduler processes, so per-rank files never collide:
    ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank`` with ``dp_rank`` counted only for DP replicas (with
    DP attention ``tp_rank`` is already global). With one pipeline stage and one replica it is ``tp_rank``.
    """
    server_args = runner.server_args
    tp_rank = int(getattr(runner, "tp_rank", 0) or 0)
    tp_size = max(int(getattr(runner, "tp_size", 1) or 1), 1)
    pp_rank = int(getattr(runner, "pp_rank", 0) or 0)
    pp_size = max(int(getattr(runner, "pp_size", 1) or 1), 1)
    dp_rank = getattr(runner, "dp_rank", None)
    dp_size = max(int(getattr(server_args, "dp_size", 1) or 1), 1)
    rank = {"tp_rank": tp_rank}
    if pp_size > 1:
        rank["pp_rank"] = pp_rank
    replica = 0
    if dp_rank is not None:
        if getattr(server_args, "enable_dp_attention", False):
            if dp_size > 1:
                rank["attn_dp_rank"] = int(dp_rank)
        elif dp_size > 1 or int(dp_rank) != 0:
            replica = int(dp_rank)
            rank["dp_rank"] = replica
    return rank, (replica * pp_size + pp_rank) * tp_size + tp_rank


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
    rank, report_rank = runner_ranks(runner)
    groups = []
    for spec in specs:
        # Σ prefix over a batch can exceed the pool many times over when rows share a cached prefix (radix hits):
        # size the verify plan for every row's full context, up to VERIFY_CAPACITY_CAP entries (32 B each;
        # the verify grid is sized from the SM count, so capacity costs memory only).
        rows, ctx = int(r2t.shape[0]), int(r2t.shape[1])
        vcap = max(3 * spec.num_slots, min(rows * ctx, VERIFY_CAPACITY_CAP))
        manager = CanaryManager(
            config,
            num_slots=spec.num_slots,
            req_to_token=r2t,
            device=device,
            max_batch_size=max_bs,
            max_tokens_per_forward=max(spec.num_slots, max_bs),
            verify_capacity=vcap,
            real_kv_sources=spec.sources,
            swa_window_size=spec.swa_window_size,
            full_to_swa_index_mapping=spec.full_to_swa_index_mapping,
            reporter=Reporter(config.mode, config.report_path_for(report_rank), rank=rank),
            rank=rank,
        )
        groups.append(Group(spec, manager))
    inst = Installation(
        config=config,
        groups=groups,
        to_views=BatchConverter(specs, max_bs, device),
        req_to_token=r2t,
        fault_plan=_fault_plan_for_rank(report_rank),
    )
    inst.wrap_model_forward(runner.model)
    setattr(runner, INSTALL_ATTR, inst)
    remember(inst)
    logger.info(
        "kvcanary: installed on %s (%s, %s, report %s) with %d group(s): %s", type(pool).__name__, device,
        " ".join(f"{k}={v}" for k, v in rank.items()), groups[0].manager.reporter.report_path or "-", len(groups),
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
    t0 = time.perf_counter_ns()
    inst.host_before(lambda i, step, cls: inject_fault(i, step, forward_batch, cls))
    t1 = time.perf_counter_ns()
    out = original(self, forward_batch, *args, **kwargs)
    if inst.pending_repairs:
        repair_token_swaps(inst, forward_batch)
    t2 = time.perf_counter_ns()
    inst.host_after()
    t3 = time.perf_counter_ns()
    inst.account_forward(t3 - t0, t1 - t0 + t3 - t2)
    return out


def after_populate(result, self, *args, forward_batch=None, raw_bs=None, raw_num_token=None, bs=None,
                   num_tokens_per_bs=1, **kwargs):
    """0.5.12 leaves padded rows' req_pool_indices and positions stale: zero them (row 0 is the padding row).

    Only the padding the graph of ``bs`` reads, and nothing when the batch fills its graph: every replay pays
    these launches in host time."""
    if raw_bs is None or bs is None or bs <= raw_bs:
        return result
    self.req_pool_indices[raw_bs:bs].zero_()
    if raw_num_token is not None:
        self.positions[raw_num_token : bs * int(num_tokens_per_bs or 1)].zero_()
    return result


def scheduler_stream_of(scheduler) -> Callable[[], torch.cuda.Stream | None]:
    """The stream sglang 0.5.12's scheduler event loop runs on (``Scheduler.schedule_stream``, created when the
    loop starts, after the cache), read when asked; None before that or off CUDA. Weak: never keeps the
    scheduler alive."""
    ref = weakref.ref(scheduler)

    def stream() -> torch.cuda.Stream | None:
        owner = ref()
        found = getattr(owner, "schedule_stream", None) if owner is not None else None
        return found if isinstance(found, torch.cuda.Stream) else None

    return stream


def after_init_cache(result, self, *args, **kwargs):
    tree = getattr(self, "tree_cache", None)
    r2t_pool = getattr(self, "req_to_token_pool", None)
    for inst in installations():
        if r2t_pool is not None and inst.req_to_token is not getattr(r2t_pool, "req_to_token", None):
            continue
        source = radix_sweep_source(tree, scheduler_stream_of(self)) if tree is not None else None
        if source is None:
            if inst.config.sweep_interval > 0:
                logger.warning("kvcanary: prefix cache %s cannot be swept (supported: RadixCache); sweep off",
                               type(tree).__name__)
        else:
            inst.set_sweep_source(source)
            inst.prefix_cache = tree
            logger.info("kvcanary: sweep source: %s", type(tree).__name__)
    return result


# A request still being prefilled in chunks (Req.is_chunked > 0) has this many forwards ahead, for the injector.
_CHUNKED_REMAINING = 1 << 30


def after_forward_batch_init(result, cls, batch, model_runner, *args, **kwargs):
    inst = installation_of(model_runner)
    if inst is None or (not inst.verify_tokens and inst.fault_plan is None):
        return result
    reqs = getattr(batch, "reqs", None) or ()
    if inst.fault_plan is not None:
        inst.batch_reqs = list(reqs)
        # ModelWorkerBatch.reqs (0.5.12): how many tokens each row's request still decodes, so the injector
        # can pick rows whose next forward re-verifies what it corrupts. Under the overlap scheduler
        # output_ids may lag one step behind; the injector keeps a margin.
        inst.row_remaining = {
            int(req.req_pool_idx): (_CHUNKED_REMAINING if getattr(req, "is_chunked", 0) > 0 else
                                    int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids))
            for req in reqs if getattr(req, "req_pool_idx", None) is not None
        }
    if inst.verify_tokens:
        inst.update_expected_tokens(expected_token_updates(inst.token_mirror, reqs))
    return result


def expected_token_updates(mirror: dict, reqs) -> list[tuple[int, int, list[int]]]:
    """``(row, start, tokens)`` for what each request's row gained since its last upload (``mirror`` is updated).

    A row's expected tokens are the request's ``origin_input_ids + output_ids``; a decode row gains one token
    per forward, a chunked prefill none. The whole row is sent again when the row holds another request, or
    when the last token sent no longer matches (the request's tokens were rewritten, e.g. by a retraction).
    """
    updates = []
    for req in reqs:
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            continue
        row = int(row)
        origin, output = req.origin_input_ids, req.output_ids
        n_origin = len(origin)
        total = n_origin + len(output)
        start = 0
        prev = mirror.get(row)
        if prev is not None and prev[0] is req and 0 < prev[1] <= total:
            last = prev[1] - 1
            if (origin[last] if last < n_origin else output[last - n_origin]) == prev[2]:
                start = prev[1]
        if start == total and prev is not None:
            continue
        new = list(output[start - n_origin :]) if start >= n_origin else list(origin[start:]) + list(output)
        updates.append((row, start, new))
        mirror[row] = (req, total, (origin[total - 1] if total <= n_origin else output[-1]) if total else None)
    return updates


# ----------------------------------------------------------------------------------------------- faults
# How many tokens a row's request must still decode for a token swap to be re-verified by a later forward
# (one token of margin for the overlap scheduler's lagging output_ids, one for the forward itself).
SWAP_MIN_REMAINING = 3


@dataclass
class SwapRepair:
    """A token swap's row, to be rewritten with its true tokens once its next forward has verified it."""

    row: int
    position: int  # the swapped token's position (its slot holds the swapped record)
    req: object  # the engine's Req in that row
    step: int  # the injection's forward


def repair_token_swaps(inst: Installation, fb) -> None:
    """After a forward: rewrite the records of each swapped row that this forward verified.

    A token swap leaves the canary records of its rows (the swapped token, and every later record, whose chain
    hash descends from it) disagreeing with the tokens the engine keeps. The row's next forward reports it
    (verify_token); after that the records must agree with the engine again, or the disagreement outlives the
    injection: when the finished request enters the RadixCache after another request's identical prefix, the
    tree links the first slot after the shared part to that request's record, and the sweep reports it. So,
    once the row's next decode forward has run, its records from the swapped position through this forward's
    token are written again with the true tokens (plan + verify + write of a one-row extend, stream-ordered
    after the forward's own canary kernels).
    """
    if getattr(fb.forward_mode, "name", "") != "DECODE" or fb.seq_lens_cpu is None:
        return
    keep = []
    for rep in inst.pending_repairs:
        if rep.step >= inst.steps:  # the injecting forward itself (steps counts finished forwards)
            keep.append(rep)
            continue
        if getattr(rep.req, "req_pool_idx", None) != rep.row:
            logger.warning("kvcanary: token swap of step %d: row %d left before its repair; its records stay swapped",
                           rep.step, rep.row)
            continue
        k = next((i for i, r in enumerate(inst.batch_reqs) if r is rep.req), None)
        if k is None:
            keep.append(rep)
            continue
        last = int(fb.seq_lens_cpu[k]) - 1  # the position this forward wrote for the row
        known = (list(rep.req.origin_input_ids) + list(rep.req.output_ids))[rep.position : last]
        if len(known) != last - rep.position:  # output_ids lag further than one token: retry next forward
            keep.append(rep)
            continue
        device = inst.req_to_token.device
        ids = torch.cat([torch.tensor(known, dtype=torch.int64, device=device), _i64(fb.input_ids[k : k + 1])])
        n = last + 1 - rep.position
        one_row = types.SimpleNamespace(
            forward_mode=types.SimpleNamespace(name="EXTEND"), out_cache_loc_swa=None,
            req_pool_indices=torch.tensor([rep.row], dtype=torch.int64, device=device),
            extend_prefix_lens=torch.tensor([rep.position], dtype=torch.int64, device=device),
            extend_seq_lens=torch.tensor([n], dtype=torch.int64, device=device),
            out_cache_loc=_i64(inst.req_to_token[rep.row, rep.position : last + 1]),
        )
        positions = torch.arange(rep.position, last + 1, dtype=torch.int64, device=device)
        for group, view in zip(inst.groups, inst.to_views(one_row, ids, positions)):
            group.manager.before_forward(view)
            group.manager.after_forward(view)
    inst.pending_repairs = keep


def idle_cached_slots(tree_cache) -> list[int]:
    """Slots the RadixCache holds in nodes no running request locks (``TreeNode.lock_ref == 0``), in walk order.

    Reads slots on the host: fault injection only."""
    tree_cache = _radix_cache(tree_cache)
    if tree_cache is None:
        return []
    return [int(x) for node, _, _ in _cached_nodes(tree_cache) if getattr(node, "lock_ref", 0) == 0
            for x in node.value.tolist()]


def _batch_rows(fb) -> tuple[str, list[int], list[int], list[int]]:
    """(mode name, req_to_token rows, cached prefix length per row, extend length per row) of a ForwardBatch."""
    mode = getattr(fb.forward_mode, "name", "")
    rows = fb.req_pool_indices.tolist()
    if mode == "DECODE":
        return mode, rows, fb.positions.tolist()[: len(rows)], [1] * len(rows)
    return mode, rows, fb.extend_prefix_lens.tolist(), fb.extend_seq_lens.tolist()


def inject_fault(inst: Installation, step: int, fb, cls: str | None = None):
    """KVCANARY_FAULT in a real engine: inject ``cls`` (default: the plan's pick) into live state before this
    forward; returns the Injection, or None when this batch cannot take it (the class then stays pending).

    Every class is chosen so the canary must see it, and undone so it corrupts nothing beyond the slots it
    names (a later violation on any other slot is a false positive):

    * req_to_token_redirect: ``req_to_token[row, p]`` of a batch row with a cached prefix of >= 3 tokens
      (1 <= p <= prefix-2) -> the row's position-0 slot; this forward's verify sees the redirected entry
      and its successor (chain hash); restored after the forward (the write seeds from prefix-1, untouched).
    * real_kv_flip: byte 0 of the first real-KV source of the last cached slot of a batch row (inside the
      PARTIAL window); this forward's verify sees it; flipped back after the forward.
    * cached_idle_corruption: only before a forward whose step runs the sweep; a RadixCache slot no request
      locks and this forward does not verify; the sweep sees it; flipped back after the sweep.
    * token_swap: decode only; the input tokens of two rows whose requests decode >= SWAP_MIN_REMAINING more
      tokens (needs KVCANARY_VERIFY_TOKENS): their next forward's verify sees the stored tokens (verify_token);
      after that forward the rows' records are rewritten with the true tokens (``repair_token_swaps``).
    * position_skew: extend/mixed only (never graph-replayed); +1 on the last token of a row with a cached
      prefix (the chain-position assert is armed there): this forward's write reports it (write_position);
      after the forward the position and the canary records of the forward are rewritten as the engine
      meant them, so the successor written next is not reported too.
    """
    from kvcanary import faults

    if cls is None:
        cls = inst.fault_plan.pick(step)
    mode = getattr(fb.forward_mode, "name", "")
    if mode not in ("EXTEND", "DECODE", "MIXED") or fb.req_pool_indices is None or fb.input_ids is None:
        return None
    mode, rows, prefixes, extends = _batch_rows(fb)
    r2t = inst.req_to_token
    sources = inst.groups[0].spec.sources
    rng = random.Random(step)

    if cls == faults.REQ_TO_TOKEN_REDIRECT:
        live = [(r, p) for r, p in zip(rows, prefixes) if r > 0 and p >= 3]
        if not live:
            return None
        row, prefix = rng.choice(live)
        pos = rng.randrange(1, prefix - 1)
        old = int(r2t[row, pos])
        inj = faults.redirect_req_to_token(r2t, row, pos, int(r2t[row, 0]), step=step)

        def undo_redirect(row=row, pos=pos, old=old):
            r2t[row, pos] = old

        inst.undo_after_forward(undo_redirect)
        return inj

    if cls == faults.REAL_KV_FLIP:
        live = [(r, p) for r, p in zip(rows, prefixes) if r > 0 and p >= 1]
        if not live or not sources:
            return None
        row, prefix = rng.choice(live)
        slot = int(r2t[row, prefix - 1])
        inj = faults.flip_real_kv(sources[0], slot, byte=0, step=step)
        inst.undo_after_forward(lambda slot=slot: _flip_back(sources[0], slot))
        return inj

    if cls == faults.CACHED_IDLE_CORRUPTION:
        manager = inst.manager
        interval = manager.config.sweep_interval
        if not sources or manager._sweep_source is None or interval <= 0 or inst.prefix_cache is None:
            return None
        if (manager._steps + 1) % interval != 0:
            return None  # wait for the forward whose step sweeps
        verified = set()
        for r, p in zip(rows, prefixes):
            if r > 0 and p > 0:
                verified.update(r2t[r, :p].tolist())
        idle = [s for s in idle_cached_slots(inst.prefix_cache) if s > 0 and s not in verified]
        if not idle:
            return None
        slot = rng.choice(idle)
        inj = faults.flip_cached_idle(sources[0], slot, byte=0, step=step)
        inst.undo_after_forward(lambda slot=slot: _flip_back(sources[0], slot), after_step=True)
        return inj

    if cls == faults.TOKEN_SWAP:
        if mode != "DECODE" or not inst.verify_tokens:
            return None
        ids = fb.input_ids.tolist()
        ok = [i for i, r in enumerate(rows) if r > 0 and inst.row_remaining.get(r, 0) >= SWAP_MIN_REMAINING]
        rng.shuffle(ok)
        pair = next(((i, j) for i in ok for j in ok if i < j and ids[i] != ids[j]), None)
        if pair is None:
            return None
        i, j = pair
        inj = faults.swap_tokens(fb.input_ids, i, j, out_cache_loc=fb.out_cache_loc, step=step)
        for b in (i, j):
            req = inst.batch_reqs[b] if b < len(inst.batch_reqs) else None
            if req is not None and getattr(req, "req_pool_idx", None) == rows[b]:
                inst.pending_repairs.append(SwapRepair(rows[b], prefixes[b], req, step))

        def undo_swap(i=i, j=j, a=ids[i], b=ids[j]):
            fb.input_ids[i], fb.input_ids[j] = a, b  # the canary records keep the swapped tokens

        inst.undo_after_forward(undo_swap)
        return inj

    if cls == faults.POSITION_SKEW:
        if mode == "DECODE":
            return None
        starts = [0]
        for e in extends:
            starts.append(starts[-1] + e)
        locs = fb.out_cache_loc.tolist()
        cand = [starts[k + 1] - 1 for k, (r, p, e) in enumerate(zip(rows, prefixes, extends))
                if r > 0 and p >= 1 and e >= 1 and locs[starts[k + 1] - 1] > 0]
        if not cand or not any(int(g.manager.enable_chain_position_assert[0]) for g in inst.groups[:1]):
            return None
        i = rng.choice(cand)
        old = int(fb.positions[i])
        inj = faults.skew_position(fb.positions, i, 1, out_cache_loc=fb.out_cache_loc, step=step)

        def undo_skew(i=i, old=old):
            fb.positions[i] = old
            views = inst.to_views(fb, fb.input_ids, fb.positions)
            for group, view in zip(inst.groups, views):
                group.manager._positions[i] = old
                group.manager.after_forward(view)  # rewrite this forward's records with the true position

        inst.undo_after_forward(undo_skew)
        return inj

    logger.warning("kvcanary: fault %s cannot be injected by the sglang %s adapter; skipped", cls, SGLANG_VERSION)
    inst.pending_fault = None
    inst.fault_skips += 1
    return None


def _flip_back(source, slot: int) -> None:
    row, col = divmod(slot, source.page_size)
    col = col * source.num_bytes_per_token
    kv = source.kv_bytes
    kv[row, col] = kv[row, col] ^ 0xFF  # byte 0 back (device op, no sync)


TARGETS: tuple[Target, ...] = tuple(t for t, _ in _hook_table())
