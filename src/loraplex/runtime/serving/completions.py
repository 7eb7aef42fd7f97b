"""Completions as OpenAI-style clients see them: sampled tokens turned into text, cut where generation
stopped, each token with its logprob and optionally the likeliest alternatives.

The sampler returns a stop (EOS, a stop token, or the tokens completing a stop string) with the tokens;
OpenAI's text leaves it out. So a completion's text ends before the first stop string it contains, or
before its last token when that token itself stopped it. Its tokens are every token sampled, the stop
included, as vLLM returns them (lm-evaluation-harness counts positions in them); each token's piece is
cut to the text, so the pieces of a stream still join to exactly the text. Built from the engine's sample
results; inference.py submits the requests. No tensors, no HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import numpy as np

from loraplex.runtime.core.sampling import SampledSequence, SampleResult
from loraplex.runtime.serving.text_codec import TextCodec


@dataclass(frozen=True)
class ScoredToken:
    """One token of a prompt or a completion."""

    token_id: int
    token: str  # the token alone as text
    piece: str  # the text it adds ("" while a UTF-8 character is incomplete, or past a completion's stop)
    logprob: float | None  # None for a prompt's first token: nothing comes before it
    top: tuple[tuple[str, float], ...] = ()  # likeliest tokens at this position and their logprobs


@dataclass(frozen=True)
class Choice:
    """One sampled completion of a prompt."""

    text: str
    tokens: tuple[ScoredToken, ...]  # every sampled token, the stop included
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length" (max_tokens reached)


@dataclass(frozen=True)
class Completion:
    """One prompt and its choices."""

    num_prompt_tokens: int
    prompt: tuple[ScoredToken, ...]  # only when echoed; logprob None throughout unless it was scored
    choices: tuple[Choice, ...]


def to_choice(codec: TextCodec, sequence: SampledSequence, stop_strings: Sequence[str]) -> Choice:
    """A sampled sequence as OpenAI text: cut before the stop (module docstring)."""
    token_ids = [int(t) for t in sequence.tokens]
    pieces = codec.pieces(token_ids)
    # Where each piece starts in the text, then where the text ends.
    starts = list(accumulate((len(piece) for piece in pieces), initial=0))
    text = "".join(pieces)
    cut = len(text)
    if sequence.stop_reason == "stop":
        found = _first_stop(text, stop_strings)
        # A stop string, else the last token (EOS or a stop id), which stopped it by itself.
        cut = found if found is not None else starts[-2]
    tokens = tuple(
        ScoredToken(token_id, codec.token_text(token_id), piece[: max(0, cut - start)], float(logprob))
        for token_id, piece, start, logprob in zip(
            token_ids, pieces, starts[:-1], sequence.logprobs.tolist(), strict=True
        )
    )
    return Choice(text[:cut], tokens, "stop" if sequence.stop_reason == "stop" else "length")


def to_prompt(
    codec: TextCodec, prompt: Sequence[int], result: SampleResult | None
) -> tuple[ScoredToken, ...]:
    """A prompt's tokens as text, with the scores `result` holds for them (if it was scored)."""
    logprobs = result.prompt_logprobs if result is not None else None
    tops = _tops(codec, result, 0, len(prompt)) if result is not None else None
    return tuple(
        ScoredToken(
            token_id,
            codec.token_text(token_id),
            piece,
            _finite_or_none(logprobs[i]) if logprobs is not None else None,
            tops[i] if tops is not None else (),
        )
        for i, (token_id, piece) in enumerate(zip(prompt, codec.pieces(prompt), strict=True))
    )


def with_top(codec: TextCodec, choice: Choice, scored: SampleResult, prompt_length: int) -> Choice:
    """`choice` with the likeliest alternatives at each of its tokens, from `scored`: its prompt + tokens
    scored with top-k prompt logprobs."""
    tops = _tops(codec, scored, prompt_length, len(choice.tokens))
    if tops is None:
        return choice
    return replace(
        choice, tokens=tuple(replace(t, top=top) for t, top in zip(choice.tokens, tops, strict=True))
    )


def _tops(
    codec: TextCodec, result: SampleResult, first: int, count: int
) -> list[tuple[tuple[str, float], ...]] | None:
    """The top-k (token text, logprob) at positions [first, first + count) of a scored prompt."""
    if result.topk_prompt_ids is None or result.topk_prompt_logprobs is None:
        return None
    ids_NK = result.topk_prompt_ids[first : first + count]
    logprobs_NK = result.topk_prompt_logprobs[first : first + count]
    return [
        tuple(
            (codec.token_text(int(token)), float(logprob))
            for token, logprob in zip(ids_K.tolist(), logprobs_K.tolist(), strict=True)
            if token >= 0  # -1: a position that was not scored (a prompt's first)
        )
        for ids_K, logprobs_K in zip(ids_NK, logprobs_NK, strict=True)
    ]


def _first_stop(text: str, stop_strings: Sequence[str]) -> int | None:
    found = [i for i in (text.find(stop) for stop in stop_strings) if i >= 0]
    return min(found, default=None)


def _finite_or_none(value: np.floating) -> float | None:
    return float(value) if math.isfinite(value) else None
