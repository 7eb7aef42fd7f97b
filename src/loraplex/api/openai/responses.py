"""OpenAI's response bodies and stream chunks, built from the runtime's completions.

A stream follows its generation's events (runtime/serving/streaming.py): per choice, a first chunk (the
role, or the echoed prompt), a chunk per token as the sampler releases it, then one with its
finish_reason; choices of different prompts and samples interleave as they are drawn. Then a usage chunk
when stream_options.include_usage, and `data: [DONE]`. A failure after the stream has started is sent as
an `{"error": ...}` event before `[DONE]`. A choice's index is prompt index × n + sample index.
No tensors.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from loraplex.api.openai.errors import stream_error_body
from loraplex.runtime.serving.completions import Choice, Completion, ScoredToken
from loraplex.runtime.serving.streaming import ChoiceFinished, ChoiceStarted, StreamEvent, TokensDrawn


@dataclass(frozen=True)
class Envelope:
    """The fields every body and chunk of one response repeats."""

    response_id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Envelope:
        """A fresh id (`cmpl-…` or `chatcmpl-…`), stamped now."""
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def wrap(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A body or chunk of this response."""
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }


def usage_json(completions: list[Completion]) -> dict[str, int]:
    """Prompt tokens once per prompt; every sampled token of every choice, stops included."""
    prompt = sum(c.num_prompt_tokens for c in completions)
    completion = sum(len(choice.tokens) for c in completions for choice in c.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events as OpenAI sends them; a failure midway is sent as an error event."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as error:  # the status is sent: the error goes in the stream, as OpenAI's does
        yield f"data: {json.dumps(stream_error_body(error))}\n\n"
    yield "data: [DONE]\n\n"


# --- /v1/completions
def completion_body(
    envelope: Envelope, completions: list[Completion], logprobs: int | None
) -> dict[str, Any]:
    """The non-streamed /v1/completions body (a completion's prompt tokens are there only when echoed)."""
    choices = [
        {
            "index": index,
            "text": _text(completion.prompt) + choice.text,
            "logprobs": _completion_logprobs(completion.prompt + choice.tokens, 0)
            if logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
        }
        for index, completion, choice in _indexed(completions)
    ]
    return envelope.wrap("text_completion", choices, usage=usage_json(completions))


async def completion_chunks(
    envelope: Envelope, events: AsyncIterator[StreamEvent], logprobs: int | None, usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """The /v1/completions stream: a choice's echoed prompt as one chunk, then a chunk per token."""
    extra = {"usage": None} if usage else {}
    offsets: dict[int, int] = {}  # choice index -> where its next token's text starts

    def chunk(index: int, text: str, scored: tuple[ScoredToken, ...], finish: str | None) -> dict:
        lp = _completion_logprobs(scored, offsets[index]) if logprobs is not None and scored else None
        offsets[index] += len(text)
        body = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return envelope.wrap("text_completion", [body], **extra)

    async for event in events:
        if isinstance(event, ChoiceStarted):
            offsets[event.index] = 0
            if event.prompt:
                yield chunk(event.index, _text(event.prompt), event.prompt, None)
        elif isinstance(event, TokensDrawn | ChoiceFinished):
            for token in event.tokens:
                yield chunk(event.index, token.piece, (token,), None)
            if isinstance(event, ChoiceFinished):
                yield chunk(event.index, "", (), event.finish_reason)
        elif usage:
            yield envelope.wrap("text_completion", [], usage=usage_json(event.completions))


def _completion_logprobs(tokens: tuple[ScoredToken, ...], offset: int) -> dict[str, Any]:
    """Legacy logprobs: parallel lists; each top dict also holds the chosen token, as OpenAI's does."""
    offsets = list(accumulate((len(t.piece) for t in tokens), initial=offset))[:-1]  # where each one starts
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.logprob is None else {**dict(t.top), t.token: t.logprob} for t in tokens],
        "text_offset": offsets,
    }


# --- /v1/chat/completions
def chat_body(envelope: Envelope, completions: list[Completion], logprobs: bool) -> dict[str, Any]:
    """The non-streamed /v1/chat/completions body."""
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": _chat_logprobs(choice.tokens) if logprobs else None,
            "finish_reason": choice.finish_reason,
        }
        for index, _, choice in _indexed(completions)
    ]
    return envelope.wrap("chat.completion", choices, usage=usage_json(completions))


async def chat_chunks(
    envelope: Envelope, events: AsyncIterator[StreamEvent], logprobs: bool, usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """The /v1/chat/completions stream: the role, a content delta per token, then the finish_reason."""
    extra = {"usage": None} if usage else {}

    def chunk(index: int, delta: dict, scored: tuple[ScoredToken, ...], finish: str | None) -> dict:
        lp = _chat_logprobs(scored) if logprobs and scored else None
        body = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return envelope.wrap("chat.completion.chunk", [body], **extra)

    async for event in events:
        if isinstance(event, ChoiceStarted):
            yield chunk(event.index, {"role": "assistant", "content": ""}, (), None)
        elif isinstance(event, TokensDrawn | ChoiceFinished):
            for token in event.tokens:
                yield chunk(event.index, {"content": token.piece}, (token,), None)
            if isinstance(event, ChoiceFinished):
                yield chunk(event.index, {}, (), event.finish_reason)
        elif usage:
            yield envelope.wrap("chat.completion.chunk", [], usage=usage_json(event.completions))


def _chat_logprobs(tokens: tuple[ScoredToken, ...]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": list(t.token.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": logprob, "bytes": list(text.encode())}
                    for text, logprob in t.top
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def _text(tokens: tuple[ScoredToken, ...]) -> str:
    return "".join(t.piece for t in tokens)


def _indexed(completions: list[Completion]) -> Iterator[tuple[int, Completion, Choice]]:
    """(choice index, its completion, the choice) in index order."""
    index = 0
    for completion in completions:
        for choice in completion.choices:
            yield index, completion, choice
            index += 1
