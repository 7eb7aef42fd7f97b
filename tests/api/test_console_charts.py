"""The console's charts: TensorBoard's debiased EMA, the axis rules (padding never leaves a metric's
domain, ticks are round numbers) and the SVG an overlay chart draws, point by point. Expected values are
worked out by hand (or by pandas) in the comments, not by the code under test."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest

from loraplex.api.console.axes import (
    DOMAIN_RULES,
    FRACTION,
    NON_NEGATIVE,
    UNBOUNDED,
    metric_domain,
    nice_step,
    y_axis,
)
from loraplex.api.console.charts import Trace, metric_chart
from loraplex.api.console.smoothing import smooth


def test_smoothing_is_the_debiased_ema_so_it_starts_at_the_first_value() -> None:
    # w = 0.5: ema 0.5, 1.25, 2.125 over debias 1 - 0.5**n = 0.5, 0.75, 0.875
    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.6666667, 2.4285714])


def test_smoothing_equals_pandas_adjusted_ewm() -> None:
    values = [4.0, 9.0, 1.0, 7.5, 3.25, 8.0, 2.0]
    for weight in (0.0, 0.3, 0.6, 0.95):
        reference = pd.Series(values).ewm(alpha=1 - weight, adjust=True).mean().tolist() if weight else values
        assert smooth(values, weight) == pytest.approx(reference)


def test_smoothing_keeps_a_constant_series_and_refuses_a_weight_outside_0_to_1() -> None:
    assert smooth([2.5] * 6, 0.9) == pytest.approx([2.5] * 6)
    for weight in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="smoothing weight must be in"):
            smooth([1.0], weight)


@pytest.mark.parametrize(
    ("name", "domain"),
    [
        ("grad_norm", NON_NEGATIVE),
        ("learning_rate", NON_NEGATIVE),
        ("loss:sum", NON_NEGATIVE),
        ("clip_fraction:mean", FRACTION),
        # the server's training and sampling health (docs/METRICS.md)
        ("train/tokens", NON_NEGATIVE),
        ("rl/kl_sample_train_v1", NON_NEGATIVE),
        ("rl/kl_sample_train_v2", NON_NEGATIVE),
        ("rl/logprob_abs_diff_max", NON_NEGATIVE),
        ("rl/clipped_tokens", NON_NEGATIVE),
        ("rl/advantage_std", NON_NEGATIVE),
        ("sample/sequences", NON_NEGATIVE),
        ("sample/tokens", NON_NEGATIVE),
        ("sample/length_mean", NON_NEGATIVE),
        ("sample/stop_reason_stop", NON_NEGATIVE),
        ("sample/stop_reason_length", NON_NEGATIVE),
        ("rl/advantage_mean", UNBOUNDED),
        ("reward", UNBOUNDED),
    ],
)
def test_a_metrics_domain_is_read_from_its_name(name: str, domain: object) -> None:
    assert metric_domain(name) == domain


def test_a_grad_norm_axis_starts_exactly_at_0_where_padding_would_go_below() -> None:
    # span 0.298, padded 5 % each way: -0.0129 .. 0.3149; step 0.1 (0.3278 / 4 = 0.082 -> 0.1)
    axis = y_axis([0.002, 0.01, 0.3], metric_domain("grad_norm"))
    assert (axis.low, axis.high) == (0.0, 0.4)
    assert axis.ticks == (0.0, 0.1, 0.2, 0.3, 0.4)
    unbounded = y_axis([0.002, 0.01, 0.3], metric_domain("rl/advantage_mean"))
    assert (unbounded.low, unbounded.high) == (-0.1, 0.4)


def test_a_fraction_axis_stops_at_1_and_a_constant_0_norm_at_0() -> None:
    # 0.9 .. 1.0 padded: 0.895 .. 1.005, step 0.05 -> 0.85 .. 1.05, capped at 1
    axis = y_axis([0.9, 1.0, 0.95], FRACTION)
    assert (axis.low, axis.high, axis.ticks) == (0.85, 1.0, (0.85, 0.9, 0.95, 1.0))
    flat = y_axis([0.0, 0.0], NON_NEGATIVE)  # padded by 1 each way, step 0.5
    assert (flat.low, flat.high, flat.ticks) == (0.0, 1.0, (0.0, 0.5, 1.0))


def test_data_outside_a_domain_widens_the_axis_rather_than_being_hidden() -> None:
    # a KL estimate that came out negative: -0.02 .. 0.05 padded, step 0.02 -> -0.04 .. 0.06
    axis = y_axis([-0.02, 0.05], metric_domain("rl/kl_sample_train_v1"))
    assert (axis.low, axis.high) == (-0.04, 0.06)


def test_ticks_are_1_2_or_5_times_a_power_of_ten() -> None:
    assert [nice_step(span, 4) for span in (35.64, 0.33, 7.0, 1e-5)] == [10.0, 0.1, 2.0, 5e-6]
    axis = y_axis([10.3, 42.7], UNBOUNDED)  # 8.68 .. 44.32, step 10
    assert axis.ticks == (0.0, 10.0, 20.0, 30.0, 40.0, 50.0)


def test_a_log_axis_spans_whole_decades() -> None:
    axis = y_axis([0.003, 0.2], NON_NEGATIVE, is_log=True)
    assert (axis.low, axis.high, axis.ticks) == (0.001, 1.0, (0.001, 0.01, 0.1, 1.0))
    within = y_axis([2.0, 8.0], UNBOUNDED, is_log=True)
    assert within.ticks == (1.0, 2.0, 5.0, 10.0)


def _figure(markup: str) -> ET.Element:
    return ET.fromstring(str(markup))


def _lines(figure: ET.Element, kind: str = "line") -> dict[str, str]:
    return {
        p.get("data-run", ""): p.get("points", "")
        for p in figure.iter("polyline")
        if p.get("class", "").split()[0] == kind
    }


TWO_RUNS = [
    Trace(((1, 0.1), (2, 0.3), (3, 0.2)), "run-a", 0),
    Trace(((1, 0.2), (3, 0.4)), "run-b", 1),
]


def test_an_overlay_chart_draws_one_polyline_per_run_at_the_right_points() -> None:
    figure = _figure(metric_chart("optim_step", "grad_norm", TWO_RUNS))
    # y: 0.1 .. 0.4 padded, step 0.1 -> 0 .. 0.5; x: steps 1 .. 3. Plot area x 64 .. 628, y 12 .. 192:
    # x = 64 + (step - 1) / 2 * 564, y = 12 + (1 - value / 0.5) * 180.
    assert (figure.get("data-y-low"), figure.get("data-y-high")) == ("0", "0.5")
    assert _lines(figure) == {
        "run-a": "64.0,156.0 346.0,84.0 628.0,120.0",
        "run-b": "64.0,120.0 628.0,48.0",
    }
    colours = [p.get("class") for p in figure.iter("polyline")]
    assert colours == ["line series-0", "line series-1"]
    legend = [(li.get("class"), "".join(li.itertext())) for li in figure.iter("li")]
    assert legend == [("series-0", "run-a"), ("series-1", "run-b")]
    assert len(list(figure.iter("circle"))) == 5


def test_a_smoothed_chart_draws_the_smoothed_line_over_the_faint_raw_one() -> None:
    figure = _figure(metric_chart("optim_step", "grad_norm", TWO_RUNS, smoothing=0.5))
    assert _lines(figure, "raw")["run-a"] == "64.0,156.0 346.0,84.0 628.0,120.0"
    # smoothed run-a: 0.1, 0.175 / 0.75 = 0.2333, 0.1875 / 0.875 = 0.2143 -> y 156.0, 108.0, 114.9
    assert _lines(figure)["run-a"] == "64.0,156.0 346.0,108.0 628.0,114.9"
    assert not list(figure.iter("circle"))


def test_a_log_scale_is_refused_with_a_note_for_values_at_or_below_0() -> None:
    refused = _figure(
        metric_chart("forward_backward", "rl/advantage_mean", [Trace(((1, -0.5), (2, 0.5)))], is_log=True)
    )
    assert refused.get("data-scale") == "linear"
    assert "log scale needs every value above 0" in "".join(refused.find("figcaption").itertext())
    taken = _figure(metric_chart("optim_step", "grad_norm", TWO_RUNS, is_log=True))
    assert taken.get("data-scale") == "log"
    # log axis 0.1 .. 1: y = 12 + (1 - (log10 v + 1)) * 180; 0.1 -> 192, 0.3 -> 106.1, 0.2 -> 137.8
    assert _lines(taken)["run-a"] == "64.0,192.0 346.0,106.1 628.0,137.8"


def test_the_domain_table_in_the_docs_lists_the_rules_the_charts_apply() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "METRICS.md").read_text()
    rows = re.findall(r"^\| (first|last|any) words? (.+?) \| (\[0, 1\]|≥ 0) \|", docs, flags=re.M)
    documented = [(where, frozenset(re.findall(r"`([a-z]+)`", words)), bound) for where, words, bound in rows]
    bounds = {FRACTION: "[0, 1]", NON_NEGATIVE: "≥ 0"}
    assert documented == [(where, names, bounds[domain]) for where, names, domain in DOMAIN_RULES]
