"""A streamed generation: each choice's tokens handed on as the sampler draws them, as text safe to show.

The engine thread reports each decode step's tokens of a streaming request (SampleJob.on_progress); they are
queued onto the generation's event loop, never handled on the engine thread, and turned into text here as
the reader takes them. A token is released once the text up to its end can no longer change:
- its characters are complete: a token that leaves a UTF-8 character unfinished adds "" and is held, with
  every token after it, until a later token completes the character (a token whose text is empty, an id
  the tokenizer has no text for, is complete and goes with an empty piece);
- no stop string can begin inside it: the text's longest tail that is a proper prefix of a stop string is
  held. The sampler stops a sequence on the token that completes a stop string (and on EOS or a stop id),
  so released text never holds a stop, and the finishing token is never released early.
When a prompt's sampling finishes, its choices' final form (completions.to_choice, exactly the
non-streamed answer) supplies the tokens not yet released; the released ones have the same pieces there,
so a stream's pieces join to exactly the non-streamed text. Generations that score their tokens after
sampling (top_logprobs, an echoed prompt with logprobs) are not streamed token by token: each choice
arrives whole once scored. No tensors, no HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from loraplex.runtime.core.sampling import SampleProgress
from loraplex.runtime.serving.completions import Completion, ScoredToken, to_prompt
from loraplex.runtime.serving.text_codec import TextCodec


@dataclass(frozen=True)
class ChoiceStarted:
    """A choice's first event: its echoed prompt (empty unless the request echoes)."""

    index: int  # prompt index × n + sample index, as the response numbers choices
    prompt: tuple[ScoredToken, ...]


@dataclass(frozen=True)
class TokensDrawn:
    """Tokens of a choice, next in order, whose text can no longer change."""

    index: int
    tokens: tuple[ScoredToken, ...]


@dataclass(frozen=True)
class ChoiceFinished:
    """A choice's last tokens (those not yet released, cut as the non-streamed answer is) and why it ended."""

    index: int
    tokens: tuple[ScoredToken, ...]
    finish_reason: str


@dataclass(frozen=True)
class GenerationDone:
    """Every prompt's completion, after every choice has finished (for the usage chunk)."""

    completions: list[Completion]


StreamEvent = ChoiceStarted | TokensDrawn | ChoiceFinished | GenerationDone


class _ChoiceText:
    """One choice's text as its tokens arrive: what can be released, and how much has been."""

    def __init__(self, codec: TextCodec, stop_strings: Sequence[str]) -> None:
        self._codec, self._stop_strings = codec, stop_strings
        self._detokenizer = codec.detokenizer()
        self._held: list[ScoredToken] = []  # drawn, not yet released, in order
        self._settled: list[bool] = []  # per held token: its text, and all before it, is final
        self._text = ""  # the text of every token drawn so far
        self.released = 0  # tokens released
        self.started = False
        self.finished = False

    def push(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> tuple[ScoredToken, ...]:
        """Add drawn tokens; return those that can now be released (module docstring)."""
        for token_id, logprob in zip(token_ids, logprobs, strict=True):
            piece = self._detokenizer.push(token_id)
            self._held.append(ScoredToken(token_id, self._codec.token_text(token_id), piece, float(logprob)))
            self._settled.append(not self._detokenizer.holds_back)
            self._text += piece
        safe_end = len(self._text) - self._stop_prefix_length()
        held_start = len(self._text) - sum(len(t.piece) for t in self._held)
        releasable, end = 0, held_start
        for i, (token, settled) in enumerate(zip(self._held, self._settled, strict=True)):
            end += len(token.piece)
            if end > safe_end:
                break
            if settled:  # no character is left unfinished up to it: it and every token before it go
                releasable = i + 1
        released, self._held = tuple(self._held[:releasable]), self._held[releasable:]
        self._settled = self._settled[releasable:]
        self.released += releasable
        return released

    def _stop_prefix_length(self) -> int:
        """The length of the text's longest tail that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class LiveGeneration:
    """The events of one streamed generation, fed from its sampling and read by its response."""

    def __init__(
        self, codec: TextCodec, prompts: list[list[int]], n: int, stop_strings: Sequence[str]
    ) -> None:
        self._codec, self._prompts, self._n = codec, prompts, n
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple] = asyncio.Queue()
        self._choices = [_ChoiceText(codec, stop_strings) for _ in range(len(prompts) * n)]
        self._unqueued = len(prompts)  # prompts whose sampling is not queued yet
        self._accepted: asyncio.Future[None] = self._loop.create_future()
        self._task: asyncio.Future[list[Completion]] | None = None
        self.echo = False  # set by the generation: each choice starts with its prompt
        self.streams_tokens = True  # False: the generation scores its tokens after sampling

    def prompt(self, prompt_index: int) -> PromptStream:
        """Where one prompt's sampling reports to."""
        return PromptStream(self, prompt_index)

    def _queued(self) -> None:
        self._unqueued -= 1
        if not self._unqueued and not self._accepted.done():
            self._accepted.set_result(None)

    async def start(self, work: Callable[[LiveGeneration], asyncio.Future[list[Completion]]]) -> None:
        """Run the generation (`work`) and return once all its prompts are queued; raise what failed it
        before that (a refusal is an HTTP error, not an event). Cancelling this cancels the work."""
        task = self._task = asyncio.ensure_future(work(self))
        task.add_done_callback(self._ended)
        try:
            await asyncio.wait((self._accepted, task), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if not self._accepted.done():
            task.result()  # raises what failed it; a generation with no prompts is refused before this

    def _ended(self, task: asyncio.Future[list[Completion]]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        self._queue.put_nowait(("failed", error) if error is not None else ("finished", task.result()))

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The generation's events in order; raises what failed it. Leaving early (the client went away)
        cancels the generation, and with it the sampling it queued."""
        assert self._task is not None, "events() before start()"
        try:
            while True:
                kind, *rest = await self._queue.get()
                if kind == "progress":
                    for event in self._on_progress(*rest):
                        yield event
                elif kind == "done":
                    for event in self._on_done(*rest):
                        yield event
                elif kind == "failed":
                    raise rest[0]
                else:
                    yield GenerationDone(rest[0])
                    return
        finally:
            self._task.cancel()  # nothing if it has finished

    def _on_progress(self, prompt_index: int, progress: SampleProgress) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for sample, (tokens, logprobs) in enumerate(zip(progress.tokens, progress.logprobs, strict=True)):
            index = prompt_index * self._n + sample
            choice = self._choices[index]
            if choice.finished:  # its final form is out; nothing may follow it
                continue
            if released := choice.push(tokens, logprobs):
                if not choice.started:
                    choice.started = True
                    echoed = to_prompt(self._codec, self._prompts[prompt_index], None) if self.echo else ()
                    events.append(ChoiceStarted(index, echoed))
                events.append(TokensDrawn(index, released))
        return events

    def _on_done(self, prompt_index: int, completion: Completion) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for sample, final in enumerate(completion.choices):
            index = prompt_index * self._n + sample
            choice = self._choices[index]
            choice.finished = True
            if not choice.started:
                choice.started = True
                events.append(ChoiceStarted(index, completion.prompt))
            events.append(ChoiceFinished(index, final.tokens[choice.released :], final.finish_reason))
        return events


@dataclass(frozen=True)
class PromptStream:
    """One prompt's side of a live generation: its sampling's progress, queueing and completion."""

    live: LiveGeneration
    prompt_index: int

    @property
    def on_progress(self) -> Callable[[SampleProgress], None] | None:
        """What the engine thread calls with the prompt's new tokens (it only queues them on the loop);
        None when the generation is not streamed token by token."""
        if not self.live.streams_tokens:
            return None
        loop, queue, index = self.live._loop, self.live._queue, self.prompt_index
        return lambda progress: loop.call_soon_threadsafe(queue.put_nowait, ("progress", index, progress))

    def queued(self) -> None:
        """The prompt's sampling is queued: once every prompt's is, the generation is accepted."""
        self.live._queued()

    def done(self, completion: Completion) -> None:
        """The prompt's completion, its choices in their final form."""
        self.live._queue.put_nowait(("done", self.prompt_index, completion))
