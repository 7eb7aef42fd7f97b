"""Persistence of the control plane: tables, the Store repository, and the result codec. No tensors."""

from loraplex.runtime.control.store.repository import FutureOutcome, RequestSpan, Store

__all__ = ["FutureOutcome", "RequestSpan", "Store"]
