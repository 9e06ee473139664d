"""Hook targets: a :class:`Target` names one sglang callable and the parameters a hook relies on;
:func:`resolve_target` checks it against the installed sglang before anything is patched, and
:func:`register_hooks` hands the hooks to sglang's ``HookRegistry`` (sglang's ``load_plugins`` applies them)."""

from __future__ import annotations

import inspect
import logging
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class HookTargetError(RuntimeError):
    """A hook target is missing from the installed sglang or has unexpected parameters."""


@dataclass(frozen=True)
class Target:
    dotted: str
    hook_type: str  # HookType member name
    params: tuple[str, ...]  # parameter names the hook relies on (the first is self/cls)
    classmethod: bool = False


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
            raise HookTargetError(
                f"sglang hook target {target.dotted}: expected a classmethod, got {type(raw).__name__}"
            )
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


def register_hooks(table: Sequence[tuple[Target, Callable]]) -> None:
    """Verify every target of ``table``, then register each hook once (a second call in the same process, e.g.
    a second ``load_plugins()``, registers nothing twice: the hooks are the same objects)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, _ in table:
        resolve_target(target)  # all verified before the first is registered
    for target, hook in table:
        if any(h is hook for _, h, _ in HookRegistry._hooks.get(target.dotted, [])):
            continue  # registered already in this process
        HookRegistry.register(target.dotted, hook, HookType[target.hook_type])
