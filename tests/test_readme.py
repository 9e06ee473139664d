"""README.md and docs/ against the code, so they cannot drift apart: the manager snippet (docs/manager.md) runs as
written in a fresh environment (on CPU), the Repository layout table (docs/layout.md) names every module of the
package and every entry of integration/ (and nothing that is gone), and every relative link of every page resolves,
anchors included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
LAYOUT_DOC = REPO / "docs" / "layout.md"
MANAGER_DOC = REPO / "docs" / "manager.md"
PACKAGE = REPO / "plugin" / "kvcanary"
INTEGRATION = REPO / "integration"
# What a user's shell may carry that is not a run setting (the e2e driver passes the same three through).
PASS_THROUGH = {"KVCANARY_CACHE_DIR", "KVCANARY_CUDA_ARCH", "KVCANARY_SANITIZE"}


def section(title: str, page: Path = README) -> str:
    """The text of a page's ``## title`` section (the README's by default), up to the next ``## `` heading."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end == -1 else end]


def manager_snippet() -> str:
    text = section("Runtime: the manager an engine adapter drives", MANAGER_DOC)
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"expected one python block in the manager section, found {len(blocks)}"
    return blocks[0]


def layout_rows() -> dict[str, set[str]]:
    """The layout table's rows whose first column is one folder: folder -> the backticked names of the row."""
    rows: dict[str, set[str]] = {}
    for line in LAYOUT_DOC.read_text(encoding="utf-8").splitlines():
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
    assert not missing, f"docs/layout.md's table does not name {missing} (add each to its folder's row)"


def test_layout_table_names_no_file_that_is_gone() -> None:
    gone = [
        f"{folder}{name}"
        for folder, names in layout_rows().items()
        for name in names
        if re.fullmatch(r"[\w.-]+\.(py|sh|cuh|cc|h)", name) and not (REPO / folder / name).is_file()
    ]
    assert not gone, f"docs/layout.md's table names files that do not exist there: {gone}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_every_page_resolves() -> None:
    """A section that moves (README -> docs/) must take its links along and leave none dangling."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "docs" / "upstream-bugs").glob("*.md")), REPO / "integration" / "README.md",
             REPO / "benchmarks" / "README.md"]
    anchors: dict[Path, set[str]] = {}
    bad = []
    for page in pages:
        for n, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
            for _label, target in re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+://", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = page if not path else (page.parent / path).resolve()
                if not dest.exists():
                    bad.append(f"{page.relative_to(REPO)}:{n}: {target} (no such file)")
                elif anchor and dest.suffix == ".md":
                    if dest not in anchors:
                        anchors[dest] = {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", dest.read_text(), re.M)}
                    if anchor not in anchors[dest]:
                        bad.append(f"{page.relative_to(REPO)}:{n}: {target} (no such heading)")
    assert not bad, "\n".join(bad)
