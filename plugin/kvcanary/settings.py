"""The ``KVCANARY_*`` environment grammar every part of kvcanary reads: the variables' names, the errors that name
them (``ConfigError``), the parsers (integers, choices, booleans, CUDA archs, sanitizers, paths), the canary's
mode (``Mode``) and the unknown-variable warning. No other kvcanary module is imported here, so the kernels' build,
the reporter and the runtime read the same rules from below all of them; ``kvcanary.runtime.config.Config`` puts
them together into the runtime configuration (its docstring lists the rules and the defaults).
"""

from __future__ import annotations

import difflib
import enum
import logging
import os
import re
import stat
from collections.abc import Mapping

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




class ConfigError(ValueError):
    """A bad ``KVCANARY_*`` value; the message starts with the variable's name. A ``ValueError``, so callers that
    catch that keep working; the command line catches this class alone and prints the message as one line, while
    any other exception (a bug) keeps its traceback."""


def _expected_one_of(var: str, allowed: tuple[str, ...] | list[str], raw: str) -> ConfigError:
    return ConfigError(f"{var}: expected one of {', '.join(allowed)}; got {raw!r}")


def parse_choice(var: str, raw: str, choices: Mapping[str, object]) -> object:
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


def parse_bool(var: str, raw: str) -> bool:
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


def warn_unknown_env_vars(environ: Mapping[str, str]) -> None:
    unknown = unknown_env_vars(environ)
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(KNOWN_ENV_VARS), n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    logger.warning("kvcanary: ignoring unknown environment variable(s): %s", ", ".join(parts))
