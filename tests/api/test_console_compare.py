"""Comparing runs in the web console over HTTP: the runs list ticks runs into a shareable GET URL, the
compare page overlays each run's curve on one chart per metric (smoothed or on a log scale when asked),
refuses bad options and too many runs with a clear message, and shows only runs the viewer may see:
another tenant's run id answers exactly like an unknown one. The runs list shows each run's newest
metric values; the requests list filters by run, request type and status."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from loraplex.api.console.charts import PLOT_H, TOP
from loraplex.api.console.pages import render_fragment
from loraplex.runtime.control.keys import Viewer
from loraplex.runtime.observability.console import MAX_COMPARED, RequestFilter, RequestSummary
from tests.api.test_console import Console, _train, serving_console


@dataclass
class Runs:
    console: Console
    a: str  # alice's, 3 steps
    b: str  # alice's, 2 steps
    c: str  # bob's, 1 step


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    with serving_console(tmp_path_factory.mktemp("compare")) as (http, service, keys):
        alice = {"X-API-Key": keys["alice"]}
        a, b = _train(http, alice, 3), _train(http, alice, 2)
        c = _train(http, {"X-API-Key": keys["bob"]}, 1)
        yield Runs(Console(http, service, keys, a), a, b, c)


def _figures(html: str) -> dict[tuple[str, str], ET.Element]:
    """The page's charts, parsed, by (kind, metric)."""
    found = re.findall(r'<figure class="chart".*?</figure>', html, flags=re.S)
    figures = [ET.fromstring(markup) for markup in found]
    return {(f.get("data-kind", ""), f.get("data-metric", "")): f for f in figures}


def _curves(figure: ET.Element, kind: str = "line") -> dict[str, list[tuple[float, float]]]:
    """Each run's polyline of `kind` (line or raw) in one chart, as (x, y) points."""
    svg = figure.find("svg")
    assert svg is not None
    return {
        p.get("data-run", ""): [tuple(map(float, xy.split(","))) for xy in p.get("points", "").split()]
        for p in svg.iter("polyline")
        if p.get("class", "").split()[0] == kind
    }


def test_the_runs_list_ticks_runs_into_a_get_form_for_the_compare_page(runs: Runs) -> None:
    html = runs.console.get("/console/runs", runs.console.sign_in("alice")).text
    assert '<form class="compare" method="get" action="/console/compare">' in html
    for run in (runs.a, runs.b):
        assert f'<input type="checkbox" name="run" value="{run}"' in html


def test_the_runs_list_shows_each_runs_newest_loss_and_the_step_it_was_at(runs: Runs) -> None:
    html = runs.console.get("/console/runs", runs.console.sign_in("alice")).text
    history = {
        s.name: s.points for s in runs.console.service.history.series(runs.a) if s.kind == "forward_backward"
    }
    step, value = history["loss:sum"][-1]
    row = re.search(rf'<tr data-run-id="{re.escape(runs.a)}">.*?</tr>', html, flags=re.S)
    assert row is not None
    shown = re.search(r'data-metric="loss:sum" data-step="(\d+)"[^>]*>loss:sum <b>([^<]+)</b>', row.group(0))
    assert shown is not None and (int(shown.group(1)), shown.group(2)) == (3, f"{value:.4g}") and step == 3


def test_the_compare_page_overlays_one_curve_per_run_on_each_metrics_chart(runs: Runs) -> None:
    alice = runs.console.sign_in("alice")
    page = runs.console.get(f"/console/compare?run={runs.a}&run={runs.b}", alice)
    assert page.status_code == 200
    figures = _figures(page.text)
    history = {
        run: {(s.kind, s.name): s.points for s in runs.console.service.history.series(run)}
        for run in (runs.a, runs.b)
    }
    assert (
        set(figures)
        == set(history[runs.a])
        == {
            ("forward_backward", "loss:sum"),
            ("forward_backward", "train/tokens"),
            ("optim_step", "grad_norm"),
            ("optim_step", "learning_rate"),
        }
    )
    for key, figure in figures.items():
        curves = _curves(figure)
        assert list(curves) == [runs.a, runs.b]  # one polyline per run, in the order asked
        low, high = float(figure.get("data-y-low", "nan")), float(figure.get("data-y-high", "nan"))
        for run, points in curves.items():
            expected = [value for _, value in history[run][key]]
            # y back to a value: the axis runs from `high` at the top to `low` at the bottom
            drawn = [high - (y - TOP) / PLOT_H * (high - low) for _, y in points]
            assert drawn == pytest.approx(expected, abs=(high - low) * 0.001)
        legend = [li.get("class", "") + " " + "".join(li.itertext()) for li in figure.iter("li")]
        assert legend == [f"series-0 {runs.a}", f"series-1 {runs.b}"]


def test_smoothing_draws_a_faint_raw_curve_behind_each_smoothed_one_and_log_scale_is_kept(runs: Runs) -> None:
    alice = runs.console.sign_in("alice")
    html = runs.console.get(f"/console/compare?run={runs.a}&run={runs.b}&smoothing=0.6&scale=log", alice).text
    loss = _figures(html)["forward_backward", "loss:sum"]
    assert list(_curves(loss, "raw")) == [runs.a, runs.b] and list(_curves(loss)) == [runs.a, runs.b]
    assert loss.get("data-scale") == "log"
    assert 'name="smoothing" type="number" min="0" max="0.99" step="0.05" value="0.6"' in html
    assert 'name="scale" value="log" checked' in html


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("", "no run to compare"),
        ("&".join(f"run=r{i}:train:0" for i in range(MAX_COMPARED + 1)), f"compare at most {MAX_COMPARED}"),
        ("run={a}&smoothing=1", "smoothing &#39;1&#39;: a number from 0 (none) up to, not including, 1"),
        ("run={a}&smoothing=nan", "smoothing &#39;nan&#39;"),
        ("run={a}&smoothing=x", "smoothing &#39;x&#39;"),
        ("run={a}&scale=cubic", "scale &#39;cubic&#39; is not one of linear, log"),
    ],
)
def test_bad_compare_options_are_refused_with_a_message(runs: Runs, query: str, message: str) -> None:
    page = runs.console.get(f"/console/compare?{query.format(a=runs.a)}", runs.console.sign_in("alice"))
    assert page.status_code == 400
    assert message in page.text and "<figure" not in page.text


def test_another_tenants_run_in_a_comparison_answers_like_an_unknown_id(runs: Runs) -> None:
    bob = runs.console.sign_in("bob")
    foreign = runs.console.get(f"/console/compare?run={runs.c}&run={runs.a}", bob)
    missing = runs.console.get(f"/console/compare?run={runs.c}&run=nobody:train:0", bob)
    assert foreign.status_code == missing.status_code == 404
    assert foreign.text.replace(runs.a, "ID") == missing.text.replace("nobody:train:0", "ID")
    assert "alice" not in foreign.text and "<figure" not in foreign.text


def test_an_admin_compares_runs_of_different_tenants(runs: Runs) -> None:
    html = runs.console.get(f"/console/compare?run={runs.a}&run={runs.c}", runs.console.sign_in("ops")).text
    assert list(_curves(_figures(html)["forward_backward", "loss:sum"])) == [runs.a, runs.c]


def test_the_requests_page_filters_by_run_request_type_and_status(runs: Runs) -> None:
    alice = runs.console.sign_in("alice")
    html = runs.console.get(f"/console/requests?run={runs.b}&type=OptimStep&status=complete", alice).text
    rows = re.findall(
        r'<tr class="(\w+)" data-request-id="[^"]+">\s*<td[^>]*>[^<]*</td>\s*<td>(\w+)</td>', html
    )
    assert rows == [("complete", "OptimStep")] * 2  # run b took 2 steps
    assert html.count(f">{runs.b}</a>") == 2 and runs.a not in html.split("<table", 1)[1]
    assert "No request matches" in runs.console.get("/console/requests?status=failed", alice).text
    bob = runs.console.sign_in("bob")
    assert "No request matches" in runs.console.get(f"/console/requests?run={runs.a}", bob).text


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("status=done", "status &#39;done&#39; is not one of pending, complete, failed"),
        ("type=Nap", "request type"),
    ],
)
def test_an_unknown_request_filter_is_refused_with_what_is_allowed(
    runs: Runs, query: str, message: str
) -> None:
    page = runs.console.get(f"/console/requests?{query}", runs.console.sign_in("alice"))
    assert page.status_code == 400 and message in page.text


def test_a_long_error_is_shown_whole_behind_a_summary_cut_between_words() -> None:
    error = "the request failed because " + " ".join(f"word{i}" for i in range(60))
    request = RequestSummary(
        "req-1", "alice", "OptimStep", "a:train:0", 2, "failed", datetime.now(UTC), 0.5, error
    )
    chosen = RequestFilter()
    html = render_fragment(
        "requests.html", requests=[request], chosen=chosen, types=(), statuses=(), viewer=Viewer("alice")
    )
    summary = re.search(r"<summary>(.*?)</summary>", html)
    assert summary is not None and summary.group(1).endswith(" …")
    assert error.startswith(summary.group(1)[: -len(" …")] + " ")  # cut where a word ends
    assert f'<div class="full">{error}</div>' in html
