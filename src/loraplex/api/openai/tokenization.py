"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize and GET /tokenizer_info, with vLLM's
request and response bodies, so that clients written for a vLLM server (lm-evaluation-harness's remote
tokenizer among them) tokenize with the served model's tokenizer.

vLLM serves them at the root, not under /v1; api/app.py routes those root paths to this app (they answer
under /v1 too). `model` is optional: the base model, or any name /v1/completions takes (an adapter shares
its base model's tokenizer, but a name the caller may not use is refused the same way). No tensors.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field, ValidationInfo, field_validator

from loraplex.api.openai.auth import Inference, Tenant
from loraplex.api.openai.schemas import ChatMessage, StrictBody
from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.errors import FieldError
from loraplex.runtime.serving.inference import InferenceService
from loraplex.runtime.serving.text_codec import TextCodec

router = APIRouter(route_class=PooledJsonRoute)

# The root paths vLLM serves these routes at.
ROOT_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizeRequest(StrictBody):
    """POST /tokenize: vLLM's TokenizeCompletionRequest (a prompt) or TokenizeChatRequest (messages,
    rendered by the model's chat template), told apart as vLLM tells them: by which of the two is given."""

    model: str | None = None  # None: the base model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's default, true for a prompt and false for messages (the chat template writes its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # accepted at its neutral value only
    return_token_strs: bool | None = False

    @field_validator("continue_final_message")
    @classmethod
    def _no_continue_final_message(cls, value: bool) -> bool:
        if value:
            raise ValueError("continue_final_message is not supported by this server; leave it false")
        return value

    @field_validator("messages")
    @classmethod
    def _not_both(cls, value: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if value is not None and info.data.get("prompt") is not None:
            raise ValueError("give a prompt or messages, not both")
        return value

    def to_tokens(self, codec: TextCodec) -> list[int]:
        """The prompt's or the messages' token ids."""
        if self.messages is not None:
            messages = [message.to_template() for message in self.messages]
            return codec.encode_chat(messages, self.add_generation_prompt, bool(self.add_special_tokens))
        if self.prompt is None:
            raise FieldError("prompt", "is missing: give a prompt, or chat messages")
        return codec.encode(self.prompt, self.add_special_tokens is not False)


class DetokenizeRequest(StrictBody):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 24)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, inference: Inference, tenant: Tenant) -> dict[str, Any]:
    await _resolve(inference, tenant, body.model)
    codec = inference.codec
    tokens = body.to_tokens(codec)
    return {
        "count": len(tokens),
        "max_model_len": inference.info.max_context_length,
        "tokens": tokens,
        "token_strs": codec.token_strs(tokens) if body.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, inference: Inference, tenant: Tenant) -> dict[str, str]:
    await _resolve(inference, tenant, body.model)
    return {"prompt": inference.codec.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(inference: Inference, _tenant: Tenant) -> dict[str, Any]:
    return inference.codec.tokenizer_info()


async def _resolve(inference: InferenceService, tenant: str, model: str | None) -> None:
    """Refuse a `model` the caller may not use, as /v1/completions does (ModelNotFoundError, 404)."""
    if model is not None:
        await inference.resolve(tenant, model)
