"""README.md against the code, so the two cannot drift apart: the manager snippet runs as written in a fresh
environment (on CPU), and the Repository layout table names every module of the package and every entry of
integration/ (and nothing that is gone)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PACKAGE = REPO / "plugin" / "kvcanary"
INTEGRATION = REPO / "integration"
# What a user's shell may carry that is not a run setting (the e2e driver passes the same three through).
PASS_THROUGH = {"KVCANARY_CACHE_DIR", "KVCANARY_CUDA_ARCH", "KVCANARY_SANITIZE"}


def section(title: str) -> str:
    """The text of the README's ``## title`` section, up to the next ``## `` heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end == -1 else end]


def manager_snippet() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```$", section("Runtime: the manager an engine adapter drives"),
                        flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"expected one python block in the manager section, found {len(blocks)}"
    return blocks[0]


def layout_rows() -> dict[str, set[str]]:
    """The layout table's rows whose first column is one folder: folder -> the backticked names of the row."""
    rows: dict[str, set[str]] = {}
    for line in section("Repository layout").splitlines():
        match = re.fullmatch(r"\| `([^`]+/)` \| (.*) \|", line)
        if match:
            rows[match.group(1)] = set(re.findall(r"`([^`]+)`", match.group(2)))
    return rows


@pytest.mark.slow
def test_manager_snippet_runs_as_written_in_a_fresh_environment(tmp_path: Path) -> None:
    """The snippet once failed as written without KVCANARY_MODE ("mode is off; do not build a manager")."""
    script = tmp_path / "snippet.py"
    script.write_text(manager_snippet(), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_") or k in PASS_THROUGH}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "plugin"), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # on CPU here, also on a GPU machine (no CUDA build in this test)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    # the snippet's corrupted slot was reported, in the WARNING line log mode writes
    assert "kvcanary violation: step=2 tag=verify reasons=verify_real_kv_hash slot=2" in done.stderr, done.stderr


def test_layout_table_names_every_module_and_integration_entry() -> None:
    rows = layout_rows()
    missing: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        folder = path.parent.relative_to(REPO).as_posix() + "/"  # each package folder has a row of its own
        if path.name not in rows.get(folder, set()):
            missing.append(path.relative_to(REPO).as_posix())
    for entry in sorted(INTEGRATION.iterdir()):
        if entry.name in ("results", "__pycache__") or entry.name.startswith("."):
            continue
        name = entry.name + ("/" if entry.is_dir() else "")
        if name not in rows["integration/"]:
            missing.append(f"integration/{name}")
    assert not missing, f"README.md's Repository layout table does not name {missing} (add each to its folder's row)"


def test_layout_table_names_no_file_that_is_gone() -> None:
    gone = [
        f"{folder}{name}"
        for folder, names in layout_rows().items()
        for name in names
        if re.fullmatch(r"[\w.-]+\.(py|sh|cuh|cc|h)", name) and not (REPO / folder / name).is_file()
    ]
    assert not gone, f"README.md's Repository layout table names files that do not exist there: {gone}"
