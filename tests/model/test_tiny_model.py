"""The built-in tiny model: deterministic bytes, a normal HF directory, and our logits equal transformers'."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex.model import tiny
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.packing import PackedSequences
from loraplex.model.tiny import ensure_tiny_model
from tests.model.float64 import float64_copy
from tests.model.rounding import assert_within_rounding


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("data"))


def test_two_creations_are_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = ensure_tiny_model(tmp_path)
    names = sorted(path.name for path in tiny_dir.iterdir())
    assert names == sorted(path.name for path in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_an_existing_model_is_reused_untouched(tiny_dir: Path) -> None:
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_dir.parent.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_losing_the_creation_race_keeps_the_winners_directory(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "models" / "tiny"

    def write_while_another_process_wins(directory: Path) -> None:
        shutil.copytree(tiny_dir, final)  # the other process renames its copy into place first
        directory.joinpath("config.json").write_text("{}")

    monkeypatch.setattr(tiny, "_write_model", write_while_another_process_wins)
    assert ensure_tiny_model(tmp_path) == final
    assert (final / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    assert [path.name for path in final.parent.iterdir()] == ["tiny"]  # no staging directory left


def test_tokenizer_round_trips_any_text_and_renders_chatml(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    text = "héllo, 世界 🎉\n\ttabs\x00 and <|im_end|> too"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids[:2] == [ord("h"), 0xC3]  # token id b is byte b
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 258)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 256)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 257
    assert len(tokenizer) <= 512
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_our_packed_logits_equal_transformers_on_the_tiny_model(tiny_dir: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    decoder, twin = load_decoder(tiny_dir), load_decoder(tiny_dir, "cpu", torch.float64)
    assert decoder.config.model_type == "qwen3" and decoder.config.tie_word_embeddings
    lengths = (9, 4, 13)
    tokens = torch.randint(0, 259, (sum(lengths),))
    with torch.no_grad():
        ours, ours_exact = (d.logits(tokens, PackedSequences.from_lengths(lengths)) for d in (decoder, twin))
        expected, exact = (
            torch.cat([model(input_ids=seq[None]).logits[0] for seq in tokens.split(lengths)])
            for model in (hf_model, float64_copy(hf_model))
        )
    assert ours.shape == (sum(lengths), 512)
    assert_within_rounding(ours, expected, exact, "logits", got_exact=ours_exact)
