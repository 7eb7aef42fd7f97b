"""Persistence of the control plane: tables (schema.py, made by migrations/), the Store (repository.py, over
the query classes future_rows.py and metric_rows.py on connection.py), and the result codec (results.py).
No tensors.
"""

from loraplex.runtime.control.store.future_rows import (
    Batch,
    FutureOutcome,
    RequestSpan,
    SamplerGoneError,
    SeqIdTakenError,
)
from loraplex.runtime.control.store.repository import Store

__all__ = ["Batch", "FutureOutcome", "RequestSpan", "SamplerGoneError", "SeqIdTakenError", "Store"]
