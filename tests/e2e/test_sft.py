"""The official SDK trains through a real server: SFT, concurrent tenants, client-side custom losses."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from tinker import types

from tests.e2e.sdk import LR, client, create_key, logprobs, new_run, rl_datum, sft_datum, sft_steps


def test_thirty_sft_steps_on_one_phrase_cut_loss_sum_five_fold(server) -> None:
    losses = sft_steps(new_run(client(server), server), 30)
    assert losses[-1] * 5 <= losses[0], losses


def _ppo_steps(run, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = run.forward_backward(
            [rl_datum()], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        )
        opt = run.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def test_two_tenants_training_concurrently_with_different_losses_each_get_what_they_get_alone(
    start_server,
) -> None:
    server = start_server("--auth", "keys")
    alice, bob = (client(server, create_key(server.data_dir, t)) for t in ("alice", "bob"))
    alone = (sft_steps(new_run(alice, server, seed=1), 3), _ppo_steps(new_run(bob, server, seed=2), 3))
    run_a, run_b = new_run(alice, server, seed=1), new_run(bob, server, seed=2)
    with ThreadPoolExecutor(2) as pool:  # both tenants' futures are in flight at the same time
        together = pool.submit(sft_steps, run_a, 3), pool.submit(_ppo_steps, run_b, 3)
        concurrent = (together[0].result(), together[1].result())
    np.testing.assert_allclose(concurrent[0], alone[0], rtol=1e-4)
    np.testing.assert_allclose(concurrent[1], alone[1], rtol=1e-4)


def _ppo_loss(
    data: list[types.Datum], logprobs_list: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO written client-side from docs/LOSSES.md, thresholds 0.9 / 1.1."""
    total = torch.zeros(())
    for datum, lp in zip(data, logprobs_list, strict=True):
        q = torch.tensor(datum.loss_fn_inputs["logprobs"].to_numpy())
        adv = torch.tensor(datum.loss_fn_inputs["advantages"].to_numpy())
        ratio = torch.exp(lp - q)
        total = total - torch.minimum(ratio * adv, torch.clamp(ratio, 0.9, 1.1) * adv).sum()
    return total, {}


def test_forward_backward_custom_with_a_client_side_ppo_updates_like_builtin_ppo(server) -> None:
    service = client(server)
    builtin, custom = new_run(service, server, seed=5), new_run(service, server, seed=5)
    _ppo_steps(builtin, 1)
    custom.forward_backward_custom([rl_datum()], _ppo_loss).result()
    custom.optim_step(types.AdamParams(learning_rate=LR)).result()
    after_builtin, after_custom = logprobs(builtin), logprobs(custom)
    assert not np.allclose(after_builtin, logprobs(new_run(service, server, seed=5)))  # the step did move
    np.testing.assert_allclose(after_custom, after_builtin, rtol=1e-4, atol=1e-5)


def test_forward_returns_per_token_logprobs_without_touching_gradients(server) -> None:
    run = new_run(client(server), server)
    first = logprobs(run)
    assert first.shape == (len(sft_datum().loss_fn_inputs["target_tokens"].to_numpy()),)
    assert np.all(first < 0)
    run.optim_step(types.AdamParams(learning_rate=LR)).result()
    np.testing.assert_array_equal(logprobs(run), first)  # no gradient was accumulated, so nothing moved
