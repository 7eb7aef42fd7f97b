"""Line charts of metric series as inline SVG, drawn on the server: no JavaScript, no library.

A chart draws one metric's traces (a run's page: one; the compare page: one per run) against the
optimizer step (x), on a y axis that padding keeps inside the metric's domain, linear or log (axes.py).
Each trace has a colour class (series-0 … series-7 in console.css), so the page's
Content-Security-Policy needs no inline styles; a smoothed trace (smoothing.py) keeps its raw values as a
faint line behind. Unsmoothed points get a circle each while there are few enough to tell apart, with
their step and value as a tooltip. No tensors, no SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

from loraplex.api.console.axes import Axis, metric_domain, x_axis, y_axis
from loraplex.api.console.smoothing import smooth
from loraplex.runtime.observability.console import ComparedMetric, RunSummary
from loraplex.runtime.observability.history import MetricSeries

WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 28  # margins around the plot area, in SVG units
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
MAX_CIRCLES = 300  # more points than this are drawn as the lines alone
COLOURS = 8  # series-0 … series-7 in console.css


@dataclass(frozen=True)
class Trace:
    """One curve of a chart."""

    points: tuple[tuple[int, float], ...]  # (step, value) in record order
    label: str | None = None  # its name in the legend; None: a chart of one curve needs no legend
    colour: int = 0  # its colour class, series-{colour % COLOURS}


def line_chart(series: MetricSeries) -> Markup:
    """The chart of one run's series, saying how many of its records it draws."""
    shown = f"{len(series.points)} points" + (
        f" of {series.total}" if series.total > len(series.points) else ""
    )
    return metric_chart(series.kind, series.name, [Trace(series.points)], note=shown)


def compared_chart(
    metric: ComparedMetric, runs: Sequence[RunSummary], smoothing: float, is_log: bool
) -> Markup:
    """The chart of one metric of the compare page: a curve per run that has it, coloured by the run's
    place in the comparison (the same colour on every chart)."""
    traces = [
        Trace(series.points, run.run_id, place)
        for place, (run, series) in enumerate(zip(runs, metric.series, strict=True))
        if series is not None
    ]
    return metric_chart(metric.kind, metric.name, traces, smoothing, is_log)


def metric_chart(
    kind: str,
    name: str,
    traces: Sequence[Trace],
    smoothing: float = 0.0,
    is_log: bool = False,
    note: str = "",
) -> Markup:
    """A <figure> holding the SVG chart of metric `name` of requests of `kind`, one polyline per trace.

    A log scale needs every value above 0: a chart with one at or below 0 is drawn linear and says so.
    """
    values = [value for trace in traces for _, value in trace.points]
    log_refused = is_log and any(value <= 0 for value in values)
    y = y_axis(values, metric_domain(name), is_log and not log_refused)
    x = x_axis([step for trace in traces for step, _ in trace.points])
    parts = _frame(x, y)
    for trace in traces:
        parts += _curves(trace, x, y, smoothing)
    if smoothing == 0 and len(values) <= MAX_CIRCLES:
        for trace in traces:
            parts += _circles(trace, x, y)
    notes = [note] if note else []
    if log_refused:
        notes.append("log scale needs every value above 0: drawn linear")
    label = f"{kind} {name}"
    caption = escape(label) + "".join(Markup(' <span class="note">{}</span>').format(n) for n in notes)
    legend = _legend([trace for trace in traces if trace.label is not None])
    return Markup(
        f'<figure class="chart" data-kind="{escape(kind)}" data-metric="{escape(name)}" '
        f'data-points="{len(values)}" data-scale="{"log" if y.is_log else "linear"}" '
        f'data-y-low="{y.low:g}" data-y-high="{y.high:g}"><figcaption>{caption}</figcaption>'
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}">'
        + "".join(parts)
        + f"</svg>{legend}</figure>"
    )


def to_svg(x: Axis, y: Axis, step: float, value: float) -> tuple[float, float]:
    """The SVG coordinates of (step, value), rounded to 0.1 as drawn."""
    return round(LEFT + x.position(step) * PLOT_W, 1), round(TOP + (1 - y.position(value)) * PLOT_H, 1)


def _frame(x: Axis, y: Axis) -> list[str]:
    """Axes, grid lines and tick labels."""
    bottom = TOP + PLOT_H
    parts = [
        f'<line class="axis" x1="{LEFT}" y1="{bottom}" x2="{LEFT + PLOT_W}" y2="{bottom}"/>',
        f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}"/>',
    ]
    for tick in y.ticks:
        _, ty = to_svg(x, y, x.low, tick)
        parts.append(f'<line class="grid" x1="{LEFT}" y1="{ty}" x2="{LEFT + PLOT_W}" y2="{ty}"/>')
        parts.append(
            f'<text class="tick y" x="{LEFT - 6}" y="{ty + 4:.1f}" text-anchor="end">{_num(tick)}</text>'
        )
    for tick in x.ticks:
        tx, _ = to_svg(x, y, tick, y.high)
        parts.append(f'<text class="tick x" x="{tx}" y="{HEIGHT - 8}" text-anchor="middle">{tick:.0f}</text>')
    return parts


def _curves(trace: Trace, x: Axis, y: Axis, smoothing: float) -> list[str]:
    """The trace's line (smoothed when asked), and its raw line behind a smoothed one."""
    colour = f"series-{trace.colour % COLOURS}"
    run = f' data-run="{escape(trace.label)}"' if trace.label is not None else ""
    steps = [step for step, _ in trace.points]
    raw = [value for _, value in trace.points]
    parts = []
    if smoothing > 0:
        parts.append(f'<polyline class="raw {colour}"{run} points="{_points(x, y, steps, raw)}"/>')
    drawn = smooth(raw, smoothing)
    parts.append(f'<polyline class="line {colour}"{run} points="{_points(x, y, steps, drawn)}"/>')
    return parts


def _circles(trace: Trace, x: Axis, y: Axis) -> list[str]:
    colour = f"series-{trace.colour % COLOURS}"
    whose = f"{trace.label}, " if trace.label is not None else ""
    return [
        '<circle class="point {}" cx="{}" cy="{}" r="3"><title>{}step {}: {}</title></circle>'.format(
            colour, *to_svg(x, y, step, value), escape(whose), step, _num(value)
        )
        for step, value in trace.points
    ]


def _points(x: Axis, y: Axis, steps: Sequence[int], values: Sequence[float]) -> str:
    return " ".join(
        "{},{}".format(*to_svg(x, y, step, value)) for step, value in zip(steps, values, strict=True)
    )


def _legend(traces: Sequence[Trace]) -> str:
    if not traces:
        return ""
    items = "".join(
        f'<li class="series-{t.colour % COLOURS}"><span class="swatch"></span>{escape(t.label)}</li>'
        for t in traces
    )
    return f'<ul class="legend">{items}</ul>'


def _num(value: float) -> str:
    """A tick or tooltip number: 4 significant digits."""
    return f"{value:.4g}"
