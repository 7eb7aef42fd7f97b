"""Rendering the console's pages: Jinja2 templates (autoescaped) over the runtime's console views.

Each page is a body template under templates/; `render_page` wraps it in base.html (navigation, the
signed-in viewer, the script that refreshes the live part), `render_fragment` returns the body alone,
which is what the page's script fetches every few seconds. No tensors, no SQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from loraplex.api.console.charts import compared_chart, line_chart
from loraplex.runtime.control.keys import Viewer

HERE = Path(__file__).parent
# Pages of the navigation: (path under /console, title).
NAVIGATION = (("runs", "Runs"), ("samplers", "Samplers"), ("requests", "Requests"), ("server", "Server"))


def _bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _time(when: datetime | None) -> str:
    return "-" if when is None else when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _ttl(expires_at: datetime | None) -> str:
    if expires_at is None:
        return "never expires"
    left = (expires_at - datetime.now(UTC)).total_seconds()
    return "expired" if left <= 0 else f"expires in {_duration(left)}"


def _number(value: float) -> str:
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def _lead(text: str, chars: int = 160) -> str:
    """The start of `text` up to the last whole word within `chars`, with an ellipsis if cut."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    if not text[chars].isspace():  # the cut falls inside a word: leave that word out
        words = head.rsplit(None, 1)
        head = words[0] if len(words) == 2 else head  # a single word longer than `chars` has no better cut
    return head.rstrip() + " …"


_env = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(bytes=_bytes, time=_time, duration=_duration, ttl=_ttl, number=_number, lead=_lead)
_env.globals.update(line_chart=line_chart, compared_chart=compared_chart)


def render_fragment(template: str, **context: Any) -> str:
    """A page's body alone: what its script swaps in when it refreshes."""
    return _env.get_template(template).render(**context)


def render_page(
    template: str, title: str, section: str, viewer: Viewer, refresh_ms: int | None, **context: Any
) -> str:
    """A whole page: base.html around the body of `template`."""
    body = Markup(render_fragment(template, viewer=viewer, **context))
    return _env.get_template("base.html").render(
        title=title,
        section=section,
        viewer=viewer,
        navigation=NAVIGATION,
        refresh_ms=refresh_ms,
        body=body,
    )


def render_login(error: str | None = None) -> str:
    """The sign-in form."""
    return _env.get_template("login.html").render(error=error)
