"""SDK routes this server does not implement: each answers a clear, non-retryable 400 naming the feature,
never a bare 404 or 405 (the SDK would report those as a missing resource or retry them).

`UNSUPPORTED` is the one table of them; a feature that gets implemented leaves it. Any other path under
/api/v1 gets the same kind of answer from the catch-all, registered after every real route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.errors import UserError

# (methods, path, the feature as a user would name it)
UNSUPPORTED: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (
        ("GET",),
        "/training_runs/{run_id}/checkpoints/{kind}/{name}/archive",
        "checkpoint archives (SDK <= 0.32)",
    ),
    (("PUT",), "/sessions/{session_id}/project", "projects"),
    (("GET", "DELETE"), "/auth/apikey/me", "API key details (tinker auth login/logout)"),
    (("POST",), "/auth/token", "JWT authentication"),
    (("GET",), "/audit", "audit logs"),
    (("GET",), "/billing/usage/events", "billing"),
    (("POST",), "/copy_weights", "copying weights between projects"),
    (("POST",), "/unload_model", "unload_model (sessions end with /sessions/{id}/finish)"),
    # Behind client/config flags this server leaves off; named in case a client turns them on.
    (("POST",), "/retrieve_futures", "retrieve_futures (sample_use_retrieve_futures)"),
    (("POST",), "/cancel_future", "cancel_future (sample_cancel_enabled)"),
    (("POST",), "/join_sampling_session", "join_sampling_session"),
    (("POST",), "/create_custom_loss", "server-side custom losses (create_custom_loss)"),
)


class UnsupportedError(UserError):
    """A request for something this server does not do (400; the SDK does not retry it)."""


def unsupported(feature: str, where: str) -> UnsupportedError:
    """The refusal of `feature`, asked for by `where` (a route, or a field of one)."""
    return UnsupportedError(f"{feature} is not supported by this server ({where})")


def _refuse(feature: str | None) -> Callable[[Request], Awaitable[None]]:
    """An endpoint that refuses `feature` (None: whatever the request asked for)."""

    async def refuse(request: Request) -> None:
        what = f"{request.method} {request.url.path}"
        if feature is None:
            raise UnsupportedError(
                f"{what} is not a route of this server; loraplex serves the Tinker API of the tinker SDK "
                "0.38.0 (training, sampling, checkpoints)"
            )
        raise unsupported(feature, what)

    return refuse


router = APIRouter(route_class=PooledJsonRoute)
for _methods, _path, _feature in UNSUPPORTED:
    router.add_api_route(_path, _refuse(_feature), methods=list(_methods), include_in_schema=False)

# Registered after every other router: what no route serves, including a known path with another method.
fallback = APIRouter(route_class=PooledJsonRoute)
fallback.add_api_route(
    "/{path:path}", _refuse(None), methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
