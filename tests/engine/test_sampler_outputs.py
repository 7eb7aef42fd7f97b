"""The sampler's optional outputs, each against an independent reference: the model's full (uncached)
forward over prompt + sampled tokens, log_softmax and topk in plain torch.

- topk_sample_logprobs: the top-k of the distribution each sampled token was drawn from;
- target_prompt_logprobs: the temperature-1 logprobs of named ids at prompt positions;
- prompt_alt_tokens_k: seeded draws at the request's temperature at every prompt position after the first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loraplex.engine.local import LocalEngine
from loraplex.engine.sampler.sampling import draw_token_reference
from loraplex.engine.types import LoraConfig, SampleRequest, SampleResult, SamplingParams
from loraplex.errors import UserError
from loraplex.model.multi_lora import LoRARouting
from loraplex.model.packing import PackedSequences
from tests.engine.conftest import randomize_lora_b
from tests.engine.test_sampler import float64_twin, same_tokens, sample_all, sample_one, tokens_of
from tests.model.rounding import assert_within_rounding

PROMPT = tokens_of(b"the cat sat")


@pytest.fixture(scope="module")
def adapter(engine: LocalEngine, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """A slot with random LoRA weights and its snapshot: the sampler reads the snapshot, the reference the
    slot."""
    slot = engine.create_slot(LoraConfig(rank=4, seed=3))
    randomize_lora_b(engine.pool.get(slot).weights, 0.1, torch.Generator().manual_seed(0))
    snapshot = tmp_path_factory.mktemp("snapshots") / "random"
    engine.save_snapshot(slot, snapshot)
    return slot, snapshot


@pytest.fixture(scope="module")
def twin(engine: LocalEngine, adapter: tuple[int, Path]) -> LocalEngine:
    """The engine's model in float64 with the adapter's slot (the same id and weights): the exact side of
    each comparison (tests/model/rounding.py)."""
    slot, _ = adapter
    twin = float64_twin(engine)
    assert twin.create_slot(engine.pool.get(slot).config) == slot
    twin.pool.get(slot).assign(engine.pool.get(slot).weights, None)
    return twin


@pytest.fixture(params=["base", "adapter"])
def model(request: pytest.FixtureRequest, adapter) -> tuple[int | None, Path | None]:
    """(slot for the reference, snapshot for the sampler) of the base model or of the adapter."""
    return (None, None) if request.param == "base" else adapter


def reference_logits(engine: LocalEngine, tokens: np.ndarray, slot: int | None) -> torch.Tensor:
    """(T, V) logits of a full forward (fp32, float64 on the twin): row t predicts tokens[t + 1]."""
    with torch.no_grad():
        routing = LoRARouting.from_sequences([len(tokens)], [slot])
        packing = PackedSequences.from_lengths([len(tokens)])
        logits = engine.decoder.logits(torch.from_numpy(tokens), packing, routing)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))


def truncated_logprobs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The README's sampling distribution of one position, written out: tempered, the top_k likeliest kept
    and renormalised (top_p stays 1 in these tests); greedy reports temperature 1."""
    lp_V = torch.log_softmax(logits_V / (params.temperature or 1.0), -1)
    if params.temperature == 0 or params.top_k == -1:
        return lp_V
    kept = lp_V.topk(params.top_k).indices
    out_V = torch.full_like(lp_V, float("-inf"))
    out_V[kept] = torch.log_softmax(lp_V[kept], -1)
    return out_V


# ---- topk_sample_logprobs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=()),
        SamplingParams(max_tokens=6, temperature=0.7, top_k=3, seed=6, stop=()),
        SamplingParams(max_tokens=6, temperature=0.0, stop=()),
    ],
    ids=["temperature-1", "tempered-top_k-3", "greedy"],
)
def test_topk_sample_logprobs_are_the_top_k_of_the_distribution_each_token_was_drawn_from(
    engine, twin, model, params: SamplingParams
) -> None:
    slot, snapshot = model
    k = 5
    request = SampleRequest(PROMPT, params, num_samples=2, topk_sample_logprobs=k, snapshot=snapshot)
    for sequence in sample_one(engine, request).sequences:
        n = len(sequence.tokens)
        assert sequence.topk_ids.shape == sequence.topk_logprobs.shape == (n, k)
        tokens = np.concatenate([PROMPT, sequence.tokens])
        logits, exact_logits = (reference_logits(e, tokens, slot) for e in (engine, twin))
        got, want, exact = [], [], []
        for i in range(n):
            row = len(PROMPT) - 1 + i
            lp_V, exact_lp_V = (truncated_logprobs(x[row], params) for x in (logits, exact_logits))
            values, ids = lp_V.topk(k)
            kept = values > float("-inf")  # top_k 3: two cells have no id
            assert sequence.topk_ids[i].tolist() == torch.where(kept, ids, -1).tolist()
            got.append(sequence.topk_logprobs[i][kept.numpy()])
            want.append(values[kept].numpy())
            exact.append(exact_lp_V[ids[kept]].numpy())
            assert np.isnan(sequence.topk_logprobs[i][~kept.numpy()]).all()
            # The sampled token's logprob is its own entry, when it is among the k: the same row of the
            # same distribution, through the same ops.
            where = np.flatnonzero(sequence.topk_ids[i] == sequence.tokens[i])
            if len(where):
                assert sequence.topk_logprobs[i][where[0]] == sequence.logprobs[i]
        assert_within_rounding(*(np.concatenate(x) for x in (got, want, exact)), "top-k logprobs")
        if params.temperature == 0:
            assert sequence.topk_ids[:, 0].tolist() == sequence.tokens.tolist()


# ---- target_prompt_logprobs


def test_target_prompt_logprobs_are_the_temperature_one_logprobs_of_the_named_ids(
    engine, twin, model
) -> None:
    slot, snapshot = model
    rows = len(PROMPT) - 1
    ids = np.full((rows, 3), -1, np.int64)
    ids[2] = [PROMPT[3], 0, 511]
    ids[5, 1] = 97
    ids[rows - 1, 2] = PROMPT[-1]
    params = SamplingParams(max_tokens=2, temperature=0.5, seed=1)  # the temperature does not apply
    request = SampleRequest(PROMPT, params, prompt_logprobs=True, target_prompt_ids=ids, snapshot=snapshot)
    result = sample_one(engine, request)
    lp, exact_lp = (torch.log_softmax(reference_logits(e, PROMPT, slot), -1) for e in (engine, twin))
    named = ids >= 0
    assert result.target_prompt_logprobs.shape == (rows, 3)
    assert np.isnan(result.target_prompt_logprobs[~named]).all()
    r, j = np.nonzero(named)
    want, exact = (x[r, ids[r, j]] for x in (lp, exact_lp))
    assert_within_rounding(result.target_prompt_logprobs[r, j], want, exact, "target logprobs")
    # Naming the prompt's own token gives its prompt logprob: the same entry of the same chunk's lp.
    assert result.target_prompt_logprobs[2, 0] == result.prompt_logprobs[3]
    assert not result.target_prompt_is_sparse


# ---- prompt_alt_tokens_k


def alt_uniforms(seed: int, num_samples: int, shape: tuple[int, int]) -> torch.Tensor:
    """The uniforms the sampler draws the prompt's alternatives with: the request seed's child after the
    samples' (generation.py), spelled out here so the draws can be checked one by one."""
    child = np.random.SeedSequence(seed).spawn(num_samples + 1)[-1]
    generator = torch.Generator().manual_seed(int(child.generate_state(1, np.uint64)[0]))
    return torch.rand(shape, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_prompt_alt_tokens_are_the_seeded_draws_at_the_requests_temperature(
    engine, twin, model, temperature
) -> None:
    slot, snapshot = model
    k, rows = 4, len(PROMPT) - 1
    params = SamplingParams(max_tokens=2, temperature=temperature, top_k=2, seed=21)  # top_k: not for draws
    result = sample_one(engine, SampleRequest(PROMPT, params, 2, prompt_alt_tokens_k=k, snapshot=snapshot))
    assert result.prompt_alt_ids.shape == result.prompt_alt_logprobs.shape == (rows, k)
    logits, exact_logits = (reference_logits(e, PROMPT, slot) for e in (engine, twin))
    uniforms = alt_uniforms(21, 2, (rows, k))
    want, exact = np.zeros((rows, k)), np.zeros((rows, k))
    for r in range(rows):
        # Draws at the temperature alone; greedy ones report the temperature-1 logprob.
        exact_lp_V = torch.log_softmax(exact_logits[r] / (temperature or 1.0), -1)
        for a in range(k):
            token, want[r, a] = draw_token_reference(
                logits[r], SamplingParams(temperature=temperature), float(uniforms[r, a])
            )
            assert result.prompt_alt_ids[r, a] == token
            exact[r, a] = float(exact_lp_V[token])
    assert_within_rounding(result.prompt_alt_logprobs, want, exact, "alternative logprobs")
    if temperature == 0:
        assert (result.prompt_alt_ids == logits[:-1].argmax(-1).numpy()[:, None]).all()
    else:
        assert len(np.unique(result.prompt_alt_ids)) > rows  # the draws differ


def test_asking_for_prompt_draws_leaves_the_samples_as_they_were(engine) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=())
    plain = sample_one(engine, SampleRequest(PROMPT, params, num_samples=3))
    drawn = sample_one(engine, SampleRequest(PROMPT, params, num_samples=3, prompt_alt_tokens_k=2))
    assert [s.tokens.tolist() for s in drawn.sequences] == [s.tokens.tolist() for s in plain.sequences]


# ---- mixed batches


def test_a_request_with_every_output_and_one_without_share_a_batch_and_get_what_each_asked(
    engine, twin, adapter
) -> None:
    _, snapshot = adapter
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=9, stop=())
    targets = np.full((len(PROMPT) - 1, 2), -1, np.int64)
    targets[4] = [10, 20]
    asking = SampleRequest(
        PROMPT,
        params,
        num_samples=3,
        topk_sample_logprobs=4,
        prompt_alt_tokens_k=3,
        target_prompt_ids=targets,
        snapshot=snapshot,
    )
    plain = SampleRequest(tokens_of(b"a dog"), params, num_samples=2)
    alone = {"asking": sample_one(engine, asking), "plain": sample_one(engine, plain)}
    exact = {"asking": sample_one(twin, asking), "plain": sample_one(twin, plain)}
    for key in alone:
        same_tokens([alone[key], exact[key]])
    together = sample_all(engine, {"asking": asking, "plain": plain}, join_every=2)  # plain joins mid-decode
    for key in alone:
        for shared, single, exactly in zip(
            together[key].sequences, alone[key].sequences, exact[key].sequences, strict=True
        ):
            assert shared.tokens.tolist() == single.tokens.tolist()
            assert_within_rounding(shared.logprobs, single.logprobs, exactly.logprobs, f"{key} logprobs")
    asked: SampleResult = together["asking"]
    for shared, single, exactly in zip(
        asked.sequences, alone["asking"].sequences, exact["asking"].sequences, strict=True
    ):
        assert shared.topk_ids.tolist() == single.topk_ids.tolist() == exactly.topk_ids.tolist()
        assert_within_rounding(shared.topk_logprobs, single.topk_logprobs, exactly.topk_logprobs, "top-k")
    assert asked.prompt_alt_ids.tolist() == alone["asking"].prompt_alt_ids.tolist()
    named = targets >= 0
    want, want_exact = (r["asking"].target_prompt_logprobs[named] for r in (alone, exact))
    assert_within_rounding(asked.target_prompt_logprobs[named], want, want_exact, "target logprobs")
    quiet = together["plain"]
    assert all(s.topk_ids is None and s.topk_logprobs is None for s in quiet.sequences)
    assert (quiet.target_prompt_logprobs, quiet.prompt_alt_ids, quiet.prompt_alt_logprobs) == (
        None,
        None,
        None,
    )


# ---- bounds


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs must be an integer in [0, 512]"),
        ({"topk_sample_logprobs": 513}, "topk_sample_logprobs must be an integer in [0, 512]"),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k must be an integer in [0, 512]"),
        (
            {"target_prompt_ids": np.array([[5], [6]])},
            "has 2 rows; it needs len(prompt) - 1 = 3",
        ),
        ({"target_prompt_ids": np.full((3, 2), -1)}, "target_prompt_logprobs names no token id"),
        ({"target_prompt_ids": np.array([[5], [512], [-1]])}, "target_prompt_logprobs has token id 512"),
        ({"target_prompt_ids": np.array([[5], [-2], [-1]])}, "target_prompt_logprobs has token id -2"),
        ({"target_prompt_ids": np.array([5, 6, 7])}, "target_prompt_logprobs must be a 2-D tensor"),
    ],
)
def test_an_output_asked_out_of_bounds_is_refused_naming_the_field(
    engine, change: dict, message: str
) -> None:
    with pytest.raises(UserError) as refused:
        engine.validate_sample_request(SampleRequest(np.array([1, 2, 3, 4]), **change))
    assert message in str(refused.value)


def test_widths_over_the_servers_caps_are_refused_naming_the_flag(engine, set_limits) -> None:
    set_limits(max_topk_prompt_logprobs=8, max_topk_sample_logprobs=4)
    engine.validate_sample_request(SampleRequest(PROMPT, topk_sample_logprobs=4, prompt_alt_tokens_k=8))
    with pytest.raises(UserError) as refused:
        engine.validate_sample_request(SampleRequest(PROMPT, topk_sample_logprobs=5))
    assert str(refused.value) == (
        "topk_sample_logprobs must be an integer in [0, 4] (this server's --max-topk-sample-logprobs), got 5"
    )
    with pytest.raises(UserError) as refused:
        engine.validate_sample_request(SampleRequest(PROMPT, prompt_alt_tokens_k=9))
    assert str(refused.value) == (
        "prompt_alt_tokens_k must be an integer in [0, 8] (this server's --max-topk-prompt-logprobs), got 9"
    )
