"""The per-version contract: what every sglang version module (``kvcanary.sglang.v0_5_12``, ...) provides.

A version module holds one sglang version range's facts: hook targets and their parameters, the forward-mode
table, the prefix-cache class, and the accessors the shared hook bodies (:mod:`kvcanary.sglang.hooks`,
:mod:`kvcanary.sglang.protect`, :mod:`kvcanary.sglang.fault_injection`) read engine objects through: every member
they read, none optional. It starts from the shared defaults of :mod:`kvcanary.sglang.base` and states what differs.
:class:`VersionModule` is that contract as a typing Protocol; :func:`check_version_module` checks a module against
it (names, kinds, parameter names, hook tables, version range), and ``tests/adapters`` runs it on every module in
``kvcanary.sglang.SUPPORTED``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.runtime.config import Config
from kvcanary.runtime.installation import GroupSpec, Installation, WrapperCall
from kvcanary.runtime.sweep import SweepPlan
from kvcanary.sglang.pools import PoolClasses
from kvcanary.sglang.radix_index import RadixNodeHooks
from kvcanary.sglang.targets import Target

# The hook bodies of kvcanary.sglang.hooks.AdapterHooks a version can attach to targets; a version module's
# HOOK_TARGETS maps each to its target. REQUIRED_HOOKS must be there; the others fix one version's quirks.
HOOK_NAMES: tuple[str, ...] = (
    "after_init_memory_pool", "around_forward", "after_initialize", "after_populate", "after_init_cache",
    "after_forward_batch_init",
    # EAGLE speculative decoding (kvcanary.sglang.speculative): the draft CUDA-graph replays, the verify verdicts.
    "around_draft_replay", "around_draft_extend_replay", "after_verify_complete",
    # HiCache (kvcanary.sglang.hicache): records follow the host tier's backups and load-backs. A version without
    # them must refuse --enable-hierarchical-cache (kvcanary.sglang.audit).
    "after_hicache_write", "after_hicache_load", "around_hicache_start_loading",
)
SPECULATIVE_HOOKS: frozenset[str] = frozenset({"around_draft_replay", "around_draft_extend_replay",
                                               "after_verify_complete"})
HICACHE_HOOKS: frozenset[str] = frozenset({"after_hicache_write", "after_hicache_load",
                                           "around_hicache_start_loading"})
REQUIRED_HOOKS: frozenset[str] = frozenset(HOOK_NAMES) - {"after_populate"} - SPECULATIVE_HOOKS - HICACHE_HOOKS
# The hooks of kvcanary.sglang.protect.ProtectHooks (KVCANARY_MODE=protect); a version module's PROTECT_HOOK_TARGETS
# maps each to its target, or is empty where protect mode is not taught (it is refused there).
PROTECT_HOOK_NAMES: tuple[str, ...] = (
    "protect_after_init_cache", "protect_after_forward_batch_init", "protect_before_schedule",
    "protect_before_results",
)


@dataclass(frozen=True)
class RunnerParts:
    """What kvcanary's install reads from a ModelRunner (its KV pool built), through the version's accessor."""

    kv_pool: object  # the token-to-KV pool (pool_groups turns it into groups)
    req_to_token: torch.Tensor  # int32 [rows, max_context_len]
    max_running_requests: int  # rows of the request pool (req_to_token_pool.size)
    cuda_graph_max_bs: int  # largest decode graph batch (0: none)
    sliding_window_size: int | None
    model: torch.nn.Module  # whose instance ``forward`` is wrapped

    @classmethod
    def of_runner(cls, runner, *, cuda_graph_max_bs: int) -> RunnerParts:
        """The parts every supported version keeps under the same ModelRunner attributes (``token_to_kv_pool``,
        ``req_to_token_pool``, ``sliding_window_size``, ``model``); where the largest decode-graph batch comes from
        differs by version, so the version module passes it."""
        r2t_pool = runner.req_to_token_pool
        return cls(
            kv_pool=runner.token_to_kv_pool,
            req_to_token=r2t_pool.req_to_token,
            max_running_requests=int(r2t_pool.size),
            cuda_graph_max_bs=cuda_graph_max_bs,
            sliding_window_size=getattr(runner, "sliding_window_size", None),
            model=runner.model,
        )


class VersionModule(Protocol):
    """One sglang version range's adapter module (functions are module-level: no ``self`` in the module)."""

    SGLANG_VERSION: str  # the version it was written and tested against (named in messages)
    VERSION_RANGE: str  # PEP 440 specifier set of the versions it serves, e.g. ">=0.5.12,<0.5.13"
    STARTUP_FAILURE_TARGET: str  # dotted callable that re-raises a start-up error (ModelRunner.__init__)
    HOOK_TARGETS: Mapping[str, Target]  # hook name (HOOK_NAMES) -> target
    TARGETS: tuple[Target, ...]  # HOOK_TARGETS' values, in registration order
    PROTECT_HOOK_TARGETS: Mapping[str, Target]  # protect hook name (PROTECT_HOOK_NAMES) -> target; empty: refused
    FORWARD_MODES: Mapping[str, ForwardKind]  # sglang ForwardMode name -> kind; anything else is refused
    RADIX_CACHE_CLASS: str  # dotted name of the RadixCache class (protect mode evicts from exactly that class)
    RADIX_NODE_HOOKS: RadixNodeHooks | None  # its methods the incremental sweep follows; None: walked every sweep
    POOL_CLASSES: PoolClasses  # its KV pool classes and the kinds kvcanary has run on it (pools.pool_kind)

    def check_supported(self, server_args) -> None: ...

    def check_after_initialize(self, runner) -> None:
        """After init, before the chain-position assert goes on: refuse graph runners kvcanary cannot run around
        (and keep its ``model.forward`` wrapper in place where compiling replaced it)."""

    def server_args_of(self, runner) -> object: ...

    def runner_parts(self, runner) -> RunnerParts: ...

    def runner_ranks(self, runner) -> tuple[dict[str, int], int]: ...

    def pool_groups(self, pool, config: Config, *, sliding_window_size: int | None = None,
                    layers: Sequence[int] | None = None) -> list[GroupSpec]: ...

    def batch_view(self, fb, input_ids: torch.Tensor, positions: torch.Tensor, ones: torch.Tensor,
                   empty: torch.Tensor) -> BatchView: ...

    def batch_requests(self, batch) -> Sequence[object]: ...

    def scheduler_cache(self, scheduler) -> tuple[object | None, torch.Tensor | None]: ...

    def radix_cache(self, tree_cache) -> object | None: ...

    def swept_tree(self, tree_cache) -> object | None:
        """The tree whose cached slots the sweep walks (a RadixCache, or an SWARadixCache's full slots), or None."""

    def scheduler_stream_of(self, scheduler) -> Callable[[], torch.cuda.Stream | None]: ...

    def sweep_source(self, tree_cache, producer_stream: Callable[[], torch.cuda.Stream | None] | None = None
                     ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | SweepPlan] | None:
        """``() -> (slots, prevs, positions)`` of every slot the prefix cache holds, or a plan of them the source
        keeps up to date (:class:`kvcanary.runtime.sweep.SweepPlan`); None: it cannot be swept."""

    def wrapper_gate(self, inst: Installation) -> Callable[[], WrapperCall]:
        """How kvcanary's ``model.forward`` wrapper classifies each of its calls (``inst.wrapper_call``)."""

    def max_static_tokens(self, server_args) -> int:
        """Most tokens a prefill graph replay hands ``model.forward`` (0: none beyond the pool's slot count)."""


# name -> the parameter names a version module's function must accept (in order).
_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "check_supported": ("server_args",),
    "check_after_initialize": ("runner",),
    "server_args_of": ("runner",),
    "runner_parts": ("runner",),
    "runner_ranks": ("runner",),
    "pool_groups": ("pool", "config", "sliding_window_size", "layers"),
    "batch_view": ("fb", "input_ids", "positions", "ones", "empty"),
    "batch_requests": ("batch",),
    "scheduler_cache": ("scheduler",),
    "radix_cache": ("tree_cache",),
    "scheduler_stream_of": ("scheduler",),
    "sweep_source": ("tree_cache", "producer_stream"),
    "wrapper_gate": ("inst",),
    "max_static_tokens": ("server_args",),
}


def contract_problems(module: ModuleType) -> list[str]:
    """Every way ``module`` misses the contract (empty when it satisfies it)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    name = module.__name__
    problems: list[str] = []
    for attr in ("SGLANG_VERSION", "VERSION_RANGE", "STARTUP_FAILURE_TARGET", "RADIX_CACHE_CLASS"):
        if not isinstance(getattr(module, attr, None), str):
            problems.append(f"{name}.{attr}: expected a str")
    version_range, version = getattr(module, "VERSION_RANGE", None), getattr(module, "SGLANG_VERSION", None)
    if isinstance(version_range, str) and isinstance(version, str):
        try:
            if version not in SpecifierSet(version_range):
                problems.append(f"{name}: SGLANG_VERSION {version} is outside VERSION_RANGE {version_range}")
        except InvalidSpecifier as exc:
            problems.append(f"{name}.VERSION_RANGE: not a PEP 440 specifier set: {exc}")
    hooks = getattr(module, "HOOK_TARGETS", None)
    if not isinstance(hooks, Mapping) or not all(isinstance(t, Target) for t in hooks.values()):
        problems.append(f"{name}.HOOK_TARGETS: expected a mapping of hook name -> Target")
    else:
        unknown = sorted(set(hooks) - set(HOOK_NAMES))
        missing = sorted(REQUIRED_HOOKS - set(hooks))
        if unknown:
            problems.append(f"{name}.HOOK_TARGETS: unknown hook(s) {unknown} (known: {list(HOOK_NAMES)})")
        if missing:
            problems.append(f"{name}.HOOK_TARGETS: missing required hook(s) {missing}")
        if tuple(getattr(module, "TARGETS", ())) != tuple(hooks.values()):
            problems.append(f"{name}.TARGETS: expected HOOK_TARGETS' values in order")
    protect = getattr(module, "PROTECT_HOOK_TARGETS", None)
    if not isinstance(protect, Mapping) or not all(isinstance(t, Target) for t in protect.values()):
        problems.append(f"{name}.PROTECT_HOOK_TARGETS: expected a mapping of protect hook name -> Target (may be "
                        "empty)")
    elif sorted(set(protect) - set(PROTECT_HOOK_NAMES)):
        problems.append(f"{name}.PROTECT_HOOK_TARGETS: unknown hook(s) {sorted(set(protect) - set(PROTECT_HOOK_NAMES))}"
                        f" (known: {list(PROTECT_HOOK_NAMES)})")
    if not isinstance(getattr(module, "POOL_CLASSES", None), PoolClasses):
        problems.append(f"{name}.POOL_CLASSES: expected a PoolClasses")
    if not isinstance(getattr(module, "RADIX_NODE_HOOKS", 0), RadixNodeHooks | None):
        problems.append(f"{name}.RADIX_NODE_HOOKS: expected a RadixNodeHooks or None")
    modes = getattr(module, "FORWARD_MODES", None)
    if not isinstance(modes, Mapping) or not all(isinstance(k, ForwardKind) for k in modes.values()):
        problems.append(f"{name}.FORWARD_MODES: expected a mapping of ForwardMode name -> ForwardKind")
    for fn_name, params in _FUNCTIONS.items():
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            problems.append(f"{name}.{fn_name}: missing (expected a function of {', '.join(params)})")
            continue
        have = list(inspect.signature(fn).parameters)
        missing = [p for p in params if p not in have]
        if missing:
            problems.append(f"{name}.{fn_name}: expected parameters {list(params)}, found {have} (missing: {missing})")
    return problems


def check_version_module(module: ModuleType) -> None:
    """Raise TypeError listing every way ``module`` misses the contract."""
    problems = contract_problems(module)
    if problems:
        raise TypeError("kvcanary: sglang version module does not satisfy the contract: " + "; ".join(problems))
