"""kvcanary.config: KVCANARY_* parsing, defaults, errors and the unknown-variable warning."""

from __future__ import annotations

import logging
import re

import pytest

from kvcanary.config import KNOWN_ENV_VARS, Config, Mode, unknown_env_vars
from kvcanary.layout import RealKvHashMode
from kvcanary.tags import NUM_LAUNCH_TAGS, LaunchTag, is_write, tag_name


def test_defaults_from_empty_environment() -> None:
    cfg = Config.from_env({})
    assert cfg == Config()
    assert cfg.mode is Mode.OFF
    assert not cfg.enabled
    assert cfg.real_kv is RealKvHashMode.PARTIAL
    assert cfg.real_kv_mode == 1
    assert cfg.sweep_interval == 0
    assert cfg.ring_capacity == 1024
    assert cfg.stats_every == 1000
    assert cfg.report_path is None
    assert cfg.verify_tokens is False
    assert cfg.cache_dir is None
    assert cfg.health_window == 100


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_MODE", "log")
    assert Config.from_env().mode is Mode.LOG


@pytest.mark.parametrize(
    ("raw", "mode"),
    [("off", Mode.OFF), ("log", Mode.LOG), ("raise", Mode.RAISE), (" RAISE ", Mode.RAISE), ("Log", Mode.LOG)],
)
def test_mode_values(raw: str, mode: Mode) -> None:
    cfg = Config.from_env({"KVCANARY_MODE": raw})
    assert cfg.mode is mode
    assert cfg.enabled == (mode is not Mode.OFF)


@pytest.mark.parametrize(
    ("raw", "value"),
    [("none", 0), ("partial", 1), ("all", 2), ("ALL", 2), ("  None\n", 0)],
)
def test_real_kv_values(raw: str, value: int) -> None:
    cfg = Config.from_env({"KVCANARY_REAL_KV": raw})
    assert cfg.real_kv == RealKvHashMode(value)
    assert cfg.real_kv_mode == value


@pytest.mark.parametrize(
    ("var", "field", "raw", "value"),
    [
        ("KVCANARY_SWEEP_INTERVAL", "sweep_interval", "0", 0),
        ("KVCANARY_SWEEP_INTERVAL", "sweep_interval", " 50 ", 50),
        ("KVCANARY_RING_CAPACITY", "ring_capacity", "1", 1),
        ("KVCANARY_RING_CAPACITY", "ring_capacity", "4096", 4096),
        ("KVCANARY_RING_CAPACITY", "ring_capacity", str((1 << 31) - 1), (1 << 31) - 1),
        ("KVCANARY_STATS_EVERY", "stats_every", "0", 0),
        ("KVCANARY_STATS_EVERY", "stats_every", "25", 25),
        ("KVCANARY_HEALTH_WINDOW", "health_window", "1", 1),
        ("KVCANARY_HEALTH_WINDOW", "health_window", "300", 300),
    ],
)
def test_int_values(var: str, field: str, raw: str, value: int) -> None:
    assert getattr(Config.from_env({var: raw}), field) == value


@pytest.mark.parametrize(
    ("raw", "value"),
    [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("0", False), ("false", False), ("off", False)],
)
def test_verify_tokens_values(raw: str, value: bool) -> None:
    assert Config.from_env({"KVCANARY_VERIFY_TOKENS": raw}).verify_tokens is value


def test_string_values() -> None:
    cfg = Config.from_env({"KVCANARY_REPORT": " /tmp/kv-{rank}.jsonl ", "KVCANARY_CACHE_DIR": "/tmp/kvc"})
    assert cfg.report_path == "/tmp/kv-{rank}.jsonl"
    assert cfg.cache_dir == "/tmp/kvc"


def test_report_path_expands_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    assert Config.from_env({"KVCANARY_REPORT": "~/kv.jsonl"}).report_path == "/home/someone/kv.jsonl"


@pytest.mark.parametrize(
    "var",
    [
        "KVCANARY_MODE",
        "KVCANARY_REAL_KV",
        "KVCANARY_SWEEP_INTERVAL",
        "KVCANARY_RING_CAPACITY",
        "KVCANARY_STATS_EVERY",
        "KVCANARY_REPORT",
        "KVCANARY_VERIFY_TOKENS",
        "KVCANARY_CACHE_DIR",
        "KVCANARY_HEALTH_WINDOW",
    ],
)
@pytest.mark.parametrize("raw", ["", "   ", "\t\n"])
def test_empty_value_means_unset(var: str, raw: str) -> None:
    assert Config.from_env({var: raw}) == Config()


@pytest.mark.parametrize(
    ("var", "raw", "allowed"),
    [
        ("KVCANARY_MODE", "loud", "off, log, raise"),
        ("KVCANARY_MODE", "1", "off, log, raise"),
        ("KVCANARY_REAL_KV", "some", "none, partial, all"),
        ("KVCANARY_REAL_KV", "1", "none, partial, all"),
        ("KVCANARY_SWEEP_INTERVAL", "-1", ">= 0"),
        ("KVCANARY_SWEEP_INTERVAL", "ten", ">= 0"),
        ("KVCANARY_SWEEP_INTERVAL", "1.5", ">= 0"),
        ("KVCANARY_RING_CAPACITY", "0", "[1, 2147483647]"),
        ("KVCANARY_RING_CAPACITY", "2147483648", "[1, 2147483647]"),
        ("KVCANARY_RING_CAPACITY", "1k", "[1, 2147483647]"),
        ("KVCANARY_STATS_EVERY", "-5", ">= 0"),
        ("KVCANARY_STATS_EVERY", "often", ">= 0"),
        ("KVCANARY_HEALTH_WINDOW", "0", ">= 1"),
        ("KVCANARY_HEALTH_WINDOW", "0x10", ">= 1"),
        ("KVCANARY_VERIFY_TOKENS", "maybe", "0, 1"),
        ("KVCANARY_VERIFY_TOKENS", "2", "true, false"),
    ],
)
def test_bad_value_names_variable_allowed_values_and_value(var: str, raw: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        Config.from_env({var: raw})
    message = str(info.value)
    assert message.startswith(f"{var}: expected ")
    assert allowed in message
    assert f"got {raw!r}" in message


def test_mode_error_message_exact() -> None:
    with pytest.raises(ValueError, match=r"^KVCANARY_MODE: expected one of off, log, raise; got 'loud'$"):
        Config.from_env({"KVCANARY_MODE": "loud"})


def test_direct_construction_validates() -> None:
    with pytest.raises(ValueError, match="ring_capacity"):
        Config(ring_capacity=0)
    with pytest.raises(ValueError, match="health_window"):
        Config(health_window=0)
    with pytest.raises(ValueError, match="sweep_interval"):
        Config(sweep_interval=-1)
    with pytest.raises(ValueError, match="mode"):
        Config(mode="log")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stats_every"):
        Config().replace(stats_every=True)


def test_report_path_for_rank() -> None:
    cfg = Config(mode=Mode.LOG, report_path="/r/kv-{rank}/tp{rank}.jsonl")
    assert cfg.report_path_for(0) == "/r/kv-0/tp0.jsonl"
    assert cfg.report_path_for(3) == "/r/kv-3/tp3.jsonl"
    assert Config(report_path="/r/kv.jsonl").report_path_for(5) == "/r/kv.jsonl"
    assert Config(report_path="/r/{other}-{rank}.jsonl").report_path_for(1) == "/r/{other}-1.jsonl"
    assert Config().report_path_for(2) is None


def test_unknown_variables_warn_but_do_not_fail(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "KVCANARY_MOD": "raise",
        "KVCANARY_SWEEP": "10",
        "KVCANARY_MODE": "log",
        "KVCANARY_CUDA_ARCH": "9.0a",
        "KVCANARY_SANITIZE": "address",
        "KVCANARY_FAULT_FLIP_TOKEN": "1",
        "KVCANARY_FAULT": "x",
        "OTHER_VAR": "1",
    }
    with caplog.at_level(logging.WARNING, logger="kvcanary.config"):
        cfg = Config.from_env(env)
    assert cfg.mode is Mode.LOG
    assert unknown_env_vars(env) == ["KVCANARY_MOD", "KVCANARY_SWEEP"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "KVCANARY_MOD (did you mean KVCANARY_MODE?)" in text
    assert "KVCANARY_SWEEP" in text
    named = set(re.findall(r"KVCANARY_\w+", text))
    assert not named & {"KVCANARY_CUDA_ARCH", "KVCANARY_SANITIZE", "KVCANARY_FAULT_FLIP_TOKEN", "KVCANARY_FAULT"}
    assert "OTHER_VAR" not in text


def test_no_warning_for_known_variables(caplog: pytest.LogCaptureFixture) -> None:
    env = {name: "" for name in KNOWN_ENV_VARS}
    with caplog.at_level(logging.WARNING, logger="kvcanary.config"):
        Config.from_env(env)
    assert not caplog.records


def test_describe_is_one_line_with_every_setting() -> None:
    cfg = Config.from_env(
        {
            "KVCANARY_MODE": "raise",
            "KVCANARY_REAL_KV": "all",
            "KVCANARY_SWEEP_INTERVAL": "7",
            "KVCANARY_REPORT": "/tmp/r.jsonl",
            "KVCANARY_VERIFY_TOKENS": "1",
        }
    )
    text = cfg.describe()
    assert "\n" not in text
    for part in (
        "mode=raise",
        "real_kv=all",
        "sweep_interval=7",
        "ring_capacity=1024",
        "stats_every=1000",
        "health_window=100",
        "verify_tokens=true",
        "report=/tmp/r.jsonl",
        "cache_dir=-",
    ):
        assert part in text.split(), part


def test_expected_launch_tags() -> None:
    assert Config().expected_launch_tags() == (LaunchTag.VERIFY, LaunchTag.WRITE)
    assert Config(sweep_interval=10).expected_launch_tags() == (LaunchTag.VERIFY, LaunchTag.WRITE, LaunchTag.SWEEP)
    assert Config(sweep_interval=500, health_window=100).expected_launch_tags() == (LaunchTag.VERIFY, LaunchTag.WRITE)


def test_launch_tags() -> None:
    assert [int(t) for t in LaunchTag] == [0, 1, 2]
    assert NUM_LAUNCH_TAGS == 3
    assert [t.label for t in LaunchTag] == ["verify", "write", "sweep"]
    assert is_write(1) and is_write(LaunchTag.WRITE)
    assert not is_write(LaunchTag.VERIFY) and not is_write(LaunchTag.SWEEP) and not is_write(7)
    assert tag_name(2) == "sweep"
    assert tag_name(9) == "tag9"
