"""Build and load the kernels: the export units (``csrc/export_*.cc``, one per kernel) built for CPU (g++) and
CUDA (nvcc) through tvm-ffi into one module per backend, cached under a project-owned directory keyed by the
sources' content. The units compile in parallel (ninja: one job per core, ``MAX_JOBS`` caps it), so a cold CUDA
build takes about as long as its slowest unit.

Cache layout: ``$KVCANARY_CACHE_DIR`` (default ``~/.cache/kvcanary``) /
``<kvcanary version>-<sha256 of include/ + csrc/ contents>`` / ``<backend>-<arch>-tvmffi<version>``.
A finished build leaves a ``.complete`` marker; a warm load only dlopens the ``.so``.

Environment (checked here and, at start-up, by ``kvcanary.runtime.config.Config.from_env``; a bad value is a
``kvcanary.settings.ConfigError`` naming the variable): ``KVCANARY_CACHE_DIR`` must be a directory or creatable,
and writable when a build is needed (a prebuilt read-only cache only loads); ``KVCANARY_CUDA_ARCH`` is one or
more archs in any of the forms ``9.0``, ``9.0a``, ``90``, ``90a``, ``sm_90a``, ``100a``, ``10.0f``
(``kvcanary.settings.parse_cuda_arch``), normalised to ``major.minor[a|f]`` for tvm-ffi; ``KVCANARY_SANITIZE``
is ``address`` or unset (``kvcanary.settings.parse_sanitize``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcanary.settings import ConfigError, check_cache_dir, parse_cuda_arch, parse_sanitize

logger = logging.getLogger(__name__)

BACKENDS = ("cpu", "cuda")
MODULE_NAME = "kvcanary_ops"
EXPORT_GLOB = "export_*.cc"  # the export translation units in csrc/ (csrc/export_shims.h)
CACHE_DIR_ENV = "KVCANARY_CACHE_DIR"
CUDA_ARCH_ENV = "KVCANARY_CUDA_ARCH"
MAX_JOBS_ENV = "MAX_JOBS"  # tvm-ffi's (and torch's) cap on a build's parallel compiles
SANITIZE_ENV = "KVCANARY_SANITIZE"  # "address": CPU build under AddressSanitizer (tests; needs libasan preloaded)
# Keyed by kvcanary.settings.SANITIZERS (the values start-up accepts; tests/test_cli_papercuts.py pins the two
# together).
_SANITIZE_FLAGS = {"address": ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]}
# The progress line's estimate of a cold build, export units in parallel: CPU 15 s and CUDA 33 s on the 16-core H200
# machine (2026-12-02), CPU 30-35 s on a 2-core box; rounded up towards the smaller machines.
TYPICAL_BUILD_SECONDS = {"cpu": 30, "cuda": 40}
_COMPLETE_MARKER = ".complete"
_CXX_STD = "-std=c++17"
_OPT = "-O3"

_modules: dict[str, Any] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class BuildInfo:
    """Where and how one backend was built (or found)."""

    backend: str
    arch: str
    directory: Path
    library: Path
    seconds: float
    cached: bool


_build_info: dict[str, BuildInfo] = {}


def source_root() -> Path:
    """Directory holding ``include/`` and ``csrc/``: the installed package, else the repository root."""
    here = Path(__file__).resolve().parents[1]  # the kvcanary package (this file is kvcanary/kernels/jit.py)
    for candidate in (here, here.parent.parent):  # the wheel's kvcanary/, else the checkout's root above plugin/
        if (candidate / "include" / "kvcanary").is_dir() and export_units(candidate):
            return candidate
    raise FileNotFoundError(
        f"kvcanary: cannot find include/ and csrc/ next to {here} or in the repository root; "
        "reinstall kvcanary (the wheel must carry them)"
    )


def export_units(root: Path) -> list[Path]:
    """The export translation units under ``root/csrc``, in a fixed order."""
    return sorted((root / "csrc").glob(EXPORT_GLOB))


def source_digest(root: Path | None = None) -> str:
    """sha256 over the relative paths and contents of include/ and csrc/ (first 16 hex digits)."""
    root = root or source_root()
    h = hashlib.sha256()
    for sub in ("include", "csrc"):
        for path in sorted((root / sub).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(path.relative_to(root).as_posix().encode())
                h.update(b"\0")
                h.update(path.read_bytes())
                h.update(b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """``$KVCANARY_CACHE_DIR`` (``~`` expanded), else ``~/.cache/kvcanary``; ``ValueError`` naming the variable
    when it is set to something that is not (and cannot become) a directory."""
    raw = os.environ.get(CACHE_DIR_ENV)
    if raw and raw.strip():
        check_cache_dir(raw.strip(), CACHE_DIR_ENV, raw)
        return Path(raw.strip()).expanduser()
    return Path.home() / ".cache" / "kvcanary"


def _make_build_directory(directory: Path) -> None:
    """``mkdir -p`` of a build directory, with a failure that names the cache variable (not a bare OSError)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        writable = os.access(directory, os.W_OK | os.X_OK)
    except OSError as exc:
        raise ConfigError(
            f"{CACHE_DIR_ENV}: cannot create the build directory {str(directory)!r} under the kernel cache "
            f"{str(cache_root())!r}: {exc.strerror or exc}; point {CACHE_DIR_ENV} at a writable directory"
        ) from exc
    if not writable:
        raise ConfigError(
            f"{CACHE_DIR_ENV}: the build directory {str(directory)!r} is not writable and holds no finished build; "
            f"point {CACHE_DIR_ENV} at a writable directory"
        )


def _package_version() -> str:
    from kvcanary import __version__

    return __version__


def _tvm_ffi_version() -> str:
    import tvm_ffi

    return str(getattr(tvm_ffi, "__version__", "unknown"))


def cuda_arch() -> str:
    """Arch for nvcc: ``$KVCANARY_CUDA_ARCH`` (normalised, e.g. ``sm_90a`` → ``9.0a``; a bad value raises
    ``ValueError`` naming the variable), else the current GPU's (``9.0a`` on Hopper), else ``9.0a``.

    tvm-ffi's own detection picks sm_90 on an H200 (no wgmma/TMA), so the arch is always set here.
    """
    explicit = os.environ.get(CUDA_ARCH_ENV)
    if explicit and explicit.strip():
        return parse_cuda_arch(explicit, CUDA_ARCH_ENV)
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor}{'a' if major == 9 else ''}"
    except Exception as exc:  # noqa: BLE001 - a broken CUDA setup must not hide the fallback
        logger.debug("kvcanary: could not query the CUDA device capability: %s", exc)
    return "9.0a"


def sanitizer() -> str | None:
    """The sanitizer the CPU build is instrumented with (``$KVCANARY_SANITIZE``), if any."""
    return parse_sanitize(os.environ.get(SANITIZE_ENV), SANITIZE_ENV)


def build_directory(backend: str, arch: str | None = None) -> Path:
    _check_backend(backend)
    if backend == "cpu":
        san = sanitizer()
        tag = f"cpu-{san}" if san else "cpu"
    else:
        archs = parse_cuda_arch(arch, "arch") if arch else cuda_arch()
        tag = f"cuda-sm{archs.replace('.', '').replace(' ', '-')}"
    return cache_root() / f"{_package_version()}-{source_digest()}" / f"{tag}-tvmffi{_tvm_ffi_version()}"


def build_jobs() -> int:
    """How many compiles a build may run at once: ``$MAX_JOBS`` (tvm-ffi passes it to ninja as ``-j``), else the
    machine's cores."""
    raw = os.environ.get(MAX_JOBS_ENV, "").strip()
    if raw:
        try:
            jobs = int(raw)
        except ValueError:
            jobs = 0
        if jobs < 1:
            raise ConfigError(f"{MAX_JOBS_ENV}: expected a positive integer (compiles at once), got {raw!r}")
        return jobs
    return os.cpu_count() or 1


# One export unit inside the single file of a one-job build, as it would be compiled apart: csrc/export_shims.h
# builds what follows it at -O1 for g++ (the shims) and a GCC optimize pragma holds to the end of the file, so each
# unit runs between a push and a pop of the options (the next unit's kernel header is built at -O3 again), and the
# shims header's include guard is dropped before each unit so that it sets -O1 for every unit's shims.
_UNIT_IN_ONE_FILE = """#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC push_options
#endif
#undef KVCANARY_EXPORT_SHIMS_H_
#include "{unit}"
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC pop_options
#endif
"""


def compile_units(units: list[Path], directory: Path, suffix: str) -> list[str]:
    """The files the build compiles: one per export unit, or with a single job one file including them all (the
    units share their headers, so compiling them apart costs ~1.4x the CPU time: worth it only in parallel).

    A file is written into the build directory (``suffix`` ".cu": nvcc compiles a ``.cc`` file as host code only, so
    the CUDA build reaches each unit through a file whose suffix says CUDA); a CPU unit compiled apart is used as is.
    """
    groups = [[unit] for unit in units] if build_jobs() > 1 else [units]
    files = []
    for group in groups:
        if len(group) == 1 and suffix == ".cc":
            files.append(str(group[0]))
            continue
        stem = group[0].stem if len(group) == 1 else "export_all"
        wrapper = directory / f"{stem}{suffix}"
        text = (f'#include "{group[0].name}"\n' if len(group) == 1
                else "".join(_UNIT_IN_ONE_FILE.format(unit=unit.name) for unit in group))
        if not wrapper.is_file() or wrapper.read_text() != text:
            wrapper.write_text(text)
        files.append(str(wrapper))
    return files


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"kvcanary: backend: expected one of {BACKENDS}, got {backend!r}")


@contextlib.contextmanager
def _toolchain_env(backend: str, arch: str) -> Iterator[None]:
    """PATH with ninja, and for CUDA: CUDA_HOME and tvm-ffi's arch list. Restored afterwards."""
    saved = {k: os.environ.get(k) for k in ("PATH", "CUDA_HOME", "TVM_FFI_CUDA_ARCH_LIST")}
    try:
        if shutil.which("ninja") is None:
            try:
                import ninja

                os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
            except ImportError as exc:
                raise RuntimeError("kvcanary: the ninja build tool is missing; pip install ninja") from exc
        if backend == "cuda":
            if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH") and Path("/usr/local/cuda").is_dir():
                os.environ["CUDA_HOME"] = "/usr/local/cuda"
            os.environ["TVM_FFI_CUDA_ARCH_LIST"] = arch
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build(backend: str, *, arch: str | None = None, force: bool = False) -> BuildInfo:
    """Build ``backend`` into the cache (no load); returns where the library is.

    With ``backend="cuda"`` this needs nvcc but no GPU: CI uses it to compile-check the CUDA build.
    """
    _check_backend(backend)
    if backend == "cuda":
        arch = parse_cuda_arch(arch, "arch") if arch else cuda_arch()
    else:
        arch = arch or "host"
    directory = build_directory(backend, arch if backend == "cuda" else None)
    library = directory / f"{MODULE_NAME}.so"
    marker = directory / _COMPLETE_MARKER
    if not force and marker.is_file() and library.is_file():
        return BuildInfo(backend, arch, directory, library, 0.0, cached=True)

    _make_build_directory(directory)  # before the tvm-ffi import: a bad cache fails fast, naming the variable
    import tvm_ffi.cpp

    root = source_root()
    units = export_units(root)
    defines = [f"-DKVCANARY_SRC_TAG={source_digest(root)}"]
    common = {
        "extra_include_paths": [str(root / "include"), str(root / "csrc")],
        "build_directory": str(directory),
    }
    start = time.perf_counter()
    with _toolchain_env(backend, arch):
        if backend == "cpu":
            san_flags = _SANITIZE_FLAGS.get(sanitizer() or "", [])
            path = tvm_ffi.cpp.build(
                MODULE_NAME,
                cpp_files=compile_units(units, directory, ".cc"),
                extra_cflags=[_CXX_STD, _OPT, *san_flags, *defines],
                extra_ldflags=san_flags,
                **common,
            )
        else:
            path = tvm_ffi.cpp.build(
                MODULE_NAME,
                cuda_files=compile_units(units, directory, ".cu"),
                extra_cuda_cflags=[_CXX_STD, _OPT, "-lineinfo", *defines],
                **common,
            )
    seconds = time.perf_counter() - start
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(f"{backend} {arch} {seconds:.2f}s\n")
    tmp.replace(marker)
    logger.info("kvcanary: built the %s kernels (%s) in %.1f s into %s", backend, arch, seconds, directory)
    return BuildInfo(backend, arch, directory, Path(path), seconds, cached=False)


def is_built(backend: str, *, arch: str | None = None) -> bool:
    """Whether :func:`build` would find ``backend`` finished in the cache (and so only load it): callers print
    a "building, this takes a while" line only when it will not."""
    directory = build_directory(backend, arch)
    return (directory / _COMPLETE_MARKER).is_file() and (directory / f"{MODULE_NAME}.so").is_file()


def load_module(backend: str) -> Any:
    """The raw tvm-ffi module of ``backend`` ("cpu" or "cuda"), built on first use and memoised."""
    _check_backend(backend)
    module = _modules.get(backend)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(backend)
        if module is None:
            import tvm_ffi

            info = build(backend)
            module = tvm_ffi.load_module(str(info.library))
            _modules[backend] = module
            _build_info[backend] = info
    return module


def build_info(backend: str) -> BuildInfo | None:
    """How the loaded module of ``backend`` was obtained (None if not loaded yet)."""
    return _build_info.get(backend)
