"""Command line: ``kvcanary <subcommand>`` (also ``python -m kvcanary``).

Subcommands:
    doctor   build every kernel backend available here, self-test each, print one row per backend.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TextIO

logger = logging.getLogger(__name__)

_COLUMNS = ("backend", "arch", "build", "self-test", "detail")


def _build_parser() -> argparse.ArgumentParser:
    from kvcanary import __version__

    parser = argparse.ArgumentParser(prog="kvcanary", description="KV-cache integrity canary tools.")
    parser.add_argument("--version", action="version", version=f"kvcanary {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log build and self-test details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    doctor = sub.add_parser(
        "doctor",
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
    return parser


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str] = _COLUMNS) -> str:
    """Rows as ``a | b | c`` lines with padded columns (the last column is not padded)."""
    table = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    lines = []
    for i, row in enumerate(table):
        cells = [cell.ljust(widths[j]) for j, cell in enumerate(row[:-1])] + [row[-1]]
        lines.append(" | ".join(cells).rstrip())
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * len(header[-1]))
    return "\n".join(lines)


def _cmd_doctor(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    from kvcanary import __version__, doctor, jit

    out.write(
        f"kvcanary {__version__} | torch {torch.__version__} | tvm-ffi {jit._tvm_ffi_version()} | "
        f"cache {jit.cache_root()}\n"
    )
    out.flush()
    report = doctor.run_doctor(rebuild=args.rebuild, compile_cuda=args.compile_cuda)
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


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Entry point of the ``kvcanary`` console script; returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args, out or sys.stdout))


if __name__ == "__main__":
    sys.exit(main())
