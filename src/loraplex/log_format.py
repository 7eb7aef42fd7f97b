"""How the server's log lines look on stderr: readable text (the default) or one JSON object per line
(`loraplex serve --log-format json`), for every logger. A record's request fields (`REQUEST_FIELDS`, set
by the API's request log) are appended as `key=value` in text and become keys of their own in JSON.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

# The fields a request's log line carries (api/request_log.py), in the order text shows them.
REQUEST_FIELDS = (
    "request_id",
    "method",
    "route",
    "path",
    "status",
    "latency_ms",
    "tenant",
    "run_id",
    "seq_id",
    "sampler_id",
    "future_id",
)
# Fields a request line's text message already shows ("POST /api/v1/forward_backward 200 2.4 ms").
_IN_MESSAGE = frozenset({"method", "path", "status", "latency_ms"})
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`: the request fields a record has that its message does
    not show are appended."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [
            f"{k}={v}"
            for k in REQUEST_FIELDS
            if k not in _IN_MESSAGE and (v := record.__dict__.get(k)) is not None
        ]
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {' '.join(fields)}{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the request fields a
    record has, and `exception` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in REQUEST_FIELDS:
            if (value := record.__dict__.get(key)) is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_format: str, level: str) -> None:
    """Send every logger's records to stderr in `log_format` ("text" or "json"): loraplex's at `level` and
    above, other libraries' at INFO or `level`, whichever is higher (their debug output is not ours)."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    formatter = JsonFormatter() if log_format == "json" else TextFormatter()
    for handler in root.handlers:
        handler.setFormatter(formatter)
    threshold = logging.getLevelNamesMapping()[level.upper()]
    root.setLevel(max(threshold, logging.INFO))
    logging.getLogger("loraplex").setLevel(threshold)
