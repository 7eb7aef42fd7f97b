"""What the request observer (request metrics + one log line) costs per request, and what each Telemetry
call costs, in CPU time: a trivial ASGI app called bare and wrapped, interleaved, in one process.

Usage (repo root): PYTHONPATH=. .venv/bin/python bench/ab_observability.py, with --log-format text|json
and --log-level info|warning (at warning no request line is written: the figure is the metrics alone).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from tests.fakes import FakeEngine

from loraplex.api.metrics import Metrics
from loraplex.api.request_log import RequestObserver
from loraplex.config import ServerConfig
from loraplex.engine.interface import EngineUsage
from loraplex.log_format import configure_logging
from loraplex.runtime.control.service import TrainingService
from loraplex.runtime.observability.telemetry import Telemetry

_SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/api/v1/forward_backward",
    "headers": [],
    "root_path": "",
}


class _Route:
    path = "/api/v1/forward_backward"


async def _app(scope: dict, receive: Any, send: Any) -> None:
    scope["route"] = _Route()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": b"{}"})


async def _receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: dict) -> None:
    pass


def _request_cpu_us(app: Any, n: int) -> float:
    async def loop() -> None:
        for _ in range(n):
            await app(dict(_SCOPE), _receive, _send)

    start = time.process_time()
    asyncio.run(loop())
    return (time.process_time() - start) / n * 1e6


def _call_cpu_ns(call: Callable[[], object], n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        call()
    return (time.process_time() - start) / n * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--log-level", choices=("info", "warning"), default="info")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        log_file = open(Path(scratch) / "server.log", "w")  # noqa: SIM115 (closed with the directory)
        logging.getLogger().handlers[:] = [logging.StreamHandler(log_file)]
        configure_logging(args.log_format, args.log_level)
        service = TrainingService.open(FakeEngine(), ServerConfig(data_dir=Path(scratch) / "data"))
        observed = RequestObserver(_app, Metrics(service))
        bare, wrapped = [], []
        for _ in range(args.rounds):
            bare.append(_request_cpu_us(_app, 20000))
            wrapped.append(_request_cpu_us(observed, 20000))
        costs = [w - b for w, b in zip(wrapped, bare, strict=True)]
        rounds = ", ".join(f"{c:.1f}" for c in costs)
        arm = f"log {args.log_format} at {args.log_level}"
        print(f"request observer, {arm}: {median(costs):.1f} us CPU per request (rounds: {rounds})")
        telemetry = Telemetry()
        calls: dict[str, Callable[[], object]] = {
            "record_pass": lambda: telemetry.record_pass(256, 8, 8, 1, 0.25),
            "record_optim_step": lambda: telemetry.record_optim_step(8, 0.05),
            "record_sampler_step": lambda: telemetry.record_sampler_step(0.01, EngineUsage(sampled_tokens=8)),
            "record_db_call": lambda: telemetry.record_db_call("add_future", 0.0001),
            "record_outcomes": lambda: telemetry.record_outcomes(8, {}),
        }
        for name, call in calls.items():
            cost_ns = median(_call_cpu_ns(call, 100000) for _ in range(5))
            print(f"Telemetry.{name}: {cost_ns:.0f} ns CPU per call")
        snapshot_us = median(_call_cpu_ns(telemetry.snapshot, 2000) for _ in range(5)) / 1000
        print(f"Telemetry.snapshot: {snapshot_us:.1f} us CPU per call")
        log_file.close()


if __name__ == "__main__":
    main()
