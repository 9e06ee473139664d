"""Plain-text tables for the ``kvcanary`` commands (doctor, demo, report)."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str], *, right: Sequence[int] = ()) -> str:
    """Rows as ``a | b | c`` lines under a header and a rule; columns padded to their widest cell (the last column
    is not padded unless right-aligned). ``right``: indices of right-aligned (numeric) columns."""
    table = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    ncols = len(header)
    widths = [max(len(r[i]) for r in table) for i in range(ncols)]
    last = ncols - 1

    def cell(i: int, text: str) -> str:
        if i in right:
            return text.rjust(widths[i])
        return text if i == last else text.ljust(widths[i])

    lines = []
    for n, row in enumerate(table):
        lines.append(" | ".join(cell(i, c) for i, c in enumerate(row)).rstrip())
        if n == 0:  # the unpadded last column's rule is as wide as its header
            rule = [w if i in right or i != last else len(table[0][i]) for i, w in enumerate(widths)]
            lines.append("-+-".join("-" * w for w in rule))
    return "\n".join(lines)
