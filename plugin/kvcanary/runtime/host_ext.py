"""The host path's one CPython extension (issue 25): ``decode_post.c``, the token mail's decode post in C, built
on first use with the machine's C compiler into the kernel cache (``$KVCANARY_CACHE_DIR``), keyed by its source and
the Python it was built for, and loaded from there.

Not a kernel (those are tvm-ffi modules, :mod:`kvcanary.kernels.jit`): it reads Python objects (a batch's requests
and the token mirror), which is what it saves the host time of. It needs the Python headers (``Python.h``, which
torch's and triton's own JIT builds need too). Without them, or a compiler, :func:`decode_fill` raises
:class:`HostExtError` saying why, and the caller takes the Python path, which applies the same rule (and says so
in its log once)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcanary.kernels.jit import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_post.c")
MODULE = "_kvcanary_decode_post"
# (no -Werror here: a newer Python's headers may warn; tests/test_host_ext.py builds it with -Werror)
_FLAGS = ("-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall")
_BUILD_SECONDS = 120  # a cold build takes well under a second; this bounds a hung compiler

_lock = threading.Lock()
_loaded: dict[Path, Any] = {}


class HostExtError(RuntimeError):
    """The extension could not be built or loaded (the message says why: no compiler, no Python.h, ...)."""


def compile_command(source: Path, output: Path, *extra_flags: str) -> list[str]:
    """The command that builds ``source`` into the extension ``output``: the C compiler Python was built with
    (``sysconfig``'s CC, e.g. ``gcc -pthread``; ``$CC`` wins; else ``cc``), this Python's headers, ``extra_flags``
    last (the tests add ``-Werror``)."""
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths().get("include") or ""
    return [*compiler, *_FLAGS, *extra_flags, f"-I{include}", str(source), "-o", str(output)]


def library_path(source: Path = SOURCE) -> Path:
    """Where the build of ``source`` for this Python lives in the cache (its name carries the source's digest)."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_root() / f"host-{digest}" / f"{MODULE}{suffix}"


def build(source: Path = SOURCE) -> Path:
    """Compile ``source`` into the cache unless it is there; the library's path. :class:`HostExtError` on failure."""
    library = library_path(source)
    if library.is_file():
        return library
    include = sysconfig.get_paths().get("include") or ""
    if not (Path(include) / "Python.h").is_file():
        raise HostExtError(f"no Python.h in {include!r} (install the Python development headers)")
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HostExtError(f"cannot create {str(library.parent)!r}: {exc.strerror or exc}") from exc
    tmp = library.with_name(f"{library.name}.{os.getpid()}.tmp")  # ranks may build at once: each its own file
    command = compile_command(source, tmp)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostExtError(f"{shlex.join(command)}: {exc}") from exc
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise HostExtError(f"{shlex.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    tmp.replace(library)  # atomic: a reader sees no library or a whole one
    logger.info("kvcanary: built the host extension %s", library)
    return library


def load(source: Path = SOURCE) -> Any:
    """The extension module built from ``source`` (built first if needed), loaded once per process."""
    library = build(source)
    with _lock:
        module = _loaded.get(library)
        if module is None:
            loader = importlib.machinery.ExtensionFileLoader(MODULE, str(library))
            spec = importlib.util.spec_from_file_location(MODULE, library, loader=loader)
            if spec is None:
                raise HostExtError(f"cannot load {library}")
            module = importlib.util.module_from_spec(spec)
            try:
                loader.exec_module(module)
            except ImportError as exc:
                raise HostExtError(f"cannot load {library}: {exc}") from exc
            _loaded[library] = module
    return module


DecodeFill = Callable[..., int]


def decode_fill() -> DecodeFill:
    """``fill_decode`` of ``decode_post.c`` (its signature and rule are in the source's header comment)."""
    return load().fill_decode
