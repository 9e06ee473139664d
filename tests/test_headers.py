"""Header hygiene: each header compiles alone under g++, and primitives stay framework-free."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADERS = sorted((ROOT / "include" / "kvcanary").glob("*.h")) + sorted((ROOT / "csrc").glob("*.cuh"))
# tvm-ffi may appear only in the validation header, the CUDA launch helpers and csrc/ host wrappers.
TVM_FFI_ALLOWED = {"tensor_check.h", "launch.h"}


def _tvm_ffi_include() -> str:
    import tvm_ffi.libinfo

    return str(Path(tvm_ffi.libinfo.find_include_path()))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("header", HEADERS, ids=lambda p: p.name)
def test_header_compiles_alone(header: Path, tmp_path: Path) -> None:
    tu = tmp_path / "tu.cc"
    tu.write_text(f'#include "{header}"\n')
    inc = _tvm_ffi_include()
    cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-I{ROOT / 'include'}", f"-I{ROOT / 'csrc'}", f"-I{inc}", str(tu)]
    dlpack = Path(inc).parent / "3rdparty" / "dlpack" / "include"
    if dlpack.is_dir():
        cmd.insert(-1, f"-I{dlpack}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("header", sorted((ROOT / "include" / "kvcanary").glob("*.h")), ids=lambda p: p.name)
def test_primitives_are_framework_free(header: Path) -> None:
    includes = re.findall(r'#include\s+[<"]([^>"]+)[>"]', header.read_text())
    assert not [i for i in includes if "torch" in i or "ATen" in i or "c10" in i]
    if header.name not in TVM_FFI_ALLOWED:
        assert not [i for i in includes if i.startswith("tvm/")], f"{header.name} must not depend on tvm-ffi"


@pytest.mark.parametrize("kernel", sorted((ROOT / "csrc").glob("canary_*.cuh")), ids=lambda p: p.name)
def test_kernel_headers_open_with_a_contract_block(kernel: Path) -> None:
    head = "\n".join(kernel.read_text().splitlines()[:45])
    for word in ("\\brief", "Grid", "Block", "Writes"):
        assert word in head, f"{kernel.name}: contract block lacks {word!r}"


def test_no_allocation_in_csrc() -> None:
    for path in (ROOT / "csrc").iterdir():
        text = path.read_text()
        assert "FromEnvAlloc" not in text and "cudaMalloc" not in text, f"{path.name} allocates"
