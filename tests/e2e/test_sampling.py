"""Sampling through the official SDK against a real server: snapshots of every kind, logprobs that match
training, stops, seeds, isolation between tenants, sampling beside training, 429 backpressure."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.e2e.conftest import Server
from tests.e2e.sdk import PHRASE, base_model, client, create_key, logprobs, new_run, sft_steps

# Stops need the model's tokenizer and backpressure a sampler that takes time: the fake engine has neither.

PROMPT = types.ModelInput.from_ints(PHRASE)
QUEUE_LIMIT = 4  # samples queued at once on this module's server


@pytest.fixture(scope="module")
def server(start_module_server) -> Server:
    return start_module_server("--auth", "keys", "--max-queued-samples", str(QUEUE_LIMIT))


@pytest.fixture(scope="module")
def alice_key(server: Server) -> str:
    return create_key(server.data_dir, "alice")


@pytest.fixture(scope="module")
def alice(server: Server, alice_key: str) -> tinker.ServiceClient:
    return client(server, alice_key)


@pytest.fixture(scope="module")
def run(alice: tinker.ServiceClient, server: Server) -> tinker.TrainingClient:
    """A run trained a little, so its adapter differs from the base model."""
    trained = new_run(alice, server)
    sft_steps(trained, 2)
    return trained


def _params(**overrides) -> types.SamplingParams:
    return types.SamplingParams(**{"max_tokens": 6, "seed": 1, "stop": [], **overrides})


def _sample(sampler: tinker.SamplingClient, num_samples: int = 1, **params) -> types.SampleResponse:
    return sampler.sample(PROMPT, num_samples, _params(**params)).result()


def test_a_snapshot_samples_num_samples_sequences_with_logprobs_and_stops_at_max_tokens(run) -> None:
    out = _sample(run.save_weights_and_get_sampling_client().result(), num_samples=3, max_tokens=5)
    assert [(len(s.tokens), len(s.logprobs), s.stop_reason) for s in out.sequences] == [(5, 5, "length")] * 3
    assert all(-30 < lp < 0 for s in out.sequences for lp in s.logprobs)
    assert len({s.sequence_id for s in out.sequences}) == 3


def test_compute_logprobs_starts_with_none_and_equals_the_training_forward(run) -> None:
    scored = run.save_weights_and_get_sampling_client().result().compute_logprobs(PROMPT).result()
    assert scored[0] is None and len(scored) == len(PHRASE)
    np.testing.assert_allclose(scored[1:], logprobs(run), atol=1e-4)


def test_sampled_top_k_named_prompt_ids_and_prompt_draws_come_back_through_the_sdk(run) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    rows = len(PHRASE) - 1
    ids = torch.full((rows, 2), -1, dtype=torch.int64)
    ids[1, 0], ids[rows - 1] = PHRASE[2], torch.tensor([PHRASE[-1], 7])  # row i scores position i + 1
    out = sampler.sample(
        PROMPT,
        2,
        _params(max_tokens=4),
        include_prompt_logprobs=True,
        topk_sample_logprobs=3,
        target_prompt_logprobs=types.TensorData.from_torch_sparse(ids, pad_value=-1),
        prompt_alt_tokens_k=2,
    ).result()

    # Top-3 at each sampled position, at temperature 1: what scoring prompt + sample reports there.
    for sequence in out.sequences:
        scored = sampler.sample(
            types.ModelInput.from_ints(PHRASE + sequence.tokens),
            1,
            _params(max_tokens=1),
            topk_prompt_logprobs=3,
        ).result()
        assert [[t for t, _ in row] for row in sequence.topk_logprobs] == [
            [t for t, _ in row] for row in scored.topk_prompt_logprobs[len(PHRASE) :]
        ]
        np.testing.assert_allclose(
            [[lp for _, lp in row] for row in sequence.topk_logprobs],
            [[lp for _, lp in row] for row in scored.topk_prompt_logprobs[len(PHRASE) :]],
            atol=1e-4,
        )
        # A sampled token's logprob is its own entry, when it is among the 3.
        top_k = sequence.topk_logprobs
        for token, logprob, top in zip(sequence.tokens, sequence.logprobs, top_k, strict=True):
            assert dict(top).get(token, logprob) == pytest.approx(logprob, abs=1e-5)

    # Named ids: sent sparse, returned sparse; the prompt's own token scores its prompt logprob.
    target = out.target_prompt_logprobs
    assert target.sparse_crow_indices is not None and target.shape == [rows, 2]
    dense = target.to_numpy()
    assert dense[1, 0] == pytest.approx(out.prompt_logprobs[2], abs=1e-5)
    assert dense[rows - 1, 0] == pytest.approx(out.prompt_logprobs[-1], abs=1e-5)
    assert dense[rows - 1, 1] < 0 and (dense[ids.numpy() < 0] == 0).all()

    # Draws: [rows, 2] ids whose logprobs are those the same prompt scores for them (temperature 1).
    alt = out.prompt_alt_tokens
    assert (alt.tokens.dtype, alt.tokens.shape, alt.logprobs.shape) == ("int64", [rows, 2], [rows, 2])
    named = sampler.sample(PROMPT, 1, _params(max_tokens=1), target_prompt_logprobs=alt.tokens).result()
    np.testing.assert_allclose(named.target_prompt_logprobs.to_numpy(), alt.logprobs.to_numpy(), atol=1e-5)


def test_a_seeded_request_samples_the_same_tokens_every_time(run) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    first, again = (_sample(sampler, 2, max_tokens=16, seed=11) for _ in range(2))
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    assert [s.logprobs for s in again.sequences] == [s.logprobs for s in first.sequences]
    other = _sample(sampler, 2, max_tokens=16, seed=12)
    assert [s.tokens for s in other.sequences] != [s.tokens for s in first.sequences]


def _sampler_id(sampler: tinker.SamplingClient) -> str:
    """The sampling_session_id the SDK sends (it keeps it private), for requests made by hand."""
    return sampler._sampling_session_id


def _greedy(sampler: tinker.SamplingClient, **params) -> types.SampledSequence:
    return _sample(sampler, max_tokens=16, temperature=0.0, **params).sequences[0]


def _cut_at(tokens: list[int], stops: set[int]) -> list[int]:
    """The tokens up to and including the first one in `stops` (EOS always stops unless stop=[])."""
    end = next(i for i, t in enumerate(tokens) if t in stops)
    return tokens[: end + 1]


def test_a_stop_token_id_ends_the_sample_on_that_token(run) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    free = _greedy(sampler).tokens  # greedy: stops only cut this sequence short
    eos = run.get_tokenizer().eos_token_id
    stopped = _greedy(sampler, stop=[free[3]])
    assert (stopped.tokens, stopped.stop_reason) == (_cut_at(free, {free[3], eos}), "stop")


def test_a_stop_string_ends_the_sample_on_the_token_that_completes_it(run) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    tokenizer = run.get_tokenizer()
    free = _greedy(sampler).tokens
    stop = tokenizer.decode(free[2:4])  # two tokens' text: the string completes on the second
    assert len(stop) == 2
    eos = tokenizer.eos_token_id
    end = next(i for i in range(len(free)) if stop in tokenizer.decode(free[: i + 1]) or free[i] == eos)
    stopped = _greedy(sampler, stop=[stop])
    assert (stopped.tokens, stopped.stop_reason) == (free[: end + 1], "stop")


def test_named_sampler_weights_a_training_checkpoint_and_an_unnamed_snapshot_sample_the_same_model(
    alice: tinker.ServiceClient, run, server: Server
) -> None:
    named = run.save_weights_for_sampler("snap").result().path
    weights = run.save_state("state").result().path
    assert named == f"tinker://{run.model_id}/sampler_weights/snap"
    samplers = [
        alice.create_sampling_client(model_path=named).result(),
        alice.create_sampling_client(model_path=weights).result(),
        run.save_weights_and_get_sampling_client().result(),
    ]
    scores = [s.compute_logprobs(PROMPT).result()[1:] for s in samplers]
    np.testing.assert_allclose(scores[1], scores[0], rtol=1e-6)
    np.testing.assert_allclose(scores[2], scores[0], rtol=1e-6)
    base = alice.create_sampling_client(base_model=base_model(server)).result()
    assert not np.allclose(base.compute_logprobs(PROMPT).result()[1:], scores[0])


def test_an_older_snapshot_keeps_sampling_the_old_model_after_more_training(
    alice: tinker.ServiceClient, server: Server
) -> None:
    trained = new_run(alice, server, seed=3)
    old = trained.save_weights_and_get_sampling_client().result()
    before = _sample(old, 2, max_tokens=12)
    sft_steps(trained, 3)
    after = _sample(old, 2, max_tokens=12)
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    newer = _sample(trained.save_weights_and_get_sampling_client().result(), 2, max_tokens=12)
    assert [s.logprobs for s in newer.sequences] != [s.logprobs for s in before.sequences]


def test_another_tenants_sampler_answers_404_with_a_body(server: Server, run) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    named = run.save_weights_for_sampler("private").result().path
    mallory_key = create_key(server.data_dir, "mallory")
    body = {
        "sampling_session_id": _sampler_id(sampler),
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PHRASE}]},
        "sampling_params": {"max_tokens": 2},
    }
    as_mallory = {"X-API-Key": mallory_key}
    sample = httpx.post(f"{server.base_url}/api/v1/asample", headers=as_mallory, json=body)
    describe = httpx.get(f"{server.base_url}/api/v1/samplers/{_sampler_id(sampler)}", headers=as_mallory)
    for reply in (sample, describe):
        assert reply.status_code == 404 and "sampler" in reply.json()["detail"]
    with pytest.raises(tinker.NotFoundError, match="not found"):
        client(server, mallory_key).create_sampling_client(model_path=named).result()


def test_sampling_while_another_run_trains_completes_both_with_unchanged_samples(
    alice: tinker.ServiceClient, run, server: Server
) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    alone = _sample(sampler, 4, max_tokens=24, seed=5)
    trainer = new_run(alice, server, seed=4)
    with ThreadPoolExecutor(2) as pool:
        losses = pool.submit(sft_steps, trainer, 5)
        beside = pool.submit(lambda: [_sample(sampler, 4, max_tokens=24, seed=5) for _ in range(5)])
        assert losses.result()[-1] < losses.result()[0]
        for out in beside.result():
            assert [s.tokens for s in out.sequences] == [s.tokens for s in alone.sequences]


def test_a_full_sampling_queue_answers_429_and_the_sdk_backs_off_and_resends(
    server: Server, alice_key: str, run
) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    headers = {"X-API-Key": alice_key}

    def asample(seq_id: int, num_samples: int, max_tokens: int) -> httpx.Response:
        body = {
            "sampling_session_id": _sampler_id(sampler),
            "seq_id": 10**12 + seq_id,  # clear of the SDK client's own seq_ids
            "num_samples": num_samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PHRASE}]},
            "sampling_params": {"max_tokens": max_tokens, "stop": []},
        }
        return httpx.post(f"{server.base_url}/api/v1/asample", headers=headers, json=body)

    filling = asample(0, QUEUE_LIMIT, max_tokens=200).json()  # fills the queue for a while
    refused = asample(1, 1, max_tokens=2)
    assert refused.status_code == 429 and "queued" in refused.json()["detail"]
    started = time.monotonic()
    out = _sample(sampler, 1, max_tokens=3)  # answered 429 at first, then resent after the SDK's backoff
    assert time.monotonic() - started >= 0.9 and len(out.sequences[0].tokens) == 3
    done = httpx.post(
        f"{server.base_url}/api/v1/retrieve_future",
        headers=headers,
        json={"request_id": filling["request_id"]},
        timeout=60,
    ).json()
    assert [len(s["tokens"]) for s in done["sequences"]] == [200] * QUEUE_LIMIT
