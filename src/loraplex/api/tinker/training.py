"""Training routes: create_model, load_weights, get_info, forward(_backward), optim_step, the saves.

Each submission answers at once with an UntypedAPIFuture; the result comes from retrieve_future.

Every request that names a run's seq_id consumes it, whatever becomes of it: the SDK counts seq_ids on
its side and moves on even when a call fails, so a refusal that skipped the run's log would hold every
later request of the run forever. Once a body yields its run and seq_id, any refusal (a field that
fails validation, an undecodable tensor, a feature this server lacks) is recorded as that seq_id's
failed future (a `Submission` carrying the refusal) and answered like any submission; the SDK then raises the
precise message from the future. Only a body without a readable run and seq_id is refused outright (422).

Bodies are decoded on the codec pool when they are large (codec_pool.py), never on the event loop; their
submissions go to the service through the submission thread (submissions.py): their database writes
never block the event loop, and a burst of them is written in one transaction.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.api.request_log import note_request
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.codec_pool import (
    INLINE_JSON_BODY_BYTES,
    INLINE_PROTOBUF_BODY_BYTES,
    CodecPool,
    body_chunks,
    body_size,
    join_chunks,
)
from loraplex.api.tinker.codecs import (
    decompress,
    forward_backward_command,
    parse_forward_backward,
)
from loraplex.api.tinker.deps import Codecs, Info, Submissions, Training
from loraplex.api.tinker.json_body import json_body_route
from loraplex.api.tinker.submissions import SubmissionThread
from loraplex.api.tinker.wire import (
    CreateModelRequest,
    LoadWeightsRequest,
    ModelRequest,
    OptimStepRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    describe_errors,
    lora_info_json,
)
from loraplex.errors import UserError
from loraplex.runtime.control.futures import FutureRecord
from loraplex.runtime.control.service import Submission
from loraplex.runtime.core.commands import Command, ForwardBackward

router = APIRouter(route_class=PooledJsonRoute)


class UnprocessableBodyError(UserError):
    """A JSON body that cannot be read as the route's request, nor as far as its run and seq_id (422)."""

    status_code = 422


def _future(record: FutureRecord, model_id: str, seq_id: int | None = None) -> dict[str, Any]:
    note_request(run_id=model_id, seq_id=seq_id, future_id=record.id)
    return {"request_id": record.id, "model_id": model_id}


async def _submit_ordered(
    chunks: list[bytes],
    codecs: CodecPool,
    submissions: SubmissionThread,
    tenant: str,
    wire: type[BaseModel],
    request_type: str,
    to_command: Callable[[Any], Command],
) -> dict[str, Any]:
    """Validate a JSON body into its command and submit it; a refusal becomes its seq_id's failed future."""
    is_small = body_size(chunks) < INLINE_JSON_BODY_BYTES
    submission = await codecs.run(
        is_small, _ordered_submission, chunks, tenant, wire, request_type, to_command
    )
    return _future(await submissions.submit(submission), submission.run_id, submission.seq_id)


def _ordered_submission(
    chunks: list[bytes],
    tenant: str,
    wire: type[BaseModel],
    request_type: str,
    to_command: Callable[[Any], Command],
) -> Submission:
    """The submission of a JSON body: its command, or the refusal recorded as its seq_id's failed future."""
    raw = b"".join(chunks)
    try:
        body = wire.model_validate_json(raw)
        command = to_command(body)
    except (ValidationError, UserError) as error:
        refusal = UserError(describe_errors(error.errors())) if isinstance(error, ValidationError) else error
        model_id, seq_id = _run_and_seq_id(raw, refusal)
        return Submission(tenant, model_id, seq_id, request_type, refusal=refusal)
    return Submission(tenant, body.model_id, body.seq_id, command.request_type, command)  # type: ignore[attr-defined]


def _run_and_seq_id(raw: bytes, refusal: UserError) -> tuple[str, int]:
    """The model_id and seq_id of a refused body, read leniently; without both, the refusal is a 422."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    model_id = data.get("model_id") if isinstance(data, dict) else None
    seq_id = data.get("seq_id") if isinstance(data, dict) else None
    if not isinstance(model_id, str) or isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise UnprocessableBodyError(str(refusal))
    return model_id, seq_id


@router.post("/create_model")
def create_model(body: CreateModelRequest, training: Training, tenant: Tenant) -> dict[str, Any]:
    record = training.create_run(tenant, body.session_id, body.model_seq_id, body.to_command())
    return _future(record, f"{body.session_id}:train:{body.model_seq_id}", 0)


@router.post("/load_weights", **json_body_route(LoadWeightsRequest))
async def load_weights(
    request: Request, training: Training, submissions: Submissions, codecs: Codecs, tenant: Tenant
) -> dict[str, Any]:
    """Create-via-load (session_id + model_seq_id: a new run) or the legacy in-place load (model_id +
    seq_id)."""
    chunks = await body_chunks(request)
    body = await codecs.run(body_size(chunks) < INLINE_JSON_BODY_BYTES, _load_weights_body, chunks)
    if body is not None and body.session_id is not None and body.model_seq_id is not None:
        command = body.to_command()
        record = await submissions.call(
            training.create_run, tenant, body.session_id, body.model_seq_id, command
        )
        return _future(record, f"{body.session_id}:train:{body.model_seq_id}")

    def in_place(body: LoadWeightsRequest) -> Command:
        if body.model_id is None or body.seq_id is None:
            raise UserError(
                "load_weights needs session_id + model_seq_id (new run) or model_id + seq_id (in place)"
            )
        return body.to_command()

    return await _submit_ordered(
        chunks, codecs, submissions, tenant, LoadWeightsRequest, "LoadWeights", in_place
    )


def _load_weights_body(chunks: list[bytes]) -> LoadWeightsRequest | None:
    """The body as a LoadWeightsRequest, or None if it is not one (refused as the in-place load it names,
    or a 422 if it names no run)."""
    try:
        return LoadWeightsRequest.model_validate_json(b"".join(chunks))
    except ValidationError:
        return None


@router.post("/get_info")
async def get_info(body: ModelRequest, training: Training, info: Info, tenant: Tenant) -> dict[str, Any]:
    run = training.run_state(tenant, body.model_id)
    model_data = {
        "arch": info.arch,
        "model_name": info.model_name,
        "tokenizer_id": info.tokenizer_dir or None,
    }
    assert run.lora_config is not None
    return {
        "type": "get_info",
        "model_id": run.run_id,
        "model_data": model_data,
        "model_name": info.model_name,
        **lora_info_json(run.lora_config),
    }


@router.post("/forward_backward")
@router.post("/forward")
async def forward_backward(
    request: Request, submissions: Submissions, codecs: Codecs, tenant: Tenant
) -> dict[str, Any]:
    """forward and forward_backward share this handler: the proto's forward_only says which."""
    chunks = await body_chunks(request)
    encoding = request.headers.get("content-encoding")
    # A compressed body's size is known only once it is decompressed.
    is_small = not encoding and body_size(chunks) < INLINE_PROTOBUF_BODY_BYTES
    model_id, seq_id, decoded = await codecs.run(is_small, _decode_forward_backward, chunks, encoding)
    if isinstance(decoded, UserError):
        submission = Submission(tenant, model_id, seq_id, "ForwardBackward", refusal=decoded)
    else:
        submission = Submission(tenant, model_id, seq_id, "ForwardBackward", decoded)
    return _future(await submissions.submit(submission), model_id, seq_id)


def _decode_forward_backward(
    chunks: list[bytes], content_encoding: str | None
) -> tuple[str, int, ForwardBackward | UserError]:
    """A forward(_backward) body's run, seq_id and command, or the refusal to record against them; what
    comes before the run and seq_id are known (size, zstd, protobuf) raises."""
    msg = parse_forward_backward(decompress(join_chunks(chunks), content_encoding))
    try:
        return msg.model_id, msg.seq_id, forward_backward_command(msg)
    except UserError as refusal:
        return msg.model_id, msg.seq_id, refusal


@router.post("/optim_step", **json_body_route(OptimStepRequest))
async def optim_step(
    request: Request, submissions: Submissions, codecs: Codecs, tenant: Tenant
) -> dict[str, Any]:
    return await _submit_ordered(
        await body_chunks(request),
        codecs,
        submissions,
        tenant,
        OptimStepRequest,
        "OptimStep",
        OptimStepRequest.to_command,
    )


@router.post("/save_weights", **json_body_route(SaveWeightsRequest))
async def save_weights(
    request: Request, submissions: Submissions, codecs: Codecs, tenant: Tenant
) -> dict[str, Any]:
    return await _submit_ordered(
        await body_chunks(request),
        codecs,
        submissions,
        tenant,
        SaveWeightsRequest,
        "SaveWeights",
        SaveWeightsRequest.to_command,
    )


@router.post("/save_weights_for_sampler", **json_body_route(SaveWeightsForSamplerRequest))
async def save_weights_for_sampler(
    request: Request, training: Training, submissions: Submissions, codecs: Codecs, tenant: Tenant
) -> dict[str, Any]:
    def to_command(body: SaveWeightsForSamplerRequest) -> Command:
        return body.to_command(training.run_state(tenant, body.model_id).session_id)

    return await _submit_ordered(
        await body_chunks(request),
        codecs,
        submissions,
        tenant,
        SaveWeightsForSamplerRequest,
        "SaveWeightsForSampler",
        to_command,
    )


@router.post("/save_weights_external", **json_body_route(SaveWeightsExternalRequest))
async def save_weights_external(
    request: Request, submissions: Submissions, codecs: Codecs, tenant: Tenant
) -> dict[str, Any]:
    return await _submit_ordered(
        await body_chunks(request),
        codecs,
        submissions,
        tenant,
        SaveWeightsExternalRequest,
        "SaveWeightsExternal",
        SaveWeightsExternalRequest.to_command,
    )
