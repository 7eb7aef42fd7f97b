"""The sweep chart and table: `python -m loraplex.bench.chart SWEEP.jsonl OUT.png` draws a `bench train
--sweep --json` output as a grid of line charts (rows: figures; columns: ranks; x: tokens per slot; one
line per slot count; grey: the docs/BENCHMARKS.md target where there is one) and prints it as a Markdown
table.

Plain data in, PNG bytes and text out (raster.py draws); knows nothing of how the figures were measured.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from loraplex.bench.raster import GLYPH_HEIGHT, Canvas, Color

# (summary field, row title, target or None)
FIGURES: tuple[tuple[str, str, float | None], ...] = (
    ("tokens_per_s", "tokens/s", None),
    ("speedup_vs_naive_peft", "speedup vs naive peft", 3.0),
    ("fusion_efficiency", "fusion efficiency", 0.9),
    ("roofline_fraction", "roofline fraction", 0.5),
)
_SLOT_COLORS: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
_INK, _GRID, _TARGET = (30, 30, 30), (225, 225, 225), (150, 150, 150)
_PANEL_W, _PANEL_H = 250, 150
_LEFT, _TOP, _GAP_X, _GAP_Y = 60, 64, 70, 58


def _nice_max(value: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above value (1 for non-positive values)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= value)


def _label(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:g}K"
    return f"{value:g}"


def _panel(
    canvas: Canvas,
    left: int,
    top: int,
    title: str,
    xs: Sequence[int],
    lines: dict[int, list[float | None]],
    target: float | None,
    y_max: float,
) -> None:
    """One chart: x categories evenly spaced, y from 0 to y_max, 4 labelled gridlines."""
    canvas.text(left, top - 14, title, _INK)
    bottom, right = top + _PANEL_H, left + _PANEL_W

    def to_y(value: float) -> int:
        return bottom - round(value / y_max * _PANEL_H)

    for i in range(5):
        y = bottom - round(i * _PANEL_H / 4)
        canvas.line(left, y, right, y, _GRID)
        label = _label(y_max * i / 4)
        canvas.text(left - 6 - Canvas.text_width(label), y - GLYPH_HEIGHT // 2, label, _INK)
    step = _PANEL_W / max(1, len(xs) - 1) if len(xs) > 1 else 0
    x_at = [left + round(i * step) if len(xs) > 1 else left + _PANEL_W // 2 for i in range(len(xs))]
    for x, tokens in zip(x_at, xs, strict=True):
        canvas.line(x, bottom, x, bottom + 3, _INK)
        canvas.text(x - Canvas.text_width(str(tokens)) // 2, bottom + 6, str(tokens), _INK)
    if target is not None and target <= y_max:
        for x in range(left, right, 6):
            canvas.line(x, to_y(target), min(x + 2, right), to_y(target), _TARGET)
    for color, series in zip(_SLOT_COLORS, lines.values(), strict=False):
        points = [(x, to_y(v)) for x, v in zip(x_at, series, strict=True) if v is not None]
        for (x0, y0), (x1, y1) in pairwise(points):
            canvas.line(x0, y0, x1, y1, color, width=2)
        for x, y in points:
            canvas.rect(x - 2, y - 2, x + 2, y + 2, color)
    canvas.line(left, top, left, bottom, _INK)
    canvas.line(left, bottom, right, bottom, _INK)


def render_sweep(points: list[dict[str, Any]], title: str) -> bytes:
    """PNG bytes of the grid: a row per FIGURES entry present (one y axis), a column per rank."""
    ranks = sorted({p["rank"] for p in points})
    slot_counts = sorted({p["slots"] for p in points})
    xs = sorted({p["tokens_per_slot"] for p in points})
    figures = [f for f in FIGURES if any(p.get(f[0]) is not None for p in points)]
    width = _LEFT + len(ranks) * (_PANEL_W + _GAP_X)
    height = _TOP + len(figures) * (_PANEL_H + _GAP_Y) + 10
    canvas = Canvas(width, height)
    canvas.text(_LEFT - 40, 10, title, _INK)
    legend_x = _LEFT - 40
    for color, slots in zip(_SLOT_COLORS, slot_counts, strict=False):
        label = f"{slots} slot" + ("s" if slots != 1 else "")
        canvas.rect(legend_x, 30, legend_x + 12, 36, color)
        canvas.text(legend_x + 18, 30, label, _INK)
        legend_x += 30 + Canvas.text_width(label)
    canvas.line(legend_x, 33, legend_x + 12, 33, _TARGET)
    canvas.text(legend_x + 18, 30, "target (docs/BENCHMARKS.md)   x: tokens per slot", _INK)
    by_key = {(p["rank"], p["slots"], p["tokens_per_slot"]): p for p in points}
    for row, (field, name, target) in enumerate(figures):
        values = [p[field] for p in points if p.get(field) is not None]
        y_max = _nice_max(max([*values, target or 0.0]))
        for column, rank in enumerate(ranks):
            lines = {
                slots: [by_key.get((rank, slots, x), {}).get(field) for x in xs] for slots in slot_counts
            }
            left = _LEFT + column * (_PANEL_W + _GAP_X)
            top = _TOP + 16 + row * (_PANEL_H + _GAP_Y)
            _panel(canvas, left, top, f"{name}, rank {rank}", xs, lines, target, y_max)
    return canvas.to_png()


# (summary field, column title, format) of the Markdown table.
_TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rank", "rank", "{}"),
    ("slots", "slots", "{}"),
    ("tokens_per_slot", "tokens/slot", "{}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("naive_peft_tokens_per_s", "naive PEFT tokens/s", "{:.0f}"),
    ("speedup_vs_naive_peft", "speedup vs naive", "{:.2f}"),
    ("fusion_efficiency", "fusion efficiency", "{:.2f}"),
    ("roofline_fraction", "roofline fraction", "{:.3f}"),
    ("dense_matmul_gflops", "dense GFLOP/s", "{:.0f}"),
    ("cpu_stall_fraction", "CPU stalled", "{:.0%}"),
)


def sweep_table(points: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table, one row per point in the given order (medians)."""
    header = "| " + " | ".join(title for _, title, _ in _TABLE_COLUMNS) + " |"
    rule = "|" + "|".join("---:" for _ in _TABLE_COLUMNS) + "|"
    rows = [
        "| "
        + " | ".join("–" if p.get(key) is None else fmt.format(p[key]) for key, _, fmt in _TABLE_COLUMNS)
        + " |"
        for p in points
    ]
    return "\n".join([header, rule, *rows])


def read_points(path: Path) -> list[dict[str, Any]]:
    """The sweep points of a `bench train --sweep --json` output file."""
    lines = Path(path).read_text().splitlines()
    return [p for p in map(json.loads, filter(None, lines)) if p.get("kind") == "sweep_point"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: SWEEP.jsonl OUT.png [TITLE]."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3):
        print("usage: python -m loraplex.bench.chart SWEEP.jsonl OUT.png [TITLE]", file=sys.stderr)
        return 2
    points = read_points(Path(args[0]))
    if not points:
        print(f"no sweep_point lines in {args[0]}", file=sys.stderr)
        return 2
    title = args[2] if len(args) == 3 else "loraplex bench train --sweep"
    Path(args[1]).write_bytes(render_sweep(points, title))
    print(sweep_table(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
