"""The codec pool: small work inline, large work on its own threads in the caller's context, nothing after
close; and the routes hand their large bodies to it (a small one stays on the loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.api.limits import DEFAULT_LIMITS, current_limits, limits_in_force
from loraplex.api.tinker import sampling, training
from loraplex.api.tinker.codec_pool import (
    INLINE_JSON_BODY_BYTES,
    INLINE_PROTOBUF_BODY_BYTES,
    CodecPool,
    join_chunks,
)
from loraplex.config import ServerConfig
from loraplex.errors import ServerError
from loraplex.runtime.assembly import Runtime
from tests.api.test_http import KEY, _fb_body, _retrieve, _run, _sampler
from tests.fakes import VOCAB, FakeEngine


def _thread_name() -> str:
    return threading.current_thread().name


def test_small_work_runs_on_the_loop_and_large_work_on_a_codec_thread_with_the_limits_in_force() -> None:
    pool = CodecPool()
    limits = dataclasses.replace(DEFAULT_LIMITS, max_target_width=3)

    async def both() -> tuple[str, str, str, object]:
        with limits_in_force(limits):
            inline = await pool.run(True, _thread_name)
            pooled = await pool.run(False, _thread_name)
            return inline, pooled, _thread_name(), await pool.run(False, current_limits)

    inline, pooled, loop_thread, seen_limits = asyncio.run(both())
    pool.close()
    assert inline == loop_thread and pooled.startswith("loraplex-codec")
    assert seen_limits == limits


def test_work_handed_over_after_close_is_refused_as_a_server_error() -> None:
    pool = CodecPool()
    pool.close()
    with pytest.raises(ServerError, match="shutting down"):
        asyncio.run(pool.run(False, _thread_name))


def test_pieces_join_into_the_body_they_came_from() -> None:
    pieces = [bytes(range(7)) * 3, b"", b"\xff" * 65536, b"x"]
    assert bytes(join_chunks(pieces)) == b"".join(pieces)
    assert bytes(join_chunks([b"one"])) == b"one" and bytes(join_chunks([])) == b""


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    config = ServerConfig(data_dir=tmp_path, long_poll_s=2.0)
    with TestClient(create_app(Runtime.open(FakeEngine(), config))) as client:
        yield client


def test_a_large_forward_backward_body_is_decoded_on_a_codec_thread_and_a_small_one_inline(
    http: TestClient, monkeypatch
) -> None:
    threads: list[str] = []
    parse = training.parse_forward_backward

    def recorded(body):
        threads.append(_thread_name())
        return parse(body)

    monkeypatch.setattr(training, "parse_forward_backward", recorded)
    run = _run(http)
    small = _fb_body(run, 1)
    padding = b"\x7a\x80\x80\x02" + bytes(32768)  # field 15, which no message has: 32 KiB protobuf skips
    large = _fb_body(run, 2) + padding
    assert len(small) < INLINE_PROTOBUF_BODY_BYTES < len(large)
    futures = [
        http.post("/api/v1/forward_backward", content=body, headers=KEY).json() for body in (small, large)
    ]
    assert all("loss_fn_outputs" in _retrieve(http, future["request_id"]) for future in futures)
    assert not threads[0].startswith("loraplex-codec") and threads[1].startswith("loraplex-codec")


def test_a_long_prompt_is_validated_on_a_codec_thread(http: TestClient, monkeypatch) -> None:
    threads: list[str] = []
    validate = sampling.validate_json_body

    def recorded(*args):
        threads.append(_thread_name())
        return validate(*args)

    monkeypatch.setattr(sampling, "validate_json_body", recorded)
    sampler = _sampler(http)
    prompt = {"chunks": [{"type": "encoded_text", "tokens": (np.arange(4096) % VOCAB).tolist()}]}
    body = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "prompt": prompt,
        "sampling_params": {"max_tokens": 2},
    }
    future = http.post("/api/v1/asample", json=body, headers=KEY).json()
    assert len(_retrieve(http, future["request_id"])["sequences"][0]["tokens"]) == 2
    assert len(str(prompt)) > INLINE_JSON_BODY_BYTES and threads[0].startswith("loraplex-codec")
