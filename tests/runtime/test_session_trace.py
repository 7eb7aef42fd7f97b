"""A session's trace: one process per run and sampler, one slice per recorded request with its kind, seq_id,
status and error, and slices that overlap in time put on separate lanes."""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import pairwise
from typing import Any

import pytest

from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.service import Submission
from tests.runtime.conftest import create_run, held, result_of, sft_pass, train_steps


def _trace(service: Runtime, session_id: str) -> dict[str, Any]:
    return json.loads("".join(service.session_traces.trace("local", session_id)))


def test_each_recorded_request_is_a_slice_of_its_runs_process_in_seq_id_order(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 2)  # seq 1-4
    (refused,) = service.training.submit_many(
        [Submission("local", run, 5, "ForwardBackward", refusal=UserError("no such loss"))]
    )
    result_of(service, refused)  # type: ignore[arg-type]
    trace = _trace(service, run.split(":")[0])

    events = trace["traceEvents"]
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [run]
    slices = [e for e in events if e["ph"] == "X"]
    assert [(s["name"], s["args"]["seq_id"], s["args"]["status"]) for s in slices] == [
        ("CreateModel", 0, "complete"),
        ("ForwardBackward", 1, "complete"),
        ("OptimStep", 2, "complete"),
        ("ForwardBackward", 3, "complete"),
        ("OptimStep", 4, "complete"),
        ("ForwardBackward", 5, "failed"),
    ]
    assert slices[-1]["args"] | {"request_id": None} == {
        "request_id": None,
        "seq_id": 5,
        "status": "failed",
        "error": "no such loss",
        "category": "user",
    }
    assert all(s["dur"] >= 0 for s in slices)


def test_requests_that_overlap_in_time_go_on_separate_lanes_and_no_lane_holds_overlapping_slices(
    service_factory,
) -> None:
    service = service_factory()
    run = create_run(service)
    with held(service):  # both submitted before either can finish
        first = service.training.submit("local", run, 1, sft_pass())
        second = service.training.submit("local", run, 2, sft_pass())
    for record in (first, second):
        result_of(service, record)
    events = _trace(service, run.split(":")[0])["traceEvents"]

    lanes = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert sorted(lanes) == [(1, 1), (1, 2)]
    for spans in lanes.values():
        assert all(end <= next_start for (_, end), (next_start, _) in pairwise(spans))
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {1: "lane 1", 2: "lane 2"}


def test_another_tenants_session_has_no_trace_even_before_it_is_read(service_factory) -> None:
    service = service_factory()
    session = service.sessions.create("alice", {})
    with pytest.raises(NotFoundError):
        service.session_traces.trace("bob", session)
    assert json.loads("".join(service.session_traces.trace("alice", session))) == {
        "displayTimeUnit": "ms",
        "traceEvents": [],
    }
