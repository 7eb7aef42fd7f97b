"""Work that ends when its HTTP client goes away: a /v1 generation runs until it is done or its client
disconnects, whichever comes first, so nothing samples for a reader who has left (cancelling the work
cancels its sampling: runtime/serving/inference.py). No tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")

# The status logged for a request whose client closed the connection before the answer (nginx's 499); it
# is never sent, as nobody is left to read it.
CLIENT_CLOSED_REQUEST = 499


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None if the client disconnected first: `work` is then cancelled, and this
    returns once it has stopped. `receive` is the request's ASGI channel, its body already read."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine is cancelled itself: the work must not outlive it
        watch.cancel()
        task.cancel()  # nothing if it is done
    if task.done():
        return task.result()
    await asyncio.wait((task,))
    return None


async def _disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the body is read: what comes next is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
