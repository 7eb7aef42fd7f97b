"""A streamed generation's events (runtime/serving/streaming.py), on the built-in tiny model's byte-level
tokenizer (one token per byte): which tokens are released as they are drawn, which are held (an
unfinished UTF-8 character, a tail that may begin a stop string), and that the released and final pieces
join to exactly the non-streamed text. The sampling is played by hand: progress as the engine thread
reports it, then the prompt's completion as inference.py builds it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from loraplex.errors import UserError
from loraplex.model.tiny import ensure_tiny_model
from loraplex.runtime.core.sampling import SampledSequence, SampleProgress
from loraplex.runtime.serving.completions import Completion, to_choice
from loraplex.runtime.serving.streaming import (
    ChoiceFinished,
    ChoiceStarted,
    GenerationDone,
    LiveGeneration,
    StreamEvent,
    TokensDrawn,
)
from loraplex.runtime.serving.text_codec import TextCodec


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    loaded = TextCodec.load(str(ensure_tiny_model(tmp_path_factory.mktemp("data"))))
    assert loaded is not None
    return loaded


def _play(
    codec: TextCodec, steps: list[list[int]], final: list[int], stop_reason: str, stops: list[str]
) -> list[StreamEvent]:
    """The events of one prompt, one sample: `steps` reported one after another (the tokens the engine
    drew by each report), then the sample finished as `final` (every token, the stopping one included)."""

    async def generation() -> list[StreamEvent]:
        live = LiveGeneration(codec, [[1]], 1, stops)

        async def work(live: LiveGeneration) -> list[Completion]:
            prompt = live.prompt(0)
            prompt.queued()
            assert prompt.on_progress is not None
            for tokens in steps:
                await asyncio.sleep(0)
                prompt.on_progress(SampleProgress([tokens], [[-0.5] * len(tokens)]))
            await asyncio.sleep(0)
            completion = Completion(1, (), (to_choice(codec, _sequence(final, stop_reason), stops),))
            prompt.done(completion)
            return [completion]

        await live.start(work)
        return [event async for event in live.events()]

    return asyncio.run(generation())


def _sequence(tokens: list[int], stop_reason: str) -> SampledSequence:
    return SampledSequence(np.array(tokens, np.int32), np.full(len(tokens), -0.5, np.float32), stop_reason)


def _drawn(events: list[StreamEvent]) -> list[str]:
    """The text of each TokensDrawn event, in order."""
    return ["".join(t.piece for t in e.tokens) for e in events if isinstance(e, TokensDrawn)]


def _streamed_text(events: list[StreamEvent]) -> str:
    return "".join(t.piece for e in events if isinstance(e, TokensDrawn | ChoiceFinished) for t in e.tokens)


def test_a_tail_that_may_begin_a_stop_string_is_held_and_the_stop_never_streams(codec: TextCodec) -> None:
    text = b"ab\n\nUser:"  # the sampler stops on ":", which completes the stop string
    steps = [[t] for t in text[:-1]]
    events = _play(codec, steps, list(text), "stop", ["\n\nUser:"])
    assert _drawn(events) == ["a", "b"]  # "\n\nUser" could still become the stop: held
    assert isinstance(events[0], ChoiceStarted) and events[0].prompt == ()
    finished = events[-2]
    assert isinstance(finished, ChoiceFinished) and finished.finish_reason == "stop"
    assert [t.token for t in finished.tokens] == list("\n\nUser:")  # every sampled token, none twice
    whole = to_choice(codec, _sequence(list(text), "stop"), ["\n\nUser:"])
    assert _streamed_text(events) == "ab" == whole.text
    assert isinstance(events[-1], GenerationDone)


def test_a_held_tail_is_released_once_it_can_no_longer_begin_a_stop(codec: TextCodec) -> None:
    text = b"ab\n\nUsex!"
    events = _play(codec, [list(text[:4]), list(text[4:8])], list(text), "length", ["\n\nUser:"])
    # After "ab\n\n" the tail "\n\n" is held; "\n\nUsex" no longer begins the stop: all of it goes.
    assert _drawn(events) == ["ab", "\n\nUsex"]
    assert _streamed_text(events) == "ab\n\nUsex!"


def test_an_unfinished_character_is_held_until_a_later_token_completes_it(codec: TextCodec) -> None:
    text = "hé€.".encode()  # h, two bytes, three bytes, a dot
    events = _play(codec, [[t] for t in text[:-1]], list(text), "length", [])
    assert _drawn(events) == ["h", "é", "€"]
    pieces = [[t.piece for t in e.tokens] for e in events if isinstance(e, TokensDrawn)]
    assert pieces == [["h"], ["", "é"], ["", "", "€"]]  # as the non-streamed tokens' pieces
    assert _streamed_text(events) == "hé€."


def test_a_token_with_no_text_is_released_at_once_with_an_empty_piece(codec: TextCodec) -> None:
    no_text = 488  # the tiny model pads its vocabulary past the tokenizer's: such ids decode to ""
    events = _play(codec, [[no_text], [no_text, *b"a"]], [no_text, no_text, *b"a", no_text], "length", [])
    drawn = [[(t.token_id, t.piece) for t in e.tokens] for e in events if isinstance(e, TokensDrawn)]
    assert drawn == [[(no_text, "")], [(no_text, ""), (ord("a"), "a")]]
    assert _streamed_text(events) == "a"


def test_an_eos_is_never_streamed_and_its_text_is_cut_as_the_whole_answers(codec: TextCodec) -> None:
    eos = 258  # <|im_end|>: a special token, whose literal text the answer leaves out
    events = _play(codec, [[*b"hi"]], [*b"hi", eos], "stop", [])
    assert _drawn(events) == ["hi"]
    finished = events[-2]
    assert isinstance(finished, ChoiceFinished)
    assert [(t.token_id, t.piece) for t in finished.tokens] == [(eos, "")]


def test_a_failure_before_every_prompt_is_queued_is_raised_by_start_and_streams_nothing(
    codec: TextCodec,
) -> None:
    async def refused(_live: LiveGeneration) -> list[Completion]:
        raise UserError("prompt too long")

    async def generation() -> None:
        live = LiveGeneration(codec, [[1]], 1, [])
        with pytest.raises(UserError, match="prompt too long"):
            await live.start(refused)

    asyncio.run(generation())


def test_a_failure_after_the_stream_started_ends_its_events_with_that_error(codec: TextCodec) -> None:
    async def fails_midway(live: LiveGeneration) -> list[Completion]:
        prompt = live.prompt(0)
        prompt.queued()
        assert prompt.on_progress is not None
        prompt.on_progress(SampleProgress([[*b"ok"]], [[-0.5, -0.5]]))
        await asyncio.sleep(0)
        raise UserError("snapshot unreadable")

    async def generation() -> list[str]:
        live = LiveGeneration(codec, [[1]], 1, [])
        await live.start(fails_midway)
        seen: list[str] = []
        with pytest.raises(UserError, match="snapshot unreadable"):
            async for event in live.events():
                seen += _drawn([event])
        return seen

    assert asyncio.run(generation()) == ["ok"]


def test_leaving_the_events_early_cancels_the_generation(codec: TextCodec) -> None:
    cancelled = asyncio.Event()

    async def endless(live: LiveGeneration) -> list[Completion]:
        prompt = live.prompt(0)
        prompt.queued()
        assert prompt.on_progress is not None
        try:
            while True:
                prompt.on_progress(SampleProgress([[*b"a"]], [[-0.5]]))
                await asyncio.sleep(0.001)
        finally:
            cancelled.set()

    async def generation() -> None:
        live = LiveGeneration(codec, [[1]], 1, [])
        await live.start(endless)
        events = live.events()
        async for event in events:
            if isinstance(event, TokensDrawn):
                break
        await events.aclose()  # what the response does when its client goes away
        await asyncio.wait_for(cancelled.wait(), 5.0)

    asyncio.run(generation())
