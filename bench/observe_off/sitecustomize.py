"""The "off" arm of the metrics and request-log A/B (docs/BENCHMARKS.md): with LORAPLEX_OBSERVE_OFF=1 and
this folder on PYTHONPATH, a `loraplex serve` started by `loraplex bench api` runs without the request
observer (no request metrics, no request log line) and with every Telemetry record call a no-op.

Usage (repo root), alternating the arms:
    .venv/bin/loraplex bench api --rounds 8 --json | tail -1
    LORAPLEX_OBSERVE_OFF=1 PYTHONPATH=bench/observe_off \
        .venv/bin/loraplex bench api --rounds 8 --json | tail -1
"""

import os

if os.environ.get("LORAPLEX_OBSERVE_OFF") == "1":
    import starlette.applications

    from loraplex.runtime.observability import telemetry

    _add_middleware = starlette.applications.Starlette.add_middleware

    def _without_observer(self, cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        if cls.__name__ != "RequestObserver":
            _add_middleware(self, cls, *args, **kwargs)

    starlette.applications.Starlette.add_middleware = _without_observer  # type: ignore[method-assign]
    for _name in [n for n in vars(telemetry.Telemetry) if n.startswith("record_")]:
        setattr(telemetry.Telemetry, _name, lambda self, *args, **kwargs: None)
