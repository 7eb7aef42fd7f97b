"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info, at the root and under /v1) and
OpenAI's models.retrieve, in process over the fake engine with the tiny model's tokenizer: their bodies
have vLLM's and OpenAI's shapes, and their tokens are those transformers gives with the same files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import transformers
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.model.tiny import ensure_tiny_model
from tests.api.test_openai_http import MODEL, _error, _key, _service

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo?"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(tokenizer_dir: Path) -> transformers.PreTrainedTokenizerBase:
    """The same tokenizer files as transformers reads them."""
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture
def http(tmp_path: Path, tokenizer_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(_service(tmp_path, tokenizer_dir))) as client:
        client.headers["Authorization"] = f"Bearer {_key(tmp_path, 'alice')}"
        yield client


@pytest.mark.parametrize("root", ["", "/v1"])
def test_tokenize_a_prompt_answers_vllms_body_with_transformers_tokens(
    http: TestClient, reference, root: str
) -> None:
    text = "Héllo <|im_end|> world"
    reply = http.post(f"{root}/tokenize", json={"prompt": text, "return_token_strs": True})
    tokens = reference(text)["input_ids"]
    assert reply.status_code == 200
    assert reply.json() == {
        "count": len(tokens),
        "max_model_len": 4096,  # the fake engine's context
        "tokens": tokens,
        "token_strs": reference.convert_ids_to_tokens(tokens),
    }
    assert 258 in tokens  # <|im_end|> is one special token
    plain = http.post(f"{root}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert plain.json()["token_strs"] is None and plain.json()["tokens"] == tokens


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages_renders_the_chat_template_as_transformers_does(
    http: TestClient, reference, add_generation_prompt: bool
) -> None:
    body = {"messages": CHAT, "add_generation_prompt": add_generation_prompt}
    reply = http.post("/tokenize", json=body).json()
    text = reference.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert reply["tokens"] == reference(text, add_special_tokens=False)["input_ids"]
    assert reply["count"] == len(reply["tokens"])
    assert text.endswith("<|im_start|>assistant\n") is add_generation_prompt


def test_detokenize_is_transformers_decode_with_special_tokens(http: TestClient, reference) -> None:
    tokens = reference("<|im_start|>user\nHéllo<|im_end|>")["input_ids"]
    reply = http.post("/detokenize", json={"tokens": tokens})
    assert (reply.status_code, reply.json()) == (200, {"prompt": reference.decode(tokens)})
    assert reply.json()["prompt"] == "<|im_start|>user\nHéllo<|im_end|>"


def test_tokenizer_info_is_the_tokenizer_config_with_its_class_and_chat_template(
    http: TestClient, reference, tokenizer_dir: Path
) -> None:
    info = http.get("/tokenizer_info").json()
    assert info == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": reference.eos_token,
        "pad_token": reference.pad_token,
        "bos_token": None,
        "model_max_length": reference.model_max_length,
        "chat_template": reference.chat_template,
    }
    assert info["eos_token"] == "<|im_end|>"


def test_tokenizer_routes_refuse_bad_input_in_openais_shape(http: TestClient) -> None:
    def post(url: str, body: dict) -> tuple:
        reply = http.post(url, json=body)
        return reply.status_code, reply.json()

    assert post("/detokenize", {"tokens": [1, 259, 300]}) == _error(
        400, "tokens has token id 259, outside the tokenizer's vocabulary [0, 259)", "tokens"
    )
    assert post("/tokenize", {"prompt": "a", "model": "gpt-4o"}) == _error(
        404, "The model 'gpt-4o' does not exist or you do not have access to it.", "model", "model_not_found"
    )
    assert post("/tokenize", {"prompt": 5}) == _error(400, "prompt: Input should be a valid string", "prompt")
    assert post("/tokenize", {"model": MODEL}) == _error(
        400, "prompt is missing: give a prompt, or chat messages", "prompt"
    )
    assert post("/tokenize", {"prompt": "a", "messages": CHAT}) == _error(
        400, "messages: give a prompt or messages, not both", "messages"
    )
    assert post("/tokenize", {"messages": CHAT, "continue_final_message": True}) == _error(
        400,
        "continue_final_message: continue_final_message is not supported by this server; leave it false",
        "continue_final_message",
    )
    missing_key = http.get("/tokenizer_info", headers={"Authorization": ""})
    assert missing_key.status_code == 401 and missing_key.json()["error"]["code"] == "invalid_api_key"


def test_models_retrieve_answers_one_entry_or_openais_404_naming_model(http: TestClient) -> None:
    listed = http.get("/v1/models").json()["data"]
    assert http.get(f"/v1/models/{MODEL}").json() == listed[0] and listed[0]["id"] == MODEL
    reply = http.get("/v1/models/gpt-4o")
    assert (reply.status_code, reply.json()) == _error(
        404, "The model 'gpt-4o' does not exist or you do not have access to it.", "model", "model_not_found"
    )
