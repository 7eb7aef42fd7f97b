"""The /v1 routes: models, aliases, completions and chat completions. Each reads, converts, runs the
generation through the runtime's InferenceService and answers as OpenAI does; a generation whose client
disconnects first is cancelled (disconnects.py). No tensors."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from loraplex.api.openai.auth import Inference, Tenant
from loraplex.api.openai.disconnects import CLIENT_CLOSED_REQUEST, unless_disconnected
from loraplex.api.openai.responses import (
    Envelope,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    sse,
)
from loraplex.api.openai.schemas import AliasRequest, ChatCompletionRequest, CompletionRequest
from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.errors import FieldError
from loraplex.runtime.serving.completions import Completion
from loraplex.runtime.serving.inference import InferenceService, ModelCard
from loraplex.runtime.serving.streaming import LiveGeneration

router = APIRouter(route_class=PooledJsonRoute)

_SSE = "text/event-stream"


@router.get("/models")
async def list_models(inference: Inference, tenant: Tenant) -> dict[str, Any]:
    return {"object": "list", "data": [_model_json(card) for card in await inference.models(tenant)]}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, inference: Inference, tenant: Tenant) -> dict[str, Any]:
    """OpenAI's models.retrieve: one entry of /v1/models (ids hold slashes: `tinker://...`, aliases)."""
    return _model_json(await inference.model(tenant, model_id))


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, inference: Inference, tenant: Tenant, request: Request
) -> dict[str, Any] | Response:
    envelope = Envelope.new("cmpl", body.model)
    if body.stream:
        if (live := await _start(request, inference, tenant, body)) is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        chunks = completion_chunks(envelope, live.events(), body.logprobs, body.includes_usage)
        return StreamingResponse(sse(chunks), media_type=_SSE)
    if (done := await _complete(request, inference, tenant, body)) is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return completion_body(envelope, done, body.logprobs)


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, inference: Inference, tenant: Tenant, request: Request
) -> dict[str, Any] | Response:
    envelope = Envelope.new("chatcmpl", body.model)
    if body.stream:
        if (live := await _start(request, inference, tenant, body)) is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        chunks = chat_chunks(envelope, live.events(), body.logprobs, body.includes_usage)
        return StreamingResponse(sse(chunks), media_type=_SSE)
    if (done := await _complete(request, inference, tenant, body)) is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return chat_body(envelope, done, body.logprobs)


async def _complete(
    request: Request,
    inference: InferenceService,
    tenant: str,
    body: CompletionRequest | ChatCompletionRequest,
) -> list[Completion] | None:
    """The body's completions, or None if the client went away first (its sampling is then cancelled). A
    refused field is named as the body names it."""
    try:
        work = inference.complete(tenant, body.to_generation(inference.codec))
        return await unless_disconnected(request.receive, work)
    except FieldError as refused:
        raise FieldError(body.openai_field(refused.field), refused.problem) from refused


async def _start(
    request: Request,
    inference: InferenceService,
    tenant: str,
    body: CompletionRequest | ChatCompletionRequest,
) -> LiveGeneration | None:
    """The body's generation once queued, to stream; None if the client went away first. A refusal is
    raised here, before the response starts; once it streams, leaving the stream cancels it."""
    work = inference.stream(tenant, body.to_generation(inference.codec))
    return await unless_disconnected(request.receive, work)


@router.get("/aliases")
async def list_aliases(inference: Inference, tenant: Tenant) -> dict[str, Any]:
    aliases = await asyncio.to_thread(inference.aliases.of, tenant)  # the database, off the loop
    return {"object": "list", "data": [_alias_json(alias, model) for alias, model in aliases.items()]}


@router.post("/aliases")
async def set_alias(body: AliasRequest, inference: Inference, tenant: Tenant) -> dict[str, Any]:
    await inference.set_alias(tenant, body.alias, body.model)
    return _alias_json(body.alias, body.model)


@router.delete("/aliases/{alias:path}")
async def delete_alias(alias: str, inference: Inference, tenant: Tenant) -> dict[str, Any]:
    await asyncio.to_thread(inference.aliases.delete, tenant, alias)
    return {"object": "alias.deleted", "alias": alias, "deleted": True}


def _model_json(card: ModelCard) -> dict[str, Any]:
    return {
        "id": card.model_id,
        "object": "model",
        "created": int(card.created.timestamp()),
        "owned_by": card.owned_by,
        "root": card.root,
        "parent": card.parent,
    }


def _alias_json(alias: str, model: str) -> dict[str, str]:
    return {"object": "alias", "alias": alias, "model": model}
