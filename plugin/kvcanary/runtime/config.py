"""Runtime configuration, read from ``KVCANARY_*`` environment variables (SPEC §5).

A plugin cannot add flags to ``sglang.launch_server``, so everything comes from the environment. Parsing
rules, the same for every variable:

* surrounding whitespace is stripped and an empty value means "unset" (the default applies);
* enum values (``KVCANARY_MODE``, ``KVCANARY_REAL_KV``) are case-insensitive;
* integers are plain ASCII decimal digits with an optional leading sign (``parse_ascii_int``): ``1_000``,
  ``0x10``, ``1e3`` and non-ASCII digits (``'١٠'``) are rejected, although Python's ``int()`` takes some of them;
* a bad value raises ``ConfigError`` (a ``ValueError``) naming the variable, the allowed values and the value
  given, e.g. ``KVCANARY_MODE: expected one of off, log, raise; got 'loud'``; the command line prints it as one
  line;
* ``KVCANARY_REPORT`` may hold ``{rank}`` and no other ``{...}`` (a misspelt ``{rnak}`` is refused, not written
  into a file name);
* when the canary is enabled (``log``/``raise``), the paths are checked too, so a bad one stops start-up
  naming the variable: ``KVCANARY_REPORT`` (``check_report_path``: not a directory, not under ``/proc`` or
  ``/sys``, writable or creatable) and ``KVCANARY_CACHE_DIR`` (``check_cache_dir``: a directory or creatable;
  a read-only existing cache is accepted here, the JIT names the variable if it then has to build there);
  ``KVCANARY_CUDA_ARCH`` and ``KVCANARY_SANITIZE`` (owned by ``kvcanary.kernels.jit``) are checked by
  ``parse_cuda_arch`` and ``parse_sanitize`` in every mode;
* an unknown ``KVCANARY_*`` variable (a typo such as ``KVCANARY_MOD`` or ``KVCANARY_FAULT_EVREY``) is not an
  error: one WARNING line names it. Variables that other modules own are listed by name in ``KNOWN_ENV_VARS``
  (the fault-injection family too), so a typo in them is flagged like any other.

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
* ``protect_hold=false`` (``KVCANARY_PROTECT_HOLD``, protect mode only): the scheduler does not wait for the
  device before it processes a batch's results, so a violation is acted on a drain later (the detection window,
  ``kvcanary.runtime.protect``); ``true`` closes the window at the price of one device sync per batch.
* ``log_repeat_window=1000`` forwards: in ``log`` mode one corrupted slot found again every forward logs one
  line per 1000 forwards with a repeat count instead of one per forward (``kvcanary.report``); the JSONL report
  keeps every row. ``0`` logs every row.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvcanary.kernels.layout import RealKvHashMode
from kvcanary.settings import (
    DEFAULT_LOG_REPEAT_WINDOW,
    ENV_CACHE_DIR,
    ENV_CUDA_ARCH,
    ENV_DRAIN_EVERY,
    ENV_HEALTH_WINDOW,
    ENV_MODE,
    ENV_PROTECT_HOLD,
    ENV_REAL_KV,
    ENV_REPORT,
    ENV_RING_CAPACITY,
    ENV_SANITIZE,
    ENV_STATS_EVERY,
    ENV_SWEEP_INTERVAL,
    ENV_VERIFY_TOKENS,
    MAX_RING_CAPACITY,
    RANK_PLACEHOLDER,
    Mode,
    check_cache_dir,
    check_report_path,
    check_report_placeholders,
    log_repeat_window_from_env,
    parse_bool,
    parse_choice,
    parse_cuda_arch,
    parse_int_env,
    parse_sanitize,
    warn_unknown_env_vars,
)

logger = logging.getLogger(__name__)


_REAL_KV_NAMES: dict[str, RealKvHashMode] = {m.name.lower(): m for m in RealKvHashMode}


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
    log_repeat_window: int = DEFAULT_LOG_REPEAT_WINDOW
    protect_hold: bool = False

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
            ("log_repeat_window", self.log_repeat_window, 0, None),
        )
        for name, value, minimum, maximum in checks:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an int; got {value!r}")
            if value < minimum or (maximum is not None and value > maximum):
                raise ValueError(f"{name}: out of range; got {value}")
        if not isinstance(self.protect_hold, bool):
            raise ValueError(f"protect_hold: expected a bool; got {self.protect_hold!r}")
        if self.report_path is not None and not self.report_path:
            raise ValueError("report_path: expected None or a non-empty path")
        if self.report_path is not None:
            check_report_placeholders(self.report_path, "report_path")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Read ``KVCANARY_*`` from ``environ`` (default ``os.environ``); see the module docstring for rules."""
        env = os.environ if environ is None else environ
        warn_unknown_env_vars(env)

        def get(var: str) -> str | None:
            raw = env.get(var)
            if raw is None or not raw.strip():
                return None
            return raw

        kwargs: dict[str, object] = {}
        if (raw := get(ENV_MODE)) is not None:
            kwargs["mode"] = parse_choice(ENV_MODE, raw, {m.value: m for m in Mode})
        if (raw := get(ENV_REAL_KV)) is not None:
            kwargs["real_kv"] = parse_choice(ENV_REAL_KV, raw, _REAL_KV_NAMES)
        if (raw := get(ENV_SWEEP_INTERVAL)) is not None:
            kwargs["sweep_interval"] = parse_int_env(ENV_SWEEP_INTERVAL, raw, minimum=0)
        if (raw := get(ENV_RING_CAPACITY)) is not None:
            kwargs["ring_capacity"] = parse_int_env(ENV_RING_CAPACITY, raw, minimum=1, maximum=MAX_RING_CAPACITY)
        if (raw := get(ENV_STATS_EVERY)) is not None:
            kwargs["stats_every"] = parse_int_env(ENV_STATS_EVERY, raw, minimum=0)
        if (raw := get(ENV_HEALTH_WINDOW)) is not None:
            kwargs["health_window"] = parse_int_env(ENV_HEALTH_WINDOW, raw, minimum=1)
        if (raw := get(ENV_DRAIN_EVERY)) is not None:
            kwargs["drain_every"] = parse_int_env(ENV_DRAIN_EVERY, raw, minimum=1)
        kwargs["log_repeat_window"] = log_repeat_window_from_env(env)
        if (raw := get(ENV_VERIFY_TOKENS)) is not None:
            kwargs["verify_tokens"] = parse_bool(ENV_VERIFY_TOKENS, raw)
        if (raw := get(ENV_PROTECT_HOLD)) is not None:
            kwargs["protect_hold"] = parse_bool(ENV_PROTECT_HOLD, raw)
        if (raw := get(ENV_REPORT)) is not None:
            check_report_placeholders(raw.strip())  # named as the variable, before the field check below
            kwargs["report_path"] = os.path.expanduser(raw.strip())
        if (raw := get(ENV_CACHE_DIR)) is not None:
            kwargs["cache_dir"] = raw.strip()
        if (raw := get(ENV_CUDA_ARCH)) is not None:
            parse_cuda_arch(raw)  # kvcanary.kernels.jit reads it to build; a typo should stop start-up, not the build
        parse_sanitize(env.get(ENV_SANITIZE))  # likewise
        config = cls(**kwargs)  # type: ignore[arg-type]
        if config.enabled:  # filesystem checks only when something will be opened or built
            if config.report_path is not None:
                check_report_path(config.report_path_for(0), raw=env.get(ENV_REPORT))
            if config.cache_dir is not None:
                check_cache_dir(config.cache_dir, raw=env.get(ENV_CACHE_DIR))
        return config

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


    def report_path_for(self, rank: int) -> str | None:
        """The JSONL report path for one rank: every ``{rank}`` in ``report_path`` replaced by ``rank``.

        ``{rank}`` is the only placeholder (the constructor refuses any other ``{...}``); ``None`` when unset.
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
            f"log_repeat_window={self.log_repeat_window} "
            f"verify_tokens={str(self.verify_tokens).lower()} report={self.report_path or '-'} "
            f"cache_dir={self.cache_dir or '-'}"
            + (f" protect_hold={str(self.protect_hold).lower()}" if self.mode is Mode.PROTECT else "")
        )
