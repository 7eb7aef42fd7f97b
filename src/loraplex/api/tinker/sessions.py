"""Session routes of RestClient over the caller's own sessions: list, get, search (`search_sessions`) and the
trace export (`export_session_trace`, `tinker session export-trace`).

The trace export answers at once with `ready` and a signed URL (runtime/control/downloads.py) of this server's
`/session_traces/{token}/{session_id}.json`, which needs no API key, as the SDK and CLI fetch it with a
plain GET; the trace is built from the database as it is downloaded. Handlers that read the database are
plain `def`: FastAPI runs them on its worker threads, never on the event loop.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import AwareDatetime, Field

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.deps import Downloads, Runs, Search, Traces
from loraplex.api.tinker.unsupported import unsupported
from loraplex.api.tinker.wire import WireModel
from loraplex.runtime.control.downloads import URL_LIFETIME_S, DownloadDeniedError
from loraplex.runtime.control.session_search import (
    SessionPage,
    SessionQuery,
    SessionStatus,
    SessionSummary,
    StatusFilter,
)

router = APIRouter(route_class=PooledJsonRoute)


@router.get("/sessions")
def list_sessions(
    catalog: Runs,
    tenant: Tenant,
    limit: int = Query(20, ge=1, le=1000),
    offset: Annotated[int, Query(ge=0, lt=2**63)] = 0,
) -> dict[str, Any]:
    return {"sessions": catalog.session_ids(tenant, limit, offset)}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, catalog: Runs, tenant: Tenant) -> dict[str, Any]:
    view = catalog.session(tenant, session_id)
    return {
        "training_run_ids": view.training_run_ids,
        "sampler_ids": view.sampler_ids,
        "user_metadata": {str(k): str(v) for k, v in view.user_metadata.items()} or None,
    }


# --- search: the body of tinker.types.SessionSearchRequest, its answer a SessionSearchResponse
class SearchOwner(WireModel):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = Field(None, min_length=1, max_length=10)


class StatusQuery(WireModel):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1)

    def to_filter(self) -> StatusFilter:
        return StatusFilter(self.type, None if self.reasons is None else frozenset(self.reasons))


class SearchCursor(WireModel):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(WireModel):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(None, min_length=1)
    owner: SearchOwner = Field(default_factory=SearchOwner)
    statuses: list[StatusQuery] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursor | None = None

    def to_query(self) -> SessionQuery:
        """The runtime's query; projects are refused, as this server has none."""
        if self.project_ids is not None:
            raise unsupported("projects", "project_ids of POST /api/v1/sessions/search")
        return SessionQuery(
            session_id=self.session_id,
            display_name=self.display_name,
            user_metadata=self.user_metadata,
            owners=frozenset(self.owner.owner_urns or ()) if self.owner.type == "user" else None,
            statuses=None if self.statuses is None else tuple(s.to_filter() for s in self.statuses),
            limit=self.limit,
            after=None if self.cursor is None else (self.cursor.last_created_at, self.cursor.last_session_id),
        )


@router.post("/sessions/search")
def search_sessions(body: SessionSearchRequest, search: Search, tenant: Tenant) -> dict[str, Any]:
    return _page_json(search.search(tenant, body.to_query()))


def _page_json(page: SessionPage) -> dict[str, Any]:
    after = page.next_after
    cursor = None if after is None else {"last_created_at": after[0].isoformat(), "last_session_id": after[1]}
    return {"sessions": [_summary_json(s) for s in page.sessions], "next_cursor": cursor}


def _summary_json(summary: SessionSummary) -> dict[str, Any]:
    return {
        "session_id": summary.session_id,
        "created_at": summary.created_at.isoformat(),
        "owner": summary.owner,
        "project_id": "",  # required by the SDK's SessionSummary; this server has no projects
        "status": _status_json(summary.status),
        "checkpoints_count": summary.checkpoints_count,
        "display_name": summary.display_name,
        "user_metadata": summary.user_metadata or None,
        "checkpoint_storage_bytes": summary.checkpoint_bytes,
    }


def _status_json(status: SessionStatus | None) -> dict[str, Any] | None:
    if status is None:
        return None
    if status.reason is None:
        return {"type": status.kind}
    return {"type": status.kind, "reason": {"type": status.reason}, "detail": None}


# --- trace export
@router.get("/sessions/{session_id}/trace_export")
def export_trace(
    session_id: str, request: Request, catalog: Runs, downloads: Downloads, tenant: Tenant
) -> dict[str, Any]:
    catalog.session(tenant, session_id)  # another tenant's session: 404
    expires = int(time.time()) + URL_LIFETIME_S
    file = _trace_file(session_id)
    token = downloads.sign(tenant, session_id, file, expires)
    url = f"{str(request.base_url).rstrip('/')}/api/v1/session_traces/{token}/{file}"
    return {"status": "ready", "url": url, "error": None}


@router.get("/session_traces/{token}/{file}")
def download_trace(token: str, file: str, downloads: Downloads, traces: Traces) -> StreamingResponse:
    grant = downloads.verify(token, file)
    if file != _trace_file(grant.subject):  # a token signed for a checkpoint's file
        raise DownloadDeniedError("this download token is for another file")
    pieces = traces.trace(grant.tenant, grant.subject)
    return StreamingResponse(pieces, media_type="application/json")


def _trace_file(session_id: str) -> str:
    return f"{session_id}.json"
