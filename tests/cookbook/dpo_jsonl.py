"""A tinker-cookbook DPO recipe over a local JSONL of labelled comparisons, for the built-in tiny model.

It is the cookbook's `recipes/preference/dpo/train.py` with a local file in place of its Hub datasets:
a chz CLI config, the cookbook's `ComparisonBuilderFromJsonl` and `DPODatasetBuilderFromComparisons`,
then the cookbook's `train_dpo.main`, unmodified. Run it against a server:

    TINKER_API_KEY=tml-local HF_HUB_OFFLINE=1 python -m tests.cookbook.dpo_jsonl \
        train_path=comparisons.jsonl base_url=http://127.0.0.1:8000 log_path=/tmp/dpo

Each line is `{"comparison": {"prompt_conversation": [...], "completion_A": [...], "completion_B": [...]},
"label": "A" | "B"}`, the format the cookbook's `ComparisonBuilderFromJsonl` reads.
"""

from __future__ import annotations

import chz
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


@chz.chz
class CLIConfig:
    train_path: str
    log_path: str
    base_url: str | None = None
    model_name: str = "loraplex/tiny"
    # The tiny model's tokenizer is byte-level; role_colon renders plain "User: ...\n\nAssistant:" text.
    renderer_name: str = "role_colon"
    batch_size: int = 4  # comparisons per step
    num_epochs: int = 5
    learning_rate: float = 1e-3
    dpo_beta: float = 0.5
    lora_rank: int = 8


def cli_main(cli: CLIConfig) -> None:
    """Build the cookbook's DPO config from the CLI config and run the cookbook's DPO loop."""
    dataset = DPODatasetBuilderFromComparisons(
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=cli.model_name,
            renderer_name=cli.renderer_name,
            max_length=1024,
            batch_size=cli.batch_size,
        ),
        comparison_builder=ComparisonBuilderFromJsonl(train_path=cli.train_path),
    )
    config = train_dpo.Config(
        log_path=cli.log_path,
        model_name=cli.model_name,
        recipe_name="loraplex_dpo_jsonl",
        dataset_builder=dataset,
        renderer_name=cli.renderer_name,
        learning_rate=cli.learning_rate,
        lr_schedule="constant",
        num_epochs=cli.num_epochs,
        dpo_beta=cli.dpo_beta,
        lora_rank=cli.lora_rank,
        base_url=cli.base_url,
        save_every=0,
        eval_every=0,
    )
    train_dpo.main(config)


if __name__ == "__main__":
    cli_main(chz.entrypoint(CLIConfig))
