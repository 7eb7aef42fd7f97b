"""Line charts of metric series as inline SVG, drawn on the server: no JavaScript, no library.

A chart plots a series' points in record order (x: the record's place, labelled with its step; y: the
value, on a linear scale padded to the data), one circle per point while there are few enough to tell
apart, each with its step and value as a tooltip. Styling comes from console.css through classes, so
the page's Content-Security-Policy needs no inline styles. No tensors, no SQL.
"""

from __future__ import annotations

from markupsafe import Markup, escape

from loraplex.runtime.observability.history import MetricSeries

WIDTH, HEIGHT = 640, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 12, 12, 28  # margins around the plot area, in SVG units
MAX_CIRCLES = 300  # more points than this are drawn as the line alone
_Y_TICKS = 5
_X_TICKS = 6


def line_chart(series: MetricSeries) -> Markup:
    """A <figure> holding the SVG chart of `series`; data-points says how many points it draws."""
    values = [value for _, value in series.points]
    steps = [step for step, _ in series.points]
    low, high = _padded_range(values)
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM
    last = max(len(values) - 1, 1)

    def x(i: int) -> float:
        return _LEFT + (i / last * plot_w if len(values) > 1 else plot_w / 2)

    def y(value: float) -> float:
        return _TOP + (high - value) / (high - low) * plot_h

    parts = [
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_LEFT + plot_w}" y2="{_TOP + plot_h}"/>',
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + plot_h}"/>',
    ]
    for k in range(_Y_TICKS):
        value = low + (high - low) * k / (_Y_TICKS - 1)
        ty = y(value)
        parts.append(f'<line class="grid" x1="{_LEFT}" y1="{ty:.1f}" x2="{_LEFT + plot_w}" y2="{ty:.1f}"/>')
        parts.append(
            f'<text class="tick" x="{_LEFT - 6}" y="{ty + 4:.1f}" text-anchor="end">{_num(value)}</text>'
        )
    x_ticks = {round(k * (len(values) - 1) / (_X_TICKS - 1)) for k in range(_X_TICKS)} if values else set()
    for i in sorted(x_ticks):
        parts.append(
            f'<text class="tick" x="{x(i):.1f}" y="{HEIGHT - 8}" text-anchor="middle">{steps[i]}</text>'
        )
    if values:
        line = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        parts.append(f'<polyline class="line" points="{line}"/>')
    if len(values) <= MAX_CIRCLES:
        for i, (step, value) in enumerate(series.points):
            parts.append(
                f'<circle class="point" cx="{x(i):.1f}" cy="{y(value):.1f}" r="3">'
                f"<title>step {step}: {_num(value)}</title></circle>"
            )
    label = f"{series.kind} {series.name}"
    shown = f"{len(values)} points" + (f" of {series.total}" if series.total > len(values) else "")
    return Markup(
        f'<figure class="chart" data-kind="{escape(series.kind)}" data-metric="{escape(series.name)}" '
        f'data-points="{len(values)}"><figcaption>{escape(label)} <span class="note">{shown}</span>'
        f'</figcaption><svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}">'
        + "".join(parts)
        + "</svg></figure>"
    )


def _padded_range(values: list[float]) -> tuple[float, float]:
    """The y range: the data's, widened by 5 % each way (by half its value around a constant series)."""
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    if high == low:
        pad = abs(low) / 2 or 1.0
        return low - pad, high + pad
    pad = (high - low) * 0.05
    return low - pad, high + pad


def _num(value: float) -> str:
    """A tick or tooltip number: 4 significant digits."""
    return f"{value:.4g}"
