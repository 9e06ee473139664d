"""Packaging: the wheel carries the kernel sources (a non-editable install JIT-builds them) and the license; the
editable wheel carries only the path hook (no copies of the headers to leave behind in site-packages); the sdist
carries what the README's commands need (requirements-sglang-cpu.txt, docs/, the license) and builds the same
wheel."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not (REPO / "pyproject.toml").is_file(), reason="needs the source tree (pyproject.toml next to tests/)"
)


def _build(target: str, out: Path, root: Path = REPO) -> Path:
    """``hatchling build --target TARGET`` of ``root`` into ``out``: no build isolation, no network, a few seconds."""
    pytest.importorskip("hatchling", reason="the test extra installs hatchling")
    proc = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "--target", target, "--directory", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    built = [p for p in out.iterdir() if p.name.startswith("kvcanary-")]
    assert len(built) == 1, built
    return built[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("wheel", tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("sdist", tmp_path_factory.mktemp("sdist"))


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
        "kvcanary/csrc/export_write.cc",
        "kvcanary/csrc/export_shims.h",
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
    for module in ("__init__", "__main__", "ops", "settings", "kernels/__init__", "kernels/jit", "kernels/layout",
                   "kernels/call", "kernels/write", "kernels/verify", "kernels/plan_step", "kernels/check",
                   "kernels/tokens", "kernels/row_serials", "kernels/hash_ref", "kernels/write_ref",
                   "kernels/verify_ref", "kernels/plan_step_ref", "kernels/check_ref", "kernels/batch",
                   "kernels/real_kv", "runtime/__init__", "runtime/manager",
                   "runtime/config", "report/__init__", "report/record", "report/reporter", "report/metrics",
                   "report/table", "cli/__init__", "cli/main", "cli/doctor", "cli/demo", "cli/check", "cli/summarize",
                   "cli/matcher", "sim/__init__", "sim/engine", "sim/injector", "sglang/__init__"):
        assert f"kvcanary/{module}.py" in names, sorted(names)
    # the host extension's C source (kvcanary.runtime.host_ext builds it on the serving machine)
    assert "kvcanary/runtime/decode_post.c" in names, sorted(names)
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
    for dep in ("apache-tvm-ffi<0.2,>=0.1.9", "torch>=2.4", "numpy", "ninja", "packaging"):
        assert f"Requires-Dist: {dep}" in metadata, metadata
    # prometheus_client only for the metrics extra (and the tests), never for a plain install
    assert "Requires-Dist: prometheus-client; extra == 'metrics'" in metadata, metadata
    assert not any(line.startswith("Requires-Dist: prometheus") and "extra ==" not in line
                   for line in metadata.splitlines())
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert "kvcanary = kvcanary.cli:main" in entry_points
    assert "[console_scripts]" in entry_points
    assert "[sglang.srt.plugins]" in entry_points, entry_points
    assert "kvcanary = kvcanary.sglang:register" in entry_points, entry_points


def test_license_is_apache_2_and_ships_in_the_wheel(wheel: Path) -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(f"kvcanary-{_version()}.dist-info/licenses/LICENSE").decode() == text


def test_editable_wheel_carries_only_the_path_hook(tmp_path: Path) -> None:
    """An editable install reads include/ and csrc/ from the checkout (kvcanary.kernels.jit.source_root); copying them
    into site-packages/kvcanary (what a force-include did) left an empty kvcanary/include there after pip uninstall."""
    pytest.importorskip("editables", reason="the test extra installs editables (hatchling's editable wheels)")
    names = _names(_build("wheel:editable", tmp_path))
    assert not [n for n in names if n.startswith("kvcanary/")], sorted(names)
    pth = [n for n in names if n.endswith(".pth")]
    assert len(pth) == 1, names
    with zipfile.ZipFile(next(tmp_path.glob("kvcanary-*.whl"))) as zf:
        assert zf.read(pth[0]).decode().strip() == str(REPO / "plugin")


def test_sdist_carries_what_the_readme_needs_and_builds_the_same_wheel(sdist: Path, wheel: Path,
                                                                       tmp_path: Path) -> None:
    prefix = f"kvcanary-{_version()}/"
    with tarfile.open(sdist) as tar:
        names = {n.removeprefix(prefix) for n in tar.getnames()}
        tar.extractall(tmp_path, filter="data")
    for required in ("requirements-sglang-cpu.txt", "LICENSE", "README.md", "pyproject.toml",
                     "plugin/kvcanary/__init__.py", "include/kvcanary/layout.h", "csrc/export_write.cc"):
        assert required in names, sorted(names)
    for doc in (REPO / "docs").glob("*.md"):
        assert f"docs/{doc.name}" in names, sorted(names)
    for req in REPO.glob("requirements-*.txt"):  # every sglang install the README and .ci/run name
        assert req.name in names, sorted(names)
    rebuilt = _build("wheel", tmp_path / "out", root=tmp_path / prefix.rstrip("/"))
    assert _names(rebuilt) == _names(wheel)
