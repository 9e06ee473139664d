"""The kernels' module layout (issue 31): each wrapper module has its pure-torch reference beside it, the references
never load the compiled kernels or tvm-ffi, and nothing in kernels/ imports a layer above it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "plugin" / "kvcanary" / "kernels"
REFERENCES = ("hash_ref", "write_ref", "verify_ref", "plan_step_ref", "check_ref")
ABOVE = ("kvcanary.runtime", "kvcanary.report", "kvcanary.sglang", "kvcanary.cli", "kvcanary.sim")


def test_references_are_pure_torch() -> None:
    script = (
        "import sys\n"
        f"from kvcanary.kernels import {', '.join(REFERENCES)}\n"
        "print(sorted(m for m in sys.modules if m.startswith('tvm_ffi') or m in "
        "('kvcanary.kernels.jit', 'kvcanary.kernels.call')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_every_wrapper_with_a_reference_sits_beside_it() -> None:
    for name in REFERENCES[1:]:
        assert (KERNELS / f"{name.removesuffix('_ref')}.py").is_file(), name


def test_kernels_import_no_layer_above() -> None:
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                assert not name.startswith(ABOVE), f"{path.name} imports {name}"
