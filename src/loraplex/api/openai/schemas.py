"""Request bodies of the /v1 routes, validated, and their conversion into the runtime's Generation.

Unknown parameters are refused (400 naming them), as OpenAI does; parameters this server cannot honour are
accepted only at their neutral values (penalties 0, no logit_bias, best_of = n, plain-text responses).
`top_k` is the one extension (vLLM's): -1 or 0 = no limit. A refusal further down (the sampler's checks,
which name Tinker's fields, and the runtime's) is answered naming the request's own field: `openai_field`.
No tensors.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from loraplex.runtime.core.sampling import SamplingParams
from loraplex.runtime.serving.inference import Generation
from loraplex.runtime.serving.text_codec import TextCodec

MAX_TOP_LOGPROBS = 20  # as vLLM; OpenAI allows 5 (completions) and 20 (chat)
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# A union's forms are told apart by their first item or their type (pydantic's Discriminator), and tagged
# in angle brackets: pydantic puts the tag in an error's location, and errors.py leaves such parts out of
# the `param` it answers, which names the request's own field as OpenAI does (`prompt.1`, not a form).


def _prompt_form(value: Any) -> str | None:
    """Which form a prompt takes (None: none), read from its first item. Tried in turn as a plain union,
    each wrong form fails on every item of a long prompt: 100k token ids cost 12 ms of validation, held
    on the event loop, where validating them as the form they are takes 1 ms."""
    if isinstance(value, str):
        return "<text>"
    if not isinstance(value, list):
        return None  # refused with the message below
    if not value:
        return "<ids>"  # then refused by _some_prompt
    first = value[0]
    if isinstance(first, str):
        return "<texts>"
    return "<id lists>" if isinstance(first, list) else "<ids>"


# One text, texts, one prompt's token ids, or several prompts' token ids.
Prompt = Annotated[
    Annotated[str, Tag("<text>")]
    | Annotated[list[str], Tag("<texts>")]
    | Annotated[list[int], Tag("<ids>")]
    | Annotated[list[list[int]], Tag("<id lists>")],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_form",
        custom_error_message="give a text, a list of texts, a list of token ids or a list of such lists",
    ),
]


def _text_or_list(value: Any) -> str | None:
    if isinstance(value, str):
        return "<text>"
    return "<list>" if isinstance(value, list) else None  # None: refused with the union's message


# `stop`: one string or several.
StopStrings = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[str], Tag("<list>")],
    Discriminator(
        _text_or_list,
        custom_error_type="stop_form",
        custom_error_message="give a string or a list of strings",
    ),
]


class StrictBody(BaseModel):
    """A request body that refuses unknown parameters (400 naming them), as OpenAI's API does."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage changes anything here."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingRequest(StrictBody):
    """The parameters completions and chat completions share."""

    model: str
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: StopStrings | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float, info: ValidationInfo) -> float:
        if value != 0:
            raise ValueError(f"{info.field_name} is not supported by this server; leave it 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    # Tinker's fields (the sampler's checks) and the runtime's Generation's, by the field of this request
    # they come from; either request adds its own (prompt, logprobs).
    _FIELDS: ClassVar[dict[str, str]] = {
        "num_samples": "n",
        "n": "n",
        "sampling_params.temperature": "temperature",
        "sampling_params.top_k": "top_k",
        "sampling_params.top_p": "top_p",
        "sampling_params.seed": "seed",
        "sampling_params.stop": "stop",
    }

    def openai_field(self, field: str) -> str:
        """This request's name for a field the sampler or the runtime refused (unknown names kept)."""
        return self._FIELDS.get(field) or self._own_fields().get(field) or field

    def _own_fields(self) -> dict[str, str]:
        """The names that differ between completions and chat (each request class has its own)."""
        raise NotImplementedError

    @property
    def includes_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The Tinker sampling parameters: OpenAI's stop strings still let EOS stop, so [] means None."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=-1 if self.top_k == 0 else self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(stop) or None,
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: int | None = Field(COMPLETIONS_MAX_TOKENS, ge=0)  # None = up to the server's default
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n"):
            raise ValueError("best_of is not supported by this server; leave it out or equal to n")
        return value

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: str | list[Any]) -> str | list[Any]:
        if value == []:
            raise ValueError("give at least one prompt")
        return value

    def _own_fields(self) -> dict[str, str]:
        return {
            "prompt": "prompt",
            "sampling_params.max_tokens": "max_tokens",
            "topk_prompt_logprobs": "logprobs",
            "top_logprobs": "logprobs",
        }

    def to_generation(self, codec: TextCodec) -> Generation:
        """The request in the sampler's terms (string prompts tokenized with the model's tokenizer)."""
        return Generation(
            model=self.model,
            prompts=self._prompts(codec),
            params=self.sampling_params(self.max_tokens),
            n=self.n,
            is_sampled=self.max_tokens != 0,
            echo=self.echo,
            scores_prompt=self.echo and self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
        )

    def _prompts(self, codec: TextCodec) -> list[list[int]]:
        """Every prompt as token ids: one text, one id list, or a batch of either."""
        items: list[Any] = [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
        if all(isinstance(item, int) for item in items):
            items = [items]  # one prompt, given as ids
        return [codec.encode(item) if isinstance(item, str) else list(item) for item in items]


class TextPart(StrictBody):
    """A text part of a message's content (the only kind of part served)."""

    type: Literal["text"]
    text: str


# A message's content: one text or a list of text parts.
Content = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[TextPart], Tag("<list>")],
    Discriminator(
        _text_or_list,
        custom_error_type="content_form",
        custom_error_message="give a string or a list of text parts",
    ),
]


class ChatMessage(BaseModel):
    """One message; fields beyond role and content (name, tool_calls, ...) reach the chat template as is."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # Checked before the union, whose own error would name one of its member types instead.
        for part in value if isinstance(value, list) else ():
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(f"only text content parts are served here, not {part.get('type')!r}")
        return value

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it: content as one string."""
        message = self.model_dump(exclude_none=True)
        content = self.content
        message["content"] = (
            "\n".join(p.text for p in content) if isinstance(content, list) else content or ""
        )
        return message


class ResponseFormat(StrictBody):
    """`response_format`: plain text only (no JSON mode or schemas)."""

    type: Literal["text"]


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # OpenAI's older name for max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def _own_fields(self) -> dict[str, str]:
        max_tokens = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {
            "prompt": "messages",
            "sampling_params.max_tokens": max_tokens,
            "topk_prompt_logprobs": "top_logprobs",
            "top_logprobs": "top_logprobs",
        }

    def to_generation(self, codec: TextCodec) -> Generation:
        """The request in the sampler's terms: the messages rendered with the model's chat template."""
        prompt = codec.encode_chat([message.to_template() for message in self.messages])
        max_tokens = self.max_completion_tokens or self.max_tokens  # None = the server's default
        return Generation(
            model=self.model,
            prompts=[prompt],
            params=self.sampling_params(max_tokens),
            n=self.n,
            top_logprobs=self.top_logprobs or 0,
        )


class AliasRequest(StrictBody):
    """POST /v1/aliases: name one of your checkpoints."""

    alias: str
    model: str  # a tinker:// sampler_weights or weights path
