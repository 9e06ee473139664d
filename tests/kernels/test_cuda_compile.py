"""CPU-CI check that the CUDA backend compiles (nvcc, no GPU needed).

Builds ``kvcanary.kernels.jit.build("cuda", arch="9.0a")`` into a fresh cache directory and checks that the
shared library exists. Skipped only when nvcc cannot be found. Takes ~25-40 s (one nvcc build).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvcanary.kernels import jit


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


@pytest.mark.slow
@pytest.mark.skipif(_find_nvcc() is None, reason="nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda)")
def test_cuda_backend_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tvm_ffi")
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path / "kvcanary-cache"))
    nvcc = Path(_find_nvcc() or "")
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
        # tvm-ffi derives CUDA home from `which nvcc`, which breaks for wrapper scripts outside the toolkit.
        home = nvcc.resolve().parent.parent
        monkeypatch.setenv("CUDA_HOME", str(home if (home / "lib64").exists() else Path("/usr/local/cuda")))
    if shutil.which("nvcc") is None:
        monkeypatch.setenv("PATH", f"{nvcc.parent}{os.pathsep}{os.environ.get('PATH', '')}")

    info = jit.build("cuda", arch="9.0a", force=True)

    assert info.backend == "cuda"
    assert info.arch == "9.0a"
    assert not info.cached
    assert info.library.is_file(), f"no shared library at {info.library}"
    assert info.library.stat().st_size > 0
    assert info.directory.is_relative_to(tmp_path), "the build must go to $KVCANARY_CACHE_DIR"
    assert "cuda-sm90a" in info.directory.name
    # A second build call is served from the cache without compiling.
    again = jit.build("cuda", arch="9.0a")
    assert again.cached and again.library == info.library
