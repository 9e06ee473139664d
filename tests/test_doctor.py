"""``kvcanary doctor``: the self-test passes on working kernels and fails when detection is broken."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcanary
from kvcanary.cli import doctor
from kvcanary.cli.main import main
from kvcanary.kernels import layout

CPU_ROW = re.compile(r"^cpu\s+\|\s+\S+\s+\|\s+(cached|\d+\.\d s)\s+\|\s+PASS\s+\|\s+\d+ checks ok", re.MULTILINE)


def _check(result: doctor.SelfTestResult, name: str) -> doctor.CheckResult:
    matches = [c for c in result.checks if c.name == name]
    assert len(matches) == 1, [c.name for c in result.checks]
    return matches[0]


def test_selftest_passes_on_cpu() -> None:
    result = doctor.run_selftest("cpu")
    assert result.error is None, result.error
    assert result.passed, result.detail
    names = {c.name for c in result.checks}
    assert {
        "write: no violations",
        "write: kernel_run_counter",
        "verify clean: no violations",
        "verify detects a changed token",
        "verify detects a flipped KV byte",
        "verify (token): kernel_run_counter",
        "verify (KV): kernel_run_counter",
    } <= names


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_selftest_passes_on_cuda() -> None:
    result = doctor.run_selftest("cuda")
    assert result.passed, result.detail


def test_selftest_fails_when_token_corruption_is_not_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    # A "corruption" that changes nothing: verify finds nothing, so the detection check must fail.
    monkeypatch.setattr(doctor, "_corrupt_token", lambda canary_buf, slot: None)
    result = doctor.run_selftest("cpu")
    assert not result.passed
    check = _check(result, "verify detects a changed token")
    assert not check.passed
    assert "got 0 row(s)" in check.detail
    assert _check(result, "verify detects a flipped KV byte").passed


def test_selftest_fails_when_kv_flip_is_not_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_flip_kv_byte", lambda kv, slot: None)
    result = doctor.run_selftest("cpu")
    assert not result.passed
    assert not _check(result, "verify detects a flipped KV byte").passed


def test_selftest_fails_on_wrong_reason_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # If the kernels reported a different bit than the doctor expects, the row must say FAIL.
    monkeypatch.setattr(layout, "REASON_VERIFY_REAL_KV_HASH", layout.REASON_VERIFY_POSITION)
    result = doctor.run_selftest("cpu")
    check = _check(result, "verify detects a flipped KV byte")
    assert not check.passed
    assert "verify_real_kv_hash" in check.detail


def test_selftest_reports_kernel_errors() -> None:
    result = doctor.run_selftest("meta")
    assert not result.passed
    assert result.error is not None


def test_cpu_backend_row_reports_cached_build() -> None:
    doctor.check_backend("cpu")  # make sure it is in the cache
    report = doctor.check_backend("cpu")
    assert report.cached and report.build_column == "cached"
    assert report.library is not None and report.library.is_file()
    assert report.passed and report.status == "PASS"


def test_cli_exit_status_is_nonzero_when_selftest_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_corrupt_token", lambda canary_buf, slot: None)
    out = io.StringIO()
    assert main(["doctor"], out=out) == 1
    text = out.getvalue()
    assert re.search(r"^cpu\s+\|.*\|\s+FAIL\s+\|", text, re.MULTILINE), text
    assert "FAIL verify detects a changed token" in text
    assert "kvcanary doctor: FAILED" in text


def test_cli_exit_status_is_nonzero_when_build_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_build(*args: object, **kwargs: object) -> None:
        raise RuntimeError("compiler exploded\nmore lines")

    monkeypatch.setattr(doctor.jit, "build", broken_build)
    out = io.StringIO()
    assert main(["doctor"], out=out) == 1
    assert re.search(r"^cpu\s+\|.*\|\s+failed\s+\|\s+FAIL\s+\|\s+build failed: RuntimeError: compiler exploded$",
                     out.getvalue(), re.MULTILINE), out.getvalue()


def test_cli_in_process_passes() -> None:
    out = io.StringIO()
    assert main(["doctor"], out=out) == 0, out.getvalue()
    assert CPU_ROW.search(out.getvalue()), out.getvalue()
    assert "all backends passed" in out.getvalue()
    assert "host extension: ok (" in out.getvalue(), out.getvalue()  # (CI has a compiler and the Python headers)


def test_a_host_extension_that_cannot_be_built_is_a_note_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a failure (the token check's decode batches take the Python path), but said, with the cause."""
    from kvcanary.runtime import host_ext

    def no_headers(*args, **kwargs):
        raise host_ext.HostExtError("no Python.h in '/nowhere' (install the Python development headers)")

    monkeypatch.setattr(host_ext, "build", no_headers)
    out = io.StringIO()
    assert main(["doctor"], out=out) == 0, out.getvalue()
    assert "host extension: not available (no Python.h in '/nowhere'" in out.getvalue(), out.getvalue()
    assert "take the Python path" in out.getvalue()


@pytest.mark.slow
def test_python_m_kvcanary_doctor_subprocess(tmp_path: Path) -> None:
    doctor.check_backend("cpu")  # warm the cache the subprocess inherits
    env = dict(os.environ)
    package_parent = str(Path(kvcanary.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "kvcanary", "doctor"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert CPU_ROW.search(proc.stdout), proc.stdout
    assert re.search(r"^backend\s+\|\s+arch\s+\|\s+build\s+\|\s+self-test\s+\|\s+detail$", proc.stdout, re.MULTILINE)


def test_cli_requires_a_subcommand() -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code != 0
