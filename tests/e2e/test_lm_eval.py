"""lm-evaluation-harness evaluates a model served here as it evaluates one served by vLLM: its
`local-completions` model, given only the completions URL, finds the server's tokenizer endpoints
(tokenizer_backend=auto, no tokenizer named, nothing downloaded) and runs a local multiple-choice task
and a generation task. Its loglikelihoods equal the Tinker SDK's compute_logprobs of the same tokens, its
generations the SDK's greedy samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tinker
import transformers
import yaml
from tinker import types

from tests.e2e.conftest import Server
from tests.e2e.sdk import base_model, client

TASKS = Path(__file__).parent / "lm_eval_tasks"
KEY = "tml-local"  # any key names the one tenant of an --auth none server
# Both sides are the same fp32 forward of the same tokens; only the order of a sum of logprobs differs.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def sampler(module_server: Server) -> tinker.SamplingClient:
    return client(module_server, KEY).create_sampling_client(base_model=base_model(module_server)).result()


@pytest.fixture(scope="module")
def tokenizer(module_server: Server) -> transformers.PreTrainedTokenizerBase:
    """The served model's tokenizer files, read by transformers."""
    return transformers.AutoTokenizer.from_pretrained(str(module_server.data_dir / "models" / "tiny"))


@pytest.fixture
def lm(module_server: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """lm-eval's local-completions model of the server, as `--model_args base_url=...,auth_token=...`
    makes it (batched); datasets and lm-eval read and write nothing outside tmp_path, nor the network."""
    for variable, value in {
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OPENAI_API_KEY": KEY,  # what local-completions sends with each completion request
    }.items():
        monkeypatch.setenv(variable, value)
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=f"{module_server.base_url}/v1/completions",
        model=base_model(module_server),
        auth_token=KEY,  # what its remote tokenizer sends
        max_length=256,
        batch_size=8,  # every request of a task in one /v1/completions call: a list of prompts
    )


def _task(name: str, tmp_path: Path) -> dict[str, Any]:
    """A task YAML of lm_eval_tasks/, its data file made absolute and its cache kept in tmp_path."""
    config = yaml.safe_load((TASKS / name).read_text())
    config["dataset_kwargs"] = {
        "data_files": {"test": str(TASKS / config["dataset_kwargs"]["data_files"]["test"])},
        "cache_dir": str(tmp_path / "datasets"),
    }
    return config


def _evaluate(lm: Any, task: dict[str, Any]) -> list[dict[str, Any]]:
    """Every logged sample of `task` evaluated by `lm`."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Not lm-eval's own thousands of task files: indexing them takes longer than the evaluation.
    tasks = TaskManager(include_defaults=False)
    results = simple_evaluate(model=lm, tasks=[task], task_manager=tasks, log_samples=True, bootstrap_iters=0)
    assert results is not None
    return results["samples"][task["task"]]


def test_lm_evals_loglikelihoods_equal_the_sdks_compute_logprobs_through_the_remote_tokenizer(
    lm: Any, sampler: tinker.SamplingClient, tokenizer, tmp_path: Path
) -> None:
    assert lm.tokenizer_backend == "remote"  # auto-detected from the completions URL alone
    # lm-eval reads eos_token from /tokenizer_info and tokenizes it through /tokenize.
    assert lm.eot_token_id == tokenizer.eos_token_id
    samples = _evaluate(lm, _task("tiny_choice.yaml", tmp_path))
    compared = 0
    for sample in samples:
        for (context, continuation), ((loglikelihood, _),) in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            context_ids = tokenizer.encode(context, add_special_tokens=False)
            continuation_ids = tokenizer.encode(continuation, add_special_tokens=False)
            tokens = types.ModelInput.from_ints(context_ids + continuation_ids)
            logprobs = sampler.compute_logprobs(tokens).result()[len(context_ids) :]
            assert loglikelihood == pytest.approx(sum(logprobs), abs=TOLERANCE)
            compared += 1
    assert compared == 3 + 2 + 3  # every choice of every question in tiny.jsonl


def test_lm_evals_greedy_generations_equal_the_sdks_greedy_samples_cut_at_the_stops(
    lm: Any, sampler: tinker.SamplingClient, tokenizer, tmp_path: Path
) -> None:
    samples = _evaluate(lm, _task("tiny_generate.yaml", tmp_path))
    assert len(samples) == 3
    for sample in samples:
        ((context, generation_kwargs),) = sample["arguments"]
        stops = [*generation_kwargs["until"], tokenizer.eos_token]
        params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=stops)
        prompt = types.ModelInput.from_ints(tokenizer.encode(context, add_special_tokens=False))
        (sequence,) = sampler.sample(prompt, 1, params).result().sequences
        text = tokenizer.decode(sequence.tokens)
        for stop in stops:
            text = text.split(stop)[0]
        assert sample["resps"] == [[text]]
