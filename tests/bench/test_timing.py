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


def test_bench_api_reads_the_engine_threads_duty_cycle_from_its_probe() -> None:
    """The engine thread's seconds by state, as the server's probe reports them, become the duty cycle:
    engine ÷ (engine + durable + other), round by round (idle and held count for nothing)."""
    from loraplex.bench.api import ENGINE_THREAD_PROBE, _engine_thread_figures

    spent = dict.fromkeys(("engine", "durable", "held", "idle", "other"), 0.0)
    per_call = {"sdk": {"engine": 0.9, "durable": 0.06, "held": 0.5, "idle": 7.0, "other": 0.04}}

    def run(name: str):
        def call() -> None:
            for state, seconds in per_call.get(name, {}).items():
                spent[state] += seconds

        return call

    timings = time_interleaved(
        {"sdk": run("sdk"), "engine": run("engine")},
        rounds=3,
        warmup=1,
        device=torch.device("cpu"),
        cpu_probes={ENGINE_THREAD_PROBE: lambda: dict(spent)},
    )
    figures = _engine_thread_figures(timings)

    assert abs(figures["engine_duty_cycle"].median - 0.9) < 1e-9
    assert "engine_thread_idle_share" not in figures
    assert set(figures) == {"engine_duty_cycle"} | {
        f"engine_thread_{state}_share" for state in ("engine", "durable", "held", "other")
    }
