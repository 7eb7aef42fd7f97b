"""Nothing heavy runs on the API's event loop: a session of large bodies (protobuf, zstd, JSON) and large
results (protobuf and JSON) over HTTP never holds the loop longer than STALL_BOUND_S.

tests/api/test_no_sql_on_the_loop.py catches database calls on the loop; this catches CPU work, whoever
does it: a pool thread holding the GIL through one long C call stalls the loop's callbacks too.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zstandard
from fastapi import routing as fastapi_routing
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.heap import freeze_startup_heap
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.futures import outcome_row
from loraplex.runtime.core.commands import PassResult
from loraplex.runtime.core.sampling import SampledSequence, SampleResult
from tests.api.test_http import KEY, _run, _sampler
from tests.fakes import VOCAB, FakeEngine

# A request that arrives at any moment is answered within 100 ms (tests/e2e/test_admission.py asks it of
# healthz), so the app may never hold the loop that long. Time the host did not run the process at all is
# not counted (loop_stalls); what the scheduler adds while it runs (switching between its threads) is
# measured in the same test, with the app idle, and allowed on top. Quiet, the longest stall measured
# 27-44 ms (thread switching); before the codec pool, 3.8 s (the first body decoded on the loop), then
# 0.5 s and 0.3 s; a full collection of the test process's heap, 0.3-0.6 s (loraplex/heap.py); FastAPI
# building the /v1 routes on the first request there, 90-130 ms (build_route_tables in api/app.py).
STALL_BOUND_S = 0.1
_QUIET_WINDOW_S = 1.0
_BEAT_S = 0.001
PROTOBUF = {**KEY, "Accept": "application/x-protobuf"}


@contextmanager
def loop_stalls(http: TestClient) -> Iterator[list[float]]:
    """The times (s) the app's event loop went without running a callback inside the block, longest
    first: a task on the loop wakes every millisecond, and the time between its wake-ups is how long the
    loop was held, by a callback or by a thread holding the GIL.

    Only time the process ran counts: a gap is the smaller of its wall time and the CPU time this process
    used in it (all its threads). Whatever holds the loop runs meanwhile, so a real hold costs its full
    length in CPU time; a host too busy to schedule the process (other tests, CI neighbours) costs none.
    """
    stalls: list[float] = []
    stop = http.portal.call(asyncio.Event)  # type: ignore[union-attr]

    async def heartbeat() -> None:
        loop = asyncio.get_running_loop()
        last, last_cpu = loop.time(), time.process_time()
        while not stop.is_set():
            await asyncio.sleep(_BEAT_S)
            now, cpu = loop.time(), time.process_time()
            stalls.append(min(now - last, cpu - last_cpu) - _BEAT_S)
            last, last_cpu = now, cpu

    running = http.portal.start_task_soon(heartbeat)  # type: ignore[union-attr]
    try:
        yield stalls
    finally:
        http.portal.call(stop.set)  # type: ignore[union-attr]
        running.result()
        stalls.sort(reverse=True)


def _forward_backward(run: str, seq_id: int, datums: int, tokens: int, width: int) -> bytes:
    """A body of `datums` datums of `tokens` tokens, each with dense 1-D targets and a dense (tokens, width)
    float32 input the fake engine checks but does not read (a stand-in for top-k weights' bulk)."""
    msg = pb.ForwardBackwardRequest(model_id=run, seq_id=seq_id, loss_fn="cross_entropy")
    rng = np.random.default_rng(seq_id)
    for _ in range(datums):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = rng.integers(0, VOCAB, tokens).astype("<i4").tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(dense=rng.integers(0, VOCAB, tokens).astype("<i8").tobytes(), dtype=pb.DTYPE_INT64)
        )
        bulk = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[tokens, width])
        bulk.dense = np.ones((tokens, width), "<f4").tobytes()
        datum.loss_fn_inputs["bulk"].CopyFrom(bulk)
    return msg.SerializeToString()


def _settle(http: TestClient, result: object) -> str:
    """A finished future holding `result` (the engine's results are small; the API's encoding is what
    this test is about)."""
    futures = http.app.state.futures  # type: ignore[attr-defined]
    record = futures.create("local", "Injected")
    futures.settle([(outcome_row(record.id, result), result)], is_written=True)
    return record.id


def test_no_callback_holds_the_loop_while_large_bodies_and_results_go_through(tmp_path: Path) -> None:
    config = ServerConfig(data_dir=tmp_path, long_poll_s=5.0)
    rng = np.random.default_rng(0)
    pass_result = PassResult(
        outputs=[
            {"logprobs": rng.random(4096, np.float32), "elementwise_loss": rng.random(4096, np.float32)}
            for _ in range(32)
        ],
        metrics={"loss:sum": 1.0},
    )
    prompt_ids = rng.integers(0, VOCAB, (4096, 64)).astype(np.int32)
    sample_result = SampleResult(
        [SampledSequence(np.arange(8, dtype=np.int32), np.zeros(8, np.float32), "length")],
        prompt_logprobs=rng.random(4096, np.float32),
        topk_prompt_ids=prompt_ids,
        topk_prompt_logprobs=rng.random((4096, 64), np.float32),
    )
    with TestClient(create_app(Runtime.open(FakeEngine(), config))) as http:
        run, sampler = _run(http), _sampler(http)
        # Built before the measurement: the client shares the GIL with the server here.
        large = _forward_backward(run, 1, datums=16, tokens=4096, width=128)  # 34 MB
        compressed = zstandard.ZstdCompressor().compress(_forward_backward(run, 2, 16, 4096, 128))
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4] * 8192}]}
        asample = json.dumps({"sampling_session_id": sampler, "seq_id": 0, "prompt": prompt}).encode()
        optim = json.dumps({"model_id": run, "seq_id": 3, "adam_params": {}, "note": "x" * 200_000})
        # Bodies FastAPI reads for a route (a declared body), unknown fields and all: anyone may send one. A
        # route whose fields are bounded refuses a large one as it streams in; a prompt's is parsed on the
        # codec pool (a long prompt, about 100k tokens: a parse holds the GIL ~50 ms a MiB even there).
        junk = json.dumps({"user_metadata": {}, "junk": list(range(1_000_000))})  # 7 MB of numbers
        long_prompt = json.dumps({"model": "fake/bigram", "prompt": [7] * 100_000, "max_tokens": 1})
        submitted = {"pass": _settle(http, pass_result), "sample": _settle(http, sample_result)}
        # As `loraplex serve` does once started: without it, one full collection over this process's
        # heap (pytest's and every earlier test's objects) held the loop 0.3-0.6 s.
        freeze_startup_heap()
        try:
            with loop_stalls(http) as idle_stalls:
                time.sleep(_QUIET_WINDOW_S)
            with loop_stalls(http) as stalls:
                posts = {
                    "large": ({}, large),
                    "zstd": ({"Content-Encoding": "zstd"}, compressed),
                    "asample": ({"Content-Type": "application/json"}, asample),
                    "optim": ({}, optim),
                }
                for name, (headers, content) in posts.items():
                    path = {"asample": "asample", "optim": "optim_step"}.get(name, "forward_backward")
                    reply = http.post(f"/api/v1/{path}", content=content, headers={**KEY, **headers})
                    submitted[name] = reply.json()["request_id"]
                json_headers = {**KEY, "Content-Type": "application/json"}
                session = http.post("/api/v1/create_session", content=junk, headers=json_headers)
                completion = http.post("/v1/completions", content=long_prompt, headers=json_headers)
                results = {
                    (name, form): http.post(
                        "/api/v1/retrieve_future", json={"request_id": future}, headers=headers
                    )
                    for name, future in submitted.items()
                    for form, headers in (("proto", PROTOBUF), ("json", KEY))
                }
        finally:
            gc.unfreeze()  # this process goes on to other tests
        scheduler_s = idle_stalls[0]
        assert stalls[0] < STALL_BOUND_S + scheduler_s, f"held {stalls[:5]} s, idle {scheduler_s} s"
        assert session.status_code == 413 and "--max-metadata-bytes" in session.json()["detail"]
        assert (
            completion.status_code == 400 and "tokenizer" in completion.text
        )  # read whole: the fake has none
        # The session did what it claims: every result came back whole, in both forms.
        assert all(reply.status_code == 200 for reply in results.values())
        for name in ("large", "zstd"):
            outputs = deserialize_forward_backward_output(results[name, "proto"].content).loss_fn_outputs
            assert [output["logprobs"].shape for output in outputs] == [[4096]] * 16
            assert len(json.loads(results[name, "json"].content)["loss_fn_outputs"]) == 16
        assert len(deserialize_sample_response(results["asample", "proto"].content).sequences) == 1
        assert json.loads(results["optim", "json"].content)["metrics"]["grad_norm"] > 0
        passed = json.loads(results["pass", "json"].content)["loss_fn_outputs"][31]["logprobs"]["data"]
        np.testing.assert_array_equal(passed, pass_result.outputs[31]["logprobs"])
        topk = json.loads(results["sample", "json"].content)["topk_prompt_logprobs"]
        assert [pair[0] for pair in topk[4095]] == prompt_ids[4095].tolist()
        topk_proto = deserialize_sample_response(results["sample", "proto"].content).topk_prompt_logprobs
        assert [pair[0] for pair in topk_proto[4095]] == prompt_ids[4095].tolist()


def test_no_request_builds_a_route_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FastAPI builds an included router's route table on the first request that looks through it, on
    the event loop (the first /v1 request held it 90-130 ms); create_app builds them all beforehand."""
    built: list[str] = []
    build = fastapi_routing._EffectiveRouteContext.from_api_route.__func__  # type: ignore[attr-defined]

    def counted(cls: type, *, original_route: APIRoute, include_context: object) -> object:
        built.append(original_route.path)
        return build(cls, original_route=original_route, include_context=include_context)

    monkeypatch.setattr(fastapi_routing._EffectiveRouteContext, "from_api_route", classmethod(counted))
    app = create_app(Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path)))
    assert len(built) > 50  # every route, in create_app
    built.clear()
    with TestClient(app) as http:
        bearer = {"Authorization": f"Bearer {KEY['X-API-Key']}"}
        replies = [
            http.get("/v1/models", headers=bearer),
            http.get("/api/v1/healthz"),
            http.get("/metrics", headers=KEY),
            http.get("/console/"),
            http.get("/nowhere"),
        ]
    assert [reply.status_code for reply in replies] == [200, 200, 200, 200, 404]
    assert built == []
