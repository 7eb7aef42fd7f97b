"""The sampler on a tensor-parallel decoder: two ranks driven in lockstep draw the tokens one rank draws,
with its logprobs up to rounding, and both return the same results; one rank runs the single-rank path.

Two gloo ranks run every scenario of tests/engine/sampler_tensor_parallel_scenarios.py once per module
(rank 0 in this process, rank 1 a child started with the engine's LocalRanks); the single-rank reference
runs the same scenarios here, and its float64 twin measures the reference's rounding
(tests/model/rounding.py). The ranks gather the same full-vocabulary logits, whose only difference from
one rank's is the order in which the row-parallel layers' and the experts' partial sums are added, so the
default bound (4 × the reference's measured rounding error + 1 fp32 ulp per element, rounding.py says why)
applies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from loraplex.model.tensor_parallel import SINGLE, TensorParallel
from tests.engine.sampler_tensor_parallel_scenarios import (
    Run,
    requests,
    run_all,
    run_sampler,
    write_snapshots,
)
from tests.model.float64 import float64_experts
from tests.model.rounding import assert_within_rounding
from tests.model.test_decoder_parity import save_random_hf_model
from tests.model.test_tensor_parallel import MODELS
from tests.model.two_ranks import run_on_two_ranks


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tensor-parallel tests' models (uneven MLP width and vocabulary, biases, tied head, experts split
    over the ranks), each with its snapshots."""
    directories = {}
    for name, config in MODELS.items():
        directories[name] = tmp_path_factory.mktemp("models") / name
        save_random_hf_model(config(), directories[name])
        write_snapshots(directories[name])
    return directories


@pytest.fixture(scope="module")
def two_ranks(model_dirs: dict[str, Path]) -> dict[str, list[Run]]:
    """Per model, every rank's results on two ranks (rank 1 a child process making the same calls)."""
    scenarios = "tests.engine.sampler_tensor_parallel_scenarios"
    return run_on_two_ranks(scenarios, run_all, list(model_dirs.values()))


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[str, tuple[Run, Run]]:
    """Per model, the single-rank run and its float64 twin."""
    with float64_experts():
        return {
            name: (run_sampler(directory, SINGLE), run_sampler(directory, SINGLE, torch.float64))
            for name, directory in model_dirs.items()
        }


def assert_scores_within_rounding(got: np.ndarray, want: np.ndarray, exact: np.ndarray, what: str) -> None:
    """NaN (unscored, left out) where `want` has NaN; the other entries within rounding of it."""
    is_nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), is_nan, err_msg=f"{what}: NaN positions")
    assert_within_rounding(got[~is_nan], want[~is_nan], exact[~is_nan], what)


@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_draw_the_single_rank_tokens_with_its_logprobs(
    model: str, two_ranks, references, model_dirs
) -> None:
    """Greedy and seeded samples (with and without top-k / top-p) of the base and two snapshots: the same
    tokens and top ids, logprobs within rounding."""
    got, _ = two_ranks[model][0]
    (want, _), (exact, _) = references[model]
    assert got.keys() == want.keys() == requests(model_dirs[model]).keys()
    for key, result in got.items():
        for i, (ours, theirs, exactly) in enumerate(
            zip(result.sequences, want[key].sequences, exact[key].sequences, strict=True)
        ):
            what = f"{model} {key} sample {i}"
            assert ours.tokens.tolist() == theirs.tokens.tolist() == exactly.tokens.tolist(), what
            assert ours.stop_reason == theirs.stop_reason, what
            assert_within_rounding(ours.logprobs, theirs.logprobs, exactly.logprobs, f"{what} logprobs")
            if theirs.topk_ids is not None:
                np.testing.assert_array_equal(ours.topk_ids, theirs.topk_ids, err_msg=f"{what} top ids")
                assert_scores_within_rounding(
                    ours.topk_logprobs, theirs.topk_logprobs, exactly.topk_logprobs, f"{what} top logprobs"
                )


@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_score_the_prompt_as_one_rank(model: str, two_ranks, references) -> None:
    """Prompt logprobs and top-k prompt logprobs over several chunks, through a snapshot's head."""
    key = "prompt scores rank8"
    got = two_ranks[model][0][0][key]
    want, exact = (results[key] for results, _ in references[model])
    assert_scores_within_rounding(
        got.prompt_logprobs, want.prompt_logprobs, exact.prompt_logprobs, "logprobs"
    )
    np.testing.assert_array_equal(got.topk_prompt_ids, want.topk_prompt_ids)
    assert_scores_within_rounding(
        got.topk_prompt_logprobs, want.topk_prompt_logprobs, exact.topk_prompt_logprobs, "top-k logprobs"
    )


@pytest.mark.parametrize("model", MODELS)
def test_both_ranks_return_the_same_results_and_cache_half_the_kv_heads(
    model: str, two_ranks, references
) -> None:
    """Every rank draws from the same gathered logits: the same results, bit for bit; each caches its own
    kv heads, half of one rank's."""
    (rank_0, kv_bytes_0), (rank_1, kv_bytes_1) = two_ranks[model]
    for key, result in rank_0.items():
        other = rank_1[key]
        for ours, theirs in zip(result.sequences, other.sequences, strict=True):
            for field in ("tokens", "logprobs", "topk_ids", "topk_logprobs"):
                np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field), err_msg=key)
        for field in ("prompt_logprobs", "topk_prompt_ids", "topk_prompt_logprobs"):
            np.testing.assert_array_equal(getattr(result, field), getattr(other, field), err_msg=key)
    (_, single_kv_bytes), _ = references[model]
    assert 2 * kv_bytes_0 == 2 * kv_bytes_1 == single_kv_bytes


def test_one_rank_runs_the_single_rank_path_bit_for_bit(model_dirs, references, monkeypatch) -> None:
    """A TensorParallel of one rank samples as the decoder built without one: the same results, bit for
    bit, and no collective at all."""

    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("a single-rank sampler ran a collective")

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast"):
        monkeypatch.setattr(dist, name, no_collective)
    model = "qwen3_tied_odd_vocab"
    one_rank, _ = run_sampler(model_dirs[model], TensorParallel(group=None, rank=0, size=1))
    (default, _), _ = references[model]
    for key, result in one_rank.items():
        for ours, theirs in zip(result.sequences, default[key].sequences, strict=True):
            np.testing.assert_array_equal(ours.tokens, theirs.tokens, err_msg=key)
            np.testing.assert_array_equal(ours.logprobs, theirs.logprobs, err_msg=key)
        np.testing.assert_array_equal(result.topk_prompt_logprobs, default[key].topk_prompt_logprobs)
