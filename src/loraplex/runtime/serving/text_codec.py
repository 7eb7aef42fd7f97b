"""The served model's text side for the OpenAI-compatible endpoints: its tokenizer, chat template and
tokenizer configuration (what vLLM's /tokenizer_info answers).

Prompts become token ids here, and sampled tokens become text piece by piece with the incremental
detokenizer the sampler matches stop strings with, so a stop string is cut from exactly the text the
sampler saw. Special tokens decode to their literal text, as they do for stop matching.
No tensors, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from loraplex.engine.sampler.stops import IncrementalDetokenizer
from loraplex.errors import FieldError, UserError
from loraplex.runtime.serving.chat_template import (
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    ChatTemplate,
    token_content,
)

TOKENIZER_FILE = "tokenizer.json"
# Keys of tokenizer_config.json that name files on the server's disk: not the client's business.
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
# What transformers calls a tokenizer that tokenizer_config.json does not name: the tokenizer.json one.
_DEFAULT_CLASS = "PreTrainedTokenizerFast"


class TextCodec:
    """Text <-> token ids for one model."""

    def __init__(
        self, tokenizer: Tokenizer, chat_template: ChatTemplate | None, config: dict[str, Any] | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._config = config or {}

    @classmethod
    def load(cls, tokenizer_dir: str) -> TextCodec | None:
        """The codec of an HF tokenizer directory, or None if it has no tokenizer.json."""
        directory = Path(tokenizer_dir) if tokenizer_dir else None
        if directory is None or not (directory / TOKENIZER_FILE).is_file():
            return None
        config_path = directory / TOKENIZER_CONFIG
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        return cls(tokenizer, ChatTemplate.load(directory, config), config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids, by default with the special tokens the tokenizer adds (a BOS, for
        Llama 3)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A chat's prompt ids: the chat template's text, which carries its own special tokens (those the
        tokenizer adds come on top only with `add_special_tokens`)."""
        if self._chat_template is None:
            raise UserError(
                f"this model has no chat template (no {TEMPLATE_FILE}, no chat_template in "
                f"{TOKENIZER_CONFIG}); use /v1/completions with a prompt"
            )
        text = self._chat_template.render(messages, add_generation_prompt)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, special tokens included, as transformers' `decode` gives it; FieldError
        naming `tokens` for an id the tokenizer has no token for (it would decode to nothing)."""
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if (bad := next((token for token in tokens if not 0 <= token < size), None)) is not None:
            raise FieldError("tokens", f"has token id {bad}, outside the tokenizer's vocabulary [0, {size})")
        return self._tokenizer.decode(list(tokens), skip_special_tokens=False)

    def token_strs(self, tokens: Sequence[int]) -> list[str]:
        """Each token as the tokenizer's vocabulary spells it (transformers' `convert_ids_to_tokens`: for
        a byte-level BPE, "Ġ" for a space); an id it has no token for as `token_id:N` (token_text)."""
        return [self._tokenizer.id_to_token(token) or f"token_id:{token}" for token in tokens]

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration as vLLM's /tokenizer_info gives it: tokenizer_config.json with
        special tokens as their text, no server file paths, its `tokenizer_class` and chat template."""
        info = {key: _as_json(value) for key, value in self._config.items() if key not in _FILE_KEYS}
        info["tokenizer_class"] = info.get("tokenizer_class") or _DEFAULT_CLASS
        if self._chat_template is not None:  # also when it comes from chat_template.jinja
            info["chat_template"] = self._chat_template.source
        return info

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


def _as_json(value: Any) -> Any:
    """A tokenizer_config.json value with each AddedToken dict as its text (vLLM's AddedToken objects)."""
    if isinstance(value, dict):
        return token_content(value) if "content" in value else {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json(item) for item in value]
    return value
