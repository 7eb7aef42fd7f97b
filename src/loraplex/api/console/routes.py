"""Routes of the web console under /console: sign-in and sign-out, the pages, and their two static files.

Signing in posts an API key once, in a form body (never in a URL), and trades it for a random token
(runtime/control/keys.py ConsoleLogins) that the browser keeps in an HttpOnly, SameSite=Strict cookie
scoped to /console. A page without a valid cookie redirects to the sign-in form; its live refresh
(`?fragment=1`) answers 401. Each page's data comes from the runtime's Console
(runtime/observability/console.py) and is read and rendered on a worker thread, so the event loop never
waits on the database. Pages carry a strict Content-Security-Policy: script and styles from
/console/static only, nothing inline. No tensors, no SQL.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from loraplex.api.console.pages import HERE, render_fragment, render_login, render_page
from loraplex.errors import AuthenticationError, NotFoundError, UserError
from loraplex.runtime.control.keys import ConsoleLogins, KeyReadLimitError, Viewer
from loraplex.runtime.observability.console import (
    MAX_COMPARED,
    PAGE_ROWS,
    REQUEST_STATUSES,
    REQUEST_TYPES,
    Console,
    RequestFilter,
)

router = APIRouter(prefix="/console")

COOKIE = "loraplex_console"
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # pages hold signed download URLs
    "Cache-Control": "no-store",
}
_STATIC_TYPES = {"console.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}
_STATIC = {name: (HERE / "static" / name).read_bytes() for name in _STATIC_TYPES}
_MAX_KEY_FORM_BYTES = 4096

Load = Callable[[Console, Viewer], dict[str, Any]]


@router.get("", include_in_schema=False)
@router.get("/", include_in_schema=False)
async def home() -> RedirectResponse:
    return RedirectResponse("/console/runs", status_code=303)


@router.get("/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    if name not in _STATIC:
        return Response(status_code=404)
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    return Response(_STATIC[name], media_type=_STATIC_TYPES[name], headers=headers)


@router.get("/login", include_in_schema=False)
async def login_form() -> HTMLResponse:
    return HTMLResponse(render_login(), headers=_HEADERS)


@router.post("/login", include_in_schema=False)
async def login(request: Request) -> Response:
    body = await request.body()
    fields = parse_qs(body[:_MAX_KEY_FORM_BYTES].decode(errors="replace")) if body else {}
    key = (fields.get("key") or [""])[0].strip()
    logins: ConsoleLogins = request.app.state.logins
    try:
        token, _viewer = await run_in_threadpool(logins.sign_in, key)
    except AuthenticationError as error:
        return HTMLResponse(render_login(str(error)), status_code=401, headers=_HEADERS)
    except KeyReadLimitError as error:  # too many unknown keys being tried: this one may be valid
        return HTMLResponse(render_login(str(error)), status_code=503, headers=_HEADERS)
    response = RedirectResponse("/console/runs", status_code=303, headers=_HEADERS)
    response.set_cookie(
        COOKIE,
        token,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout", include_in_schema=False)
async def logout(request: Request) -> Response:
    logins: ConsoleLogins = request.app.state.logins
    logins.sign_out(request.cookies.get(COOKIE))
    response = RedirectResponse("/console/login", status_code=303, headers=_HEADERS)
    response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
    return response


@router.get("/runs", include_in_schema=False)
async def runs(request: Request, offset: int = 0) -> Response:
    offset = max(0, min(offset, 2**62))

    def load(console: Console, viewer: Viewer) -> dict[str, Any]:
        found, total = console.runs(viewer, PAGE_ROWS, offset)
        return {"runs": found, "total": total, "offset": offset, "limit": PAGE_ROWS, "most": MAX_COMPARED}

    return await _page(request, "runs.html", "Runs", "runs", 3000, load)


@router.get("/runs/{run_id}", include_in_schema=False)
async def run(request: Request, run_id: str) -> Response:
    def load(console: Console, viewer: Viewer) -> dict[str, Any]:
        return {"detail": console.run(viewer, run_id)}

    return await _page(request, "run.html", run_id, "runs", 3000, load)


@router.get("/compare", include_in_schema=False)
async def compare(request: Request) -> Response:
    """Runs' metrics overlaid, chart by chart: ?run=A&run=B, optionally smoothing=W (in [0, 1)) and
    scale=log."""
    params = request.query_params

    def load(console: Console, viewer: Viewer) -> dict[str, Any]:
        smoothing = _smoothing(params.get("smoothing", ""))
        scale = params.get("scale", "linear")
        if scale not in ("linear", "log"):
            raise UserError(f"scale {scale!r} is not one of linear, log")
        comparison = console.compare(viewer, params.getlist("run"))
        return {"comparison": comparison, "smoothing": smoothing, "is_log": scale == "log"}

    return await _page(request, "compare.html", "Compare runs", "runs", None, load)


@router.get("/samplers", include_in_schema=False)
async def samplers(request: Request) -> Response:
    def load(console: Console, viewer: Viewer) -> dict[str, Any]:
        return {"samplers": console.samplers(viewer)}

    return await _page(request, "samplers.html", "Samplers", "samplers", 5000, load)


@router.get("/requests", include_in_schema=False)
async def requests(request: Request) -> Response:
    params = request.query_params
    chosen = RequestFilter(
        run=params.get("run") or None,
        request_type=params.get("type") or None,
        status=params.get("status") or None,
    )

    def load(console: Console, viewer: Viewer) -> dict[str, Any]:
        found = console.requests(viewer, chosen)
        return {"requests": found, "chosen": chosen, "types": REQUEST_TYPES, "statuses": REQUEST_STATUSES}

    return await _page(request, "requests.html", "Requests", "requests", 3000, load)


@router.get("/server", include_in_schema=False)
async def server(request: Request) -> Response:
    def load(console: Console, viewer: Viewer) -> dict[str, Any]:
        return {"status": console.server(viewer), "info": console.info}

    return await _page(request, "server.html", "Server", "server", 2000, load)


async def _page(
    request: Request, template: str, title: str, section: str, refresh_ms: int | None, load: Load
) -> Response:
    """Check the sign-in, load and render a page (or, with ?fragment=1, its body) on a worker thread."""
    logins: ConsoleLogins = request.app.state.logins
    console: Console = request.app.state.console
    token = request.cookies.get(COOKIE)
    fragment = request.query_params.get("fragment") == "1"

    def answer() -> tuple[int, str] | None:
        try:
            viewer = logins.viewer(token)
        except AuthenticationError:
            return None
        try:
            context = load(console, viewer)
        except NotFoundError as error:
            title_, status = "Not found", 404
            template_, context = "refused.html", {"heading": title_, "message": str(error)}
        except UserError as error:  # a bad query parameter: the page says which; nothing was read
            title_, status = "Cannot show that", 400
            template_, context = "refused.html", {"heading": title_, "message": str(error)}
        else:
            template_, title_, status = template, title, 200
        if fragment:
            return status, render_fragment(template_, viewer=viewer, **context)
        return status, render_page(template_, title_, section, viewer, refresh_ms, **context)

    result = await run_in_threadpool(answer)
    if result is None:
        if fragment:
            return Response("sign in again", status_code=401, headers=_HEADERS)
        return RedirectResponse("/console/login", status_code=303, headers=_HEADERS)
    status, html = result
    return HTMLResponse(html, status_code=status, headers=_HEADERS)


def _smoothing(text: str) -> float:
    """The compare page's smoothing weight: a number in [0, 1); empty is 0 (none)."""
    if not text.strip():
        return 0.0
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not 0.0 <= weight < 1.0:  # also refuses nan
        raise UserError(f"smoothing {text!r}: a number from 0 (none) up to, not including, 1")
    return weight
