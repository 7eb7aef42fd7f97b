"""Training and sampling health through the official SDK against a real server: each RL forward_backward's
sampler/learner KL, max |Δ|, advantages and clipped tokens, and each sampling request's lengths and stop
reasons, land in the run's metric history (read straight from the server's database) and in /metrics'
sums, with designed values, and the KL equals tinker-cookbook's own `compute_kl_sample_train` of the
same data; the SDK's own results carry only Tinker's metrics.

Sampler logprobs are the learner's own (from a `forward` of the same datum) plus a dyadic shift δ below
|lp|, so q − lp = δ exactly in fp32 (tests/engine/test_health.py explains the arithmetic).
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing

import numpy as np
import pytest
import tinker
from tinker import types
from tinker_cookbook.rl.metrics import compute_kl_sample_train

from tests.e2e.conftest import Server
from tests.e2e.sdk import PHRASE, client, logprobs, new_run, sft_steps
from tests.e2e.test_observability import scrape, value

PROMPT = 3  # the datum's first positions are prompt: q = 0, A = 0, outside the RL mask
N = len(PHRASE) - 1
SHIFTS = np.array([0.5, 0.25, 0.125, 1.0, 0.75, 0.5], np.float32)  # δ over the N − PROMPT action tokens
ADVANTAGES = np.array([1.0, -1.0, 2.0, 0.0, 0.5, 3.0], np.float32)  # 0 with q ≠ 0 still counts
RATIOS = np.array([0.5, 1.0, 5.0, 1.1, 0.9, 1.3])  # ppo's bounds (0.8, 1.2): 0.5, 5.0 and 1.3 outside
FP32_DIVISION = 2.0**-24


def _rl_datum(q_actions: np.ndarray, advantages: np.ndarray) -> types.Datum:
    q = np.zeros(N, np.float32)
    a = np.zeros(N, np.float32)
    q[PROMPT:], a[PROMPT:] = q_actions, advantages
    inputs = {"target_tokens": np.array(PHRASE[1:], np.int64), "logprobs": q, "advantages": a}
    return types.Datum(model_input=types.ModelInput.from_ints(PHRASE[:-1]), loss_fn_inputs=inputs)


def _greedy(stop: list[str]) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=16, temperature=0.0, stop=stop)


def _history(server: Server, run_id: str) -> list[tuple[int, str, dict[str, float]]]:
    """The run's metric history rows, oldest first: (step, kind, metrics)."""
    with closing(sqlite3.connect(server.data_dir / "loraplex.db")) as db:
        rows = db.execute(
            "SELECT step, kind, metrics FROM run_metrics WHERE run_id = ? ORDER BY id", (run_id,)
        ).fetchall()
    return [(step, kind, json.loads(metrics)) for step, kind, metrics in rows]


@pytest.fixture(scope="module")
def server(module_server: Server) -> Server:
    return module_server


@pytest.fixture
def run(server: Server) -> tinker.TrainingClient:
    """A fresh run, trained one step."""
    trained = new_run(client(server), server)
    sft_steps(trained, 1)  # one step in: the sampler rows below belong to step 1
    return trained


def test_rl_health_of_each_request_is_in_the_runs_history_and_on_metrics_never_in_the_sdks_result(
    server: Server, run: tinker.TrainingClient
) -> None:
    lp = logprobs(run)[PROMPT:]  # the learner's logprobs of the action tokens, as the server computes them
    assert min(-lp) > SHIFTS.max(), "δ must stay below |lp| for exact fp32 arithmetic"
    before = scrape(server)
    shifted = run.forward_backward([_rl_datum(lp + SHIFTS, ADVANTAGES)], "importance_sampling").result()
    exact = run.forward_backward([_rl_datum(lp, ADVANTAGES)], "importance_sampling").result()
    clipped = run.forward_backward(
        [_rl_datum((lp - np.log(RATIOS)).astype(np.float32), np.ones(N - PROMPT))],
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    ).result()
    assert set(shifted.metrics) == set(exact.metrics) == {"loss:sum"}  # Tinker's metrics, nothing more
    assert set(clipped.metrics) == {"loss:sum", "clip_fraction:mean"}

    # The step-1 SFT forward_backward and the forward come first; the three RL requests feed step 2.
    rl_rows = [
        m for step, kind, m in _history(server, run.model_id) if (step, kind) == (2, "forward_backward")
    ]
    shifted_row, exact_row, clipped_row = rl_rows
    n = N - PROMPT
    d = SHIFTS.astype(np.float64)
    assert shifted_row["train/tokens"] == n
    assert shifted_row["rl/kl_sample_train_v1"] == pytest.approx(d.mean(), rel=FP32_DIVISION)
    assert shifted_row["rl/kl_sample_train_v2"] == pytest.approx(0.5 * (d**2).mean(), rel=FP32_DIVISION)
    assert shifted_row["rl/logprob_abs_diff_max"] == 1.0
    a = ADVANTAGES.astype(np.float64)
    assert shifted_row["rl/advantage_mean"] == pytest.approx(a.mean(), rel=1e-6)
    assert shifted_row["rl/advantage_std"] == pytest.approx(a.std(), rel=1e-6)
    assert (exact_row["rl/kl_sample_train_v1"], exact_row["rl/logprob_abs_diff_max"]) == (0.0, 0.0)
    assert clipped_row["rl/clipped_tokens"] == 3
    assert clipped_row["clip_fraction:mean"] == pytest.approx(3 / n, rel=1e-6)

    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0.0)

    assert moved("loraplex_trained_tokens_total", loss_fn="importance_sampling") == 2 * n
    assert moved("loraplex_trained_tokens_total", loss_fn="ppo") == n
    assert moved("loraplex_rl_clipped_tokens_total", loss_fn="ppo") == 3
    squared = moved("loraplex_rl_logprob_diff_squared_total", loss_fn="importance_sampling")
    assert squared == pytest.approx((d**2).sum(), rel=1e-6)
    assert moved("loraplex_rl_logprob_abs_diff_max_count") == 3


def test_the_kl_in_the_history_equals_tinker_cookbooks_own_kl_sample_train_of_the_same_data(
    server: Server, run: tinker.TrainingClient
) -> None:
    rng = np.random.default_rng(0)
    lp = logprobs(run)[PROMPT:]
    shifts = rng.normal(0.0, 0.3, (2, N - PROMPT)).astype(np.float32)
    datums = [_rl_datum(lp + shift, ADVANTAGES) for shift in shifts]
    result = run.forward_backward(datums, "ppo").result()
    history = _history(server, run.model_id)
    (row,) = (m for step, kind, m in history if (step, kind) == (2, "forward_backward"))
    # The cookbook's metric reads the action mask its datums carry (and strips before sending): the
    # positions after the prompt.
    action_mask = np.arange(N) >= PROMPT
    masked = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={**d.loss_fn_inputs, "mask": action_mask.astype(np.float32)},
        )
        for d in datums
    ]
    training_logprobs = [out["logprobs"].to_torch() for out in result.loss_fn_outputs]
    cookbook = compute_kl_sample_train(masked, training_logprobs)
    assert row["rl/kl_sample_train_v1"] == pytest.approx(cookbook["optim/kl_sample_train_v1"], rel=1e-5)
    assert row["rl/kl_sample_train_v2"] == pytest.approx(cookbook["optim/kl_sample_train_v2"], rel=1e-5)


def test_each_sampling_request_records_its_lengths_and_stop_reasons_in_the_runs_history(
    server: Server, run: tinker.TrainingClient
) -> None:
    sampler = run.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PHRASE)
    before = scrape(server)
    capped = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=5, seed=1, stop=[])).result()
    assert [s.stop_reason for s in capped.sequences] == ["length"] * 3
    free = sampler.sample(prompt, 1, _greedy(stop=[])).result().sequences[0].tokens
    tokenizer = run.get_tokenizer()
    stop = tokenizer.decode(free[2:4])  # two tokens' text: the string completes by the fourth token
    # Greedy decoding repeats `free` until the string (or EOS, which stops unless stop=[]) ends it.
    eos = tokenizer.eos_token_id
    end = next(i for i in range(len(free)) if stop in tokenizer.decode(free[: i + 1]) or free[i] == eos)
    length = end + 1
    stopped = sampler.sample(prompt, 2, _greedy(stop=[stop])).result()
    assert [(len(s.tokens), s.stop_reason) for s in stopped.sequences] == [(length, "stop")] * 2

    samples = [m for step, kind, m in _history(server, run.model_id) if (step, kind) == (1, "sample")]
    assert samples == [
        {
            "sample/sequences": 3.0,
            "sample/tokens": 15.0,
            "sample/length_mean": 5.0,
            "sample/stop_reason_stop": 0.0,
            "sample/stop_reason_length": 3.0,
        },
        {
            "sample/sequences": 1.0,
            "sample/tokens": 16.0,
            "sample/length_mean": 16.0,
            "sample/stop_reason_stop": 0.0,
            "sample/stop_reason_length": 1.0,
        },
        {
            "sample/sequences": 2.0,
            "sample/tokens": 2.0 * length,
            "sample/length_mean": float(length),
            "sample/stop_reason_stop": 2.0,
            "sample/stop_reason_length": 0.0,
        },
    ]
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("loraplex_sampled_sequences_total", stop_reason="length") == 4
    assert moved("loraplex_sampled_sequences_total", stop_reason="stop") == 2
    assert moved("loraplex_sampled_tokens_total") == 15 + 16 + 2 * length


def test_a_named_sampler_snapshot_of_the_run_records_its_requests_at_the_step_it_was_saved(
    server: Server, run: tinker.TrainingClient
) -> None:
    path = run.save_weights_for_sampler("step-1").result().path
    sft_steps(run, 1)  # the run moves on; the snapshot's requests stay at step 1
    sampler = run.create_sampling_client(path).result()
    prompt = types.ModelInput.from_ints(PHRASE)
    sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=2, stop=[])).result()
    samples = [(step, m) for step, kind, m in _history(server, run.model_id) if kind == "sample"]
    expected = {
        "sample/sequences": 2.0,
        "sample/tokens": 8.0,
        "sample/length_mean": 4.0,
        "sample/stop_reason_stop": 0.0,
        "sample/stop_reason_length": 2.0,
    }
    assert samples == [(1, expected)]
