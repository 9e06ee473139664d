"""Runtime configuration, read from ``KVCANARY_*`` environment variables (SPEC §5).

A plugin cannot add flags to ``sglang.launch_server``, so everything comes from the environment. Parsing
rules, the same for every variable:

* surrounding whitespace is stripped and an empty value means "unset" (the default applies);
* enum values (``KVCANARY_MODE``, ``KVCANARY_REAL_KV``) are case-insensitive;
* a bad value raises ``ValueError`` naming the variable, the allowed values and the value given, e.g.
  ``KVCANARY_MODE: expected one of off, log, raise; got 'loud'``;
* an unknown ``KVCANARY_*`` variable (a typo such as ``KVCANARY_MOD``) is not an error: one WARNING line names
  it. Variables that other modules own (see ``KNOWN_ENV_VARS`` / ``KNOWN_ENV_PREFIXES``) are not flagged.

Defaults and why:

* ``mode=off``: loading the plugin installs nothing unless asked to.
* ``real_kv=partial``: each fingerprint reads the first 16 bytes of every real-KV source per slot, which is
  cheap and still catches KV corruption that leaves the canary records intact (a slot overwritten by another
  request, a bad copy); ``all`` reads every byte and costs a full KV read per checked slot.
* ``sweep_interval=0``: the prefix-cache sweep walks every node of the tree on the host (its slots stay on the
  device), a cost that grows with the cache; off unless asked for.
* ``ring_capacity=1024`` rows (32 KiB), as in SGLang's built-in canary.
* ``stats_every=1000``: one INFO line per 1000 forward steps shows the canary is running at negligible log
  volume; ``0`` turns it off.
* ``health_window=100`` steps, as in SGLang's built-in canary.
* ``drain_every=8``: the host reads the device status (ring index, counters, new violation rows) every 8th
  forward, from a snapshot started one forward earlier. A read costs ~50 us of host time on a slow host (more
  inside a busy engine), which a CPU-bound scheduler loop (a small model with CUDA-graph decode) pays in full;
  every 8th forward keeps it near 1 % of a ~2 ms forward, and a violation is still reported at most 8 forwards
  (a few ms) after the forward that found it. ``1`` reads every forward.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvcanary.layout import RealKvHashMode
from kvcanary.tags import LaunchTag

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVCANARY_"

ENV_MODE = "KVCANARY_MODE"
ENV_REAL_KV = "KVCANARY_REAL_KV"
ENV_SWEEP_INTERVAL = "KVCANARY_SWEEP_INTERVAL"
ENV_RING_CAPACITY = "KVCANARY_RING_CAPACITY"
ENV_STATS_EVERY = "KVCANARY_STATS_EVERY"
ENV_REPORT = "KVCANARY_REPORT"
ENV_VERIFY_TOKENS = "KVCANARY_VERIFY_TOKENS"
ENV_CACHE_DIR = "KVCANARY_CACHE_DIR"
ENV_HEALTH_WINDOW = "KVCANARY_HEALTH_WINDOW"
ENV_DRAIN_EVERY = "KVCANARY_DRAIN_EVERY"

# Every KVCANARY_* variable any kvcanary module reads. Config reads the first block; the second block belongs
# to other modules (kvcanary.jit) and is listed so that it is not reported as unknown.
KNOWN_ENV_VARS: frozenset[str] = frozenset(
    {
        ENV_MODE,
        ENV_REAL_KV,
        ENV_SWEEP_INTERVAL,
        ENV_RING_CAPACITY,
        ENV_STATS_EVERY,
        ENV_REPORT,
        ENV_VERIFY_TOKENS,
        ENV_CACHE_DIR,  # read by kvcanary.jit; Config keeps it for describe()
        ENV_HEALTH_WINDOW,
        ENV_DRAIN_EVERY,
        # owned by kvcanary.jit
        "KVCANARY_CUDA_ARCH",
        "KVCANARY_SANITIZE",
        # owned by the SGLang adapter (kvcanary.sglang.common)
        "KVCANARY_REAL_KV_LAYERS",
    }
)
# Whole families owned by other modules: fault injection (kvcanary.faults) reads KVCANARY_FAULT*.
KNOWN_ENV_PREFIXES: tuple[str, ...] = ("KVCANARY_FAULT",)

# violation_write_index is int32 on the device.
MAX_RING_CAPACITY = (1 << 31) - 1
RANK_PLACEHOLDER = "{rank}"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Mode(enum.Enum):
    """What the canary does: ``off`` installs nothing; ``log`` logs violations; ``raise`` stops the engine."""

    OFF = "off"
    LOG = "log"
    RAISE = "raise"


_REAL_KV_NAMES: dict[str, RealKvHashMode] = {m.name.lower(): m for m in RealKvHashMode}


def _expected_one_of(var: str, allowed: tuple[str, ...] | list[str], raw: str) -> ValueError:
    return ValueError(f"{var}: expected one of {', '.join(allowed)}; got {raw!r}")


def _parse_choice(var: str, raw: str, choices: Mapping[str, object]) -> object:
    value = choices.get(raw.strip().lower())
    if value is None:
        raise _expected_one_of(var, list(choices), raw)
    return value


def _parse_int(var: str, raw: str, *, minimum: int, maximum: int | None = None) -> int:
    text = raw.strip()
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError(f"{var}: expected an integer {bounds}; got {raw!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{var}: expected an integer {bounds}; got {raw!r}")
    return value


def _parse_bool(var: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _expected_one_of(var, ("0", "1", "true", "false", "yes", "no", "on", "off"), raw)


def unknown_env_vars(environ: Mapping[str, str]) -> list[str]:
    """``KVCANARY_*`` names in ``environ`` that no kvcanary module reads (likely typos), sorted."""
    return sorted(
        name
        for name in environ
        if name.startswith(ENV_PREFIX)
        and name not in KNOWN_ENV_VARS
        and not any(name.startswith(p) for p in KNOWN_ENV_PREFIXES)
    )


def _warn_unknown(environ: Mapping[str, str]) -> None:
    unknown = unknown_env_vars(environ)
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(KNOWN_ENV_VARS), n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    logger.warning("kvcanary: ignoring unknown environment variable(s): %s", ", ".join(parts))


@dataclass(frozen=True)
class Config:
    """The canary's runtime settings. Build with ``Config.from_env()``; direct construction validates too."""

    mode: Mode = Mode.OFF
    real_kv: RealKvHashMode = RealKvHashMode.PARTIAL
    sweep_interval: int = 0
    ring_capacity: int = 1024
    stats_every: int = 1000
    report_path: str | None = None
    verify_tokens: bool = False
    cache_dir: str | None = None
    health_window: int = 100
    drain_every: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode: expected a Mode; got {self.mode!r}")
        if not isinstance(self.real_kv, RealKvHashMode):
            raise ValueError(f"real_kv: expected a RealKvHashMode; got {self.real_kv!r}")
        checks = (
            ("sweep_interval", self.sweep_interval, 0, None),
            ("ring_capacity", self.ring_capacity, 1, MAX_RING_CAPACITY),
            ("stats_every", self.stats_every, 0, None),
            ("health_window", self.health_window, 1, None),
            ("drain_every", self.drain_every, 1, None),
        )
        for name, value, minimum, maximum in checks:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an int; got {value!r}")
            if value < minimum or (maximum is not None and value > maximum):
                raise ValueError(f"{name}: out of range; got {value}")
        if self.report_path is not None and not self.report_path:
            raise ValueError("report_path: expected None or a non-empty path")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Read ``KVCANARY_*`` from ``environ`` (default ``os.environ``); see the module docstring for rules."""
        env = os.environ if environ is None else environ
        _warn_unknown(env)

        def get(var: str) -> str | None:
            raw = env.get(var)
            if raw is None or not raw.strip():
                return None
            return raw

        kwargs: dict[str, object] = {}
        if (raw := get(ENV_MODE)) is not None:
            kwargs["mode"] = _parse_choice(ENV_MODE, raw, {m.value: m for m in Mode})
        if (raw := get(ENV_REAL_KV)) is not None:
            kwargs["real_kv"] = _parse_choice(ENV_REAL_KV, raw, _REAL_KV_NAMES)
        if (raw := get(ENV_SWEEP_INTERVAL)) is not None:
            kwargs["sweep_interval"] = _parse_int(ENV_SWEEP_INTERVAL, raw, minimum=0)
        if (raw := get(ENV_RING_CAPACITY)) is not None:
            kwargs["ring_capacity"] = _parse_int(ENV_RING_CAPACITY, raw, minimum=1, maximum=MAX_RING_CAPACITY)
        if (raw := get(ENV_STATS_EVERY)) is not None:
            kwargs["stats_every"] = _parse_int(ENV_STATS_EVERY, raw, minimum=0)
        if (raw := get(ENV_HEALTH_WINDOW)) is not None:
            kwargs["health_window"] = _parse_int(ENV_HEALTH_WINDOW, raw, minimum=1)
        if (raw := get(ENV_DRAIN_EVERY)) is not None:
            kwargs["drain_every"] = _parse_int(ENV_DRAIN_EVERY, raw, minimum=1)
        if (raw := get(ENV_VERIFY_TOKENS)) is not None:
            kwargs["verify_tokens"] = _parse_bool(ENV_VERIFY_TOKENS, raw)
        if (raw := get(ENV_REPORT)) is not None:
            kwargs["report_path"] = os.path.expanduser(raw.strip())
        if (raw := get(ENV_CACHE_DIR)) is not None:
            kwargs["cache_dir"] = raw.strip()
        return cls(**kwargs)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> Config:
        """A copy with some fields changed (validated like the constructor)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        """Whether the canary is installed at all (``mode`` is not ``off``)."""
        return self.mode is not Mode.OFF

    @property
    def real_kv_mode(self) -> int:
        """``real_kv`` as the int the kernels take (``layout.REAL_KV_HASH_MODE_*``)."""
        return int(self.real_kv)

    def expected_launch_tags(self) -> tuple[LaunchTag, ...]:
        """Tags whose kernel_run_counter must advance every health window: verify and write, plus sweep when on.

        Sweep is expected only when ``sweep_interval <= health_window``; a slower sweep cannot be checked
        with this window.
        """
        tags = [LaunchTag.VERIFY, LaunchTag.WRITE]
        if 0 < self.sweep_interval <= self.health_window:
            tags.append(LaunchTag.SWEEP)
        return tuple(tags)

    def report_path_for(self, rank: int) -> str | None:
        """The JSONL report path for one rank: every ``{rank}`` in ``report_path`` replaced by ``rank``.

        Only the literal ``{rank}`` is replaced (other braces are kept as they are); ``None`` when unset.
        """
        if self.report_path is None:
            return None
        return self.report_path.replace(RANK_PLACEHOLDER, str(int(rank)))

    def describe(self) -> str:
        """One line for the startup log."""
        return (
            f"kvcanary config: mode={self.mode.value} real_kv={self.real_kv.name.lower()} "
            f"sweep_interval={self.sweep_interval} ring_capacity={self.ring_capacity} "
            f"stats_every={self.stats_every} health_window={self.health_window} drain_every={self.drain_every} "
            f"verify_tokens={str(self.verify_tokens).lower()} report={self.report_path or '-'} "
            f"cache_dir={self.cache_dir or '-'}"
        )
