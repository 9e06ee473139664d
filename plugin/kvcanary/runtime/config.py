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
import difflib
import enum
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from kvcanary.kernels.layout import RealKvHashMode

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
ENV_LOG_REPEAT_WINDOW = "KVCANARY_LOG_REPEAT_WINDOW"
ENV_PROTECT_HOLD = "KVCANARY_PROTECT_HOLD"
# Read by other modules; named here so that Config can check them at start-up and the typo check knows them.
ENV_CUDA_ARCH = "KVCANARY_CUDA_ARCH"  # kvcanary.kernels.jit
ENV_SANITIZE = "KVCANARY_SANITIZE"  # kvcanary.kernels.jit
ENV_REAL_KV_LAYERS = "KVCANARY_REAL_KV_LAYERS"  # the SGLang adapter (kvcanary.sglang.common)
# Fault injection (kvcanary.runtime.faults, tests only); listed one by one so that a typo in the family is flagged.
FAULT_ENV_VARS: tuple[str, ...] = (
    "KVCANARY_FAULT",
    "KVCANARY_FAULT_EVERY",
    "KVCANARY_FAULT_WARMUP",
    "KVCANARY_FAULT_SEED",
    "KVCANARY_FAULT_RANK",
)

# Every KVCANARY_* variable any kvcanary module reads. Config reads the first block; the others belong to other
# modules and are listed so that they are not reported as unknown (tests pin each module's names against this).
KNOWN_ENV_VARS: frozenset[str] = frozenset(
    {
        ENV_MODE,
        ENV_REAL_KV,
        ENV_SWEEP_INTERVAL,
        ENV_RING_CAPACITY,
        ENV_STATS_EVERY,
        ENV_REPORT,
        ENV_VERIFY_TOKENS,
        ENV_CACHE_DIR,  # read by kvcanary.kernels.jit; Config keeps it for describe() and checks it at start-up
        ENV_HEALTH_WINDOW,
        ENV_DRAIN_EVERY,
        ENV_LOG_REPEAT_WINDOW,
        ENV_PROTECT_HOLD,
        ENV_CUDA_ARCH,
        ENV_SANITIZE,
        ENV_REAL_KV_LAYERS,
        *FAULT_ENV_VARS,
    }
)
# Whole families of variables owned by other modules (none today: every name is listed in KNOWN_ENV_VARS).
KNOWN_ENV_PREFIXES: tuple[str, ...] = ()

# violation_write_index is int32 on the device.
MAX_RING_CAPACITY = (1 << 31) - 1
RANK_PLACEHOLDER = "{rank}"
REPORT_PLACEHOLDERS: tuple[str, ...] = (RANK_PLACEHOLDER,)  # what report_path_for expands
_PLACEHOLDER_RE = re.compile(r"\{[^{}]*\}")
# KVCANARY_SANITIZE values kvcanary.kernels.jit knows how to build (its flag table is keyed by the same names).
SANITIZERS: tuple[str, ...] = ("address",)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Mode(enum.Enum):
    """What the canary does: ``off`` installs nothing; ``log`` logs violations; ``raise`` stops the engine;
    ``protect`` logs like ``log`` and acts on each violation (the request recomputed or aborted, the prefix-cache
    nodes holding bad slots evicted: :mod:`kvcanary.runtime.protect`), and keeps serving like ``log``."""

    OFF = "off"
    LOG = "log"
    RAISE = "raise"
    PROTECT = "protect"

    @property
    def keeps_serving(self) -> bool:
        """Whether nothing the canary does may stop serving (``log`` and ``protect``)."""
        return self is Mode.LOG or self is Mode.PROTECT


_REAL_KV_NAMES: dict[str, RealKvHashMode] = {m.name.lower(): m for m in RealKvHashMode}


class ConfigError(ValueError):
    """A bad ``KVCANARY_*`` value; the message starts with the variable's name. A ``ValueError``, so callers that
    catch that keep working; the command line catches this class alone and prints the message as one line, while
    any other exception (a bug) keeps its traceback."""


def _expected_one_of(var: str, allowed: tuple[str, ...] | list[str], raw: str) -> ConfigError:
    return ConfigError(f"{var}: expected one of {', '.join(allowed)}; got {raw!r}")


def _parse_choice(var: str, raw: str, choices: Mapping[str, object]) -> object:
    value = choices.get(raw.strip().lower())
    if value is None:
        raise _expected_one_of(var, list(choices), raw)
    return value


_ASCII_INT_RE = re.compile(r"[+-]?[0-9]+")


def parse_ascii_int(text: str) -> int:
    """``text`` (surrounding whitespace ignored) as a base-10 int: ASCII digits with an optional leading sign.

    ``int()`` also takes ``1_000`` and non-ASCII digits (``'١٠'``); an environment variable should not.
    Raises ``ValueError`` (without naming a variable: callers add it).
    """
    stripped = text.strip()
    if not _ASCII_INT_RE.fullmatch(stripped):
        raise ValueError(f"expected ASCII decimal digits with an optional sign; got {text!r}")
    return int(stripped, 10)


def parse_int_env(var: str, raw: str, *, minimum: int, maximum: int | None = None) -> int:
    """``raw`` as an int in ``[minimum, maximum]``; a bad value raises ``ConfigError`` naming ``var``, e.g.
    ``KVCANARY_STATS_EVERY: expected an integer >= 0; got '1_000'``."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    try:
        value = parse_ascii_int(raw)
    except ValueError:
        raise ConfigError(f"{var}: expected an integer {bounds}; got {raw!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(f"{var}: expected an integer {bounds}; got {raw!r}")
    return value


# -- KVCANARY_CUDA_ARCH ------------------------------------------------------------------------------------
# One arch: "9.0", "9.0a", "10.0f", "90", "90a", "100a", "sm_90a", "sm90a", "compute_90a" (any case). The last
# digit of a dot-less number is the minor version, as in nvcc's sm_XY names. Suffix "a" (arch-specific) or "f"
# (family, CUDA >= 12.9).
_CUDA_ARCH_RE = re.compile(
    r"(?:sm_?|compute_?)?"
    r"(?:(?P<major>[0-9]{1,2})\.(?P<minor>[0-9])|(?P<packed>[0-9]{2,3}))"
    r"(?P<suffix>[af]?)"
)
CUDA_ARCH_EXAMPLES = "9.0, 9.0a, 90, 90a, sm_90a, 100a, 10.0f"


def parse_cuda_arch(raw: str, var: str = ENV_CUDA_ARCH) -> str:
    """``KVCANARY_CUDA_ARCH`` in the ``major.minor[suffix]`` form tvm-ffi's ``TVM_FFI_CUDA_ARCH_LIST`` takes.

    Accepts one arch or several separated by spaces or commas (``"8.9 9.0a"``, as tvm-ffi does); returns them
    normalised and space-separated (``"sm_90a"`` → ``"9.0a"``, ``"100a"`` → ``"10.0a"``). A bad value raises
    ``ConfigError`` naming ``var`` and the accepted forms.
    """
    parts = [p for p in re.split(r"[\s,]+", raw.strip()) if p]
    if not parts:
        raise ConfigError(f"{var}: expected a CUDA arch such as {CUDA_ARCH_EXAMPLES}; got {raw!r}")
    out: list[str] = []
    for part in parts:
        match = _CUDA_ARCH_RE.fullmatch(part.lower())
        if match is None or not part.isascii():
            raise ConfigError(f"{var}: expected a CUDA arch such as {CUDA_ARCH_EXAMPLES}; got {raw!r}")
        if match["packed"] is not None:
            major, minor = match["packed"][:-1], match["packed"][-1]
        else:
            major, minor = match["major"], match["minor"]
        if int(major) == 0:
            raise ConfigError(f"{var}: expected a CUDA arch such as {CUDA_ARCH_EXAMPLES}; got {raw!r}")
        out.append(f"{int(major)}.{minor}{match['suffix']}")
    return " ".join(dict.fromkeys(out))


def parse_sanitize(raw: str | None, var: str = ENV_SANITIZE) -> str | None:
    """``KVCANARY_SANITIZE``: one of ``SANITIZERS``, or None when unset or blank; else ``ConfigError`` naming
    ``var``. Checked at start-up, not first when the CPU build runs (after the engine has loaded its model)."""
    value = (raw or "").strip()
    if not value:
        return None
    if value not in SANITIZERS:
        raise ConfigError(f"{var}: expected one of {', '.join(SANITIZERS)} or unset; got {raw!r}")
    return value


def check_report_placeholders(path: str, var: str = ENV_REPORT) -> None:
    """Every ``{...}`` in a report path must be a known placeholder (``REPORT_PLACEHOLDERS``): a misspelt
    ``{rnak}`` would otherwise be written into the file name. ``ConfigError`` naming ``var`` and the known ones."""
    unknown = [m for m in _PLACEHOLDER_RE.findall(path) if m not in REPORT_PLACEHOLDERS]
    if unknown:
        raise ConfigError(
            f"{var}: unknown placeholder {', '.join(dict.fromkeys(unknown))}; the known placeholders are "
            f"{', '.join(REPORT_PLACEHOLDERS)}; got {path!r}"
        )


# -- paths ---------------------------------------------------------------------------------------------------
# Kernel pseudo-file systems: a "file" there is a kernel interface, never a report.
_PSEUDO_FS_ROOTS = ("/proc", "/sys")


def _nearest_existing(path: str) -> str:
    """``path`` or its nearest existing ancestor."""
    current = path
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _check_creatable(var: str, raw: str, path: str, what: str) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a directory we may create entries in."""
    ancestor = _nearest_existing(os.path.dirname(path))
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{var}: cannot create {what} {path!r}: {ancestor!r} is not a directory; got {raw!r}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{var}: cannot create {what} {path!r}: directory {ancestor!r} is not writable; got {raw!r}"
        )


def check_report_path(path: str, var: str = ENV_REPORT, raw: str | None = None) -> None:
    """Start-up check of a (rank-formatted) JSONL report path; ``ConfigError`` naming ``var`` when it cannot work.

    Rejected: a directory; anything under ``/proc`` or ``/sys``; an existing file we may not write; a missing
    file whose nearest existing ancestor is not a writable directory. Character devices (``/dev/stdout``,
    ``/dev/null``) and FIFOs are accepted. ``Reporter`` opens the file right after, and names ``var`` too if that
    still fails.
    """
    raw = path if raw is None else raw
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        # a stream (/dev/stdout, /dev/null, a pipe): even when its link resolves under /proc
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{var}: {path!r} is not writable; got {raw!r}")
        return
    real = os.path.realpath(path)
    for root in _PSEUDO_FS_ROOTS:
        if real == root or real.startswith(root + "/"):
            raise ConfigError(
                f"{var}: {path!r} is under {root}, a kernel pseudo-file system; expected a path for a JSONL "
                f"file, e.g. /var/log/kvcanary-{{rank}}.jsonl; got {raw!r}"
            )
    if os.path.isdir(real):
        raise ConfigError(
            f"{var}: {path!r} is a directory; expected a file path, e.g. "
            f"{os.path.join(path, 'kvcanary-{rank}.jsonl')}; got {raw!r}"
        )
    if os.path.exists(real):
        if not os.access(real, os.W_OK):
            raise ConfigError(f"{var}: {path!r} is not writable; got {raw!r}")
        return
    _check_creatable(var, raw, real, "the report file")


def check_cache_dir(path: str, var: str = ENV_CACHE_DIR, raw: str | None = None) -> None:
    """Start-up check of the JIT build cache directory; ``ConfigError`` naming ``var`` when it cannot work.

    It must be a directory or creatable (its nearest existing ancestor a writable directory). An existing
    directory that is not writable is accepted: a prebuilt, read-only cache is fine, and ``kvcanary.kernels.jit``
    names ``var`` if it then has to build there.
    """
    raw = path if raw is None else raw
    real = os.path.realpath(os.path.expanduser(path))
    if os.path.exists(real):
        if not os.path.isdir(real):
            raise ConfigError(f"{var}: {path!r} is not a directory; got {raw!r}")
        return
    _check_creatable(var, raw, real, "the cache directory")


DEFAULT_LOG_REPEAT_WINDOW = 1000


def log_repeat_window_from_env(environ: Mapping[str, str] | None = None) -> int:
    """``KVCANARY_LOG_REPEAT_WINDOW`` alone (default 1000), by the same rules as ``Config.from_env``: what a
    ``Reporter`` built without an explicit window uses, so engines that build one from the mode and path only
    still honour the variable."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_LOG_REPEAT_WINDOW)
    if raw is None or not raw.strip():
        return DEFAULT_LOG_REPEAT_WINDOW
    return parse_int_env(ENV_LOG_REPEAT_WINDOW, raw, minimum=0)


def _parse_bool(var: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _expected_one_of(var, ("0", "1", "true", "false", "yes", "no", "on", "off"), raw)


def unknown_env_vars(environ: Mapping[str, str]) -> list[str]:
    """``KVCANARY_*`` names in ``environ`` that no kvcanary module reads (likely typos, e.g.
    ``KVCANARY_FAULT_EVREY``), sorted."""
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
            kwargs["verify_tokens"] = _parse_bool(ENV_VERIFY_TOKENS, raw)
        if (raw := get(ENV_PROTECT_HOLD)) is not None:
            kwargs["protect_hold"] = _parse_bool(ENV_PROTECT_HOLD, raw)
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
