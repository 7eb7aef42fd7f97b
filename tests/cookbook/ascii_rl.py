"""A tinker-cookbook RL recipe for the built-in tiny model: synchronous RL on a small custom environment.

It is shaped like the cookbook's own recipes (a chz CLI config, then the cookbook's `rl.train.main`),
and runs against a server as they do:

    TINKER_API_KEY=tml-local HF_HUB_OFFLINE=1 python -m tests.cookbook.ascii_rl \
        base_url=http://127.0.0.1:8000 log_path=/tmp/ascii-rl

The environment asks for a plain-text reply; a completion's reward is the share of its `max_tokens`
tokens that are ASCII bytes (ids 0-127 of the tiny model's byte tokenizer). A random tiny model starts
near 0.25 (most of its 512 logits are not ASCII) and nears 1.0 in about 12 steps. Everything else (rollouts,
group-centred advantages, provenance spans, the loss, optimizer steps, logging) is the cookbook's code,
unmodified.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import (
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.tokenizer_utils import get_tokenizer

ASCII_IDS = range(128)  # the byte tokenizer's id of byte b is b


class AsciiEnv(Env):
    """One turn: the user asks for plain text; the reward is the share of the token budget that is ASCII."""

    def __init__(self, renderer: renderers.Renderer, max_tokens: int) -> None:
        self.renderer = renderer
        self.max_tokens = max_tokens

    async def initial_observation(self) -> tuple[tinker.ModelInput, list[str]]:
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": "Reply in plain ASCII."}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        reward = sum(token in ASCII_IDS for token in action) / self.max_tokens
        return StepResult(
            reward=reward,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
        )


@dataclass(frozen=True)
class AsciiGroupBuilder(EnvGroupBuilder):
    """`group_size` AsciiEnvs; the cookbook centres rewards within the group (GRPO-style)."""

    model_name: str
    renderer_name: str
    group_size: int
    max_tokens: int

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))
        return [AsciiEnv(renderer, self.max_tokens) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["ascii"]


class AsciiDataset(RLDataset):
    """`batches` batches of `groups_per_batch` identical groups: one batch per training step."""

    def __init__(self, group: AsciiGroupBuilder, batches: int, groups_per_batch: int) -> None:
        self.group, self.batches, self.groups_per_batch = group, batches, groups_per_batch

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [self.group] * self.groups_per_batch

    def __len__(self) -> int:
        return self.batches


@chz.chz
class AsciiDatasetBuilder(RLDatasetBuilder):
    model_name: str
    renderer_name: str
    max_tokens: int
    batches: int
    groups_per_batch: int
    group_size: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        group = AsciiGroupBuilder(self.model_name, self.renderer_name, self.group_size, self.max_tokens)
        return AsciiDataset(group, self.batches, self.groups_per_batch), None


@chz.chz
class CLIConfig:
    log_path: str
    base_url: str | None = None
    model_name: str = "loraplex/tiny"
    # The tiny model's tokenizer is byte-level; role_colon renders plain "User: ...\n\nAssistant:" text.
    renderer_name: str = "role_colon"
    steps: int = 12
    groups_per_batch: int = 4
    group_size: int = 16
    max_tokens: int = 8
    learning_rate: float = 5e-3
    lora_rank: int = 8


def cli_main(cli: CLIConfig) -> None:
    """Build the cookbook's RL config from the CLI config and run the cookbook's sync RL loop."""
    dataset = AsciiDatasetBuilder(
        model_name=cli.model_name,
        renderer_name=cli.renderer_name,
        max_tokens=cli.max_tokens,
        batches=cli.steps,
        groups_per_batch=cli.groups_per_batch,
        group_size=cli.group_size,
    )
    config = train.Config(
        learning_rate=cli.learning_rate,
        dataset_builder=dataset,
        model_name=cli.model_name,
        recipe_name="loraplex_ascii_rl",
        max_tokens=cli.max_tokens,
        log_path=cli.log_path,
        renderer_name=cli.renderer_name,
        lora_rank=cli.lora_rank,
        base_url=cli.base_url,
        eval_every=0,
        save_every=0,
        num_groups_to_log=0,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    cli_main(chz.entrypoint(CLIConfig))
