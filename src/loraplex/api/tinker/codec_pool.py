"""The codec pool: two threads that decode large request bodies (joining, zstd, protobuf, JSON, densifying)
and encode large results, so that none of that holds the event loop, which every request waits on (a
7.6 MiB forward_backward body held it 2.2 s).

Why threads of their own rather than
- the submission thread (submissions.py): it carries every tenant's submissions in arrival order, and a
  decode of seconds in front of them would hold them all;
- anyio's worker pool (up to 40 threads, which the database routes wait for): 40 large decodes at once
  would take 40 times the largest one's memory and every thread those routes need. Two threads bound
  both; a burst of large bodies queues here while small bodies (decoded inline) and other routes go on.

What the GIL still costs: a pool thread holds it in C calls, and the event loop's thread then waits. So
the codecs keep each C call short (proto_reader.py reads protobuf without copying, sparse.py densifies by
blocks, json_render.py renders in pieces): tests/api/test_loop_stalls.py measures the longest stall.
No tensors, no SQL.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import numpy as np
from starlette.requests import Request

from loraplex.api.tinker.proto_reader import Buffer
from loraplex.errors import ServerError
from loraplex.os_threads import name_os_thread

T = TypeVar("T")

CODEC = "lpx-codec"
_THREADS = 2

# Work below these sizes stays on the loop: it costs under about a millisecond there, measured on a
# shared 2-core host (a hop to a pool thread and back took ~150 µs): an SDK forward_backward body decodes
# at ~40 KiB/ms, a JSON body (asample's prompt) at 4-7 KiB/ms, a result's arrays encode to protobuf at
# 100-200 KiB/ms and to JSON at ~2 KiB/ms.
INLINE_PROTOBUF_BODY_BYTES = 32 * 1024
INLINE_JSON_BODY_BYTES = 4 * 1024
INLINE_PROTOBUF_RESULT_BYTES = 64 * 1024
INLINE_JSON_RESULT_BYTES = 2 * 1024


class CodecPool:
    """Runs codec work on two threads of its own, for the event loop to await."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(
            _THREADS, thread_name_prefix="loraplex-codec", initializer=name_os_thread, initargs=(CODEC,)
        )
        self._lock = threading.Lock()  # work is either handed over before close, and done, or refused
        self._closed = False

    async def run(self, is_small: bool, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: inline when `is_small` (its input or output is below its INLINE_ size), else on a pool
        thread, in the caller's context (the request limits in force, the request log's fields)."""
        if is_small:
            return fn(*args)
        job = partial(contextvars.copy_context().run, fn, *args)
        with self._lock:
            if self._closed:
                raise ServerError("the server is shutting down; send the request again once it is back")
            done = asyncio.get_running_loop().run_in_executor(self._executor, job)
        return await done

    def close(self) -> None:
        """Finish the work handed over, then stop the threads; work handed over later is refused."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True)


async def body_chunks(request: Request) -> list[bytes]:
    """The request body in the pieces it arrived in: joining them is codec work too."""
    return [chunk async for chunk in request.stream() if chunk]


def body_size(chunks: list[bytes]) -> int:
    """The bytes of a body in pieces."""
    return sum(len(chunk) for chunk in chunks)


def join_chunks(chunks: list[bytes]) -> Buffer:
    """One buffer of the pieces, copied into it piece by piece (one join would hold the GIL for the whole
    body)."""
    if len(chunks) <= 1:
        return chunks[0] if chunks else b""
    joined = np.empty(body_size(chunks), np.uint8)
    start = 0
    for chunk in chunks:
        joined[start : start + len(chunk)] = np.frombuffer(chunk, np.uint8)
        start += len(chunk)
    return memoryview(joined)
