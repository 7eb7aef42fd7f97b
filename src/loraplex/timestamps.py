"""Wall-clock times as loraplex stores and shows them: timezone-aware UTC."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def as_utc(when: datetime) -> datetime:
    """SQLite returns naive datetimes; every time we store is UTC."""
    return when if when.tzinfo else when.replace(tzinfo=UTC)
