"""The cookbook's supervised recipe (`recipes/chat_sl/train.py`) on a local JSONL with a chat renderer, its
checkpoint resume, and `tinker_cookbook.weights.download` of the adapter it trained.

The renderer is `role_colon`: it writes plain "User: ...\\n\\nAssistant: ..." text, which any tokenizer
encodes, and stops on the text "\\n\\nUser:". The built-in model's tokenizer is byte-level with ChatML
specials, but it is no model the cookbook knows, so the model-specific renderers (qwen3, llama3, ...)
would assume tokens and templates of another family.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker_cookbook import weights
from tinker_cookbook.supervised.common import compute_mean_nll
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from transformers import AutoModelForCausalLM

from tests.cookbook.conftest import KEY, Cookbook, checkpoints, metric
from tests.e2e.sdk import client

RECIPE = "tinker_cookbook.recipes.chat_sl.train"
EPOCHS = 4  # the whole file is one batch, so one step per epoch
CONVERSATIONS = [
    ("What is the capital of France?", "Paris."),
    ("How many legs does a spider have?", "Eight."),
    ("What colour is the sky on a clear day?", "Blue."),
    ("What is two plus two?", "Four."),
    ("Which planet is closest to the sun?", "Mercury."),
    ("What do bees make?", "Honey."),
    ("What is frozen water called?", "Ice."),
    ("How many days are in a week?", "Seven."),
]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cookbook's conversation format: one {"messages": [...]} object per line."""
    path = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        for q, a in CONVERSATIONS
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _recipe_args(log_path: Path, data_file: Path, num_epochs: int, if_exists: str) -> list[str]:
    return [
        f"log_path={log_path}",
        f"dataset={data_file}",
        "model_name=loraplex/tiny",
        "renderer_name=role_colon",
        f"batch_size={len(CONVERSATIONS)}",
        "max_length=512",
        "lora_rank=8",
        "learning_rate=2e-3",
        "lr_schedule=constant",
        f"num_epochs={num_epochs}",
        "save_every=0",
        "eval_every=0",
        f"behavior_if_log_dir_exists={if_exists}",
        # No session_name: the recipe's default display name embeds the dataset's (deep, temporary) path.
    ]


@pytest.fixture(scope="module")
def sl_run(cookbook: Cookbook, data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log directory of one finished EPOCHS-step run of the recipe."""
    log_path = tmp_path_factory.mktemp("sl") / "run"
    cookbook.run(RECIPE, *_recipe_args(log_path, data_file, EPOCHS, "raise"))
    return log_path


def _batch(cookbook: Cookbook, data_file: Path) -> list[tinker.Datum]:
    """The recipe's one batch, built by the cookbook's own dataset code (the tokenizer read from the
    served model's directory, as the server's machine has it)."""
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=str(cookbook.server.data_dir / "models" / "tiny"),
        renderer_name="role_colon",
        max_length=512,
        batch_size=len(CONVERSATIONS),
    )
    dataset, _ = FromConversationFileBuilder(common_config=common, file_path=str(data_file))()
    return dataset.get_batch(0)


def test_the_chat_sl_recipe_trains_on_a_local_jsonl_and_its_loss_falls_every_step(sl_run: Path) -> None:
    nll = metric(sl_run, "train_mean_nll")
    assert sorted(nll) == list(range(EPOCHS))
    assert all(nll[step + 1] < nll[step] for step in range(EPOCHS - 1)), nll
    assert nll[EPOCHS - 1] < 0.85 * nll[0], nll
    assert set(metric(sl_run, "num_sequences").values()) == {len(CONVERSATIONS)}


def test_a_resumed_run_starts_at_the_saved_step_from_the_saved_weights(
    cookbook: Cookbook, sl_run: Path, data_file: Path, tmp_path: Path
) -> None:
    """Run again with more epochs in the same log directory (`behavior_if_log_dir_exists=resume`): the
    cookbook loads its last checkpoint with the optimizer state and goes on from the step it recorded."""
    (saved,) = checkpoints(sl_run)
    assert saved["epoch"] == EPOCHS
    log_path = tmp_path / "run"
    shutil.copytree(sl_run, log_path)
    cookbook.run(RECIPE, *_recipe_args(log_path, data_file, EPOCHS + 2, "resume"))

    before, after = metric(sl_run, "train_mean_nll"), metric(log_path, "train_mean_nll")
    assert sorted(after) == list(range(EPOCHS + 2))
    assert {step: after[step] for step in before} == before  # the first run's steps are kept, not redone
    assert after[EPOCHS + 1] < after[EPOCHS] < before[EPOCHS - 1]
    assert checkpoints(log_path)[-1]["epoch"] == EPOCHS + 2

    # The resumed run's first step scored the saved weights: its NLL is theirs, measured here directly.
    batch = _batch(cookbook, data_file)
    run = client(cookbook.server).create_training_client_from_state(saved["state_path"]).result()
    out = run.forward(batch, "cross_entropy").result()
    logprobs = [output["logprobs"] for output in out.loss_fn_outputs]
    expected = compute_mean_nll(logprobs, [datum.loss_fn_inputs["weights"] for datum in batch])
    assert after[EPOCHS] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("kind", ["external_weights", "weights"])
def test_weights_download_fetches_an_adapter_that_peft_loads_to_the_servers_logprobs(
    cookbook: Cookbook,
    sl_run: Path,
    data_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """The recipe's final weights, fetched by the cookbook's `weights.download`, are a PEFT adapter that gives
    the server's logprobs of a training example: from an export saved with save_weights_external
    (`external_weights`), or from the training checkpoint itself (`weights`), which the cookbook exports
    encrypted to a key it generates, then decrypts."""
    server = cookbook.server
    (saved,) = checkpoints(sl_run)
    run = client(server).create_training_client_from_state(saved["state_path"]).result()
    if kind == "external_weights":
        tinker_path = run.save_weights_external("cookbook-export").result().path
    else:
        tinker_path = saved["state_path"]
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    out_dir = Path(
        weights.download(
            tinker_path=tinker_path, output_dir=str(tmp_path / "adapter"), base_url=server.base_url
        )
    )
    assert sorted(p.name for p in out_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    datum = _batch(cookbook, data_file)[0]
    served = run.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    tokens, targets = datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].to_numpy()
    base = AutoModelForCausalLM.from_pretrained(server.data_dir / "models" / "tiny", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note on tied embeddings
        model = PeftModel.from_pretrained(base, out_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    peft = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(targets)].numpy()
    np.testing.assert_allclose(peft, served, atol=1e-4)
