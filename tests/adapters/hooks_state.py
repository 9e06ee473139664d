"""Save and restore the sglang attributes kvcanary's hooks patch (HookRegistry has no un-patch; see the notes:
keep originals in a dict, never in a module global, which apply_hooks would rewrite)."""

from __future__ import annotations

import os
import pkgutil

SAVED: dict = {}


def _owner_attr(dotted: str):
    obj_path, attr = dotted.rsplit(".", 1)
    return pkgutil.resolve_name(obj_path), attr


def snapshot(targets) -> dict:
    state = {}
    for dotted in targets:
        owner, attr = _owner_attr(dotted)
        state[dotted] = (owner, attr, owner.__dict__.get(attr))
    return state


def restore(state: dict) -> None:
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.reset()
    for owner, attr, raw in state.values():
        if raw is None:
            if attr in owner.__dict__:
                delattr(owner, attr)
        else:
            setattr(owner, attr, raw)
    plugins._plugins_loaded = False
    _reset_adapter_hooks()


def _reset_adapter_hooks() -> None:
    """The per-process adapter state an earlier test's install left: an EAGLE pool sets ``zero_graph_padding`` on
    the version's one AdapterHooks for the process's life (a test after it would see an EAGLE process)."""
    import sys

    from kvcanary.sglang import fault_hooks
    from kvcanary.sglang.hooks import hooks_for

    for name in ("kvcanary.sglang.v0_5_12", "kvcanary.sglang.v0_5_23"):
        version = sys.modules.get(name)
        if version is not None:
            hooks_for(version).zero_graph_padding = False
            fault_hooks.hooks_for(version).zero_graph_padding = False  # (the layer KVCANARY_FAULT registers)


def all_targets():
    from kvcanary.sglang import v0_5_12

    protect = [t.dotted for t in v0_5_12.PROTECT_HOOK_TARGETS.values()]
    return list(dict.fromkeys([t.dotted for t in v0_5_12.TARGETS] + protect + [v0_5_12.STARTUP_FAILURE_TARGET]))


def is_patched(dotted: str) -> bool:
    owner, attr = _owner_attr(dotted)
    raw = owner.__dict__.get(attr)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    return hasattr(fn, "__wrapped__")


def clear_kvcanary_env(monkeypatch) -> None:
    for k in list(os.environ):
        if k.startswith("KVCANARY_"):
            monkeypatch.delenv(k)
