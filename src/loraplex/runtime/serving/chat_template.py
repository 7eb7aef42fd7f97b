"""A model's chat template: the Jinja program in its tokenizer files that turns messages into prompt text.

Read as `transformers` reads it (`chat_template.jinja`, else `chat_template` in tokenizer_config.json) and
rendered in Jinja's immutable sandbox with the globals HF templates rely on, so a template renders here as
it does under `apply_chat_template`. No tensors, no HTTP.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loraplex.errors import FieldError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplate:
    """A compiled chat template and the special tokens it may name (bos_token, eos_token, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        # HF's settings: block tags leave no stray newlines or indentation in the rendered prompt.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        self._special_tokens = special_tokens

        self.source = source

    @classmethod
    def load(cls, tokenizer_dir: Path, config: dict[str, Any]) -> ChatTemplate | None:
        """The directory's template, or None if it has none; `config` is its tokenizer_config.json."""
        source = _template_source(tokenizer_dir, config)
        if source is None:
            return None
        special = {
            key: token_content(config[key])
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if config.get(key) is not None
        }
        return cls(source, special)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; with `add_generation_prompt`, ending where the assistant's reply
        begins."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special_tokens
            )
        except TemplateError as exc:
            raise FieldError("messages", f"were refused by the model's chat template: {exc}") from exc


def _template_source(tokenizer_dir: Path, config: dict[str, Any]) -> str | None:
    if (tokenizer_dir / TEMPLATE_FILE).is_file():
        return (tokenizer_dir / TEMPLATE_FILE).read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the chat one is "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def token_content(token: str | dict[str, Any]) -> str:
    """tokenizer_config.json writes a special token as its text or as an AddedToken dict."""
    return token if isinstance(token, str) else str(token.get("content", ""))


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format_spec: str) -> str:
    return datetime.now().strftime(format_spec)


def _tojson(value: Any, indent: int | None = None) -> str:
    # HF's filter: keeps non-ASCII text as is, unlike Jinja's built-in HTML-safe tojson.
    return json.dumps(value, ensure_ascii=False, indent=indent)
