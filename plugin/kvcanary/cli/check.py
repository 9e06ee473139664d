"""``kvcanary check -- <launch_server arguments>``: would kvcanary protect this sglang launch, and how?

The arguments are parsed by sglang's own parser (``ServerArgs.add_cli_args``) and turned into ``ServerArgs``
without a GPU or a model: ``ServerArgs.__post_init__`` is skipped (it reads the device's memory and the model's
config, and may download it), so the object holds the dataclass defaults plus the parsed values, and the defaults
sglang derives there (:data:`NOT_APPLIED`) are not applied. Then exactly the start-up guards the plugin runs
(the installed version module's ``check_supported``, which calls :func:`kvcanary.sglang.guards.check_supported`),
and every row of the settings audit (:mod:`kvcanary.sglang.audit`) that applies, one line each.

Exit status: 0 every applying setting is covered (or has no KV effect); 2 a setting is refused (the start-up
error names the flag as written); 1 the arguments are wrong (sglang's parser says why), or sglang is not installed,
does not import, or is a version kvcanary does not support. Needs no ``KVCANARY_*`` variable.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcanary.sglang.audit import Finding, Verdict

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2

# What ServerArgs.__post_init__ derives and this check therefore does not see (sglang 0.5.12).
NOT_APPLIED = (
    "--page-size unset is read as 1 (sglang: 1, 64 on MUSA)",
    "--speculative-num-steps/--speculative-eagle-topk/--speculative-num-draft-tokens left unset are chosen per "
    "model (Llama: topk 4, which kvcanary refuses)",
    "--speculative-algorithm NEXTN is not turned into EAGLE",
    "--disable-overlap-schedule is not forced for EAGLE topk > 1 or SGLANG_ENABLE_SPEC_V2=0",
    "--disable-radix-cache is not forced for --disaggregation-mode decode",
    "HiCache's io backend and memory layout rewrites, attention backends, memory and CUDA graph sizes",
    "the model's KV pool kind (the model's config is not read): the install refuses EAGLE over an MLA or "
    "sliding-window pool, protect mode on a sliding-window pool, and MLA or sliding-window pools on sglang 0.5.23",
)


class _SglangArgumentError(Exception):
    """sglang's parser rejected the arguments (its message)."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2, which here means "refused"
        raise _SglangArgumentError(message)


@dataclass
class CheckResult:
    exit_code: int
    sglang_version: str | None = None
    version_module: str | None = None
    findings: list[Finding] = field(default_factory=list)  # the rows that apply, in table order
    refusal: str | None = None  # the start-up error the plugin would raise
    error: str | None = None  # why the check could not run (exit 1)
    notes: list[str] = field(default_factory=list)

    @property
    def result(self) -> str:
        return {EXIT_OK: "covered", EXIT_REFUSED: "refused"}.get(self.exit_code, "error")

    def to_json(self) -> dict[str, object]:
        return {
            "result": self.result, "exit_code": self.exit_code, "sglang_version": self.sglang_version,
            "version_module": self.version_module, "refusal": self.refusal, "error": self.error,
            "settings": [{"flag": f.setting.flag, "written": f.written, "field": f.setting.field,
                          "verdict": f.verdict.value, "why": f.setting.why, "test": f.setting.test or None}
                         for f in self.findings],
            "not_applied": list(NOT_APPLIED) if self.error is None else [], "notes": list(self.notes),
        }


def _strip_separator(argv: Sequence[str]) -> list[str]:
    args = list(argv)
    return args[1:] if args[:1] == ["--"] else args


def run_check(launch_args: Sequence[str]) -> CheckResult:
    """Parse ``launch_args`` as ``sglang.launch_server`` would and judge them (see the module docstring)."""
    from kvcanary import sglang as adapter

    try:
        version = adapter._sglang_version()
    except ImportError:
        return CheckResult(EXIT_ERROR, error="sglang is not installed (pip install sglang==0.5.12)")
    try:
        module = adapter.version_module(version)
    except adapter.UnsupportedVersionError as exc:
        return CheckResult(EXIT_ERROR, sglang_version=version, error=str(exc))
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:  # installed but broken: say so, with what failed
        return CheckResult(EXIT_ERROR, sglang_version=version, version_module=module.__name__,
                           error=f"sglang {version} is installed but does not import: {type(exc).__name__}: {exc}")
    result = CheckResult(EXIT_OK, sglang_version=version, version_module=module.__name__)
    parser = _RaisingParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    try:
        namespace = parser.parse_args(_strip_separator(launch_args))
        server_args = _without_post_init(ServerArgs).from_cli_args(namespace)
    except _SglangArgumentError as exc:
        result.exit_code, result.error = EXIT_ERROR, f"sglang's parser: {exc}"
        return result

    from kvcanary.sglang import guards

    try:
        module.check_supported(server_args)
    except guards.UnsupportedSetupError as exc:
        result.exit_code, result.refusal = EXIT_REFUSED, str(exc)
    result.findings = [f for f in guards.audit(server_args, version) if f.applies]
    if result.refusal is None and any(f.verdict is Verdict.REFUSED for f in result.findings):
        # a refused row the guards let through would be a bug in the table: never report it as covered
        result.exit_code = EXIT_REFUSED
        result.refusal = "; ".join(f.written for f in result.findings if f.verdict is Verdict.REFUSED)
    if getattr(server_args, "speculative_algorithm", None) and server_args.speculative_eagle_topk is None:
        result.notes.append("--speculative-eagle-topk is not given: sglang picks it per model at launch (4 for "
                            "Llama, which kvcanary refuses); pass --speculative-eagle-topk 1")
    return result


def _without_post_init(server_args_class: type) -> type:
    """ServerArgs whose ``__post_init__`` does nothing: the dataclass defaults plus the given values."""
    return type(server_args_class.__name__, (server_args_class,), {"__post_init__": lambda self: None})


def render(result: CheckResult) -> str:
    if result.error is not None:
        return f"kvcanary check: {result.error}"
    lines = [f"kvcanary check: sglang {result.sglang_version} ({result.version_module})"]
    width = max(len(v.label) for v in Verdict)
    for f in result.findings:
        test = f" [{f.setting.test}]" if f.setting.test else ""
        lines.append(f"{f.verdict.label:<{width}}  {f.written}: {f.setting.why}{test}")
    if not result.findings:
        lines.append("no audited setting applies: sglang's defaults here are covered")
    lines += [f"note: {n}" for n in result.notes]
    lines.append("not applied (ServerArgs.__post_init__ is skipped: it needs the GPU and the model config): "
                 + "; ".join(NOT_APPLIED))
    if result.refusal is not None:
        lines.append(f"refused at start-up: {result.refusal}")
    else:
        lines.append("ok: kvcanary installs and protects this launch")
    return "\n".join(lines)
