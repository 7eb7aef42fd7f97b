"""HTTP status codes of loraplex errors: the one mapping the Tinker routes and the /v1 routes share."""

from __future__ import annotations

from loraplex.errors import CapacityError, LoraplexError


def status_of(error: LoraplexError) -> int:
    """HTTP status of an error: its own status_code if it has one (a UserError's 4xx, sampling
    backpressure's 429, the only 429); else 503 for capacity (retried) and 500 for the rest."""
    return getattr(error, "status_code", 503 if isinstance(error, CapacityError) else 500)
