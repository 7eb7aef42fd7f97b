"""The interleaved timer: order of calls, warm-up, and what its CPU probes record (no timings asserted)."""

from __future__ import annotations

import torch

from loraplex.bench.timing import time_interleaved


def test_configurations_run_interleaved_after_the_warmup_and_each_probe_counts_its_own_calls() -> None:
    calls: list[str] = []
    counter = {"ticks": 0.0}

    def run(name: str, ticks: float):
        def call() -> None:
            calls.append(name)
            counter["ticks"] += ticks

        return call

    timings = time_interleaved(
        {"a": run("a", 1.0), "b": run("b", 3.0)},
        rounds=3,
        warmup=1,
        device=torch.device("cpu"),
        cpu_probes={"ticks": lambda: counter["ticks"]},
    )

    assert calls == ["a", "b"] * 4
    assert timings.cpu["ticks"] == {"a": [1.0] * 3, "b": [3.0] * 3}
    assert set(timings.cpu) == {"process", "ticks"}
    assert all(len(v) == 3 and min(v) >= 0 for v in timings.cpu["process"].values())
    assert all(len(v) == 3 for v in timings.seconds.values())
