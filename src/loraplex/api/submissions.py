"""The one thread that carries training submissions from the event loop to the runtime.

A submission writes its future's row before it is answered, so it must not run on the event loop. It
runs on one thread of its own rather than on FastAPI's worker pool (anyio, up to 40 threads):
- the pool's hop costs more Python than the submission's own write, and spreads the submissions of one
  burst (the SDK sends a step's forward_backwards back to back) over as many threads, each woken on
  cores the engine's compute threads are using (docs/BENCHMARKS.md, sixth session);
- SQLite takes one writer at a time anyway, and on PostgreSQL a submission's two statements take about a
  millisecond: one thread carries far more submissions than the engine can execute.
Submissions keep their arrival order, and a slow database holds them back no more than it would anyway:
each must be written before it is answered. No tensors, no SQL.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class SubmissionThread:
    """Runs blocking runtime calls one at a time on a thread of its own, for the event loop to await."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-submit")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the submission thread, in the caller's context (the request log's fields)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(context.run, fn, *args))

    def close(self) -> None:
        """Finish what was handed over, then stop the thread."""
        self._pool.shutdown(wait=True)
