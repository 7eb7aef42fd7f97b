"""The OpenAI-compatible /v1 endpoints, driven by the official `openai` client against a real server: what
they return equals the Tinker SamplingClient's answer to the same request, token for token.

The run is trained a few SFT steps on one chat exchange, so that greedy replies are readable text."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import Server
from tests.e2e.sdk import PHRASE, base_model, client, create_key, new_run, sft_datum, sft_steps

MESSAGES = [{"role": "user", "content": "Name four letters."}]
REPLY = "A, B, C and D."


@pytest.fixture(scope="module")
def server(start_module_server) -> Server:
    return start_module_server("--auth", "keys")


@pytest.fixture(scope="module")
def keys(server: Server) -> dict[str, str]:
    return {tenant: create_key(server.data_dir, tenant) for tenant in ("alice", "bob")}


@pytest.fixture(scope="module")
def run(server: Server, keys: dict[str, str]) -> tinker.TrainingClient:
    """Alice's run, trained to answer MESSAGES with REPLY."""
    trained = new_run(client(server, keys["alice"]), server)
    tokenizer = trained.get_tokenizer()
    reply = tokenizer(REPLY, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    sft_steps(trained, 24, sft_datum(_chat_prompt(tokenizer) + reply))
    return trained


@pytest.fixture(scope="module")
def path(run: tinker.TrainingClient) -> str:
    return run.save_weights_for_sampler("openai").result().path


@pytest.fixture(scope="module")
def sampler(server: Server, keys: dict[str, str], path: str) -> tinker.SamplingClient:
    return client(server, keys["alice"]).create_sampling_client(model_path=path).result()


@pytest.fixture(scope="module")
def tokenizer(run: tinker.TrainingClient):
    return run.get_tokenizer()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    """MESSAGES as a completion prompt of token ids."""
    return _chat_prompt(tokenizer)


def _openai(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def alice(server: Server, keys: dict[str, str]) -> openai.OpenAI:
    return _openai(server, keys["alice"])


@pytest.fixture(scope="module")
def bob(server: Server, keys: dict[str, str]) -> openai.OpenAI:
    return _openai(server, keys["bob"])


def _tinker(sampler: tinker.SamplingClient, prompt: list[int], n: int = 1, **params) -> types.SampleResponse:
    sampling = types.SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **params})
    return sampler.sample(types.ModelInput.from_ints(prompt), n, sampling).result()


def _text(tokenizer, sequence: types.SampledSequence) -> str:
    """OpenAI's text of a Tinker sample: the tokens' text without the EOS that stopped it."""
    tokens = sequence.tokens[:-1] if sequence.stop_reason == "stop" else sequence.tokens
    return tokenizer.decode(tokens)


def _chat_text(tokenizer) -> str:
    """MESSAGES as transformers renders them with the model's chat template."""
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def _chat_prompt(tokenizer) -> list[int]:
    return tokenizer(_chat_text(tokenizer), add_special_tokens=False)["input_ids"]


def _shown(tokenizer, token: int) -> str:
    """How logprobs name a token: its text, or `token_id:N` for an id past the tokenizer's vocabulary."""
    return tokenizer.decode([token]) if token < len(tokenizer) else f"token_id:{token}"


def test_greedy_completions_and_chat_equal_the_sdk_sampling_client_token_for_token(
    alice: openai.OpenAI, sampler: tinker.SamplingClient, tokenizer, path: str, prompt: list[int]
) -> None:
    expected = _tinker(sampler, prompt, max_tokens=20).sequences[0]
    assert expected.stop_reason == "stop" and _text(tokenizer, expected) == REPLY  # the run learnt its reply
    for model_input in (_chat_text(tokenizer), prompt):  # text the server tokenizes, and token ids
        out = alice.completions.create(
            model=path, prompt=model_input, max_tokens=20, temperature=0, logprobs=0
        )
        choice = out.choices[0]
        assert choice.logprobs.token_logprobs == expected.logprobs
        assert choice.logprobs.tokens == [_shown(tokenizer, t) for t in expected.tokens]
        assert (choice.text, choice.finish_reason) == (REPLY, "stop")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(expected.tokens))

    out = alice.chat.completions.create(
        model=path, messages=MESSAGES, max_completion_tokens=20, temperature=0, logprobs=True
    )
    assert [t.logprob for t in out.choices[0].logprobs.content] == expected.logprobs
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (REPLY, "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(expected.tokens))


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_compute_logprobs_does(
    alice: openai.OpenAI, sampler: tinker.SamplingClient, tokenizer, path: str
) -> None:
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PHRASE)).result()
    out = alice.completions.create(model=path, prompt=PHRASE, echo=True, logprobs=1, max_tokens=0)
    logprobs = out.choices[0].logprobs
    assert logprobs.token_logprobs == scored
    assert out.choices[0].text == tokenizer.decode(PHRASE)
    assert logprobs.text_offset == list(range(len(PHRASE)))  # one byte-level character per token
    assert logprobs.top_logprobs[0] is None
    for token, logprob, top in zip(logprobs.tokens[1:], scored[1:], logprobs.top_logprobs[1:], strict=True):
        # The likeliest token, and the prompt's own token if another one is likelier.
        assert top[token] == logprob and len(top) in (1, 2) and max(top.values()) >= logprob
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PHRASE), 0)
    # lm-evaluation-harness asks for max_tokens=1 and drops the last position.
    lm_eval = alice.completions.create(model=path, prompt=PHRASE, echo=True, logprobs=1, max_tokens=1)
    assert lm_eval.choices[0].logprobs.token_logprobs[:-1] == scored


def test_seeded_samples_repeat_and_equal_the_sdk_samples_with_that_seed(
    alice: openai.OpenAI, sampler: tinker.SamplingClient, path: str, prompt: list[int]
) -> None:
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 7}
    first, again = (
        alice.completions.create(model=path, prompt=prompt, n=3, logprobs=0, **params) for _ in "ab"
    )
    assert [c.index for c in first.choices] == [0, 1, 2]
    samples = [(c.text, c.logprobs.token_logprobs) for c in first.choices]
    assert [(c.text, c.logprobs.token_logprobs) for c in again.choices] == samples
    assert len({tuple(logprobs) for _, logprobs in samples}) == 3
    expected = _tinker(sampler, prompt, n=3, **params)
    assert [logprobs for _, logprobs in samples] == [s.logprobs for s in expected.sequences]


def test_a_stop_string_ends_the_text_before_it_where_the_sampler_stopped(
    alice: openai.OpenAI, sampler: tinker.SamplingClient, path: str, prompt: list[int]
) -> None:
    out = alice.completions.create(
        model=path, prompt=prompt, max_tokens=20, temperature=0, stop=[", C", "D"], logprobs=0
    )
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == ("A, B", "stop")
    # Every sampled token comes back, the ones completing the stop included, as the SDK returns them.
    stopped = _tinker(sampler, prompt, max_tokens=20, stop=[", C", "D"]).sequences[0]
    assert choice.logprobs.token_logprobs == stopped.logprobs and len(stopped.logprobs) == len("A, B, C")
    chat = alice.chat.completions.create(
        model=path, messages=MESSAGES, max_tokens=20, temperature=0, stop="and"
    )
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("A, B, C ", "stop")


def test_streams_deliver_the_same_choices_as_whole_responses(
    alice: openai.OpenAI, path: str, prompt: list[int]
) -> None:
    params = {"model": path, "prompt": prompt, "max_tokens": 8, "seed": 3, "n": 2}
    whole = alice.completions.create(**params)
    chunks = list(alice.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index] = finishes[choice.index] or choice.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert (chunks[-1].choices, chunks[-1].usage) == ([], whole.usage)

    chat = {"model": path, "messages": MESSAGES, "max_tokens": 8, "seed": 3}
    whole_chat = alice.chat.completions.create(**chat)
    deltas = [c.choices[0] for c in alice.chat.completions.create(**chat, stream=True)]
    assert "".join(d.delta.content or "" for d in deltas) == whole_chat.choices[0].message.content
    assert deltas[-1].finish_reason == whole_chat.choices[0].finish_reason


def test_a_stream_is_server_sent_events_in_openais_chunk_format(
    server: Server, keys: dict[str, str], path: str
) -> None:
    body = {"model": path, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {keys['alice']}"}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = reply.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    fields = {"id", "object", "created", "model", "system_fingerprint", "choices"}
    assert {(c["id"], c["object"], frozenset(c)) for c in chunks} == {
        (chunks[0]["id"], "chat.completion.chunk", frozenset(fields))
    }
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "A"}, None),
        ({"content": ","}, None),
        ({}, "length"),
    ]


def test_top_logprobs_are_the_likeliest_tokens_at_each_sampled_position(
    alice: openai.OpenAI, sampler: tinker.SamplingClient, tokenizer, path: str, prompt: list[int]
) -> None:
    out = alice.chat.completions.create(
        model=path, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert [entry.token for entry in content] == list(REPLY[:6])
    sampled = tokenizer(REPLY[:6], add_special_tokens=False)["input_ids"]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + sampled)).result()
    for entry, temperature_1 in zip(content, scored[len(prompt) :], strict=True):
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        # Greedy: the chosen token is the likeliest, scored at temperature 1 as compute_logprobs scores it.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(temperature_1, abs=1e-5)


def test_models_lists_the_base_model_and_each_tenants_own_sampler_checkpoints(
    alice: openai.OpenAI, bob: openai.OpenAI, server: Server, path: str
) -> None:
    alices = [m.id for m in alice.models.list()]
    assert alices[0] == base_model(server) and path in alices
    assert [m.id for m in bob.models.list()] == [base_model(server)]


def test_another_tenants_checkpoint_is_refused_as_an_unknown_model(
    bob: openai.OpenAI, path: str, prompt: list[int]
) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        bob.completions.create(model=path, prompt=prompt, max_tokens=2)
    assert refused.value.body == {
        "message": f"The model {path!r} does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_an_unknown_model_gets_openais_404_and_a_bad_key_its_401(
    alice: openai.OpenAI, server: Server
) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        alice.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    error = unknown.value
    assert (error.status_code, error.type, error.code, error.param) == (
        404,
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    with pytest.raises(openai.AuthenticationError) as bad_key:
        _openai(server, "tml-not-a-key").models.list()
    assert (bad_key.value.status_code, bad_key.value.code) == (401, "invalid_api_key")


def test_an_alias_names_a_checkpoint_for_its_own_tenant_only(
    alice: openai.OpenAI,
    bob: openai.OpenAI,
    server: Server,
    keys: dict[str, str],
    path: str,
    prompt: list[int],
) -> None:
    def aliases(key: str, method: str, url: str = "", **body: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.request(method, f"{server.base_url}/v1/aliases{url}", headers=headers, json=body or None)

    created = aliases(keys["alice"], "POST", alias="sft/latest", model=path)
    assert created.json() == {"object": "alias", "alias": "sft/latest", "model": path}
    out = alice.completions.create(model="sft/latest", prompt=prompt, max_tokens=20, temperature=0)
    assert (out.model, out.choices[0].text) == ("sft/latest", REPLY)
    assert "sft/latest" in [m.id for m in alice.models.list()]
    with pytest.raises(openai.NotFoundError):
        bob.completions.create(model="sft/latest", prompt=prompt, max_tokens=2)
    stolen = aliases(keys["bob"], "POST", alias="mine", model=path)
    assert (stolen.status_code, stolen.json()["error"]["code"]) == (404, "model_not_found")
    assert aliases(keys["alice"], "DELETE", "/sft/latest").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        alice.completions.create(model="sft/latest", prompt=prompt, max_tokens=2)


def test_a_training_checkpoint_samples_the_weights_it_holds(
    alice: openai.OpenAI, run: tinker.TrainingClient, prompt: list[int]
) -> None:
    weights = run.save_state("openai-state").result().path
    out = alice.completions.create(model=weights, prompt=prompt, max_tokens=20, temperature=0)
    assert out.choices[0].text == REPLY
