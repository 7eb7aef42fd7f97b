"""The collector's view of a long-running process's heap.

A full (generation-2) collection walks every tracked object while holding the GIL. After start-up a
server holds some 300k of them (torch, the model, FastAPI, the store): one full collection took 130 ms on
the built-in model (2-core host), 0.3-0.6 s in a test process, and held the API's event loop and the
engine's thread for all of it. Objects that start-up leaves alive stay alive for the process's life, so
they are moved out of the collector's sight once: later collections walk only what came after.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect start-up's garbage, then exempt every object still alive from later collections
    (`gc.unfreeze()` undoes it)."""
    gc.collect()
    gc.freeze()
