"""The served model's text side for the OpenAI-compatible endpoints: its tokenizer and chat template.

Prompts become token ids here, and sampled tokens become text piece by piece with the incremental
detokenizer the sampler matches stop strings with, so a stop string is cut from exactly the text the
sampler saw. Special tokens decode to their literal text, as they do for stop matching.
No tensors, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from loraplex.engine.sampler.stops import IncrementalDetokenizer
from loraplex.errors import UserError
from loraplex.runtime.serving.chat_template import TEMPLATE_FILE, TOKENIZER_CONFIG, ChatTemplate

TOKENIZER_FILE = "tokenizer.json"


class TextCodec:
    """Text <-> token ids for one model."""

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template

    @classmethod
    def load(cls, tokenizer_dir: str) -> TextCodec | None:
        """The codec of an HF tokenizer directory, or None if it has no tokenizer.json."""
        directory = Path(tokenizer_dir) if tokenizer_dir else None
        if directory is None or not (directory / TOKENIZER_FILE).is_file():
            return None
        return cls(Tokenizer.from_file(str(directory / TOKENIZER_FILE)), ChatTemplate.load(directory))

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the special tokens the tokenizer adds (a BOS, for Llama 3)."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """A chat's prompt ids: the chat template's text, which carries its own special tokens."""
        if self._chat_template is None:
            raise UserError(
                f"this model has no chat template (no {TEMPLATE_FILE}, no chat_template in "
                f"{TOKENIZER_CONFIG}); use /v1/completions with a prompt"
            )
        return self._tokenizer.encode(self._chat_template.render(messages), add_special_tokens=False).ids

    def token_text(self, token: int) -> str:
        """One token on its own as text ("\\ufffd" for a part of a UTF-8 character); an id the tokenizer
        has no token for (models pad their vocabulary) as vLLM writes ids, `token_id:N`, so that no two
        of them share a name in a top_logprobs dict."""
        if self._tokenizer.id_to_token(token) is None:
            return f"token_id:{token}"
        return self._tokenizer.decode([token], skip_special_tokens=False)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A new incremental detokenizer: the text a growing sequence adds token by token, as `pieces`."""
        return IncrementalDetokenizer(self._tokenizer)

    def pieces(self, tokens: Sequence[int]) -> list[str]:
        """The text each token adds to the sequence's text ("" while a character is incomplete); they join
        to the whole sequence's text."""
        detokenizer = self.detokenizer()
        pieces = [detokenizer.push(token) for token in tokens]
        # A sequence that ends inside a character: the held-back bytes decode with the last token.
        whole = self._tokenizer.decode(list(tokens), skip_special_tokens=False)
        told = "".join(pieces)
        if pieces and whole.startswith(told):
            pieces[-1] += whole[len(told) :]
        return pieces
