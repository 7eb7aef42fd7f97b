"""The cookbook's DPO loop (`preference/train_dpo.py`) on a local JSONL of comparisons
(tests/cookbook/dpo_jsonl.py).

It takes reference logprobs from a sampling client (`compute_logprobs`) and trains with
`forward_backward_custom`, so both paths must agree on the same weights for step 0 to come out right.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.cookbook.conftest import Cookbook, metric

EPOCHS = 3  # the whole file is one batch, so one step per epoch
PROMPTS = ["Is the sky blue?", "Is water wet?", "Is fire hot?", "Is ice cold?"]


@pytest.fixture(scope="module")
def dpo_run(cookbook: Cookbook, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log directory of one run over four comparisons that each prefer "Yes." to "No!"."""
    root = tmp_path_factory.mktemp("dpo")
    rows = [
        {
            "comparison": {
                "prompt_conversation": [{"role": "user", "content": prompt}],
                "completion_A": [{"role": "assistant", "content": "No!"}],
                "completion_B": [{"role": "assistant", "content": "Yes."}],
            },
            "label": "B",
        }
        for prompt in PROMPTS
    ]
    (root / "comparisons.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cookbook.run(
        "tests.cookbook.dpo_jsonl",
        f"train_path={root / 'comparisons.jsonl'}",
        f"log_path={root / 'run'}",
        f"batch_size={len(PROMPTS)}",
        f"num_epochs={EPOCHS}",
    )
    return root / "run"


def test_the_first_step_scores_the_policy_as_its_own_reference(dpo_run: Path) -> None:
    """Before any update the policy is the reference: every log-ratio is 0, so the loss is
    -log sigmoid(0) = ln 2 and both implicit rewards are 0."""
    assert metric(dpo_run, "dpo_loss")[0] == pytest.approx(math.log(2), abs=1e-3)
    assert metric(dpo_run, "chosen_reward")[0] == pytest.approx(0.0, abs=1e-3)
    assert metric(dpo_run, "rejected_reward")[0] == pytest.approx(0.0, abs=1e-3)


def test_dpo_lowers_the_loss_every_step_and_ends_preferring_the_chosen_answers(dpo_run: Path) -> None:
    loss = metric(dpo_run, "dpo_loss")
    assert sorted(loss) == list(range(EPOCHS))
    assert all(loss[step + 1] < loss[step] for step in range(EPOCHS - 1)), loss
    assert metric(dpo_run, "accuracy")[EPOCHS - 1] == 1.0
    assert metric(dpo_run, "margin")[EPOCHS - 1] > 0.5
