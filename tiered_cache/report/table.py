"""Plain-text tables: aligned columns, no dependencies."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(rows: Sequence[Sequence[object]], headers: Sequence[str] | None = None,
                 align_right: Sequence[int] = ()) -> str:
    """Rows of cells as aligned text; columns listed in `align_right` are right-aligned (numbers)."""
    body = [[str(c) for c in row] for row in rows]
    if headers:
        body.insert(0, [str(h) for h in headers])
    if not body:
        return ""
    widths = [max(len(r[i]) for r in body if i < len(r)) for i in range(max(len(r) for r in body))]
    lines = []
    for n, row in enumerate(body):
        cells = [c.rjust(widths[i]) if i in align_right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if headers and n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
