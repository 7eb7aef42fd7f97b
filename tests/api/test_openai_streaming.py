"""/v1 streams token by token: the official `openai` client reads a stream's first chunks while its
sequence is still decoding (measured against the tokens the tiny model's sampler has drawn when each
chunk arrives, not against wall time), the chunks join to the non-streamed answer, and a client that
leaves midway has its sequence cancelled and its KV cache rows freed. Served by uvicorn in this process,
so the test can read the engine's counters as the chunks arrive."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import openai
import pytest

from loraplex.engine.local import LocalEngine, build_local_engine
from tests.api.test_openai_disconnect import CANCELLED, _decoding, _futures, _serving, _wait_for

# The first sample of seed 1 decodes more than 139 tokens before EOS (test_openai_disconnect.py): this
# many, all of them, so the generation ends on max_tokens.
TOKENS = 128
SAMPLING = {"max_tokens": TOKENS, "temperature": 1.0, "seed": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 2, 8, None)


def test_an_openai_completion_stream_yields_its_first_tokens_while_its_sequence_still_decodes(
    tmp_path: Path, tiny: LocalEngine
) -> None:
    with _serving(tiny, tmp_path) as (_runtime, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="tml-local", max_retries=0)
        model = tiny.info.model_name
        whole = client.completions.create(model=model, prompt="Once", **SAMPLING)
        start = tiny.sampler.sampled_tokens
        drawn_at_chunk: list[int] = []  # tokens the sampler had drawn when each token's chunk arrived
        texts: list[str] = []
        for chunk in client.completions.create(model=model, prompt="Once", stream=True, **SAMPLING):
            choice = chunk.choices[0]
            if choice.finish_reason is None:
                drawn_at_chunk.append(tiny.sampler.sampled_tokens - start)
                texts.append(choice.text)
            else:
                assert choice.finish_reason == "length"
    assert len(drawn_at_chunk) == TOKENS
    assert drawn_at_chunk[0] < TOKENS  # the first token came while the sequence was still decoding
    # and the tokens came over the decode steps, not in one burst at the end
    assert sum(drawn < TOKENS for drawn in drawn_at_chunk) > TOKENS // 2
    assert drawn_at_chunk == sorted(drawn_at_chunk)
    assert "".join(texts) == whole.choices[0].text


def test_an_openai_chat_stream_yields_its_first_tokens_while_its_sequence_still_decodes(
    tmp_path: Path, tiny: LocalEngine
) -> None:
    messages = [{"role": "user", "content": "Once"}]
    with _serving(tiny, tmp_path) as (_runtime, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="tml-local", max_retries=0)
        model = tiny.info.model_name
        whole = client.chat.completions.create(model=model, messages=messages, **SAMPLING)
        start = tiny.sampler.sampled_tokens
        drawn_at_chunk: list[int] = []
        content: list[str] = []
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **SAMPLING):
            delta = chunk.choices[0].delta
            if delta.content:
                drawn_at_chunk.append(tiny.sampler.sampled_tokens - start)
                content.append(delta.content)
    drawn = whole.usage.completion_tokens  # every token of the answer, the stop included
    assert drawn > 8
    assert drawn_at_chunk[0] < drawn  # the first token came while the sequence was still decoding
    assert "".join(content) == whole.choices[0].message.content


def test_a_client_that_leaves_midway_through_a_stream_has_its_sequence_cancelled_and_rows_freed(
    tmp_path: Path, tiny: LocalEngine
) -> None:
    body = json.dumps(
        {"model": tiny.info.model_name, "prompt": "Once", "stream": True, **SAMPLING, "max_tokens": 600}
    )
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer tml-local\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with _serving(tiny, tmp_path) as (runtime, port):
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(head.encode() + body.encode())
            received = b""
            while received.count(b'"text": "') < 3:  # a few tokens' chunks have arrived
                received += client.recv(4096)
            assert b"200 OK" in received
            assert _decoding(tiny) == 1  # still decoding when the client leaves
        _wait_for(lambda: _decoding(tiny) == 0, timeout_s=2.0)
        assert _futures(runtime) == [CANCELLED]
        assert tiny.usage().kv_cache_bytes == 0
