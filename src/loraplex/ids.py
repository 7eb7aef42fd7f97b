"""Random ids for requests and futures, cut from random bytes fetched a page at a time.

`uuid.uuid4()` and `os.urandom` make one system call per id, and a system call lets go of the GIL:
on the request path the thread then waits to get it back from the engine thread, up to the interpreter's
switch interval (5 ms), once per id (docs/BENCHMARKS.md, sixth session). These ids come from the same
kernel source, read 4 KiB at a time: as unpredictable, and one system call per 256 ids of 16 bytes.
"""

from __future__ import annotations

import os
import threading

_PAGE_BYTES = 4096
_lock = threading.Lock()
_page = b""
_used = 0


def random_hex(num_bytes: int = 16) -> str:
    """`num_bytes` random bytes (at most a page) as lower-case hex."""
    global _page, _used
    with _lock:
        if _used + num_bytes > len(_page):
            _page, _used = os.urandom(_PAGE_BYTES), 0
        chunk = _page[_used : _used + num_bytes]
        _used += num_bytes
    return chunk.hex()


def _forget_page() -> None:
    """A forked child must not hand out the ids left on its parent's page."""
    global _page, _used
    _page, _used = b"", 0


os.register_at_fork(after_in_child=_forget_page)
