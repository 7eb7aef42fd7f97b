"""Admission limits of the HTTP layer: how large a body may be, counted as it streams in (a chunked body
without Content-Length is cut off too), and the per-request limits that wire validators and codecs check
before they allocate anything.

The limits come from ServerConfig. `BodyLimit`, an ASGI middleware around the whole app, puts them in
force for each request: FastAPI and the routes call the validators and codecs with no way to hand them
over. No tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import anyio.to_thread
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.config import ServerConfig

MIB = 1 << 20
# Protobuf bodies; every other route reads JSON.
FORWARD_PATHS = frozenset({"/api/v1/forward_backward", "/api/v1/forward"})
# JSON bodies that may be large: prompts, texts to tokenize and tokens to detokenize (and the SDK's
# telemetry batches, which this server never reads).
# Every other route's fields are bounded by the operator's limits, so its body is too (small_json_body_bytes):
# a JSON parse holds the GIL, even off the event loop, about 50 ms a MiB on a busy 2-core host.
LARGE_JSON_PATHS = frozenset(
    {
        "/api/v1/asample",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/tokenize",
        "/v1/detokenize",
        "/api/v1/telemetry",
    }
)
# JSON escapes a byte of text into at most 6 (\u0001); a body holds user_metadata and a display name, each
# bounded by --max-metadata-bytes, and fields of a few hundred bytes besides.
_ESCAPED_BYTES = 6
_SMALL_JSON_SLACK_BYTES = 64 * 1024
# Wire bytes per token of a forward(_backward) datum: its int32 id and its 1-D inputs (an int64 target,
# float32 weights, logprobs, advantages, masks), with room to spare.
_TOKEN_WIRE_BYTES = 64
# Wire bytes per cell of the 2-D (N, K) inputs, target_tokens and weights together: the SDK sends them as
# CSR only below half density (at most 14 bytes a cell); CSR at full density takes 28 (int64 value and
# column; float32 value, int64 column).
_TARGET_WIRE_BYTES = 32


@dataclass(frozen=True)
class RequestLimits:
    """The ServerConfig limits the API checks (each field means what the ServerConfig field of its name
    says; body sizes in bytes)."""

    max_tokens_per_datum: int
    max_tokens_per_request: int
    max_target_width: int
    max_json_body_bytes: int
    max_metadata_entries: int
    max_metadata_bytes: int
    max_stop_sequences: int
    max_stop_chars: int
    max_name_bytes: int
    max_queued_samples: int
    max_topk_prompt_logprobs: int  # bounds target_prompt_logprobs' width before its ids are decoded

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        """The limits `config` sets."""
        return cls(
            max_tokens_per_datum=config.max_tokens_per_datum,
            max_tokens_per_request=config.max_tokens_per_request,
            max_target_width=config.max_target_width,
            max_json_body_bytes=config.max_json_body_mib * MIB,
            max_metadata_entries=config.max_metadata_entries,
            max_metadata_bytes=config.max_metadata_bytes,
            max_stop_sequences=config.max_stop_sequences,
            max_stop_chars=config.max_stop_chars,
            max_name_bytes=config.max_name_bytes,
            max_queued_samples=config.max_queued_samples,
            max_topk_prompt_logprobs=config.max_topk_prompt_logprobs,
        )

    @property
    def max_forward_body_bytes(self) -> int:
        """Largest forward(_backward) body, also once decompressed: the heaviest datum the limits allow (the
        SDK sends a datum too big for its ~5 MB chunks alone), or a request of 1-D inputs at the request's
        token limit, plus 1 MiB of framing."""
        per_token = _TOKEN_WIRE_BYTES + _TARGET_WIRE_BYTES * self.max_target_width
        heaviest_datum = self.max_tokens_per_datum * per_token
        return max(heaviest_datum, self.max_tokens_per_request * _TOKEN_WIRE_BYTES) + MIB

    @property
    def max_small_json_body_bytes(self) -> int:
        """Largest JSON body of a route whose every field is bounded: its metadata and display name at
        their limits, escaped, and room for the rest (never above --max-json-body-mib)."""
        bounded = 2 * _ESCAPED_BYTES * self.max_metadata_bytes + _SMALL_JSON_SLACK_BYTES
        return min(bounded, self.max_json_body_bytes)

    @property
    def max_decoded_values(self) -> int:
        """Values all loss_fn_inputs tensors of one forward(_backward) request may declare together."""
        return self.max_tokens_per_request * self.max_target_width

    def body_limit(self, path: str) -> tuple[int, str]:
        """The byte limit of a route's body, and which flags set it."""
        if path in FORWARD_PATHS:
            return self.max_forward_body_bytes, "set by --max-tokens-per-datum and --max-target-width"
        if path in LARGE_JSON_PATHS:
            return self.max_json_body_bytes, f"--max-json-body-mib {self.max_json_body_bytes // MIB}"
        return self.max_small_json_body_bytes, (
            f"this route's fields are bounded: --max-metadata-bytes {self.max_metadata_bytes}"
        )


DEFAULT_LIMITS = RequestLimits.from_config(ServerConfig())
_in_force: ContextVar[RequestLimits] = ContextVar("request_limits", default=DEFAULT_LIMITS)


def current_limits() -> RequestLimits:
    """The limits of the request being handled (ServerConfig's defaults outside one)."""
    return _in_force.get()


@contextmanager
def limits_in_force(limits: RequestLimits) -> Iterator[None]:
    """Check everything inside the block against `limits`."""
    token = _in_force.set(limits)
    try:
        yield
    finally:
        _in_force.reset(token)


class BodyTooLargeError(HTTPException):
    """A request body over its route's limit (413, with the limit named). An HTTPException because
    FastAPI passes those through when they interrupt its reading of a body, and answers them as JSON."""

    def __init__(self, path: str, limit: int, why: str) -> None:
        detail = f"request body of {path} is over {limit} bytes, the limit of this server ({why})"
        super().__init__(status_code=413, detail=detail, headers={"x-should-retry": "false"})


# A refused body at least this large has its freed memory handed back to the system (BodyLimit).
RELEASE_AFTER_REFUSED_BYTES = 2**20


class BodyLimit:
    """ASGI middleware: puts `limits` in force for each request and refuses a body over its route's limit,
    at once when Content-Length says so, else as soon as the bytes received pass it. After a request of a
    large body that was refused (any answer of 400 or more), `release_memory` runs on a worker thread: the
    memory its body and decoded arrays took would otherwise stay with the process."""

    def __init__(self, app: ASGIApp, limits: RequestLimits, release_memory: Callable[[], object]) -> None:
        self.app = app
        self.limits = limits
        self.release_memory = release_memory

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, why = self.limits.body_limit(scope["path"])
        refusal = BodyTooLargeError(scope["path"], limit, why)
        received, is_started, status = 0, False, 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise refusal
            return message

        async def watched_send(message: Message) -> None:
            nonlocal is_started, status
            if message["type"] == "http.response.start":
                is_started, status = True, message["status"]
            await send(message)

        with limits_in_force(self.limits):
            try:
                if _content_length(scope) > limit:
                    raise refusal
                await self.app(scope, bounded_receive, watched_send)
            except BodyTooLargeError as error:  # raised where no exception handler turned it into a response
                if is_started:
                    raise
                body = {"detail": error.detail}
                await JSONResponse(body, error.status_code, error.headers)(scope, receive, send)
                status = error.status_code
        if status >= 400 and received >= RELEASE_AFTER_REFUSED_BYTES:
            await anyio.to_thread.run_sync(self.release_memory)


def _content_length(scope: Scope) -> int:
    """The declared body length (0 when absent or unreadable: the streamed count still applies)."""
    try:
        return int(Headers(scope=scope).get("content-length") or 0)
    except ValueError:
        return 0
