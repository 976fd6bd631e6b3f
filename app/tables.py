"""The one table renderer of the CLI and the benchmarks: fixed-width text for a terminal, or
Markdown for the README and reports. Columns whose cells are all numbers (``1,234.5``,
``0.61``, ``3e-05``, ``12%``, ``2.1x``) are right-aligned."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"[-+]?[\d,.]+(e[-+]?\d+)?[%x]?")


def is_number(cell: str) -> bool:
    return bool(_NUMBER.fullmatch(cell.strip()))


def fmt_cell(v: Any) -> str:
    """A value as a table cell: floats with one decimal and thousands separators, ints with
    separators, ``None`` as empty."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "" if v is None else str(v)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, markdown: bool = False) -> str:
    """``rows`` under ``headers``; cells that are not strings go through :func:`fmt_cell`."""
    cells = [[c if isinstance(c, str) else fmt_cell(c) for c in r] for r in rows]
    right = [bool(col) and all(is_number(c) for c in col if c) and any(col)
             for col in ([r[i] for r in cells] for i in range(len(headers)))]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---:" if r else "---" for r in right) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(row: Sequence[str], align: Sequence[bool]) -> str:
        return "  ".join(c.rjust(w) if a else c.ljust(w) for c, w, a in zip(row, widths, align)).rstrip()

    return "\n".join([line(headers, [is_number(h) for h in headers]), line(["-" * w for w in widths], right)]
                     + [line(r, [is_number(c) for c in r]) for r in cells])
