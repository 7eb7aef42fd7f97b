"""JSON bodies FastAPI reads for a route, parsed on the codec pool when they are large: FastAPI parses a
declared body on the event loop, and an 8 MiB body of junk held it 250-450 ms (a create_session anyone may
send). `PooledJsonRoute` is the route class of every router whose routes declare a JSON body; what the
body then goes through on the loop is pydantic's validation of the parsed value, bounded by each model's
fields and the operator's limits. Routes that read a body themselves decode it on the pool too
(api/tinker/training.py, sampling.py). No tensors, no SQL.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from loraplex.api.tinker.codec_pool import INLINE_JSON_BODY_BYTES, CodecPool


class PooledJsonRequest(Request):
    """A request whose `json()` runs on the codec pool of its app when the body is large."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            codecs: CodecPool = self.scope["app"].state.codecs
            self._json = await codecs.run(len(body) < INLINE_JSON_BODY_BYTES, json.loads, body)
        return self._json


class PooledJsonRoute(APIRoute):
    """A route whose declared JSON body is parsed as `PooledJsonRequest` parses it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def pooled(request: Request) -> Response:
            return await handler(PooledJsonRequest(request.scope, request.receive))

        return pooled
