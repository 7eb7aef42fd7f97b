"""A session's timeline (RestClient.export_session_trace, `tinker session export-trace`) in the Trace Event
Format (JSON), which ui.perfetto.dev and chrome://tracing open.

Each training run and sampler of the session is a process; each request of it whose future the database
still holds (finished ones are kept --future-retention-s) is a slice from its submission to its completion,
named by its kind (CreateModel, ForwardBackward, OptimStep, Sample, ...) and carrying its request id,
seq_id, status and, when it failed, its error. Requests that overlap go on separate lanes (threads) of
their process, so slices on one lane never overlap. No HTTP, no tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from loraplex.runtime.control.catalog import Catalog
from loraplex.runtime.control.store import RequestSpan, Store
from loraplex.timestamps import utcnow


class SessionTraces:
    """Builds the traces of sessions from what the store recorded."""

    def __init__(self, store: Store, catalog: Catalog) -> None:
        self._store, self._catalog = store, catalog

    def trace(self, tenant: str, session_id: str) -> Iterator[str]:
        """The trace of one of the tenant's sessions, as pieces of one JSON document, one run or sampler at
        a time (a long session's trace is never held whole). NotFoundError now, not once it is read, for
        a session that is not the tenant's."""
        session = self._catalog.session(tenant, session_id)
        members = session.training_run_ids + session.sampler_ids
        return self._pieces(tenant, members, utcnow())

    def _pieces(self, tenant: str, members: list[str], now: datetime) -> Iterator[str]:
        yield '{"displayTimeUnit": "ms", "traceEvents": ['
        for pid, member in enumerate(members, start=1):
            events = _member_events(pid, member, self._store.request_spans(tenant, member), now)
            yield ("" if pid == 1 else ", ") + ", ".join(json.dumps(event) for event in events)
        yield "]}\n"


def _member_events(pid: int, member: str, spans: list[RequestSpan], now: datetime) -> list[dict[str, Any]]:
    """A process named `member` with one complete ("X") event per request, first-fit onto lanes.

    Semantics: spans come oldest first; each goes on the lowest lane whose last slice ended by its start,
    else on a new lane, which is the fewest lanes that keep each lane's slices apart."""
    events = [_metadata("process_name", pid, 0, member), _metadata("process_sort_index", pid, 0, pid)]
    lane_ends: list[datetime] = []
    for span in spans:
        end = max(span.completed_at or now, span.created_at)  # a pending request runs until the export
        lane = next((i for i, free_at in enumerate(lane_ends) if free_at <= span.created_at), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(end)
            events.append(_metadata("thread_name", pid, lane + 1, f"lane {lane + 1}"))
        lane_ends[lane] = end
        args: dict[str, Any] = {"request_id": span.id, "seq_id": span.seq_id, "status": span.status}
        if span.error is not None:
            args |= {"error": span.error, "category": span.category}
        events.append(
            {
                "ph": "X",
                "name": span.request_type,
                "cat": "request",
                "pid": pid,
                "tid": lane + 1,
                "ts": _microseconds(span.created_at),
                "dur": _microseconds(end) - _microseconds(span.created_at),
                "args": args,
            }
        )
    return events


def _metadata(name: str, pid: int, tid: int, value: str | int) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {key: value}}


def _microseconds(when: datetime) -> int:
    """Microseconds since the Unix epoch: the format's `ts` unit."""
    return round(when.timestamp() * 1_000_000)
