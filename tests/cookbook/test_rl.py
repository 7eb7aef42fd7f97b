"""The cookbook's synchronous RL loop (`rl.train.main`) with a small custom environment
(tests/cookbook/ascii_rl.py), and what its async default, stable_reinforce, gets from this server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tinker
from tinker_cookbook.completers import TokensWithLogprobs
from tinker_cookbook.rl.data_processing import trajectory_to_data
from tinker_cookbook.rl.types import Trajectory, Transition

from tests.cookbook.conftest import Cookbook, checkpoints, metric
from tests.e2e.sdk import client

# Learning takes off after a few steps, at a pace that varies with the unseeded samples: 21 runs of 12
# steps gained 0.65-0.75; 8 steps gained 0.16-0.65, too close to any margin that proves learning.
STEPS = 12


@pytest.fixture(scope="module")
def rl_run(cookbook: Cookbook, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log directory of one 12-step run: 4 groups of 16 completions per step, 8 tokens each."""
    log_path = tmp_path_factory.mktemp("rl") / "run"
    cookbook.run("tests.cookbook.ascii_rl", f"log_path={log_path}", f"steps={STEPS}")
    return log_path


def test_sync_rl_on_a_custom_env_raises_the_mean_reward(rl_run: Path) -> None:
    reward = metric(rl_run, "env/all/reward/total")
    assert sorted(reward) == list(range(STEPS))
    assert all(0.0 <= r <= 1.0 for r in reward.values())
    # A random tiny model starts near 0.25 (most of its logits are not ASCII) and nears 1.0 by step 11.
    first, last = (reward[0] + reward[1]) / 2, (reward[STEPS - 2] + reward[STEPS - 1]) / 2
    assert last >= first + 0.4, reward


def test_the_samplers_logprobs_agree_with_the_learners(rl_run: Path) -> None:
    """The cookbook's sample-vs-train KL (from the sampler's logprobs and the learner's, on the same
    weights) stays at fp32 rounding: the sampler and the trainer compute the same policy."""
    kl = metric(rl_run, "optim/kl_sample_train_v1")
    assert sorted(kl) == list(range(STEPS))
    assert max(abs(v) for v in kl.values()) < 1e-3, kl


def test_the_run_ends_with_a_final_checkpoint_of_both_kinds(rl_run: Path) -> None:
    (final,) = (record for record in checkpoints(rl_run) if record["name"] == "final")
    assert final["state_path"].endswith("/weights/final")
    assert final["sampler_path"].endswith("/sampler_weights/final")


def test_stable_reinforce_the_async_default_is_refused_naming_ppo_which_trains_the_same_datum(
    cookbook: Cookbook,
) -> None:
    """What the cookbook's async RL sends by default: a sample drawn with record_stability_info=True,
    turned into a datum with provenance by the cookbook's own `trajectory_to_data`, trained with
    stable_reinforce. That request fails naming the fix, and the same datum trains with ppo."""
    run = client(cookbook.server).create_lora_training_client(base_model="loraplex/tiny", rank=8).result()
    sampler = run.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = tinker.ModelInput.from_ints(list(b"User: Reply in plain ASCII.\n\nAssistant:"))
    params = tinker.SamplingParams(max_tokens=6, seed=0)
    (sequence,) = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences
    action = TokensWithLogprobs(sequence.tokens, sequence.logprobs, sequence_id=sequence.sequence_id)
    trajectory = Trajectory(
        [Transition(ob=prompt, ac=action, reward=1.0, episode_done=True)], final_ob=prompt
    )
    (datum,) = trajectory_to_data(trajectory, traj_advantage=1.0)
    assert datum.loss_fn_input_spans is not None  # provenance, as stable_reinforce requires
    datum = dataclasses.replace(
        datum, loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k != "mask"}
    )

    with pytest.raises(tinker.RequestFailedError, match="'stable_reinforce' is not supported") as refused:
        run.forward_backward([datum], "stable_reinforce").result()
    assert 'pass AsyncConfig(loss_fn="ppo")' in str(refused.value)
    # Each sampled token counts -min(r, clip(r)) * A with A = 1 and the ratio r = 1: the learner scores
    # the sample as the sampler did.
    loss = run.forward_backward([datum], "ppo").result().metrics["loss:sum"]
    assert loss == pytest.approx(-len(sequence.tokens), abs=1e-3)
