"""When one sampled sequence stops: stop token ids (EOS by default) and stop strings on the decoded text.

Stop strings are matched on the text the tokens decode to (special tokens included, as their literal
text), as tokens arrive, so a string split across token boundaries is found on the token that
completes it. Text is decoded incrementally: a small window of recent tokens is re-decoded and only the
text past its already-read prefix is new, which keeps per-token cost constant and is exact for
tokenizers whose decoders strip or merge at a sequence's start; text ending in an incomplete UTF-8
character is held until the character completes. Knows nothing of models, batches or requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

# Held-back tokens before pending text is flushed as-is: a UTF-8 character spans at most 4 bytes.
_MAX_HELD_TOKENS = 4
_REPLACEMENT = "\ufffd"


def read_eos_token_ids(model_dir: Path) -> frozenset[int]:
    """EOS ids of an HF model directory: `eos_token_id` of config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
    return frozenset(ids)


class IncrementalDetokenizer:
    """The text of a growing token sequence, returned piece by piece as tokens are pushed."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._prefix_start = 0  # first token of the context window re-decoded with new tokens
        self._read_end = 0  # tokens whose text has been returned

    def push(self, token: int) -> str:
        """Append a token; return the text it completes ("" while a character is still incomplete)."""
        self._tokens.append(token)
        window = self._tokens[self._prefix_start :]
        prefix_text = self._decode(self._tokens[self._prefix_start : self._read_end])
        text = self._decode(window)
        if text.endswith(_REPLACEMENT) and len(self._tokens) - self._read_end < _MAX_HELD_TOKENS:
            return ""
        self._prefix_start, self._read_end = self._read_end, len(self._tokens)
        return text[len(prefix_text) :]

    @property
    def holds_back(self) -> bool:
        """Whether some pushed tokens' text is held (an unfinished character); False once every token's
        text has been returned, also when a token's text is empty (an id the tokenizer decodes to "")."""
        return self._read_end < len(self._tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=False) if tokens else ""


class StopChecker:
    """Decides, token by token, whether one sequence has stopped."""

    def __init__(
        self, stop_ids: Iterable[int], stop_strings: Iterable[str], tokenizer: Tokenizer | None
    ) -> None:
        self._stop_ids = frozenset(stop_ids)
        self._stop_strings = tuple(stop_strings)
        if self._stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._detokenizer = IncrementalDetokenizer(tokenizer) if self._stop_strings and tokenizer else None
        # Enough earlier text to find a stop string that the next piece completes.
        self._keep_chars = max((len(s) for s in self._stop_strings), default=1) - 1
        self._tail = ""

    def is_stop(self, token: int) -> bool:
        """Push a sampled token: whether it is a stop id or completes a stop string."""
        if token in self._stop_ids:
            return True
        if self._detokenizer is None:
            return False
        piece = self._detokenizer.push(token)
        if not piece:
            return False
        text = self._tail + piece
        self._tail = text[-self._keep_chars :] if self._keep_chars else ""
        return any(stop in text for stop in self._stop_strings)
