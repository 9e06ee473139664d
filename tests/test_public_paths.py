"""The import paths users rely on survive the package's inner layout (issue 31 moved the modules into kernels/,
runtime/, report/ and cli/): ``kvcanary.ops``, the report API at ``kvcanary.report``, the console script
``kvcanary.cli:main``, the sglang entry point ``kvcanary.sglang:register`` and ``python -m kvcanary``."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import kvcanary
import kvcanary.ops
import kvcanary.report
from kvcanary.kernels import call, check, plan_step, row_serials, tokens, verify, write

# Every public name kvcanary.ops had when the wrappers were one module (kernels/ops.py), and the module of
# kvcanary.kernels that holds it now (issue 31 split the wrappers per kernel).
OPS_NAMES = {
    "CheckLaunch": check, "RealKvLaunch": call, "WriteLaunch": write, "canary_check_step": check,
    "canary_plan_step": plan_step, "canary_token_update": tokens, "canary_verify_step": verify,
    "canary_write_step": write, "load_module": call, "prepare_real_kv": call, "real_kv_launch_args": call,
    "canary_row_serial_update": row_serials,
}

# Every public name the one-module kvcanary.report had (its stdlib, typing and logger names aside).
REPORT_NAMES = (
    "CanaryHealthError", "CanaryViolationError", "ERROR_MESSAGE_LINES", "HEALTH_LOG_PREFIX", "HEALTH_SCHEMA",
    "INJECTION_SCHEMA", "LOG_KEYS", "LOG_LINE_RE", "LOG_PREFIX", "LOST_LOG_PREFIX", "LOST_SCHEMA", "LaunchTag", "Mode",
    "OPTIONAL_LOG_KEYS", "REPEAT_LINE_RE", "REPEAT_LOG_KEYS", "REPEAT_LOG_PREFIX", "REQUIRED_LOG_KEYS",
    "RepeatFilter", "RepeatSummary", "ReportFile", "Reporter", "SINK_ERROR_INTERVAL_S", "SINK_LOG_PREFIX",
    "TRAILING_LOG_KEYS", "VIA_HOST_TIER", "VIA_VALUES", "VIOLATION_SCHEMA", "Violation", "decode_rid", "encode_rid",
    "from_hex64", "hex64", "is_write", "layout", "log_repeat_window_from_env", "parse_log_line", "parse_repeat_line",
    "repeat_line", "tag_name",
)


def test_kvcanary_ops_is_the_kernel_wrappers() -> None:
    assert sorted(kvcanary.ops.__all__) == sorted(OPS_NAMES)
    for name, module in OPS_NAMES.items():
        assert getattr(kvcanary.ops, name) is getattr(module, name), name


def test_the_report_api_is_importable_from_kvcanary_report() -> None:
    missing = [name for name in REPORT_NAMES if not hasattr(kvcanary.report, name)]
    assert not missing, missing
    assert set(kvcanary.report.__all__) <= set(REPORT_NAMES)
    from kvcanary.report import parse_log_line

    assert parse_log_line("x kvcanary violation: step=1 tag=verify")["step"] == "1"


def test_entry_points_resolve() -> None:
    assert callable(pkgutil.resolve_name("kvcanary.cli:main"))
    assert callable(pkgutil.resolve_name("kvcanary.sglang:register"))


def test_python_dash_m_kvcanary() -> None:
    env = dict(os.environ)
    package_parent = str(Path(kvcanary.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "kvcanary", "--version"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvcanary {kvcanary.__version__}"
