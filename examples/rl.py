"""Reinforcement learning against a loraplex server with nothing but the official `tinker` SDK.

Start a server (`loraplex serve`), then:

    TINKER_API_KEY=tml-local python examples/rl.py --base-url http://127.0.0.1:8000 --steps 15

The task: each prompt ("Say the letter A:", "Type A:", ...) asks for a letter; the reward of a
completion is the fraction of its `max_tokens` tokens that are that letter (verifiable, no reward
model). Each step follows tinker-cookbook's RL loop: snapshot the adapter
(`save_weights_and_get_sampling_client`), sample a group of completions per prompt, centre the rewards
within each group (the advantages), train on the sampled tokens with the `importance_sampling` loss
and take an optimizer step. It prints the mean reward per step; `train` is also what `loraplex demo`
runs.

On the built-in random `tiny` model the reward climbs from about 0 to 1 in 10-15 steps. Asking for
several letters (`--letters ABCD`) makes the policy read the letter off the prompt, which a random
model this small does not learn in a few steps (it settles on one letter); try that on a real model.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tinker
from tinker import types

# Prompt i is PHRASINGS[i % 8] asking for letters[i % len(letters)].
PHRASINGS = (
    "Say the letter {}:",
    "Write the letter {}:",
    "Type {}:",
    "Reply with {}:",
    "The letter {}:",
    "Print {}:",
    "Answer {}:",
    "Repeat {}:",
)


@dataclass(frozen=True)
class RLConfig:
    """One RL run; every field is also a command-line flag."""

    steps: int = 15
    prompts: int = 8
    group_size: int = 8  # completions sampled per prompt; advantages are centred within each group
    letters: str = "A"  # the letters the prompts ask for, in turn
    max_tokens: int = 8
    rank: int = 16
    learning_rate: float = 5e-3
    temperature: float = 1.0
    seed: int = 0  # adapter init and every sampling seed: the same seed replays the same run


def reward(completion: list[str], letter: str, max_tokens: int) -> float:
    """The fraction of `max_tokens` completion tokens whose text is `letter` (stopping early earns less)."""
    return sum(text == letter for text in completion) / max_tokens


def print_step(step: int, mean_reward: float) -> None:
    """The default progress report: one line per step."""
    print(f"step {step:3d}  reward {mean_reward:.3f}", flush=True)


def train(
    service: tinker.ServiceClient,
    base_model: str,
    config: RLConfig,
    on_step: Callable[[int, float], None] = print_step,
) -> list[float]:
    """Run `config.steps` RL steps; return the mean reward of each step's samples (drawn before it trains)."""
    run = service.create_lora_training_client(base_model, rank=config.rank, seed=config.seed).result()
    tokenizer = run.get_tokenizer()
    letters = [config.letters[i % len(config.letters)] for i in range(config.prompts)]
    prompts = [
        tokenizer.encode(PHRASINGS[i % len(PHRASINGS)].format(letter), add_special_tokens=False)
        for i, letter in enumerate(letters)
    ]
    curve = []
    for step in range(config.steps):
        sampler = run.save_weights_and_get_sampling_client().result()
        # Submit every prompt's group before waiting on any, so the server batches them together.
        futures = [
            sampler.sample(types.ModelInput.from_ints(prompt), config.group_size, _params(config, step, i))
            for i, prompt in enumerate(prompts)
        ]
        data, rewards = [], []
        for prompt, letter, future in zip(prompts, letters, futures, strict=True):
            sequences = future.result().sequences
            texts = [[tokenizer.decode([t]) for t in s.tokens] for s in sequences]
            group = np.array([reward(text, letter, config.max_tokens) for text in texts])
            rewards.extend(group)
            data += [_datum(prompt, s, a) for s, a in zip(sequences, group - group.mean(), strict=True)]
        curve.append(float(np.mean(rewards)))
        on_step(step, curve[-1])
        fb = run.forward_backward(data, "importance_sampling")
        opt = run.optim_step(types.AdamParams(learning_rate=config.learning_rate))
        fb.result()
        opt.result()
    return curve


def _params(config: RLConfig, step: int, prompt_index: int) -> types.SamplingParams:
    seed = config.seed * 1_000_000 + step * 1_000 + prompt_index  # distinct per draw, fixed per run
    return types.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=seed)


def _datum(prompt: list[int], sequence: types.SampledSequence, advantage: float) -> types.Datum:
    """Prompt + completion as one sequence; only positions that predict sampled tokens carry the sampler's
    logprobs and the advantage (zeros elsewhere leave prompt positions out of the loss)."""
    tokens = prompt + list(sequence.tokens)
    zeros = np.zeros(len(prompt) - 1)
    logprobs = np.concatenate([zeros, sequence.logprobs]).astype(np.float32)
    advantages = np.concatenate([zeros, np.full(len(sequence.tokens), advantage)]).astype(np.float32)
    inputs = {"target_tokens": np.array(tokens[1:]), "logprobs": logprobs, "advantages": advantages}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def parse_config(argv: list[str] | None = None) -> tuple[str, RLConfig]:
    """--base-url and one flag per RLConfig field (--group-size, --learning-rate, ...)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    for name, default in vars(RLConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    return args.pop("base_url"), RLConfig(**args)


def main() -> None:
    base_url, config = parse_config()
    rest = tinker.RestClient(base_url=base_url)
    base_model = rest.get_server_capabilities().result().supported_models[0].model_name
    # As a context manager the client ends its session (sessions/{id}/finish) on exit.
    with tinker.ServiceClient(base_url=base_url) as service:
        train(service, base_model, config)


if __name__ == "__main__":
    main()
