"""The build's export units (csrc/export_*.cc, one per kernel) and how kvcanary.kernels.jit compiles them: in
parallel when more than one job may run, as one file including them all otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcanary.kernels import jit
from kvcanary.settings import ConfigError

ROOT = jit.source_root()
_EXPORT = re.compile(r"^TVM_FFI_DLL_EXPORT_TYPED_FUNC\((\w+),", re.M)


def test_every_export_is_declared_in_exactly_one_unit() -> None:
    units = jit.export_units(ROOT)
    assert len(units) >= 2, units
    seen: dict[str, str] = {}
    for unit in units:
        for name in _EXPORT.findall(unit.read_text()):
            assert name not in seen, f"{name} exported by {seen.get(name)} and {unit.name}"
            seen[name] = unit.name
    # the names the wrappers call (kvcanary.kernels.*) and the layout mirror check
    for name in ("canary_write_step", "canary_verify_step", "canary_plan_step", "canary_check_step",
                 "canary_check_bind", "canary_write_bind", "canary_token_update", "canary_token_append",
                 "canary_token_append_bind",
                 "canary_row_serial_update", "canary_sweep_plan_update", "canary_layout_constants",
                 "canary_backend_name"):
        assert name in seen, name


def test_kernels_have_internal_linkage() -> None:
    """A kernel header may be included by several export units (canary_check.cuh includes the plan and verify
    headers); a kernel with external linkage would then be defined twice and the CUDA module would not link."""
    for path in sorted((ROOT / "csrc").glob("*.cuh")) + sorted((ROOT / "include").rglob("*.h")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*(template\s*<[^>]*>\s*)?__global__\b", line):
                pytest.fail(f"{path.name}:{number}: declare kernels KVCANARY_KERNEL (static __global__): {line}")


@pytest.mark.parametrize("suffix", [".cc", ".cu"])
def test_one_job_compiles_one_file_including_every_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        suffix: str) -> None:
    monkeypatch.setenv(jit.MAX_JOBS_ENV, "1")
    units = jit.export_units(ROOT)
    files = jit.compile_units(units, tmp_path, suffix)
    assert files == [str(tmp_path / f"export_all{suffix}")]
    text = Path(files[0]).read_text()
    assert [line for line in text.splitlines() if line.startswith("#include")] == [f'#include "{u.name}"'
                                                                                   for u in units]
    # Each unit between a push and a pop of g++'s options, its shims header's guard dropped first: the -O1 the shims
    # header sets ends with the unit (it once held for every later unit's kernels: the first unit, check, set it).
    assert text.count("#pragma GCC push_options") == text.count("#pragma GCC pop_options") == len(units)
    assert text.count("#undef KVCANARY_EXPORT_SHIMS_H_") == len(units)
    assert "#define KVCANARY_EXPORT_SHIMS_H_" in (jit.source_root() / "csrc" / "export_shims.h").read_text()


def test_parallel_jobs_compile_the_units_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jit.MAX_JOBS_ENV, "4")
    units = jit.export_units(ROOT)
    assert jit.compile_units(units, tmp_path, ".cc") == [str(u) for u in units]  # g++ takes a .cc as it is
    cuda = jit.compile_units(units, tmp_path, ".cu")  # nvcc needs a .cu suffix: one wrapper each
    assert [Path(f).name for f in cuda] == [u.stem + ".cu" for u in units]
    assert all(Path(f).read_text() == f'#include "{u.name}"\n' for f, u in zip(cuda, units, strict=True))


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_a_bad_max_jobs_is_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(jit.MAX_JOBS_ENV, value)
    with pytest.raises(ConfigError, match=r"^MAX_JOBS: expected a positive integer"):
        jit.build_jobs()


def test_jobs_default_to_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(jit.MAX_JOBS_ENV, raising=False)
    monkeypatch.setattr(jit.os, "cpu_count", lambda: 6)
    assert jit.build_jobs() == 6
