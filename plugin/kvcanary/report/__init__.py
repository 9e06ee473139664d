"""What kvcanary tells the world: violation records and their log-line and JSONL forms (``record``), the
``Reporter`` that emits them (``reporter``), log-line repeat suppression (``repeats``), the JSONL file (``sink``),
Prometheus counters (``metrics``) and the tables ``kvcanary report`` prints (``table``; the command reads report
files back in ``kvcanary.cli.summarize`` and matches detections to injected faults in ``kvcanary.cli.matcher``,
above the runtime whose fault classes it matches against).

The public report API is importable from here (``from kvcanary.report import parse_log_line, Reporter``), as it
was when ``kvcanary.report`` was one module.
"""

from __future__ import annotations

# layout, LaunchTag, is_write, tag_name, Mode and log_repeat_window_from_env stay importable from here as they were
# from the one-module kvcanary.report (which imported them); they live in kvcanary.kernels and kvcanary.runtime.
from kvcanary.kernels import layout  # noqa: F401
from kvcanary.kernels.tags import LaunchTag, is_write, tag_name  # noqa: F401
from kvcanary.report.record import (
    HEALTH_LOG_PREFIX,
    HEALTH_SCHEMA,
    INJECTION_SCHEMA,
    LOG_KEYS,
    LOG_LINE_RE,
    LOG_PREFIX,
    LOST_LOG_PREFIX,
    LOST_SCHEMA,
    OPTIONAL_LOG_KEYS,
    REPEAT_LINE_RE,
    REPEAT_LOG_KEYS,
    REPEAT_LOG_PREFIX,
    REQUIRED_LOG_KEYS,
    TRAILING_LOG_KEYS,
    VIA_HOST_TIER,
    VIA_VALUES,
    VIOLATION_SCHEMA,
    Violation,
    decode_rid,
    encode_rid,
    from_hex64,
    hex64,
    parse_log_line,
    parse_repeat_line,
    repeat_line,
)
from kvcanary.report.repeats import RepeatFilter, RepeatSummary
from kvcanary.report.reporter import (
    ERROR_MESSAGE_LINES,
    SINK_ERROR_INTERVAL_S,
    SINK_LOG_PREFIX,
    CanaryHealthError,
    CanaryViolationError,
    Reporter,
)
from kvcanary.report.sink import ReportFile
from kvcanary.settings import Mode, log_repeat_window_from_env  # noqa: F401

__all__ = [
    "ERROR_MESSAGE_LINES", "HEALTH_LOG_PREFIX", "HEALTH_SCHEMA", "INJECTION_SCHEMA", "LOG_KEYS", "LOG_LINE_RE",
    "LOG_PREFIX", "LOST_LOG_PREFIX", "LOST_SCHEMA", "OPTIONAL_LOG_KEYS", "REPEAT_LINE_RE", "REPEAT_LOG_KEYS",
    "REPEAT_LOG_PREFIX", "REQUIRED_LOG_KEYS", "SINK_ERROR_INTERVAL_S", "SINK_LOG_PREFIX", "TRAILING_LOG_KEYS",
    "VIA_HOST_TIER", "VIA_VALUES", "VIOLATION_SCHEMA", "CanaryHealthError", "CanaryViolationError", "RepeatFilter",
    "RepeatSummary", "ReportFile", "Reporter", "Violation", "decode_rid", "encode_rid", "from_hex64", "hex64",
    "parse_log_line", "parse_repeat_line", "repeat_line",
]
