"""The SGLang adapter: an ``sglang.srt.plugins`` entry point (SPEC §6). The only kvcanary code that imports sglang.

``register()`` is the entry point (``kvcanary = kvcanary.sglang:register``). sglang calls it in every process that
loads plugins (the launcher, the engine and each scheduler/TP subprocess), so it must behave the same everywhere:

* ``KVCANARY_MODE`` unset or ``off``: one INFO line, nothing imported from sglang, nothing patched;
* otherwise the whole ``KVCANARY_*`` configuration is validated (``Config.from_env`` and the adapter's own
  variables), every hook target of the installed sglang version is resolved and its parameters checked, and
  the hooks are registered with ``sglang.srt.plugins.hook_registry.HookRegistry`` (sglang applies them).

sglang's ``load_plugins()`` logs and swallows exceptions raised by a plugin, so an error here would not stop the
server on its own: on any error ``register()`` also registers a hook on ``ModelRunner.__init__`` that raises
the same error, so the scheduler process (and the launch) stops with a message naming the variable or target.

Every fact about one sglang version (hook targets, attribute names, forward-mode mapping, pools, guards) lives
in one module per version (``kvcanary.sglang.v0_5_12``); ``version_module()`` picks it.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

from kvcanary.config import ENV_MODE

logger = logging.getLogger("kvcanary.sglang")

# sglang version -> adapter module. A later version gets its own module beside v0_5_12.
SUPPORTED_VERSIONS: dict[str, str] = {"0.5.12": "kvcanary.sglang.v0_5_12"}
DEFAULT_VERSION = "0.5.12"


def _sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:  # an uninstalled source checkout of sglang
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))


def version_module(sglang_version: str | None = None) -> ModuleType:
    """The adapter module for the installed sglang (the 0.5.12 one, with a warning, for an unknown version:
    its hook targets are still verified one by one, so a mismatch fails loudly)."""
    v = _sglang_version() if sglang_version is None else sglang_version
    name = SUPPORTED_VERSIONS.get(v)
    if name is None:
        logger.warning(
            "kvcanary: sglang %s is not a tested version (tested: %s); using the %s adapter, whose hook targets "
            "are verified before anything is patched", v, ", ".join(SUPPORTED_VERSIONS), DEFAULT_VERSION,
        )
        name = SUPPORTED_VERSIONS[DEFAULT_VERSION]
    return importlib.import_module(name)


def _mode_is_off() -> bool:
    raw = os.environ.get(ENV_MODE)
    return raw is None or not raw.strip() or raw.strip().lower() == "off"


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (see the module docstring)."""
    if _mode_is_off():
        logger.info("kvcanary: %s is unset or off; the SGLang plugin installs nothing", ENV_MODE)
        return
    adapter = None
    try:
        adapter = version_module()
        adapter.register_hooks()
    except Exception as exc:
        logger.error("kvcanary: start-up refused: %s", exc)
        _stop_startup_later(exc, adapter)
        raise


def _stop_startup_later(exc: Exception, adapter: ModuleType | None) -> None:
    """Make the error fatal even though sglang's plugin loader swallows it: raise it again from ModelRunner.__init__."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception:  # no sglang at all: nothing will start anyway
        return
    target = getattr(adapter, "STARTUP_FAILURE_TARGET", "sglang.srt.model_executor.model_runner.ModelRunner.__init__")
    message = f"kvcanary refused to start: {exc}"

    def refuse_startup(*args, **kwargs):
        raise type(exc)(message) if isinstance(exc, (ValueError, RuntimeError, NotImplementedError)) else RuntimeError(message)

    refuse_startup.kvcanary_startup_failure = True  # type: ignore[attr-defined]
    HookRegistry.register(target, refuse_startup, HookType.BEFORE)


__all__ = ["register", "version_module", "SUPPORTED_VERSIONS"]
