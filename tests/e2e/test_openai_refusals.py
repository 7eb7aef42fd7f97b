"""Every /v1 refusal of a request field names that field as OpenAI's API names it, in `param` and in the
message, also when the sampler (whose checks name Tinker's fields) or the runtime refused it. Driven by the
official `openai` client against a real server on the tiny model, with small limits to run into."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.e2e.conftest import Server
from tests.e2e.sdk import base_model

CONTEXT = 4096  # the tiny model's max_position_embeddings
VOCAB = 512  # its config's vocab_size
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(start_module_server) -> Server:
    return start_module_server(
        "--max-sampling-batch", "4", "--max-topk-prompt-logprobs", "3", "--max-sample-kv-mib", "1"
    )


@pytest.fixture(scope="module")
def v1(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-local", max_retries=0)


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return base_model(server)


def _refusal(create: Any, **body: Any) -> tuple[str | None, str]:
    """(param, message) of the 400 that `create(**body)` gets."""
    with pytest.raises(openai.BadRequestError) as refused:
        create(**body)
    error = refused.value
    assert (error.status_code, error.type, error.code) == (400, "invalid_request_error", None)
    return error.param, error.body["message"]


def test_completions_refusals_of_the_sampler_name_the_openai_field(v1: openai.OpenAI, model: str) -> None:
    def refused(**body: Any) -> tuple[str | None, str]:
        return _refusal(v1.completions.create, **{"model": model, "prompt": [1, 2], **body})

    assert refused(max_tokens=5000) == (
        "max_tokens",
        f"max_tokens must be an integer in [1, {CONTEXT - 2}] (context left), got 5000",
    )
    assert refused(n=5) == ("n", "n must be an integer in [1, 4], got 5")  # --max-sampling-batch
    assert refused(n=5000) == (
        "n",
        "n is 5000: 1 prompts x 5000 = 5000 samples, over the 4096 this server queues at once "
        "(--max-queued-samples); send fewer prompts or a smaller n",
    )
    assert refused(prompt=list(range(CONTEXT))) == (
        "prompt",
        f"prompt has {CONTEXT} tokens; expected 1..{CONTEXT - 1} so that at least one token fits the model's "
        f"context length {CONTEXT}",
    )
    assert refused(prompt=[1, VOCAB]) == (
        "prompt",
        f"prompt has token id {VOCAB}, outside the vocabulary [0, {VOCAB})",
    )
    assert refused(stop=["", "x"]) == ("stop", "stop has an empty stop string")
    assert refused(temperature="inf") == ("temperature", "temperature must be a finite number ≥ 0, got inf")
    assert refused(max_tokens=300) == (  # (2 + 300) tokens x 4096 bytes: over --max-sample-kv-mib 1
        "max_tokens",
        "max_tokens 300 needs 1236992 bytes of KV cache ((prompt 2 + 300 new tokens) × 1 samples × 4096 "
        "bytes per token), over the 1048576 bytes (1 MiB) this server allows one request "
        "(--max-sample-kv-mib); lower it or the number of samples",
    )
    assert refused(echo=True, logprobs=4, max_tokens=0) == (
        "logprobs",
        "logprobs must be an integer in [0, 3] (this server's --max-topk-prompt-logprobs), got 4",
    )
    assert refused(logprobs=1, max_tokens=CONTEXT - 2) == (
        "logprobs",
        f"logprobs scores the completion after it is sampled, so the prompt (2 tokens) plus max_tokens "
        f"({CONTEXT - 2}) must stay below the context length {CONTEXT}",
    )


def test_chat_refusals_of_the_sampler_name_the_openai_field(v1: openai.OpenAI, model: str) -> None:
    def refused(**body: Any) -> tuple[str | None, str]:
        return _refusal(v1.chat.completions.create, **{"model": model, "messages": MESSAGES, **body})

    # The chat template's prompt: a byte a token, but each of its special tokens (two <|im_start|>, one
    # <|im_end|>) one token.
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt = len(text) - 2 * (len("<|im_start|>") - 1) - (len("<|im_end|>") - 1)
    room = CONTEXT - prompt
    too_many = f"must be an integer in [1, {room}] (context left), got 5000"
    assert refused(max_completion_tokens=5000) == (
        "max_completion_tokens",
        f"max_completion_tokens {too_many}",
    )
    assert refused(max_tokens=5000) == ("max_tokens", f"max_tokens {too_many}")
    assert refused(n=5) == ("n", "n must be an integer in [1, 4], got 5")
    long = [{"role": "user", "content": "x" * CONTEXT}]
    param, message = refused(messages=long)
    assert param == "messages" and message.startswith(f"messages has {prompt - len('hi') + CONTEXT} tokens;")
    assert refused(stop="") == ("stop", "stop has an empty stop string")
    assert refused(logprobs=True, top_logprobs=2, max_tokens=room) == (
        "top_logprobs",
        f"top_logprobs scores the completion after it is sampled, so the prompt ({prompt} tokens) plus "
        f"max_tokens ({room}) must stay below the context length {CONTEXT}",
    )


def test_refusals_of_the_body_itself_name_the_openai_field(v1: openai.OpenAI, model: str) -> None:
    completion = {"model": model, "prompt": [1, 2]}
    assert _refusal(v1.completions.create, **completion, max_tokens=-1) == (
        "max_tokens",
        "max_tokens: Input should be greater than or equal to 0",
    )
    assert _refusal(v1.completions.create, **completion, n=2, best_of=3) == (
        "best_of",
        "best_of: best_of is not supported by this server; leave it out or equal to n",
    )
    assert _refusal(v1.completions.create, **completion, top_p=0) == (
        "top_p",
        "top_p: Input should be greater than 0",
    )
    chat = {"model": model, "messages": MESSAGES}
    assert _refusal(v1.chat.completions.create, **chat, top_logprobs=2) == (
        "top_logprobs",
        "top_logprobs: top_logprobs needs logprobs: true",
    )
