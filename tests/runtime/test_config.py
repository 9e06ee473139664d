"""kvcanary.runtime.config: KVCANARY_* parsing, defaults, errors and the unknown-variable warning."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import traceback

import pytest

from kvcanary.kernels.layout import RealKvHashMode
from kvcanary.kernels.tags import NUM_LAUNCH_TAGS, LaunchTag, is_write, tag_name
from kvcanary.runtime.config import Config
from kvcanary.runtime.health import expected_launch_tags
from kvcanary.settings import FAULT_ENV_VARS, KNOWN_ENV_VARS, Mode, parse_ascii_int, parse_cuda_arch, unknown_env_vars


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
        ("KVCANARY_LOG_REPEAT_WINDOW", "log_repeat_window", "0", 0),
        ("KVCANARY_LOG_REPEAT_WINDOW", "log_repeat_window", " 250 ", 250),
        ("KVCANARY_STATS_EVERY", "stats_every", "+25", 25),
        ("KVCANARY_STATS_EVERY", "stats_every", "007", 7),
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
        "KVCANARY_DRAIN_EVERY",
        "KVCANARY_LOG_REPEAT_WINDOW",
        "KVCANARY_CUDA_ARCH",
    ],
)
@pytest.mark.parametrize("raw", ["", "   ", "\t\n"])
def test_empty_value_means_unset(var: str, raw: str) -> None:
    assert Config.from_env({var: raw}) == Config()


@pytest.mark.parametrize(
    ("var", "raw", "allowed"),
    [
        ("KVCANARY_MODE", "loud", "off, log, raise, protect"),
        ("KVCANARY_MODE", "1", "off, log, raise, protect"),
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
        ("KVCANARY_LOG_REPEAT_WINDOW", "-1", ">= 0"),
        ("KVCANARY_LOG_REPEAT_WINDOW", "1e3", ">= 0"),
        # int() takes these; an environment variable must not
        ("KVCANARY_STATS_EVERY", "1_000", ">= 0"),
        ("KVCANARY_RING_CAPACITY", "\u0661\u0660", "[1, 2147483647]"),  # Arabic-Indic "10"
        ("KVCANARY_SWEEP_INTERVAL", "\uff15", ">= 0"),  # fullwidth 5
        ("KVCANARY_DRAIN_EVERY", "\u0968", ">= 1"),  # Devanagari 2
        ("KVCANARY_HEALTH_WINDOW", "1 0", ">= 1"),
        ("KVCANARY_HEALTH_WINDOW", "--1", ">= 1"),
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
    with pytest.raises(ValueError, match=r"^KVCANARY_MODE: expected one of off, log, raise, protect; got 'loud'$"):
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
    # {rank} is the only placeholder: any other {...} (a misspelt {rnak}) is refused, not written into a file name
    with pytest.raises(ValueError, match=r"^report_path: unknown placeholder \{other\}; the known placeholders are"):
        Config(report_path="/r/{other}-{rank}.jsonl")
    with pytest.raises(ValueError, match=r"^KVCANARY_REPORT: unknown placeholder \{rnak\}; .* got '/tmp/kv-\{rnak\}"):
        Config.from_env({"KVCANARY_REPORT": "/tmp/kv-{rnak}.jsonl"})
    assert Config(report_path="/r/kv-{rank.jsonl").report_path_for(1) == "/r/kv-{rank.jsonl"  # no {...}: no placeholder
    assert Config().report_path_for(2) is None


def test_unknown_variables_warn_but_do_not_fail(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "KVCANARY_MOD": "raise",
        "KVCANARY_SWEEP": "10",
        "KVCANARY_MODE": "log",
        "KVCANARY_CUDA_ARCH": "9.0a",
        "KVCANARY_SANITIZE": "address",
        "KVCANARY_FAULT_EVERY": "1",
        "KVCANARY_FAULT": "x",
        "OTHER_VAR": "1",
    }
    with caplog.at_level(logging.WARNING, logger="kvcanary.runtime.config"):
        cfg = Config.from_env(env)
    assert cfg.mode is Mode.LOG
    assert unknown_env_vars(env) == ["KVCANARY_MOD", "KVCANARY_SWEEP"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "KVCANARY_MOD (did you mean KVCANARY_MODE?)" in text
    assert "KVCANARY_SWEEP" in text
    named = set(re.findall(r"KVCANARY_\w+", text))
    assert not named & {"KVCANARY_CUDA_ARCH", "KVCANARY_SANITIZE", "KVCANARY_FAULT_EVERY", "KVCANARY_FAULT"}
    assert "OTHER_VAR" not in text


def test_no_warning_for_known_variables(caplog: pytest.LogCaptureFixture) -> None:
    env = {name: "" for name in KNOWN_ENV_VARS}
    with caplog.at_level(logging.WARNING, logger="kvcanary.runtime.config"):
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
    """The one rule the manager's health check uses (kvcanary.runtime.health.expected_launch_tags)."""
    assert expected_launch_tags(0, 100, True) == (LaunchTag.VERIFY, LaunchTag.WRITE)
    assert expected_launch_tags(10, 100, True) == (LaunchTag.VERIFY, LaunchTag.WRITE, LaunchTag.SWEEP)
    assert expected_launch_tags(10, 100, False) == (LaunchTag.VERIFY, LaunchTag.WRITE)  # no sweep source: no sweeps
    assert expected_launch_tags(500, 100, True) == (LaunchTag.VERIFY, LaunchTag.WRITE)


def test_launch_tags() -> None:
    assert [int(t) for t in LaunchTag] == [0, 1, 2]
    assert NUM_LAUNCH_TAGS == 3
    assert [t.label for t in LaunchTag] == ["verify", "write", "sweep"]
    assert is_write(1) and is_write(LaunchTag.WRITE)
    assert not is_write(LaunchTag.VERIFY) and not is_write(LaunchTag.SWEEP) and not is_write(7)
    assert tag_name(2) == "sweep"
    assert tag_name(9) == "tag9"


def test_describe_shows_repeat_window() -> None:
    assert "log_repeat_window=1000" in Config().describe().split()
    assert "log_repeat_window=0" in Config.from_env({"KVCANARY_LOG_REPEAT_WINDOW": "0"}).describe().split()
    with pytest.raises(ValueError, match="log_repeat_window"):
        Config(log_repeat_window=-1)


# -- integers: ASCII digits only ---------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["1_000", "\u0661\u0660", "\uff11", "0x10", "1e3", "1.0", "", " ", "+", "1 2", "٣"])
def test_parse_ascii_int_rejects_what_int_accepts_loosely(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_ascii_int(raw)


@pytest.mark.parametrize(("raw", "value"), [("0", 0), (" 42 ", 42), ("-3", -3), ("+7", 7), ("0012", 12)])
def test_parse_ascii_int_accepts_plain_digits(raw: str, value: int) -> None:
    assert parse_ascii_int(raw) == value


@pytest.mark.parametrize(
    "var", ["KVCANARY_FAULT_EVERY", "KVCANARY_FAULT_WARMUP", "KVCANARY_FAULT_SEED", "KVCANARY_FAULT_RANK"]
)
@pytest.mark.parametrize("raw", ["1_0", "\u0661\u0660"])
def test_fault_integers_are_ascii_only(var: str, raw: str) -> None:
    from kvcanary.runtime.faults import FaultPlan

    with pytest.raises(ValueError, match=f"^{var}: expected an integer"):
        FaultPlan.from_env({"KVCANARY_FAULT": "token_swap", var: raw})
    assert FaultPlan.from_env({"KVCANARY_FAULT": "token_swap", var: "2"}) is not None


# -- the fault-injection family is listed by name ------------------------------------------------------------


def test_fault_variables_are_listed_and_typos_warn(caplog: pytest.LogCaptureFixture) -> None:
    from kvcanary.runtime import faults

    owned = {v for k, v in vars(faults).items() if k.startswith("ENV_FAULT")}
    assert owned == set(FAULT_ENV_VARS) and owned <= KNOWN_ENV_VARS
    env = {"KVCANARY_FAULT": "token_swap", "KVCANARY_FAULT_EVREY": "5", "KVCANARY_FAULTS": "all"}
    assert unknown_env_vars(env) == ["KVCANARY_FAULTS", "KVCANARY_FAULT_EVREY"]
    with caplog.at_level(logging.WARNING, logger="kvcanary.runtime.config"):
        Config.from_env(env)
    (record,) = caplog.records
    assert "KVCANARY_FAULT_EVREY (did you mean KVCANARY_FAULT_EVERY?)" in record.getMessage()


def test_every_variable_read_anywhere_is_known() -> None:
    """Each KVCANARY_* string literal in the plugin's sources is a known variable (or the prefix itself)."""
    import pathlib

    import kvcanary

    root = pathlib.Path(kvcanary.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        names |= set(re.findall(r"[\"'](KVCANARY_[A-Z0-9_]+)[\"']", path.read_text()))
    names.discard("KVCANARY_")
    assert names <= KNOWN_ENV_VARS, sorted(names - KNOWN_ENV_VARS)


# -- KVCANARY_CUDA_ARCH ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "arch"),
    [
        ("9.0", "9.0"),
        ("9.0a", "9.0a"),
        (" 90 ", "9.0"),
        ("90a", "9.0a"),
        ("sm_90a", "9.0a"),
        ("SM90A", "9.0a"),
        ("compute_90a", "9.0a"),
        ("100a", "10.0a"),
        ("10.0f", "10.0f"),
        ("120", "12.0"),
        ("8.9", "8.9"),
        ("8.9 9.0a", "8.9 9.0a"),  # tvm-ffi takes a list; so did the variable before it was checked
        ("sm_89,sm_90a", "8.9 9.0a"),
    ],
)
def test_cuda_arch_accepted_forms(raw: str, arch: str) -> None:
    assert parse_cuda_arch(raw) == arch
    Config.from_env({"KVCANARY_CUDA_ARCH": raw})  # accepted at start-up


@pytest.mark.parametrize(
    "raw", ["bogus", "sm_bogus", "9", "9.0b", "9.0.1", "0.0", "sm_9000", "\u0669\u0660", "9.0a;", ","]
)
def test_cuda_arch_bad_values_name_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = r"^KVCANARY_CUDA_ARCH: expected a CUDA arch such as 9\.0, 9\.0a, 90, 90a, sm_90a.*; got "
    pattern += re.escape(repr(raw)) + "$"
    with pytest.raises(ValueError, match=pattern):
        Config.from_env({"KVCANARY_CUDA_ARCH": raw})
    from kvcanary.kernels import jit

    monkeypatch.setenv("KVCANARY_CUDA_ARCH", raw)
    with pytest.raises(ValueError, match=pattern):
        jit.cuda_arch()
    with pytest.raises(ValueError, match="KVCANARY_CUDA_ARCH"):
        jit.build_directory("cuda")


def test_jit_uses_the_normalised_arch(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from kvcanary.kernels import jit

    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCANARY_CUDA_ARCH", "sm_90a")
    assert jit.cuda_arch() == "9.0a"
    assert jit.build_directory("cuda").name.startswith("cuda-sm90a-")  # the same directory "9.0a" always used
    assert jit.build_directory("cuda", "9.0a") == jit.build_directory("cuda")


# -- paths: KVCANARY_REPORT and KVCANARY_CACHE_DIR are checked at start-up when the canary is on -------------


def _as_unprivileged(fn) -> None:
    """Run ``fn`` where permission bits apply: in a forked child as uid/gid 65534 when we are root, else here.
    The child's exit code carries the outcome (0: fn returned; 3: an assertion failed)."""
    if os.geteuid() != 0:
        fn()
        return
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            fn()
        except AssertionError:
            traceback.print_exc()
            code = 3
        except BaseException:  # noqa: BLE001 - any other failure is a failed test too
            traceback.print_exc()
            code = 4
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child failed with status {status}"


@pytest.fixture
def open_tmp():
    """A temporary directory every user may traverse (pytest's tmp_path sits under a root-only 0700 dir, where
    an unprivileged child would fail for the wrong reason)."""
    path = tempfile.mkdtemp(prefix="kvcanary-test-")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
    shutil.rmtree(path, ignore_errors=True)


def _report_error(path: str) -> str:
    with pytest.raises(ValueError) as info:
        Config.from_env({"KVCANARY_MODE": "log", "KVCANARY_REPORT": path})
    message = str(info.value)
    assert message.startswith("KVCANARY_REPORT: "), message
    assert message.endswith(f"got {path!r}"), message
    return message


def test_report_path_that_is_a_directory(tmp_path) -> None:
    assert "is a directory" in _report_error(str(tmp_path))
    assert "is a directory" in _report_error(str(tmp_path) + "/")


@pytest.mark.parametrize("path", ["/proc/kvcanary.jsonl", "/proc/self/status", "/proc/sys/kernel/kv-{rank}.jsonl",
                                  "/sys/kernel/kv.jsonl", "/proc"])
def test_report_path_under_proc_or_sys(path: str) -> None:
    assert "kernel pseudo-file system" in _report_error(path)


def test_report_path_under_a_file(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "is not a directory" in _report_error(str(blocker / "sub" / "r.jsonl"))


def test_report_path_with_an_unwritable_parent(open_tmp) -> None:
    locked = open_tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    existing = open_tmp / "ro.jsonl"
    existing.write_text("")
    existing.chmod(0o444)
    free = open_tmp / "free"
    free.mkdir()
    free.chmod(0o777)

    def check() -> None:
        assert f"directory {str(locked)!r} is not writable" in _report_error(str(locked / "r.jsonl"))
        assert f"directory {str(locked)!r} is not writable" in _report_error(str(locked / "deeper" / "r-{rank}.jsonl"))
        assert f"{str(existing)!r} is not writable" in _report_error(str(existing))
        # the control: a writable directory passes for the same user
        Config.from_env({"KVCANARY_MODE": "log", "KVCANARY_REPORT": str(free / "sub" / "r.jsonl")})

    _as_unprivileged(check)


def test_good_report_paths_pass(tmp_path) -> None:
    for path in (tmp_path / "new" / "dir" / "kv-{rank}.jsonl", tmp_path / "kv.jsonl", "/dev/null", "/dev/full"):
        cfg = Config.from_env({"KVCANARY_MODE": "raise", "KVCANARY_REPORT": str(path)})
        assert cfg.report_path == str(path)
    assert not (tmp_path / "new").exists()  # checked, not created: the Reporter creates it when it opens


def test_streams_are_accepted_even_through_proc(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read_end, write_end = os.pipe()
    try:
        # /dev/stdout of a process whose stdout is a pipe resolves to /proc/<pid>/fd/pipe:[...]
        for path in (str(fifo), f"/proc/self/fd/{write_end}", "/dev/null"):
            Config.from_env({"KVCANARY_MODE": "log", "KVCANARY_REPORT": path})
    finally:
        os.close(read_end)
        os.close(write_end)


def test_paths_are_not_checked_when_off(tmp_path) -> None:
    cfg = Config.from_env({"KVCANARY_REPORT": str(tmp_path), "KVCANARY_CACHE_DIR": "/proc/self/status"})
    assert cfg.report_path == str(tmp_path) and not cfg.enabled


def _cache_error(path: str) -> str:
    with pytest.raises(ValueError) as info:
        Config.from_env({"KVCANARY_MODE": "log", "KVCANARY_CACHE_DIR": path})
    message = str(info.value)
    assert message.startswith("KVCANARY_CACHE_DIR: ") and message.endswith(f"got {path!r}"), message
    return message


def test_cache_dir_that_is_a_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "is not a directory" in _cache_error(str(blocker))
    assert "is not a directory" in _cache_error(str(blocker / "sub"))
    from kvcanary.kernels import jit

    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(blocker))
    with pytest.raises(ValueError, match="^KVCANARY_CACHE_DIR: .* is not a directory"):
        jit.cache_root()
    with pytest.raises(ValueError, match="^KVCANARY_CACHE_DIR: "):
        jit.build("cpu")


def test_cache_dir_unwritable(open_tmp, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = open_tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    import tvm_ffi.cpp  # noqa: F401 - imported here: the unprivileged child cannot read every site-package

    from kvcanary.kernels import jit

    # Imported and hashed here, as root: the child may not enter the checkout at all (a clone in a 0700 temporary
    # directory or under /root), and where the checkout lives is not what this test checks.
    digest = jit.source_digest()
    monkeypatch.setattr(jit, "source_digest", lambda root=None: digest)

    def check() -> None:
        assert f"directory {str(locked)!r} is not writable" in _cache_error(str(locked / "kvc"))
        # an existing read-only cache is accepted at start-up (a prebuilt cache only loads) ...
        assert Config.from_env({"KVCANARY_MODE": "log", "KVCANARY_CACHE_DIR": str(locked)}).cache_dir == str(locked)
        # ... and the JIT names the variable when it would have to build there
        os.environ["KVCANARY_CACHE_DIR"] = str(locked)
        try:
            jit.build("cpu", force=True)
        except ValueError as exc:
            assert str(exc).startswith("KVCANARY_CACHE_DIR: cannot create the build directory"), str(exc)
        else:
            raise AssertionError("jit.build did not fail in a read-only cache")

    _as_unprivileged(check)


def test_good_cache_dir_passes(tmp_path) -> None:
    cfg = Config.from_env({"KVCANARY_MODE": "log", "KVCANARY_CACHE_DIR": str(tmp_path / "a" / "b")})
    assert cfg.cache_dir == str(tmp_path / "a" / "b")
