"""The SGLang adapter: an ``sglang.srt.plugins`` entry point (SPEC §6). The only kvcanary code that imports sglang.

``register()`` is the entry point (``kvcanary = kvcanary.sglang:register``). sglang calls it in every process that
loads plugins (the launcher, the engine, each scheduler/TP subprocess, and in later versions the data-parallel
controller and the detokenizer), so it must behave the same everywhere, be cheap and idempotent, and need
neither a GPU nor a ModelRunner:

* ``KVCANARY_MODE`` unset or ``off``: one INFO line, nothing imported from sglang, nothing patched;
* otherwise the installed sglang version is looked up in :data:`SUPPORTED` (an unsupported one is refused by
  name, with the supported ranges), the whole ``KVCANARY_*`` configuration is validated (``Config.from_env`` and
  the adapter's own variables), every hook target of that version is resolved and its parameters checked, and the
  hooks are registered with ``sglang.srt.plugins.hook_registry.HookRegistry`` (sglang applies them). Nothing is
  built until sglang calls a hook (``ModelRunner.init_memory_pool``).

sglang's ``load_plugins()`` logs and swallows exceptions raised by a plugin, so an error here would not stop the
server on its own: on any error ``register()`` also registers a hook on ``ModelRunner.__init__`` that raises
the same error, so the scheduler process (and the launch) stops with a message naming the variable or target.

Layout: this module (entry point, version table); ``contract`` (what a version module provides); ``base`` (the
defaults every supported version shares); one thin module per version stating only what differs from them
(``v0_5_12``, ``v0_5_23``); the shared pieces ``targets`` (hook targets, registration), ``hooks`` (hook bodies,
install), ``installed`` (where a runner's Installation lives), ``guards``, ``pools``, ``batches``, ``radix``,
``tokens``, ``ranks`` and ``fault_injection``; the engine-agnostic per-runner glue is
:mod:`kvcanary.runtime.installation`.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

from kvcanary.settings import ENV_MODE

logger = logging.getLogger("kvcanary.sglang")


@dataclass(frozen=True)
class SupportedVersion:
    """One row of the version contract: the sglang versions (a PEP 440 specifier set) one module serves."""

    versions: str
    module: str


# The supported sglang versions, each range served by one version module. A version outside every range is
# refused at start-up (never served by the nearest module): hook targets move between releases.
SUPPORTED: tuple[SupportedVersion, ...] = (
    SupportedVersion(">=0.5.12,<0.5.13", "kvcanary.sglang.v0_5_12"),
    SupportedVersion(">=0.5.23,<0.5.24", "kvcanary.sglang.v0_5_23"),
)


class UnsupportedVersionError(RuntimeError):
    """The installed sglang is outside every supported range; the message names it and the ranges."""


def supported_ranges() -> str:
    return ", ".join(f"sglang{row.versions}" for row in SUPPORTED)


def _sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:  # an uninstalled source checkout of sglang
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))


def module_name_for(sglang_version: str) -> str:
    """The version module serving ``sglang_version``; UnsupportedVersionError naming it and the supported ranges."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(sglang_version)
    except InvalidVersion:
        parsed = None
    for row in SUPPORTED:
        if parsed is not None and SpecifierSet(row.versions).contains(parsed, prereleases=True):
            return row.module
    raise UnsupportedVersionError(
        f"sglang {sglang_version} is not supported by this kvcanary (supported: {supported_ranges()}); install a "
        "supported sglang, a kvcanary that supports this one, or unset KVCANARY_MODE"
    )


def version_module(sglang_version: str | None = None) -> ModuleType:
    """The adapter module for the installed sglang (or ``sglang_version``); refuses an unsupported version."""
    v = _sglang_version() if sglang_version is None else sglang_version
    return importlib.import_module(module_name_for(v))


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
        _register_version(adapter)
    except Exception as exc:
        logger.error("kvcanary: start-up refused: %s", exc)
        _stop_startup_later(exc, adapter)
        raise


def _register_version(adapter: ModuleType) -> None:
    """Validate the configuration, verify every target of ``adapter``, register its hooks."""
    from kvcanary.runtime.config import Config
    from kvcanary.settings import Mode
    from kvcanary.sglang.fault_injection import fault_plan_from_env
    from kvcanary.sglang.hooks import hooks_for
    from kvcanary.sglang.pools import parse_real_kv_layers
    from kvcanary.sglang.targets import register_hooks

    config = Config.from_env()
    parse_real_kv_layers()
    if fault_plan_from_env() is not None:  # KVCANARY_FAULT: the fault-injection layer instead of the plain hooks
        from kvcanary.sglang.fault_hooks import hooks_for as fault_hooks_for

        table = fault_hooks_for(adapter).table
    else:
        table = hooks_for(adapter).table
    if config.mode is Mode.PROTECT:  # (its hooks are registered in protect mode only; refused where there are none)
        from kvcanary.sglang.protect import hooks_for as protect_hooks_for

        table = table + protect_hooks_for(adapter).table
    register_hooks(table)
    logger.info("kvcanary: SGLang %s adapter registered %d hooks; %s", adapter.SGLANG_VERSION, len(table),
                config.describe())


def _stop_startup_later(exc: Exception, adapter: ModuleType | None) -> None:
    """Make the error fatal even though sglang's plugin loader swallows it: raise it again from ModelRunner.__init__."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception:  # no sglang at all: nothing will start anyway
        return
    target = getattr(adapter, "STARTUP_FAILURE_TARGET", "sglang.srt.model_executor.model_runner.ModelRunner.__init__")
    if any(getattr(h, "kvcanary_startup_failure", False) for _, h, _ in HookRegistry._hooks.get(target, [])):
        return  # a second register() in this process: the first refusal stands
    message = f"kvcanary refused to start: {exc}"

    def refuse_startup(*args, **kwargs):
        same_type = isinstance(exc, (ValueError, RuntimeError, NotImplementedError))
        raise type(exc)(message) if same_type else RuntimeError(message)

    refuse_startup.kvcanary_startup_failure = True  # type: ignore[attr-defined]
    HookRegistry.register(target, refuse_startup, HookType.BEFORE)


__all__ = ["register", "version_module", "module_name_for", "SUPPORTED", "SupportedVersion", "UnsupportedVersionError"]
