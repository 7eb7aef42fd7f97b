"""A /v1 client that hangs up before its answer has its sampling cancelled, streaming or not: the requests
leave the engine (the fake's queue; the tiny model's continuous batch, its KV cache rows freed) and their
futures fail as cancelled. Served by uvicorn in this process, so the client can really go away."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import uvicorn

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.engine.interface import Engine
from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.model.tiny import ensure_tiny_model
from loraplex.runtime.assembly import Runtime
from tests.fakes import FakeEngine

CANCELLED = ("failed", "cancelled: the client went away")


@contextmanager
def _serving(engine: Engine, data_dir: Path) -> Iterator[tuple[Runtime, int]]:
    """A runtime over `engine` served over HTTP on a free port of this machine (auth none)."""
    runtime = Runtime.open(engine, ServerConfig(data_dir=data_dir))
    server = uvicorn.Server(uvicorn.Config(create_app(runtime), log_level="warning"))
    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        _wait_for(lambda: server.started, timeout_s=30.0)
        yield runtime, listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout_s} s"
        time.sleep(0.01)


@contextmanager
def _connected(port: int, path: str, body: dict) -> Iterator[None]:
    """A client that sends a request and hangs up when the block ends, before reading any answer."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer tml-local\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(head.encode() + payload)
        yield


def _futures(runtime: Runtime) -> list[tuple[str, str | None]]:
    """(status, error) of the local tenant's futures, once none is pending."""
    _wait_for(lambda: all(r.status != "pending" for r in runtime.store.recent_futures(["local"], 10)), 5.0)
    return [(row.status, row.error) for row in runtime.store.recent_futures(["local"], 10)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tiny(tokenizer_dir: Path) -> LocalEngine:
    return build_local_engine("tiny", tokenizer_dir.parents[1], "cpu", 2, 8, None)


def _decoding(engine: LocalEngine) -> int:
    """Sequences in the tiny model's batch, read while the engine loop runs (a count of its cache rows;
    the rest of Engine.usage is not safe to read meanwhile)."""
    return engine.sampler.cache.num_live_rows


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_has_its_queued_sampling_cancelled(
    tmp_path: Path, tokenizer_dir: Path, stream: bool
) -> None:
    engine = FakeEngine()
    engine.info = replace(engine.info, tokenizer_dir=str(tokenizer_dir))
    engine.holds_samples = True  # every request stays generating until cancelled
    body = {"model": "fake/bigram", "prompt": [[1, 2, 3], [4, 5]], "n": 2, "stream": stream}
    with _serving(engine, tmp_path) as (runtime, port):
        with _connected(port, "/v1/completions", body):
            _wait_for(lambda: len(engine.sample_queue) == 2, 5.0)
        _wait_for(lambda: engine.sample_queue == [], timeout_s=1.0)
        assert _futures(runtime) == [CANCELLED] * 2
        assert runtime.state.samples.queued_samples == 0


# Four samples that decode at least 139 tokens each before one stops (seed 1, for either prompt below):
# seconds of decoding on a CPU.
LONG = {"n": 4, "max_tokens": 600, "temperature": 1.0, "seed": 1}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Once", "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once"}], "stream": False}),
    ],
)
def test_a_client_that_hangs_up_leaves_no_sequence_decoding_in_the_tiny_model(
    tmp_path: Path, tiny: LocalEngine, path: str, body: dict
) -> None:
    with _serving(tiny, tmp_path) as (runtime, port):
        with _connected(port, path, {"model": tiny.info.model_name, **LONG, **body}):
            _wait_for(lambda: _decoding(tiny) == 4, 30.0)
        _wait_for(lambda: _decoding(tiny) == 0, timeout_s=2.0)
        assert _futures(runtime) == [CANCELLED]
        assert tiny.usage().kv_cache_bytes == 0
