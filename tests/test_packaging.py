"""The wheel carries the kernel sources, so a non-editable install can JIT-build them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not (REPO / "pyproject.toml").is_file(), reason="needs the source tree (pyproject.toml next to tests/)"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("hatchling", reason="the test extra installs hatchling")
    out = tmp_path_factory.mktemp("wheel")
    # hatchling directly: no build isolation, no network, a few seconds.
    proc = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "--target", "wheel", "--directory", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("kvcanary-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def _version() -> str:
    for line in (REPO / "plugin" / "kvcanary" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise AssertionError("no __version__ in plugin/kvcanary/__init__.py")


def test_wheel_carries_kernel_sources(wheel: Path) -> None:
    names = _names(wheel)
    for required in (
        "kvcanary/include/kvcanary/layout.h",
        "kvcanary/csrc/kvcanary_ops.cc",
        "kvcanary/csrc/canary_write.cuh",
        "kvcanary/csrc/canary_verify.cuh",
    ):
        assert required in names, sorted(names)
    # Every header and source of the checkout, not just the ones named above.
    for sub in ("include", "csrc"):
        for path in (REPO / sub).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                assert f"kvcanary/{path.relative_to(REPO).as_posix()}" in names, path


def test_wheel_carries_python_modules(wheel: Path) -> None:
    names = _names(wheel)
    for module in ("__init__", "__main__", "cli", "doctor", "jit", "layout", "ops", "real_kv"):
        assert f"kvcanary/{module}.py" in names, sorted(names)
    # Sources live in plugin/ in the repo but install as the top-level kvcanary package.
    assert not any(n.startswith("plugin/") for n in names), sorted(names)
    assert not any(n.startswith("tests/") for n in names), sorted(names)


def test_wheel_metadata(wheel: Path) -> None:
    version = _version()
    assert wheel.name.startswith(f"kvcanary-{version}-py3-none-any"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"kvcanary-{version}.dist-info/METADATA").decode()
        entry_points = zf.read(f"kvcanary-{version}.dist-info/entry_points.txt").decode()
    assert "Requires-Python: >=3.10" in metadata
    for dep in ("apache-tvm-ffi<0.2,>=0.1.9", "torch>=2.4", "ninja", "packaging"):
        assert f"Requires-Dist: {dep}" in metadata, metadata
    assert "kvcanary = kvcanary.cli:main" in entry_points
    assert "[console_scripts]" in entry_points
    assert "[sglang.srt.plugins]" in entry_points, entry_points
    assert "kvcanary = kvcanary.sglang:register" in entry_points, entry_points
