"""Completion text for the OpenAI endpoints, on the built-in tiny model's byte-level tokenizer: pieces, where
text is cut at a stop, prompt scores and alternatives, and chat templates rendered as transformers does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from loraplex.errors import UserError
from loraplex.model.tiny import ensure_tiny_model
from loraplex.runtime.core.sampling import SampledSequence, SampleResult
from loraplex.runtime.serving.completions import to_choice, to_prompt, with_top
from loraplex.runtime.serving.text_codec import TextCodec

IM_START, IM_END = 257, 258  # the tiny tokenizer's chat tokens (model/tiny.py)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def codec(tiny_dir: Path) -> TextCodec:
    loaded = TextCodec.load(str(tiny_dir))
    assert loaded is not None
    return loaded


def _sequence(tokens: list[int], stop_reason: str) -> SampledSequence:
    logprobs = -np.arange(1, len(tokens) + 1, dtype=np.float32) / 4  # -0.25, -0.5, ...: exact in float32
    return SampledSequence(np.array(tokens, np.int32), logprobs, stop_reason)


def test_pieces_hold_an_incomplete_character_until_it_completes_and_join_to_the_text(
    codec: TextCodec,
) -> None:
    tokens = list("hé€".encode())  # h, then 2 bytes, then 3 bytes
    assert codec.pieces(tokens) == ["h", "", "é", "", "", "€"]
    # A sequence that ends inside a character: its last token gives what is held back, decoded as is.
    assert codec.pieces(list("hé".encode())[:2]) == ["h", "\ufffd"]


def test_a_stop_string_cuts_the_text_before_it_and_keeps_every_sampled_token(codec: TextCodec) -> None:
    tokens = list(b"ab\n\nUser:")  # the sampler stops on the token completing the stop string
    choice = to_choice(codec, _sequence(tokens, "stop"), ["\n\nUser:", "zz"])
    assert (choice.text, choice.finish_reason) == ("ab", "stop")
    assert [t.token for t in choice.tokens] == list("ab\n\nUser:")
    assert [t.piece for t in choice.tokens] == ["a", "b", "", "", "", "", "", "", ""]
    assert [t.logprob for t in choice.tokens] == [-0.25 * i for i in range(1, 10)]


def test_a_stop_string_inside_one_token_keeps_that_tokens_text_before_it(codec: TextCodec) -> None:
    # The tiny tokenizer has one byte per token; a multi-byte character is the smallest multi-byte piece.
    tokens = [*b"x", *"é".encode()]
    choice = to_choice(codec, _sequence(tokens, "stop"), ["é"])
    assert (choice.text, [t.piece for t in choice.tokens]) == ("x", ["x", "", ""])


def test_eos_ends_the_text_but_stays_a_token(codec: TextCodec) -> None:
    choice = to_choice(codec, _sequence([*b"hi", IM_END], "stop"), [])
    assert (choice.text, choice.finish_reason) == ("hi", "stop")
    assert [(t.token, t.piece) for t in choice.tokens] == [("h", "h"), ("i", "i"), ("<|im_end|>", "")]


def test_a_length_finish_keeps_all_the_text_special_tokens_as_written(codec: TextCodec) -> None:
    choice = to_choice(codec, _sequence([*b"a", IM_START, *b"b"], "length"), ["b"])
    assert (choice.text, choice.finish_reason) == ("a<|im_start|>b", "length")


def test_ids_the_tokenizer_has_no_token_for_are_named_by_id(codec: TextCodec) -> None:
    choice = to_choice(codec, _sequence([300, *b"a"], "length"), [])
    assert [(t.token, t.piece) for t in choice.tokens] == [("token_id:300", ""), ("a", "a")]


def test_a_scored_prompt_has_no_score_at_its_first_token_and_its_top_k_elsewhere(codec: TextCodec) -> None:
    result = SampleResult(
        sequences=[],
        prompt_logprobs=np.array([np.nan, -1.5, -0.5], np.float32),
        topk_prompt_ids=np.array([[-1, -1], [ord("z"), ord("b")], [ord("c"), ord("y")]], np.int32),
        topk_prompt_logprobs=np.array([[np.nan, np.nan], [-0.5, -1.5], [-0.5, -2.0]], np.float32),
    )
    prompt = to_prompt(codec, list(b"abc"), result)
    assert [(t.token, t.logprob, t.top) for t in prompt] == [
        ("a", None, ()),
        ("b", -1.5, (("z", -0.5), ("b", -1.5))),
        ("c", -0.5, (("c", -0.5), ("y", -2.0))),
    ]
    assert [t.logprob for t in to_prompt(codec, list(b"abc"), None)] == [None, None, None]


def test_alternatives_of_a_choice_come_from_the_positions_after_the_prompt(codec: TextCodec) -> None:
    choice = to_choice(codec, _sequence(list(b"xy"), "length"), [])
    scored = SampleResult(  # prompt "ab" + "xy", scored on the last two positions only
        sequences=[],
        topk_prompt_ids=np.array([[-1], [-1], [ord("x")], [ord("q")]], np.int32),
        topk_prompt_logprobs=np.array([[np.nan], [np.nan], [-0.25], [-0.75]], np.float32),
    )
    assert [t.top for t in with_top(codec, choice, scored, 2).tokens] == [(("x", -0.25),), (("q", -0.75),)]


def test_a_chat_renders_and_encodes_as_transformers_apply_chat_template(
    codec: TextCodec, tiny_dir: Path
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a letter."},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Another."},
    ]
    reference = AutoTokenizer.from_pretrained(str(tiny_dir))
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert codec.encode_chat(messages) == reference(text, add_special_tokens=False)["input_ids"]


def test_a_model_without_a_chat_template_refuses_chats_naming_what_is_missing(tiny_dir: Path) -> None:
    codec = TextCodec.load(str(tiny_dir))
    assert codec is not None
    codec._chat_template = None
    with pytest.raises(UserError, match=r"no chat template .* use /v1/completions"):
        codec.encode_chat([{"role": "user", "content": "hi"}])


def test_a_directory_without_tokenizer_json_has_no_codec(tmp_path: Path) -> None:
    assert TextCodec.load(str(tmp_path)) is None and TextCodec.load("") is None
