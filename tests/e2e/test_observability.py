"""/metrics and the request log against a real server driven by the official SDK: counters move by exactly
what the SDK sent, and every request's JSON log line carries its fields."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from loraplex.model.config import DecoderConfig
from loraplex.model.memory_plan import LoraSpec, RankPlan, plan_rank
from tests.e2e.conftest import Server
from tests.e2e.sdk import LR, PHRASE, client, new_run, sft_datum

KEY = {"X-API-Key": "tml-local"}


@pytest.fixture(scope="module")
def json_server(start_module_server: Callable[..., Server]) -> Server:
    return start_module_server("--log-format", "json")


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by name and sorted labels (the text must parse)."""
    response = httpx.get(f"{server.base_url}/metrics", headers=KEY, timeout=10)
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """A sample's value; a metric missing from the scrape fails the test (a default of 0 would let every
    `== 0` pass on a metric that is not exported at all)."""
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"/metrics has no sample {name}{labels or ''}"
    return samples[key]


def scrape_until(
    server: Server, until: Callable[[dict], bool], timeout_s: float = 10.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape again until `until` holds of the samples: gauges the engine loop refreshes about once a
    second may lag what the client saw happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(server)
        if until(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def rank_bytes(samples: dict, rank: int, kind: str) -> float:
    """One engine rank's loraplex_rank_parameter_bytes of one kind; it must be exported."""
    return value(samples, "loraplex_rank_parameter_bytes", rank=str(rank), kind=kind)


def tiny_plan(server: Server, tp: int = 1) -> RankPlan:
    """The memory plan of one rank of `tp` of the model the server built in its data dir (fp32 on CPUs),
    for one rank-8 slot (what `new_run` creates)."""
    hf = json.loads((server.data_dir / "models" / "tiny" / "config.json").read_text())
    return plan_rank(DecoderConfig.from_hf(hf), tp, 4, LoraSpec(8), slots=1, kv_tokens=0)


def log_lines(
    server: Server, until: Callable[[list[dict]], bool] = bool, timeout_s: float = 10.0
) -> list[dict]:
    """The server's JSON log lines (its stdout and stderr go to one file), read again until `until` holds
    of them: a request's line is written after its response has gone out, so it may lag the client."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = (server.data_dir.parent / f"server-{server.port}.log").read_text()
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        if until(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_counters_move_by_what_the_sdk_sent(json_server: Server) -> None:
    run = new_run(client(json_server), json_server)
    before = scrape(json_server)
    datum = sft_datum()
    passes = [run.forward_backward([datum], "cross_entropy") for _ in range(3)]
    step = run.optim_step(types.AdamParams(learning_rate=LR))
    for future in passes:
        future.result()
    step.result()
    after = scrape(json_server)

    def moved(name: str, **labels: str) -> float:
        """How far a counter moved: it must be exported now; a series first seen since counts from 0."""
        return value(after, name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0.0)

    fb_route = {"method": "POST", "route": "/api/v1/forward_backward", "status": "200"}
    assert moved("loraplex_http_requests_total", **fb_route) == 3
    optim_route = {"method": "POST", "route": "/api/v1/optim_step", "status": "200"}
    assert moved("loraplex_http_requests_total", **optim_route) == 1
    fb_latency = {"method": "POST", "route": "/api/v1/forward_backward"}
    assert moved("loraplex_http_request_duration_seconds_count", **fb_latency) == 3
    assert moved("loraplex_pass_tokens_total") == 3 * (len(PHRASE) - 1)  # each datum's model_input
    assert moved("loraplex_pass_requests_total") == 3
    assert moved("loraplex_optim_steps_total") == 1
    assert moved("loraplex_optim_step_runs_total") == 1
    assert moved("loraplex_futures_finished_total", state="complete") == 4
    assert moved("loraplex_futures_finished_total", state="failed") == 0
    assert value(after, "loraplex_futures_pending") == 0
    assert value(after, "loraplex_slots_used") == 1
    assert value(after, "loraplex_queue_depth", kind="forward_backward") == 0
    assert moved("loraplex_pass_duration_seconds_count") == moved("loraplex_passes_total") >= 1
    # The four submissions' futures, in one transaction each or fewer (those that wait go together).
    assert 1 <= moved("loraplex_db_call_duration_seconds_count", op="add_futures") <= 4
    # Labels are templates and categories, never ids: no run, future or session id appears in any label.
    assert not [labels for (_, labels) in after if any(run.model_id in v for _, v in labels)]


def test_a_failed_request_counts_as_a_user_error_of_its_future(json_server: Server) -> None:
    run = new_run(client(json_server), json_server)
    before = scrape(json_server)
    bad = types.Datum(model_input=types.ModelInput.from_ints([10**9]), loss_fn_inputs={"target_tokens": [1]})
    with pytest.raises(Exception, match="outside the vocabulary"):
        run.forward_backward([bad], "cross_entropy").result()
    after = scrape(json_server)
    errors = {"category": "user", "source": "future"}
    assert (
        value(after, "loraplex_errors_total", **errors) - value(before, "loraplex_errors_total", **errors)
        == 1
    )


def test_each_request_logs_one_json_line_with_its_fields(json_server: Server) -> None:
    run = new_run(client(json_server), json_server)
    run.forward_backward([sft_datum()], "cross_entropy").result()

    def ours(lines: list[dict]) -> list[dict]:
        return [
            line
            for line in lines
            if line.get("route") == "/api/v1/forward_backward" and line.get("run_id") == run.model_id
        ]

    lines = ours(log_lines(json_server, until=ours))
    assert len(lines) == 1
    (line,) = lines
    assert line["logger"] == "loraplex.requests"
    assert (line["method"], line["status"], line["tenant"], line["seq_id"]) == ("POST", 200, "local", 1)
    assert line["future_id"].startswith("req-")
    assert len(line["request_id"]) == 16
    assert line["latency_ms"] > 0
    assert line["path"] == "/api/v1/forward_backward"


def test_the_request_id_is_returned_and_logged(json_server: Server) -> None:
    response = httpx.get(f"{json_server.base_url}/api/v1/healthz", headers={"X-Request-ID": "probe-7f3a"})
    assert response.headers["x-request-id"] == "probe-7f3a"
    fresh = httpx.get(f"{json_server.base_url}/api/v1/healthz").headers["x-request-id"]
    assert fresh != "probe-7f3a" and len(fresh) == 16

    def ids(lines: list[dict]) -> set[str]:
        return {line.get("request_id") for line in lines}

    logged = {
        line.get("request_id"): line
        for line in log_lines(json_server, until=lambda lines: {"probe-7f3a", fresh} <= ids(lines))
    }
    assert logged["probe-7f3a"]["route"] == "/api/v1/healthz"
    assert logged[fresh]["status"] == 200


def test_rank_0_reports_its_base_and_the_bytes_a_new_run_adds(json_server: Server) -> None:
    plan = tiny_plan(json_server)  # every run of this module is rank 8, as new_run makes them

    def adapters(samples: dict) -> float:
        return rank_bytes(samples, 0, "adapter")

    # The gauge is refreshed about once a second: first let it catch up with the runs earlier tests made.
    before = scrape_until(
        json_server, lambda s: adapters(s) == value(s, "loraplex_slots_used") * plan.slot.weights
    )
    assert adapters(before) == value(before, "loraplex_slots_used") * plan.slot.weights
    assert rank_bytes(before, 0, "base") == plan.base
    new_run(client(json_server), json_server, seed=5)
    after = scrape_until(json_server, lambda s: adapters(s) != adapters(before))
    assert value(after, "loraplex_slots_used") == value(before, "loraplex_slots_used") + 1
    assert adapters(after) - adapters(before) == plan.slot.weights
    optimizer_added = rank_bytes(after, 0, "optimizer") - rank_bytes(before, 0, "optimizer")
    assert optimizer_added == plan.slot.gradients + plan.slot.moments  # a creation copies no gradients
    assert rank_bytes(after, 0, "base") == plan.base
    gauge = [labels for name, labels in after if name == "loraplex_rank_parameter_bytes"]
    assert {dict(labels)["rank"] for labels in gauge} == {"0"}  # one engine rank
