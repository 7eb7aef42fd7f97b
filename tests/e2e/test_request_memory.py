"""Memory follows the requests, on a real `loraplex serve`: a refused request keeps nothing, and requests
held in a run's seq_id window (waiting for an earlier seq_id) are bounded in bytes by
--max-queued-bytes-per-run as well as in count; past the bound the SDK is told to resend later (429)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

from tests.e2e.conftest import Server
from tests.e2e.raw_http import memory_bytes, new_run, settled

KEY = {"X-API-Key": "tml-local"}
MB = 10**6
TOKENS_PER_DATUM = 32768
DATUMS = 26  # 851,968 tokens: a 10.2 MB protobuf body
QUEUED_BYTES = 130_000  # three of the small requests below, not four


@pytest.fixture(scope="module")
def server(start_module_server) -> Server:
    return start_module_server("--max-queued-bytes-per-run", str(QUEUED_BYTES))


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers=KEY, timeout=120) as http:
        yield http


def _forward_body(run: str, seq_id: int, datums: int = DATUMS, tokens: int = TOKENS_PER_DATUM) -> bytes:
    """A forward_backward of `datums` datums of `tokens` tokens (by default about 10 MB on the wire)."""
    msg = pb.ForwardBackwardRequest(model_id=run, seq_id=seq_id, loss_fn="cross_entropy")
    ids = np.arange(tokens) % 200
    for _ in range(datums):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = ids.astype("<i4").tobytes()
        targets = datum.loss_fn_inputs["target_tokens"]
        targets.dtype, targets.shape[:] = pb.DTYPE_INT64, [tokens]
        targets.dense = ids.astype("<i8").tobytes()
    return msg.SerializeToString()


def _settled_rss_bytes(server: Server) -> int:
    """The server's RSS once the memory of the last answered request is handed back (the server does it
    on a worker thread after the answer is sent): its lowest of a few readings a tenth of a second apart."""
    readings = []
    for _ in range(10):
        readings.append(memory_bytes(server, "VmRSS"))
        time.sleep(0.1)
    return min(readings)


def test_refused_requests_leave_the_servers_memory_where_it_was(http: httpx.Client, server: Server) -> None:
    run = new_run(http)
    far = _forward_body(run, 10**6)
    assert len(far) > 10 * MB
    http.post("/forward_backward", content=far)  # the refusal's own code paths, before the baseline
    before = _settled_rss_bytes(server)
    for _ in range(20):
        reply = http.post("/forward_backward", content=far)
        assert reply.status_code == 400 and "too far ahead" in reply.json()["detail"], reply.text
    grown = _settled_rss_bytes(server) - before
    assert grown < 20 * MB, f"RSS grew by {grown / MB:.1f} MB after 20 refused 10 MB requests"


def test_requests_waiting_for_an_earlier_seq_id_are_bounded_in_bytes_and_the_rest_resent_later(
    http: httpx.Client,
) -> None:
    """Each request holds 2 × 1,024 tokens of int64 ids and targets once decoded (32,768 bytes, and its
    loss inputs): the run holds three while seq_id 1 is missing; the fourth is told to come again (429,
    Retry-After), and taken once the run has worked the others off."""
    run = new_run(http)
    replies = [
        http.post("/forward_backward", content=_forward_body(run, seq, 2, 1024)) for seq in (2, 3, 4, 5)
    ]
    assert [reply.status_code for reply in replies] == [200, 200, 200, 429]
    assert replies[3].headers["Retry-After"] == "1"
    detail = replies[3].json()["detail"]
    assert "bytes of requests not yet executed" in detail and "(--max-queued-bytes-per-run)" in detail
    assert "it expects seq_id 1 next" in detail
    first = http.post("/forward_backward", content=_forward_body(run, 1, 2, 1024))  # always taken
    futures = [first.json()] + [reply.json() for reply in replies[:3]]
    results = [settled(http, future) for future in futures]
    assert all("loss_fn_outputs" in result for result in results), results
    resent = http.post("/forward_backward", content=_forward_body(run, 5, 2, 1024))
    assert resent.status_code == 200 and "loss_fn_outputs" in settled(http, resent.json())
