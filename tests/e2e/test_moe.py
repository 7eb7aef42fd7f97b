"""The official SDK against `loraplex serve --model <a tiny random Qwen3-MoE>`: SFT on attention and
experts converges, save_state resumes exactly, and greedy sampling equals transformers + PEFT."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from loraplex.model.tiny import ensure_tiny_model
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout
from tests.e2e.conftest import Server
from tests.e2e.sdk import PHRASE, client, new_run, sft_steps
from tests.model.test_decoder_parity import save_random_hf_model
from tests.model.test_moe import moe_config

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3-MoE (8 experts, top-2, one dense layer) with the built-in byte-level tokenizer."""
    directory = tmp_path_factory.mktemp("qwen3_moe")
    save_random_hf_model(moe_config(vocab_size=512), directory)
    tiny = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def server(start_module_server, moe_dir: Path) -> Server:
    return start_module_server("--model", str(moe_dir))


@pytest.fixture(scope="module")
def service(server: Server) -> tinker.ServiceClient:
    return client(server)


def test_thirty_sft_steps_on_attention_and_experts_cut_loss_sum_five_fold(service, server) -> None:
    losses = sft_steps(new_run(service, server), 30)
    assert losses[-1] * 5 <= losses[0], losses


def test_save_state_then_resume_with_optimizer_takes_the_same_next_steps(service, server) -> None:
    run = new_run(service, server, seed=2)
    sft_steps(run, 2)
    path = run.save_state("moe-step2").result().path
    uninterrupted = sft_steps(run, 2)
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    np.testing.assert_allclose(sft_steps(resumed, 2), uninterrupted, rtol=1e-5)


def test_greedy_samples_equal_transformers_generate_with_the_exported_adapter(
    service, server, moe_dir: Path
) -> None:
    run = new_run(service, server, seed=3)
    sft_steps(run, 3)
    path = run.save_weights_for_sampler("moe-greedy").result().path
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints(PHRASE)
    sampled = service.create_sampling_client(model_path=path).sample(prompt, 1, params).result()

    snapshot_dir = DiskLayout(server.data_dir).checkpoint_dir(CheckpointPath.parse(path))
    hf_model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on experimental target_parameters
        model = PeftModel.from_pretrained(hf_model, snapshot_dir).eval()
    with torch.no_grad():
        generated = model.generate(
            input_ids=torch.tensor([PHRASE]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    assert sampled.sequences[0].tokens == generated[0, len(PHRASE) :].tolist()
    with torch.no_grad(), model.disable_adapter():  # the adapter matters, so the comparison means something
        base = model.generate(input_ids=torch.tensor([PHRASE]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert base[0, len(PHRASE) :].tolist() != sampled.sequences[0].tokens
