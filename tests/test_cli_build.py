"""``kvcanary build``: the kernels built into the cache once (an image build step), named errors otherwise."""

from __future__ import annotations

import io

import pytest

from kvcanary.cli.main import main
from kvcanary.kernels import jit


def test_build_cpu_puts_the_library_in_the_cache_and_says_where(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert main(["build", "--backend", "cpu"], out=out) == 0
    lines = out.getvalue().splitlines()
    backend, _, when, library = lines[0].split("\t")
    assert backend == "cpu" and (when == "cached" or when.endswith(" s"))
    assert jit.is_built("cpu") and library.endswith("kvcanary_ops.so")
    assert lines[-1] == f"cache {jit.cache_root()}: set KVCANARY_CACHE_DIR to it where kvcanary runs"


def test_a_bad_arch_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--backend", "cuda", "--arch", "bogus"], out=io.StringIO()) == 2
    assert "kvcanary build: --arch: expected a CUDA arch" in capsys.readouterr().err


def test_a_failed_cuda_build_is_one_line(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_nvcc(backend, *, arch=None, force=False):
        raise RuntimeError("ninja exited with status 127\nnvcc: not found")

    monkeypatch.setattr(jit, "build", no_nvcc)
    monkeypatch.setattr(jit, "is_built", lambda backend, *, arch=None: False)
    assert main(["build", "--backend", "cuda", "--arch", "9.0a"], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.endswith("kvcanary build: the cuda build failed: ninja exited with status 127 (the CUDA build needs "
                        "nvcc: on PATH, or CUDA_HOME)\n")
