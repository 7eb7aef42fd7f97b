"""JSON response bodies rendered in pieces: the bytes Starlette's JSONResponse would send, but no json.dumps
call runs over more than about _PIECE_VALUES values, and a JsonList's items exist only a piece at a time.

Both for the event loop's sake, when a large result is rendered on the codec pool: the C encoder holds the
GIL for a whole call (2M floats took 1.7 s), and so does the garbage collector's full pass, which hundreds
of thousands of live Python lists set off again and again (400-600 ms pauses while a top-k result was
built whole as lists of [id, logprob] pairs).
No tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Values per json.dumps call: a few milliseconds of holding the GIL.
_PIECE_VALUES = 4096


@dataclass(frozen=True)
class JsonList:
    """A JSON list made when it is rendered: `pieces()` yields the JSON text of its items, a run of them
    at a time, comma-separated (so that no Python object of an item outlives its piece)."""

    pieces: Callable[[], Iterator[str]]


def render_json(value: Any) -> bytes:
    """`JSONResponse(value).body`, rendered a piece at a time (a JsonList as the list of its items)."""
    parts: list[str] = []
    _render(value, parts)
    return "".join(parts).encode("utf-8")


def dumps(value: Any) -> str:
    """Starlette's JSONResponse.render, before its encoding to UTF-8."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _size(value: Any) -> int:
    """About how many values `value` holds: a list's first item stands for the others (an estimate only
    sizes the pieces; the rendering is exact whatever the list holds)."""
    if isinstance(value, JsonList):
        return _PIECE_VALUES + 1  # rendered piece by piece, whatever it holds
    if isinstance(value, dict):
        return 1 + sum(_size(item) for item in value.values())
    if isinstance(value, list | tuple):
        return 1 + (len(value) * _size(value[0]) if value else 0)
    return 1


def _render(value: Any, parts: list[str]) -> None:
    if isinstance(value, JsonList):
        parts.append("[" + ",".join(piece for piece in value.pieces() if piece) + "]")
    elif _size(value) <= _PIECE_VALUES:
        parts.append(dumps(value))
    elif isinstance(value, dict) and all(isinstance(key, str) for key in value):
        for index, (key, item) in enumerate(value.items()):
            parts.append(("," if index else "{") + dumps(key) + ":")
            _render(item, parts)
        parts.append("}")
    elif isinstance(value, list | tuple):
        step = max(1, _PIECE_VALUES // _size(value[0]))
        for start in range(0, len(value), step):
            parts.append("," if start else "[")
            _render_items(value[start : start + step], parts)
        parts.append("]")
    else:  # a dict with keys that are not text: json.dumps converts them its own way
        parts.append(dumps(value))


def _render_items(items: list[Any] | tuple[Any, ...], parts: list[str]) -> None:
    """A list's items, comma-separated: in one call, or one by one when one of them is large (or holds a
    JsonList) though the first was not."""
    if len(items) > 1:
        try:
            parts.append(dumps(items)[1:-1])
            return
        except TypeError:
            pass
    for index, item in enumerate(items):
        if index:
            parts.append(",")
        _render(item, parts)
