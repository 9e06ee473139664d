"""``kvcanary check -- <launch_server arguments>``: sglang's parser, the plugin's start-up guards, one line per
applying setting, exit 0 / 1 / 2 and the --json shape (a real sglang 0.5.12 on CPU; skipped without sglang)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent / "adapters"))
import _sglang_cpu_shims  # noqa: E402  (the CPU-only machine's import shim, as tests/adapters/conftest.py applies it)

_sglang_cpu_shims.apply()

from kvcanary import sglang as adapter  # noqa: E402
from kvcanary.cli.main import main  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 2048, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3",
         "--speculative-draft-model-path", "X"]
SETTING_LINE = re.compile(r"^(covered|refused|no KV effect) {2,}(.+?): ", re.M)
HICACHE = {"--enable-hierarchical-cache": "covered", "--hicache-write-policy write_through": "covered",
           "--hicache-io-backend kernel": "covered", "--hicache-mem-layout layer_first": "covered",
           "--hicache-ratio 2.0": "no KV effect"}


@pytest.fixture
def model(tmp_path, monkeypatch) -> str:
    for var in [v for v in os.environ if v.startswith("KVCANARY_")]:
        monkeypatch.delenv(var)  # needs no KVCANARY_* environment
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def check(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["check", *args], out=out)
    return code, out.getvalue()


def verdict_lines(text: str) -> dict[str, str]:
    """written flag -> verdict, from the per-setting lines."""
    return {m.group(2): m.group(1) for m in SETTING_LINE.finditer(text)}


@pytest.mark.parametrize("extra, code, verdicts", [
    ([], 0, {}),
    (["--enable-hierarchical-cache"], 0, HICACHE),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file"], 2,
     {**HICACHE, "--hicache-storage-backend file": "refused"}),
    (["--page-size", "16"], 0, {"--page-size 16": "covered"}),
    (["--enable-torch-compile"], 2, {"--enable-torch-compile": "refused"}),
    (["--enable-pdmux"], 2, {"--enable-pdmux": "refused"}),
    ([*EAGLE, "--speculative-eagle-topk", "1"], 0, {"--speculative-algorithm EAGLE": "covered"}),
    ([*EAGLE, "--speculative-eagle-topk", "4"], 2, {"--speculative-eagle-topk 4": "refused"}),
    (["--kv-cache-dtype", "fp8_e4m3"], 0, {"--kv-cache-dtype fp8_e4m3": "covered"}),
    (["--kv-cache-dtype", "fp4_e2m1"], 2, {"--kv-cache-dtype fp4_e2m1": "refused"}),
    (["--disaggregation-mode", "prefill"], 2, {"--disaggregation-mode prefill": "refused"}),
    (["--disable-radix-cache"], 0, {"--disable-radix-cache": "covered"}),
], ids=["plain", "hicache", "hicache-storage", "page16", "torch-compile", "pdmux", "eagle-topk1", "eagle-topk4",
        "fp8-kv", "fp4-kv", "disagg-prefill", "no-radix"])
def test_check_lines_and_exit_code(model, extra, code, verdicts) -> None:
    got, text = check("--", "--model-path", model, *extra)
    assert got == code, text
    assert verdict_lines(text) == verdicts, text
    assert "not applied (ServerArgs.__post_init__ is skipped" in text
    if code == 2:
        refusal = text.splitlines()[-1]
        assert refusal.startswith("refused at start-up: ")
        assert any(w in refusal for w, v in verdicts.items() if v == "refused"), refusal
    else:
        assert text.splitlines()[-1] == "ok: kvcanary installs and protects this launch"


def test_json_has_one_object_for_scripts(model, capsys) -> None:
    code, text = check("--json", "--", "--model-path", model, "--page-size", "16", "--enable-pdmux")
    data = json.loads(text)
    assert code == data["exit_code"] == 2 and data["result"] == "refused"
    assert set(data) == {"result", "exit_code", "sglang_version", "version_module", "refusal", "error", "settings",
                         "not_applied", "notes"}
    assert data["sglang_version"].startswith("0.5.12") and data["version_module"] == "kvcanary.sglang.v0_5_12"
    assert "--enable-pdmux" in data["refusal"] and data["error"] is None and data["not_applied"]
    by_flag = {s["written"]: s for s in data["settings"]}
    assert by_flag["--page-size 16"]["verdict"] == "covered" and by_flag["--page-size 16"]["test"].startswith("tests/")
    assert by_flag["--enable-pdmux"] == {"flag": "--enable-pdmux", "written": "--enable-pdmux",
                                         "field": "enable_pdmux", "verdict": "refused",
                                         "why": by_flag["--enable-pdmux"]["why"], "test": None}
    code, text = check("--json", "--", "--model-path", model)
    assert code == 0 and json.loads(text)["result"] == "covered" and json.loads(text)["settings"] == []


def test_eagle_without_topk_notes_that_sglang_picks_it(model) -> None:
    code, text = check("--", "--model-path", model, "--speculative-algorithm", "EAGLE")
    assert code == 0 and "note: --speculative-eagle-topk is not given" in text


@pytest.mark.parametrize("args, message", [
    (["--page-size", "x"], "argument --page-size: invalid int value: 'x'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--disaggregation-mode", "both"], "argument --disaggregation-mode: invalid choice"),
])
def test_wrong_arguments_exit_1_with_sglangs_parser_message(model, capsys, args, message) -> None:
    code, text = check("--", "--model-path", model, *args)
    assert code == 1 and text == ""
    assert message in capsys.readouterr().err


def test_unsupported_or_missing_sglang_exits_1_saying_which(model, monkeypatch, capsys) -> None:
    monkeypatch.setattr(adapter, "_sglang_version", lambda: "0.5.20")
    assert check("--", "--model-path", model) == (1, "")
    assert "sglang 0.5.20 is not supported by this kvcanary" in capsys.readouterr().err

    def missing() -> str:
        raise ImportError("No module named 'sglang'")

    monkeypatch.setattr(adapter, "_sglang_version", missing)
    code, text = check("--json", "--", "--model-path", model)
    assert code == 1 and json.loads(text)["error"].startswith("sglang is not installed")


def test_help_describes_the_command(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check", "--help"])
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "launch_server" in help_text and "Exit status 0" in help_text and "--json" in help_text


@pytest.mark.parametrize("lead", [[], ["--json"]])
def test_sglang_arguments_without_the_double_dash_are_sglangs(model, lead) -> None:
    """``kvcanary check --enable-mixed-chunk`` (no ``--``): argparse would refuse the sglang flag as unknown with exit
    status 2, which check uses for a refused setting; the flags after check's own options are sglang's."""
    code, text = check(*lead, "--model-path", model, "--enable-mixed-chunk")
    assert code == 0, text
    assert "--enable-mixed-chunk" in text
    code, _ = check(*lead, "--model-path", model, "--enable-torch-compile")
    assert code == 2
