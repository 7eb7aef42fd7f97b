"""Admission limits on a real `loraplex serve`: bodies too large for their route are cut off while they
stream in, bombs (huge declared shapes, zstd bombs, KV-cache and top-k asks) are refused before they cost
memory, a 100 MiB body is decoded without holding up other requests, and `--auth none` is refused on a
non-loopback host unless the operator says so."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from loraplex.cli import build_parser, check_exposure, config_from_args
from loraplex.config import ServerConfig
from loraplex.errors import UserError
from tests.e2e.conftest import REPO, Server
from tests.e2e.raw_http import memory_bytes, settled
from tests.e2e.raw_http import new_run as new_http_run
from tests.e2e.sdk import client, new_run, sft_steps

KEY = {"X-API-Key": "tml-local"}
# Small token limits, so that the largest body a route takes stays far below the 50 MB of the memory test:
# forward bodies up to 2048 × (64 + 128 × 32) + 1 MiB bytes; asample KV up to 64 MiB.
ARGS = ("--max-tokens-per-datum", "2048", "--max-tokens-per-request", "8192", "--max-sample-kv-mib", "64")
FORWARD_LIMIT = 2048 * (64 + 128 * 32) + 2**20
MB = 10**6


@pytest.fixture(scope="module")
def server(start_module_server) -> Server:
    return start_module_server(*ARGS)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers=KEY, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def names(http: httpx.Client) -> dict[str, Any]:
    """A run (next seq_id 1) and a base-model sampler of one session, made over plain HTTP."""
    session = http.post("/create_session", json={}).json()["session_id"]
    run = new_http_run(http, session)
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "loraplex/tiny"}
    sampler = http.post("/create_sampling_session", json=body).json()["sampling_session_id"]
    return {"run": run, "sampler": sampler, "seq_id": 1}


def _chunks(total_bytes: int) -> Iterator[bytes]:
    """A body sent chunked: no Content-Length says how large it is."""
    for _ in range(total_bytes // 2**20):
        yield bytes(2**20)


def _sparse_targets(names: dict[str, Any], rows: int, width: int, num_tokens: int = 1) -> bytes:
    """A forward_backward body of one datum whose sparse target_tokens declare (rows, width)."""
    msg = pb.ForwardBackwardRequest(model_id=names["run"], seq_id=names["seq_id"], loss_fn="cross_entropy")
    names["seq_id"] += 1
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(num_tokens, dtype="<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.shape[:] = pb.DTYPE_INT64, [rows, width]
    targets.sparse_csr.values = np.array([7], "<i8").tobytes()
    targets.sparse_csr.crow_indices = np.array([0, 1], "<i8").tobytes()
    targets.sparse_csr.col_indices = np.array([width - 1], "<i8").tobytes()
    return msg.SerializeToString()


def _zstd_bomb(total_bytes: int, declares_its_size: bool) -> bytes:
    """Zeros compressed piece by piece (the test never holds them whole)."""
    compressor = zstandard.ZstdCompressor().compressobj(size=total_bytes if declares_its_size else -1)
    pieces = [compressor.compress(bytes(2**20)) for _ in range(total_bytes // 2**20)]
    return b"".join(pieces) + compressor.flush()


def _forward_error(http: httpx.Client, body: bytes, headers: dict[str, str] | None = None) -> str:
    reply = http.post("/forward_backward", content=body, headers=headers or {})
    assert reply.status_code == 200, reply.text
    result = settled(http, reply.json())
    assert result["category"] == "user"
    return result["error"]


def test_a_chunked_body_over_its_routes_limit_is_refused_with_413_while_it_streams(http, server) -> None:
    before = memory_bytes(server, "VmHWM")
    reply = http.post("/forward_backward", content=_chunks(200 * 2**20))
    assert reply.status_code == 413
    assert reply.json() == {
        "detail": f"request body of /api/v1/forward_backward is over {FORWARD_LIMIT} bytes, the limit of "
        "this server (set by --max-tokens-per-datum and --max-target-width)"
    }
    assert (
        memory_bytes(server, "VmHWM") - before < 50 * MB
    )  # the server kept none of the 200 MB past its limit
    assert http.get("/healthz").json()["status"] == "ok"  # the connection and the server carry on


def test_bombs_are_refused_and_leave_the_servers_peak_memory_within_50_mb(http, server, names) -> None:
    warm = client(server)  # the paths a legitimate client takes, before the baseline
    run = new_run(warm, server)
    run.forward_backward([_datum()], "cross_entropy").result()
    sampler = run.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=8)).result()
    baseline = memory_bytes(server, "VmHWM")

    tall = "datum 0: loss_fn_inputs['target_tokens']: shape"
    assert _forward_error(http, _sparse_targets(names, 1, 10**12)).startswith(f"{tall} [1, 1000000000000] is")
    assert "decodes per request" in _forward_error(http, _sparse_targets(names, 10**12, 1))
    assert "K = 128 (--max-target-width)" in _forward_error(http, _sparse_targets(names, 1, 10**6))
    for declares_its_size in (True, False):
        bomb = _zstd_bomb(2**30, declares_its_size)
        assert len(bomb) < 64 * 1024
        reply = http.post("/forward_backward", content=bomb, headers={"Content-Encoding": "zstd"})
        assert reply.status_code == 413 and "zstd body decompresses to over" in reply.json()["detail"]
    for path in ("/forward_backward", "/asample"):
        assert http.post(path, content=_chunks(200 * 2**20)).status_code == 413
    assert http.post("/create_session", content=bytes(20 * MB)).status_code == 413
    asample = {
        "sampling_session_id": names["sampler"],
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
    }
    topk = http.post("/asample", json={**asample, "topk_prompt_logprobs": 512})
    assert topk.status_code == 400 and "--max-topk-prompt-logprobs" in topk.json()["detail"]
    topk = http.post("/asample", json={**asample, "topk_sample_logprobs": 512})
    assert topk.status_code == 400 and "--max-topk-sample-logprobs" in topk.json()["detail"]
    for shape, refusal in (([10**12, 1], "cells this server decodes"), ([2, 10**12], "ids wide")):
        sparse = {"data": [], "dtype": "int64", "shape": shape, "sparse_crow_indices": [0]}
        named = http.post("/asample", json={**asample, "target_prompt_logprobs": sparse})
        assert named.status_code == 400 and refusal in named.json()["detail"]
    kv = http.post("/asample", json={**asample, "num_samples": 16, "sampling_params": {"max_tokens": 4000}})
    assert kv.status_code == 400 and "(--max-sample-kv-mib)" in kv.json()["detail"]

    growth = memory_bytes(server, "VmHWM") - baseline
    assert growth < 50 * MB, f"peak RSS grew by {growth / MB:.1f} MB"


def _datum(targets: np.ndarray | None = None) -> types.Datum:
    tokens = [3, 17, 9, 41]
    target = targets if targets is not None else np.array([17, 9, 41, 5], np.int64)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": target}
    )


def test_the_sdk_reports_a_target_wider_than_the_limit_as_a_user_error(server) -> None:
    run = new_run(client(server), server)
    wide = np.zeros((4, 129), np.int64)
    with pytest.raises(tinker.RequestFailedError) as refused:
        run.forward_backward([_datum(wide)], "cross_entropy").result()
    assert refused.value.category == tinker.types.RequestErrorCategory.User
    assert (
        "datum 0: loss_fn_inputs['target_tokens']: shape [4, 129] is 129 wide; this server takes (N, K) "
        "inputs up to K = 128 (--max-target-width)" in str(refused.value)
    )


# --- nothing heavy on the event loop


def _top_k_forward_backward(run: str, seq_id: int, datums: int) -> bytes:
    """A forward_backward body of `datums` datums of 4096 tokens (the tiny model's context) with (N, 128)
    top-k target_tokens and weights as sparse CSR at 90% density (13.2 MB a datum), as a distillation
    client could send; valid for the tiny model."""
    tokens, width, listed = 4096, 128, 115
    rng = np.random.default_rng(seq_id)
    crow = (np.arange(tokens + 1) * listed).astype("<i8").tobytes()
    cols = np.tile(np.arange(listed), tokens).astype("<i8").tobytes()
    msg = pb.ForwardBackwardRequest(model_id=run, seq_id=seq_id, loss_fn="cross_entropy")
    for _ in range(datums):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = rng.integers(0, 500, tokens).astype("<i4").tobytes()
        for key, dtype, values in (
            ("target_tokens", pb.DTYPE_INT64, rng.integers(0, 500, tokens * listed).astype("<i8")),
            ("weights", pb.DTYPE_FLOAT32, np.full(tokens * listed, 1 / listed, "<f4")),
        ):
            tensor = datum.loss_fn_inputs[key]
            tensor.dtype, tensor.shape[:] = dtype, [tokens, width]
            tensor.sparse_csr.values, tensor.sparse_csr.crow_indices = values.tobytes(), crow
            tensor.sparse_csr.col_indices = cols
    return msg.SerializeToString()


def test_healthz_answers_within_100_ms_while_a_100_mib_body_is_decoded(start_server) -> None:
    server = start_server("--long-poll-s", "1")  # the default limits: forward bodies up to about 131 MiB
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers=KEY, timeout=300) as http:
        run = new_http_run(http)
        # seq_id 2 first: its pass waits for seq_id 1, so that the engine's work stays out of the window.
        body = _top_k_forward_backward(run, 2, datums=8)
        assert len(body) > 100 * 2**20
        latencies_s: list[float] = []
        answers: list[Any] = []
        posted = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=server.base_url, timeout=30) as prober:
                while not posted.is_set():
                    started = time.perf_counter()
                    answers.append(prober.get("/api/v1/healthz").json()["status"])
                    latencies_s.append(time.perf_counter() - started)
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        started = time.perf_counter()
        prober.start()
        # Sent in pieces: one 100 MB write would hold this process's GIL, and the prober's timing with it.
        pieces = (body[start : start + 2**20] for start in range(0, len(body), 2**20))
        reply = http.post("/forward_backward", content=pieces, headers={"Content-Length": str(len(body))})
        took_s = time.perf_counter() - started
        posted.set()
        prober.join()
        assert reply.status_code == 200, reply.text
        # The body took the server long (upload, decode, submission), and healthz was asked all along.
        assert took_s > 0.3 and len(latencies_s) >= 10, (took_s, len(latencies_s))
        assert answers == ["ok"] * len(latencies_s)
        assert max(latencies_s) < 0.1, sorted(latencies_s)[-5:]
        # Accepted: decoded, densified and validated; a refusal would be a failed future already.
        pending = http.post("/retrieve_future", json={"request_id": reply.json()["request_id"]}).json()
        assert pending["type"] == "try_again"


# --- who may reach the server


def test_serve_refuses_auth_none_on_a_non_loopback_host(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "loraplex.cli",
        "serve",
        "--host",
        "0.0.0.0",
        "--data-dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --auth none on --host 0.0.0.0 would let anyone who can reach port 8000 act as this server's "
        "one tenant; use --auth keys (keys from `loraplex keys create`), serve on 127.0.0.1, or pass "
        "--allow-unauthenticated-remote to accept that"
    )
    assert not (tmp_path / "loraplex.db").exists()  # refused before anything was opened or loaded


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_auth_none_on_loopback_needs_no_flag(host: str) -> None:
    check_exposure(ServerConfig(host=host))


def test_an_operator_who_allows_unauthenticated_remote_access_is_warned_in_the_log(caplog) -> None:
    config = config_from_args(
        build_parser().parse_args(["serve", "--host", "::", "--allow-unauthenticated-remote"])
    )
    assert config.allow_unauthenticated_remote is True
    with caplog.at_level(logging.WARNING, logger="loraplex"):
        check_exposure(config)
    assert caplog.messages == [
        "--auth none on :: (--allow-unauthenticated-remote): anyone who can reach port 8000 is the one tenant"
    ]
    with pytest.raises(UserError):
        check_exposure(ServerConfig(host="::"))
    check_exposure(ServerConfig(host="0.0.0.0", auth="keys"))


def test_a_client_training_beside_a_stream_of_bombs_never_fails_and_gets_what_it_gets_alone(
    http, server, names
) -> None:
    alone = sft_steps(new_run(client(server), server, seed=5), 4)
    stop, sent = threading.Event(), [0]

    def bomb() -> None:
        asample = {
            "sampling_session_id": names["sampler"],
            "seq_id": 0,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        }
        with httpx.Client(base_url=f"{server.base_url}/api/v1", headers=KEY, timeout=120) as bomber:
            while not stop.is_set():
                bomber.post(
                    "/forward_backward",
                    content=_zstd_bomb(2**30, False),
                    headers={"Content-Encoding": "zstd"},
                )
                bomber.post("/forward_backward", content=_chunks(50 * 2**20))
                bomber.post(
                    "/asample", json={**asample, "num_samples": 16, "sampling_params": {"max_tokens": 4000}}
                )
                sent[0] += 3

    thread = threading.Thread(target=bomb)
    thread.start()
    try:
        beside = sft_steps(new_run(client(server), server, seed=5), 4)
    finally:
        stop.set()
        thread.join(60)
    assert sent[0] >= 3  # the bombs really ran beside the training
    np.testing.assert_allclose(beside, alone, rtol=1e-5)
