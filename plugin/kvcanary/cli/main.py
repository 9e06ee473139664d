"""Command line: ``kvcanary <subcommand>`` (also ``python -m kvcanary``).

Subcommands:
    doctor   build every kernel backend available here, self-test each, print one row per backend.
    build    build the kernels into the cache once, for an image build (the CUDA kernels need nvcc, not a GPU).
    demo     the real manager and kernels protect a simulated serving loop; inject every fault class; print a table.
    report   summarise JSONL report files (one per rank): violations, lost/health records, injections matched.
    check    judge sglang launch_server arguments: which settings kvcanary covers, refuses, or that move no KV.

``-v`` (log details) goes before or after the subcommand.

A bad ``KVCANARY_*`` value is one line naming the variable (exit 2), Ctrl-C one line ``interrupted`` (exit 130),
and a reader that leaves the pipe (``kvcanary doctor | head -1``) a quiet stop (exit 141, as if killed by SIGPIPE):
never a traceback. An unknown flag is named with the usage of the (sub)command it was given to.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from kvcanary.report.table import format_table as _format_table
from kvcanary.settings import ConfigError

logger = logging.getLogger(__name__)

_COLUMNS = ("backend", "arch", "build", "self-test", "detail")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
_MAX_BAD_LINES_ON_STDERR = 100
# demo limits: a longer run is a typo (--seconds inf, 1e309; an injection count of 23 digits), not a demo
MAX_DEMO_SECONDS = 3600.0
MAX_INJECTIONS = 1000
EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str] = _COLUMNS) -> str:
    """Rows as ``a | b | c`` lines with padded columns (the last column is not padded)."""
    return _format_table(rows, header)


def _fault_list(text: str) -> tuple[str, ...]:
    from kvcanary.cli.demo import parse_faults

    try:
        return parse_faults(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--faults: ")) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_DEMO_SECONDS:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, {MAX_DEMO_SECONDS:g}], got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:  # also a number too long for int() (over 4300 digits)
        value = 0
    if not 1 <= value <= MAX_INJECTIONS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_INJECTIONS}], got {text!r}")
    return value


def _unknown_message(tokens: Sequence[str], known: Sequence[str]) -> str:
    """``unrecognized arguments: --verison (did you mean --version?)``."""
    hints = []
    for token in tokens:
        name = token.split("=", 1)[0]
        # 0.75, not difflib's 0.6: "--bogus" is not a misspelt "--verbose"
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75) if name.startswith("-") else []
        hints.append(f"{token} (did you mean {close[0]}?)" if close else token)
    return "unrecognized arguments: " + " ".join(hints)


# ``kvcanary check``'s own options; everything after them is sglang's (with or without a ``--`` before it)
_CHECK_OPTIONS = frozenset({"--json", "-v", "--verbose", "-h", "--help"})


def _check_args(argv: list[str]) -> list[str]:
    """``argv`` with a ``--`` put in front of sglang's arguments after ``check`` when the user left it out: an sglang
    flag is not kvcanary's, and argparse would refuse it as unknown with exit status 2, which ``check`` uses for a
    refused setting."""
    i = next((k for k, token in enumerate(argv) if not token.startswith("-")), None)
    if i is None or argv[i] != "check":
        return argv
    j = i + 1
    while j < len(argv) and argv[j] in _CHECK_OPTIONS:
        j += 1
    if j < len(argv) and argv[j] != "--":
        return [*argv[:j], "--", *argv[j:]]
    return argv


class _Parser(argparse.ArgumentParser):
    """argparse that names an unknown flag where it was given. Plain argparse reports one after a subcommand with
    the top-level usage, and one before any subcommand only as "the following arguments are required: COMMAND"."""

    commands: dict[str, argparse.ArgumentParser]  # the subcommands' parsers (set by _build_parser)

    def _options(self) -> list[str]:
        return list(self._option_string_actions)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        argv = _check_args(sys.argv[1:] if args is None else list(args))
        commands = getattr(self, "commands", {})
        leading = []
        for token in argv:
            if token in commands or token == "--" or not token.startswith("-"):
                break
            leading.append(token)
        options = self._options()
        unknown = [t for t in leading if t.split("=", 1)[0] not in options
                   and not (t.startswith("--") and any(o.startswith(t.split("=", 1)[0]) for o in options))]
        if unknown:
            self.error(_unknown_message(unknown, options))
        ns, extras = self.parse_known_args(argv, namespace)
        if extras:
            sub = commands.get(getattr(ns, "command", None) or "")
            target = sub if isinstance(sub, _Parser) else self
            target.error(_unknown_message(extras, target._options()))
        return ns


def _build_parser() -> argparse.ArgumentParser:
    from kvcanary import __version__

    parser = _Parser(prog="kvcanary", description="KV-cache integrity canary tools.")
    parser.add_argument("--version", action="version", version=f"kvcanary {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log build, self-test and run details")
    # The same flag after the subcommand (`kvcanary doctor -v`); SUPPRESS keeps a -v given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log build, self-test and run details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.commands = sub.choices  # the same dict: subcommands added below are in it

    doctor = sub.add_parser(
        "doctor",
        parents=[common],
        help="build the kernels for every available backend and self-test them",
        description=(
            "Build the CPU kernels (and the CUDA kernels when a CUDA device is present), then write, verify and "
            "corrupt a small canary chain on each backend. Exit status 0 only if every row passes."
        ),
    )
    doctor.add_argument("--rebuild", action="store_true", help="rebuild even when the build cache has the library")
    doctor.add_argument(
        "--compile-cuda",
        action="store_true",
        help="without a CUDA device: compile the CUDA kernels anyway (needs nvcc) and report the build only",
    )
    doctor.set_defaults(func=_cmd_doctor)

    build = sub.add_parser(
        "build",
        parents=[common],
        help="build the kernels into the cache once (an image build step), without a GPU",
        description=(
            "Build the kernels into the build cache ($KVCANARY_CACHE_DIR, default ~/.cache/kvcanary) so that no "
            "process pays for it at start-up: run it where the image is built, e.g. a Dockerfile's "
            "'RUN KVCANARY_CACHE_DIR=/opt/kvcanary-cache kvcanary build --backend all --arch 9.0a' with the same "
            "KVCANARY_CACHE_DIR in the serving environment. The CUDA build needs nvcc, not a GPU. Exit status 0 "
            "when every asked backend built (or was already in the cache)."
        ),
    )
    build.add_argument("--backend", choices=("cpu", "cuda", "all"), default="all",
                       help="what to build (default all: cpu, and cuda when nvcc is on PATH or CUDA_HOME)")
    build.add_argument("--arch", default=None, metavar="ARCH",
                       help="the CUDA arch to build for (e.g. 9.0a; default $KVCANARY_CUDA_ARCH, else this GPU's, "
                            "else 9.0a)")
    build.add_argument("--rebuild", action="store_true", help="rebuild even when the cache has the library")
    build.set_defaults(func=_cmd_build)

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="watch the canary catch every fault class in a simulated serving loop (no sglang, no GPU needed)",
        description=(
            "The real CanaryManager and kernels protect a simulated paged-KV serving loop (prefix sharing, eviction, "
            "slot reuse, chunked prefill, decode) for a few seconds of clean traffic, then each fault class is "
            "injected and repaired in turn. Prints what was verified, what was detected, how fast, and the false "
            "positives. Exit status 0 only if every injection was detected and nothing else was reported. "
            "With --mode protect (or KVCANARY_MODE=protect) the same faults are acted on as protect mode does in "
            "sglang (the request recomputed from the tokens it keeps, the prefix-cache nodes holding bad slots "
            "evicted; KVCANARY_PROTECT_HOLD=0 acts only when the drain reports), the simulated tokens depend on the "
            "K/V each request reads, and every finished request's output is compared with its output over clean K/V; "
            "exit status 0 only if, in addition, every injection was acted on and every output equals the clean one."
        ),
    )
    demo.add_argument("--seconds", type=_positive_float, default=3.0, help="clean serving before the faults (3)")
    demo.add_argument("--faults", type=_fault_list, default=None, metavar="CLASS[,CLASS...]",
                      help="fault classes to inject (default: all): " + ", ".join(_fault_classes()))
    demo.add_argument("--injections", type=_positive_int, default=3, metavar="N", help="injections per class (3)")
    demo.add_argument("--device", choices=("cpu", "cuda"), default=None,
                      help="where the canary runs (default: cuda when available, else cpu)")
    demo.add_argument("--seed", type=int, default=0, help="seeds the workload and the injections (0)")
    demo.add_argument("--mode", choices=("log", "protect"), default=None,
                      help="log: report the faults; protect: act on them and compare the outputs with a clean run's "
                           "(default: protect when KVCANARY_MODE=protect, else log)")
    demo.add_argument("--json", action="store_true", help="print the result as one JSON object")
    demo.set_defaults(func=_cmd_demo)

    report = sub.add_parser(
        "report",
        parents=[_verbose_parent("no effect here: report prints its bad-line messages on stderr either way")],
        help="summarise KVCANARY_REPORT JSONL files (one per rank)",
        description=(
            "Read kvcanary JSONL reports (paths or quoted globs, e.g. 'kv-*.jsonl') and summarise them: violations "
            "per reason, rank and tag, top slots and requests, the step range, lost and health records, and "
            "injected faults (kvcanary.injection/1) matched to the violations they caused. A line that is not a "
            "kvcanary record (or is cut off) is reported as FILE:LINE and skipped; the exit status is then 1."
        ),
    )
    report.add_argument("files", nargs="+", metavar="FILE", help="JSONL report files, glob patterns, or - for stdin")
    report.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    report.set_defaults(func=_cmd_report)

    check = sub.add_parser(
        "check",
        parents=[common],
        help="would kvcanary protect this sglang launch? (kvcanary check -- <launch_server arguments>)",
        description=(
            "Parse sglang launch_server arguments (everything after --) with sglang's own parser, without a GPU "
            "or the model (ServerArgs.__post_init__ is skipped; the output lists the derived defaults that are "
            "therefore not applied), run the start-up guards the kvcanary plugin runs, and print one line per "
            "audited setting that applies: covered, refused or no KV effect, and why. Exit status 0: everything "
            "covered; 2: a setting is refused (named as written); 1: the arguments are wrong, or sglang is "
            "missing or not a supported version. Needs no KVCANARY_* variable."
        ),
    )
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")
    check.add_argument("launch_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                       help="sglang.launch_server arguments, after --")
    check.set_defaults(func=_cmd_check)
    return parser


def _verbose_parent(help_text: str) -> argparse.ArgumentParser:
    """``-v`` after a subcommand whose help says what it does there; SUPPRESS keeps a -v given before it."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=help_text)
    return parent


def _fault_classes() -> tuple[str, ...]:
    from kvcanary.runtime.faults import FAULT_CLASSES

    return FAULT_CLASSES


def _cmd_doctor(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    from kvcanary import __version__
    from kvcanary.cli import doctor
    from kvcanary.kernels import jit

    doctor.check_environment()  # a bad cache dir or sanitizer: one named line before the header, not a traceback
    out.write(
        f"kvcanary {__version__} | torch {torch.__version__} | tvm-ffi {jit._tvm_ffi_version()} | "
        f"cache {jit.cache_root()}\n"
    )
    out.flush()
    report = doctor.run_doctor(rebuild=args.rebuild, compile_cuda=args.compile_cuda, progress=_progress)
    rows = [(r.label, r.arch, r.build_column, r.status, r.detail) for r in report.rows]
    out.write(format_table(rows) + "\n")
    for row in report.rows:
        if row.selftest is not None and not row.selftest.passed:
            for check in row.selftest.checks:
                out.write(f"  {row.label}: {'ok  ' if check.passed else 'FAIL'} {check.name}: {check.detail}\n")
    for note in report.notes:
        out.write(f"note: {note}\n")
    out.write(("all backends passed" if report.passed else "kvcanary doctor: FAILED") + "\n")
    return 0 if report.passed else 1


def _cmd_build(args: argparse.Namespace, out: TextIO) -> int:
    import shutil

    from kvcanary.cli import doctor
    from kvcanary.kernels import jit
    from kvcanary.settings import parse_cuda_arch

    doctor.check_environment()  # a bad cache dir or sanitizer: one named line
    arch = parse_cuda_arch(args.arch, "--arch") if args.arch else None
    backends = ["cpu", "cuda"] if args.backend == "all" else [args.backend]
    if args.backend == "all" and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        backends = ["cpu"]
        out.write("kvcanary build: no nvcc on PATH and no CUDA_HOME: the cuda kernels are not built\n")
    for backend in backends:
        build_arch = (arch or jit.cuda_arch()) if backend == "cuda" else None
        if args.rebuild or not jit.is_built(backend, arch=build_arch):
            _progress(f"kvcanary build: building the {backend} kernels (~{jit.TYPICAL_BUILD_SECONDS[backend]} s) ...")
        try:
            info = jit.build(backend, arch=build_arch, force=args.rebuild)
        except Exception as exc:  # a compiler or toolchain error: its first line, naming the backend
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            hint = " (the CUDA build needs nvcc: on PATH, or CUDA_HOME)" if backend == "cuda" else ""
            sys.stderr.write(f"kvcanary build: the {backend} build failed: {first}{hint}\n")
            return 1
        out.write(f"{backend}\t{info.arch}\t{'cached' if info.cached else f'{info.seconds:.1f} s'}\t{info.library}\n")
    out.write(f"cache {jit.cache_root()}: set KVCANARY_CACHE_DIR to it where kvcanary runs\n")
    return 0


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    from kvcanary.cli import demo

    settings = demo.settings_from_env()  # the plugin's rules: a bad KVCANARY_* value stops the demo, named
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("kvcanary demo: --device cuda, but torch sees no CUDA device\n")
        return 2

    result = demo.run_demo(
        seconds=args.seconds,
        fault_classes=args.faults or _fault_classes(),
        device=args.device,
        per_class=args.injections,
        seed=args.seed,
        quiet_log=not args.verbose,
        progress=_progress,
        settings=settings,
        mode=args.mode,
    )
    if args.json:
        out.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        out.write(demo.render(result) + "\n")
    return 0 if result.passed else 1


def _progress(text: str) -> None:
    """A progress line on stderr, so that stdout stays the result alone."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _cmd_report(args: argparse.Namespace, out: TextIO) -> int:
    from kvcanary.cli import summarize

    summary, unmatched = summarize.read_reports(args.files)
    for pattern in unmatched:  # (a name with control characters is quoted, never written raw to the terminal)
        sys.stderr.write(f"kvcanary report: {pattern if pattern.isprintable() else repr(pattern)}: no such file\n")
    unreadable = {bad.path for bad in summary.bad_lines if bad.line == 0}  # (line 0: the file itself, e.g. a dir)
    if not summary.files or set(summary.files) <= unreadable:
        for bad in summary.bad_lines:
            sys.stderr.write(f"kvcanary report: {bad}\n")
        sys.stderr.write("kvcanary report: no report file to read\n")
        return 2
    for bad in summary.bad_lines[:_MAX_BAD_LINES_ON_STDERR]:
        sys.stderr.write(f"kvcanary report: {bad}\n")
    more = len(summary.bad_lines) - _MAX_BAD_LINES_ON_STDERR
    if more > 0:
        sys.stderr.write(f"kvcanary report: ... and {more} more bad lines\n")
    if args.json:
        out.write(json.dumps(summary.to_json(), indent=2) + "\n")
    else:
        out.write(summarize.render(summary) + "\n")
    return 1 if summary.bad_lines or unmatched else 0


def _cmd_check(args: argparse.Namespace, out: TextIO) -> int:
    from kvcanary.cli import check

    result = check.run_check(args.launch_args)
    if args.json:
        out.write(json.dumps(result.to_json(), indent=2) + "\n")
    elif result.error is not None:
        sys.stderr.write(check.render(result) + "\n")
    else:
        out.write(check.render(result) + "\n")
    return result.exit_code


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Entry point of the ``kvcanary`` console script; returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format=LOG_FORMAT)
    try:
        return int(args.func(args, out or sys.stdout))
    except ConfigError as exc:  # a bad KVCANARY_* value: the message names the variable
        sys.stderr.write(f"kvcanary {args.command}: {exc}\n")
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        sys.stderr.write(f"kvcanary {args.command}: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader left (`| head -1`): nothing more to say, and no one to say it to
        _silence_standard_streams()
        return EXIT_BROKEN_PIPE


def _silence_standard_streams() -> None:
    """Point stdout and stderr at /dev/null, so that the interpreter's final flush of text still buffered for the
    closed pipe does not raise again (Python would print "Exception ignored" and exit 120)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a real file (a test's StringIO): nothing to flush
            continue


if __name__ == "__main__":
    sys.exit(main())
