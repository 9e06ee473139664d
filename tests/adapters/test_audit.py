"""The settings audit (kvcanary.sglang.audit) against the code: the tests it names exist, each refused row is refused
by the start-up guards with the flag as written, the flags and fields are sglang 0.5.12's, and the generated docs
match the table."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import sgl_engine  # noqa: E402

from kvcanary.sglang import audit, guards, v0_5_12  # noqa: E402
from kvcanary.sglang.audit import Verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOT_0_5_12_FIELDS = {"kv_canary"}  # sglang 0.5.23's own canary: guarded for that version, absent from 0.5.12
README_TABLE = re.compile(r"<!-- settings-table:[^\n]*-->\n(.*?)<!-- /settings-table -->", re.S)


@pytest.fixture(scope="module")
def accepted(tmp_path_factory):
    """Real 0.5.12 ServerArgs (its __post_init__ ran) that the guards accept."""
    sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path_factory.mktemp("tiny-llama")))
    v0_5_12.check_supported(sa)
    return sa


@pytest.mark.parametrize("row", [s for s in audit.SETTINGS if s.verdict is Verdict.COVERED],
                         ids=lambda s: f"{s.flag}:{s.when}")
def test_every_covered_row_names_a_test_that_exists(row) -> None:
    path, _, name = row.test.partition("::")
    assert path.startswith("tests/") and name, row.test
    source = ROOT / path
    assert source.is_file(), f"{row.flag}: {path} does not exist"
    assert re.search(rf"^\s*def {re.escape(name)}\(", source.read_text(), re.M), f"{row.flag}: no def {name} in {path}"


@pytest.mark.parametrize("row", audit.refused_rows(), ids=lambda s: f"{s.flag}:{s.when}")
def test_every_refused_row_is_refused_at_start_up_naming_the_flag_as_written(accepted, row) -> None:
    sa = copy.copy(accepted)
    for name, value in row.example.items():
        setattr(sa, name, value)
    version = "0.5.12" if row.applies(sa, "0.5.12") else "0.5.23"
    assert row.applies(sa, version), f"{row.flag}: its example does not make it apply"
    assert not row.applies(accepted, version)
    with pytest.raises(guards.UnsupportedSetupError, match=re.escape(row.written(sa))):
        guards.check_supported(sa, version)


def test_accepted_arguments_meet_no_refused_row_and_the_audit_lists_every_row(accepted) -> None:
    findings = guards.audit(accepted, "0.5.12")
    assert [f.setting for f in findings] == list(audit.SETTINGS)
    assert not [f.written for f in findings if f.applies and f.verdict is Verdict.REFUSED]


def test_hicache_is_covered_on_0_5_12_only_and_never_with_speculative_decoding(accepted) -> None:
    sa = copy.copy(accepted)
    sa.enable_hierarchical_cache = True
    guards.check_supported(sa, "0.5.12")
    with pytest.raises(guards.UnsupportedSetupError, match="not 0.5.23"):
        guards.check_supported(sa, "0.5.23")
    for key, value in audit.SPEC_EXAMPLE.items():
        setattr(sa, key, value)
    with pytest.raises(guards.UnsupportedSetupError, match="draft pool's host copies"):
        guards.check_supported(sa, "0.5.12")


def test_every_row_is_a_0_5_12_field_and_flag() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    for row in audit.SETTINGS:
        if row.field in NOT_0_5_12_FIELDS:
            continue
        assert row.field in fields, row.field
        assert row.flag in flags, row.flag
        assert row.verdict is not Verdict.REFUSED or row.raised_by != audit.GUARDS or row.refusal, row.flag


def test_docs_are_generated_from_the_table() -> None:
    assert (ROOT / "docs" / "settings.md").read_text() == audit.settings_doc(), (
        "docs/settings.md is stale: python -m kvcanary.sglang.audit --markdown > docs/settings.md")
    found = README_TABLE.search((ROOT / "README.md").read_text())
    assert found is not None, "README.md has lost its settings-table markers"
    assert found.group(1) == audit.readme_table() + "\n", (
        "README.md's settings table is stale: paste python -m kvcanary.sglang.audit --readme between its markers")
