"""The /v1 routes in process over the fake engine: OpenAI's error bodies and status codes, auth by bearer
token, the completions stream on the wire, and no database work on the event loop."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.model.tiny import ensure_tiny_model
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.keys import KeyReadLimits, TenantResolver, create_key
from loraplex.runtime.control.store import Store
from loraplex.runtime.serving.inference import InferenceService
from tests.api.test_no_sql_on_the_loop import _guard
from tests.fakes import FakeEngine

BEARER = {"Authorization": "Bearer tml-local"}  # not a key of this --auth keys server
MODEL = "fake/bigram"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("data"))


def _service(data_dir: Path, tokenizer_dir: Path) -> Runtime:
    """A service over the fake engine, with the tiny model's tokenizer for text."""
    engine = FakeEngine()
    engine.info = replace(engine.info, tokenizer_dir=str(tokenizer_dir))
    return Runtime.open(engine, ServerConfig(data_dir=data_dir, auth="keys", long_poll_s=0.3))


def _key(data_dir: Path, tenant: str) -> str:
    """A new key of `tenant` in the server's database, as `loraplex keys create` makes one."""
    return create_key(Store(ServerConfig(data_dir=data_dir).resolved_database_url()), tenant)


@pytest.fixture
def http(tmp_path: Path, tokenizer_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(_service(tmp_path, tokenizer_dir))) as client:
        yield client


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> tuple:
    return status, {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def _post(http: TestClient, url: str, body: dict, headers: dict | None = None) -> tuple:
    reply = http.post(url, json=body, headers=headers or BEARER)
    return reply.status_code, reply.json()


def test_a_missing_or_unknown_key_is_401_in_openais_shape(http: TestClient) -> None:
    missing = http.get("/v1/models")
    assert (missing.status_code, missing.json()) == _error(
        401, "missing API key: send it as the header Authorization: Bearer tml-...", None, "invalid_api_key"
    )
    unknown = http.get("/v1/models", headers={"Authorization": "Bearer tml-nope"})
    assert (unknown.status_code, unknown.json()) == _error(
        401, "unknown or revoked API key", None, "invalid_api_key"
    )


def test_parameters_this_server_cannot_honour_are_400_naming_them(http: TestClient, tmp_path: Path) -> None:
    headers = {"Authorization": f"Bearer {_key(tmp_path, 'alice')}"}
    base = {"model": MODEL, "prompt": [1, 2]}
    assert _post(http, "/v1/completions", {**base, "presence_penalty": 0.5}, headers) == _error(
        400,
        "presence_penalty: presence_penalty is not supported by this server; leave it 0",
        "presence_penalty",
    )
    assert _post(http, "/v1/completions", {**base, "tools": []}, headers) == _error(
        400, "tools: this server does not support this parameter", "tools"
    )
    assert _post(http, "/v1/completions", {**base, "logprobs": 21}, headers) == _error(
        400, "logprobs: Input should be less than or equal to 20", "logprobs"
    )
    assert _post(http, "/v1/completions", {**base, "prompt": 5}, headers) == _error(
        400, "prompt: give a text, a list of texts, a list of token ids or a list of such lists", "prompt"
    )
    # A prompt's form is read from its first item: a later item of another form is named.
    assert _post(http, "/v1/completions", {**base, "prompt": [1, "a"]}, headers) == _error(
        400, "prompt.1: Input should be a valid integer, unable to parse string as an integer", "prompt.1"
    )
    assert _post(http, "/v1/completions", {**base, "prompt": ["a", [1]]}, headers) == _error(
        400, "prompt.1: Input should be a valid string", "prompt.1"
    )
    assert _post(http, "/v1/completions", {**base, "stop": 5}, headers) == _error(
        400, "stop: give a string or a list of strings", "stop"
    )
    no_text = {"role": "user", "content": [{"type": "text"}]}
    assert _post(http, "/v1/chat/completions", {"model": MODEL, "messages": [no_text]}, headers) == _error(
        400, "messages.0.content.0.text: Field required", "messages.0.content.0.text"
    )
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert _post(http, "/v1/chat/completions", {"model": MODEL, "messages": [image]}, headers) == _error(
        400,
        "messages.0.content: only text content parts are served here, not 'image_url'",
        "messages.0.content",
    )
    json_headers = {**headers, "content-type": "application/json"}
    broken = http.post("/v1/completions", content=b'{"model": ', headers=json_headers)
    assert (broken.status_code, broken.json()) == _error(400, "the body is not valid JSON: Expecting value")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    assert _post(http, "/v1/chat/completions", chat, headers) == _error(
        400, "top_logprobs: top_logprobs needs logprobs: true", "top_logprobs"
    )
    assert _post(http, "/v1/completions", {**base, "model": "gpt-4o"}, headers) == _error(
        404, "The model 'gpt-4o' does not exist or you do not have access to it.", "model", "model_not_found"
    )
    assert _post(
        http, "/v1/aliases", {"alias": "a:b", "model": "tinker://r/sampler_weights/x"}, headers
    ) == _error(
        400,
        "alias 'a:b' is invalid: use 1-128 characters from A-Z a-z 0-9 _ . - /, "
        "starting with a letter, digit or '_'",
        "alias",
    )
    assert _post(http, "/v1/aliases", {"alias": MODEL, "model": "tinker://r/sampler_weights/x"}, headers) == (
        _error(400, f"alias {MODEL!r} is the base model's name", "alias")
    )
    assert _post(http, "/v1/aliases", {"alias": "mine", "model": MODEL}, headers) == _error(
        400, f"model of an alias must be a tinker:// checkpoint path, not {MODEL!r}", "model"
    )


def test_an_unknown_url_under_v1_is_openais_404(http: TestClient) -> None:
    reply = http.post("/v1/embeddings", json={}, headers=BEARER)
    assert (reply.status_code, reply.json()) == _error(
        404, "Unknown request URL: POST /v1/embeddings", None, "unknown_url"
    )


def test_a_completion_stream_is_server_sent_events_whose_texts_join_to_the_whole_response(
    http: TestClient, tokenizer_dir: Path, tmp_path: Path
) -> None:
    headers = {"X-API-Key": _key(tmp_path, "alice")}  # the Tinker header works too
    body = {"model": MODEL, "prompt": [48, 49], "max_tokens": 3, "seed": 1, "echo": True, "logprobs": 0}
    status, whole = _post(http, "/v1/completions", body, headers)
    assert status == 200
    reply = http.post("/v1/completions", json={**body, "stream": True}, headers=headers)
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = reply.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert len(chunks) == 1 + 3 + 1  # the echoed prompt, a chunk per token, the finish
    choices = [chunk["choices"][0] for chunk in chunks]
    (expected,) = whole["choices"]
    assert "".join(c["text"] for c in choices) == expected["text"] and expected["text"].startswith("01")
    assert [c["finish_reason"] for c in choices] == [None] * 4 + [expected["finish_reason"]]
    joined = {key: [v for c in choices[:-1] for v in c["logprobs"][key]] for key in expected["logprobs"]}
    assert joined == expected["logprobs"]
    assert expected["logprobs"]["token_logprobs"][0] is None and expected["logprobs"]["text_offset"][:2] == [
        0,
        1,
    ]


def test_the_v1_routes_never_touch_the_database_on_the_event_loop_or_under_the_lock(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    service = _service(tmp_path, tokenizer_dir)
    headers = {"Authorization": f"Bearer {create_key(service.store, 'alice')}"}
    violations: list[str] = []
    _guard(service, violations)
    with TestClient(create_app(service)) as http:
        assert http.get("/v1/models", headers=headers).status_code == 200
        body = {"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 2, "echo": True, "logprobs": 2}
        assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
        alias = {"alias": "a", "model": "tinker://r/sampler_weights/x"}
        assert http.post("/v1/aliases", json=alias, headers=headers).status_code == 404
    assert violations == []


def test_an_unexpected_failure_is_a_500_naming_an_error_id_not_the_error(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(_self: InferenceService, _tenant: str) -> None:
        raise RuntimeError("disk /srv/secret/path is full")

    monkeypatch.setattr(InferenceService, "models", broken)
    service = _service(tmp_path, tokenizer_dir)
    headers = {"Authorization": f"Bearer {create_key(service.store, 'alice')}"}
    with TestClient(create_app(service), raise_server_exceptions=False) as http:
        reply = http.get("/v1/models", headers=headers)
    error = reply.json()["error"]
    assert (reply.status_code, error["type"], error["param"], error["code"]) == (
        500,
        "server_error",
        None,
        None,
    )
    assert re.fullmatch(
        r"internal server error \(error id [0-9a-f]{12}; the server log has the details\)", error["message"]
    )


def test_more_prompts_times_n_than_the_queue_holds_is_a_400_before_anything_is_queued(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    engine = FakeEngine()
    engine.info = replace(engine.info, tokenizer_dir=str(tokenizer_dir))
    service = Runtime.open(engine, ServerConfig(data_dir=tmp_path, max_queued_samples=4))
    body = {"model": MODEL, "prompt": [[1, 2], [3], [4]], "n": 2}
    with TestClient(create_app(service)) as http:
        assert _post(http, "/v1/completions", body) == _error(
            400,
            "n is 2: 3 prompts x 2 = 6 samples, over the 4 this server queues at once "
            "(--max-queued-samples); send fewer prompts or a smaller n",
            "n",
        )
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5}
        assert _post(http, "/v1/chat/completions", chat) == _error(
            400,
            "n is 5: 1 prompts x 5 = 5 samples, over the 4 this server queues at once "
            "(--max-queued-samples); send fewer prompts or a smaller n",
            "n",
        )
    assert service.store.recent_futures(["local"], 10) == []


def test_past_the_key_read_budget_an_unknown_key_is_a_retryable_503_and_known_keys_still_work(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    service = _service(tmp_path, tokenizer_dir)
    service.tenants = TenantResolver(service.store, "keys", KeyReadLimits(reads_per_s=0.001, burst=2))
    alice = {"Authorization": f"Bearer {create_key(service.store, 'alice')}"}
    with TestClient(create_app(service)) as http:
        assert http.get("/v1/models", headers=alice).status_code == 200
        unknown = http.get("/v1/models", headers={"Authorization": "Bearer tml-made-up"})
        assert unknown.status_code == 401
        spent = http.get("/v1/models", headers={"Authorization": "Bearer tml-made-up-too"})
        assert (spent.status_code, spent.json()["error"]["type"], "x-should-retry" in spent.headers) == (
            503,
            "server_error",
            False,
        )
        assert spent.json()["error"]["message"] == (
            "this server is checking too many API keys it does not know yet (more than 0.001 a second); "
            "try again in a moment"
        )
        assert http.get("/v1/models", headers=alice).status_code == 200  # remembered: no read needed
