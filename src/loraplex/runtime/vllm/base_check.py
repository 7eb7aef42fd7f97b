"""Whether a vLLM server serves the engine's base model, told by its logprobs.

A vLLM server given by `--vllm-url` serves whatever its operator started it with, and nothing in its API
names weights: a server of another checkpoint of the same architecture answers every request, with
samples from a model nobody trains here. So each server, as it comes up, scores a fixed prompt through
the base model's zero adapter, and the engine scored the same prompt at start: a server whose logprobs
differ from the engine's by more than two implementations of one model differ is refused (it stays
down, saying why, and is checked again at its next start).

The bound: the two sides run the same weights, perhaps in other dtypes (a CPU engine in fp32 beside a GPU
vLLM in bf16), with other kernels and summation orders. In bf16 a logit moves by a few of its units in the
last place over a deep model (bf16's unit roundoff is 2⁻⁸: ~0.1 nat at logits of magnitude 10-30), and a
token's logprob by about as much; in fp32 by ~1e-5 (tests/vllm: within 1e-4). The mean absolute
difference over the prompt's tokens is refused above `MAX_MEAN_LOGPROB_GAP`, about twice bf16's rounding.
What other weights give depends on how peaked the models are: two random tiny models, whose distributions
are near uniform over 512 ids, gave 0.359 nats (tests/vllm); trained models put most of their mass on few
ids and their logprobs span tens of nats, so other checkpoints should differ by far more (not measured
here: no real checkpoint can be downloaded on this project's machines). It guards against a wrong model,
not against a near-identical one (a light fine-tune may pass it).
No tensors: the engine's side is a forward pass it runs at start (sampler.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

PROMPT_TOKENS = 32
MAX_MEAN_LOGPROB_GAP = 0.25
# The prompt's ids stay below this: a model's config may count more ids than its tokenizer has (Qwen3:
# 151,936 rows, 151,669 tokens), and vLLM refuses a prompt id past the tokenizer's; special tokens sit at
# the top of the vocabularies we serve.
_ORDINARY_IDS = 10_000


def check_prompt(vocab_size: int) -> list[int]:
    """The fixed prompt: PROMPT_TOKENS distinct ids spread over the first ordinary ids (a prime stride),
    the same for every server and every start."""
    span = min(vocab_size, _ORDINARY_IDS)
    return [(1 + 7919 * i) % span for i in range(PROMPT_TOKENS)]


def check_body(adapter: str, prompt: list[int]) -> dict[str, Any]:
    """A /v1/completions body that scores `prompt` through `adapter` (the base model's zero adapter): the
    logprob of each prompt token after the ones before it, at temperature 1."""
    return {"model": adapter, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}


def served_logprobs(answer: dict[str, Any], prompt: list[int]) -> np.ndarray:
    """The logprob vLLM gave each prompt token after the first, from its answer to `check_body`."""
    positions = answer["choices"][0]["prompt_logprobs"][1:]
    return np.array(
        [position[str(token)]["logprob"] for position, token in zip(positions, prompt[1:], strict=True)]
    )


def logprob_gap(engine_logprobs: np.ndarray, served: np.ndarray) -> float:
    """The mean absolute difference of the two sides' logprobs of the check prompt, in nats."""
    return float(np.mean(np.abs(served - engine_logprobs)))


def base_model_mismatch(gap: float) -> str | None:
    """Why a server whose logprobs are `gap` from the engine's serves another base model; None if it
    does not."""
    if gap <= MAX_MEAN_LOGPROB_GAP:
        return None
    return (
        f"it serves another base model than the engine's: its logprobs of a fixed {PROMPT_TOKENS}-token "
        f"prompt differ from the engine's by {gap:.3g} nats on average (rounding moves them by at most "
        f"{MAX_MEAN_LOGPROB_GAP:g}); start it with the model the engine serves"
    )
