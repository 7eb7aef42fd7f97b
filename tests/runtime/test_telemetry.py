"""Telemetry: counters in its prometheus_client registry, windows and snapshots, on a fake clock; and the
service feeding it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from loraplex.config import ServerConfig
from loraplex.engine.interface import EngineUsage, ParameterBytes
from loraplex.engine.types import AdamParams
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.core.commands import OptimStep
from loraplex.runtime.observability.telemetry import QUEUE_KINDS, Occupancy, Telemetry
from tests.fakes import FakeEngine
from tests.runtime.conftest import create_run, held, result_of, sft_pass


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_train_rate_is_tokens_over_the_recent_window(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock, window_s=10)
    clock.now += 20.0
    telemetry.record_pass(tokens=600, requests=2, runs=2, tenants=1, duration_s=0.1)
    clock.now += 0.5  # 600 tokens in the window's 10 whole seconds (9 before this one, half of this one)
    assert telemetry.snapshot().train_tokens_per_s == pytest.approx(600 / 9.5)
    clock.now += 30.0  # the pass left the window
    assert telemetry.snapshot().train_tokens_per_s == 0.0


def test_a_young_server_divides_by_its_uptime(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock, window_s=10)
    clock.now += 2.0
    telemetry.record_pass(tokens=100, requests=1, runs=1, tenants=1, duration_s=0.05)
    assert telemetry.snapshot().train_tokens_per_s == pytest.approx(50.0)


def test_decode_tokens_come_from_the_engine_counters(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock, window_s=10)
    clock.now += 10.5
    telemetry.record_sampler_step(0.004, EngineUsage(prefill_tokens=30, sampled_tokens=4, sequences=4))
    telemetry.record_sampler_step(0.002, EngineUsage(prefill_tokens=30, sampled_tokens=8, sequences=4))
    telemetry.record_sampler_step(0.002, EngineUsage(prefill_tokens=30, sampled_tokens=11, sequences=3))
    snapshot = telemetry.snapshot()
    assert snapshot.totals.decode_tokens == 11
    assert snapshot.totals.prefill_tokens == 30
    assert snapshot.totals.sampler_steps == 3
    assert snapshot.decode_tokens_per_s == pytest.approx(11 / 9.5)  # 9 whole seconds and half of this one
    assert snapshot.sampler_step_duration.count == 3
    assert snapshot.sampler_step_duration.sum == pytest.approx(0.008)
    assert snapshot.kv_cache.sequences == 3


def test_recent_passes_are_bounded_and_the_last_is_the_newest(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock)
    for i in range(40):
        clock.now += 1.0
        telemetry.record_pass(tokens=i, requests=1, runs=1, tenants=1 + i % 3, duration_s=0.01)
    snapshot = telemetry.snapshot()
    assert len(snapshot.recent_passes) == 32
    assert [p.tokens for p in snapshot.recent_passes] == list(range(8, 40))
    assert snapshot.last_pass is not None
    assert (snapshot.last_pass.tokens, snapshot.last_pass.tenants, snapshot.last_pass.at_s) == (39, 1, 40.0)
    assert snapshot.totals.passes == 40
    assert snapshot.totals.pass_tokens == sum(range(40))


def test_histograms_put_each_observation_in_the_first_bucket_that_holds_it(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock)
    for duration_s in (0.004, 0.005, 0.3, 100.0):  # bounds ... 0.005, 0.01 ... 0.25, 0.5 ... 30
        telemetry.record_pass(tokens=1, requests=1, runs=1, tenants=1, duration_s=duration_s)
    histogram = telemetry.snapshot().pass_duration
    by_bound = dict(zip((*histogram.bounds, float("inf")), histogram.counts, strict=True))
    assert by_bound[0.005] == 2  # le is inclusive
    assert by_bound[0.5] == 1
    assert by_bound[float("inf")] == 1
    assert histogram.count == 4


def test_outcomes_and_database_calls_are_counted(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock)
    telemetry.record_outcomes(3, {"user": 1})
    telemetry.record_outcomes(2, {"user": 1, "server": 1})
    telemetry.record_db_call("add_futures", 0.0002)
    telemetry.record_db_call("add_futures", 0.0004)
    snapshot = telemetry.snapshot()
    assert snapshot.totals.futures_complete == 5
    assert snapshot.totals.futures_failed == {"user": 2, "server": 1}
    assert snapshot.db_call_duration["add_futures"].count == 2
    assert snapshot.db_call_duration["add_futures"].sum == pytest.approx(0.0006)


def test_the_snapshot_reads_occupancy_and_lists_every_queue_kind(clock: FakeClock) -> None:
    telemetry = Telemetry(device="cuda:0", clock=clock)
    telemetry.occupancy_source = lambda: Occupancy(3, 8, 2, 1, {"forward_backward": 5}, 7, runs_on_host=4)
    telemetry.record_usage(EngineUsage(device_name="NVIDIA H200", device_allocated_bytes=1 << 30))
    clock.now += 42.0
    snapshot = telemetry.snapshot()
    assert (snapshot.slots_used, snapshot.slots_total, snapshot.runs_parked, snapshot.runs_waiting) == (
        3,
        8,
        2,
        1,
    )
    assert snapshot.queue_depth == dict.fromkeys(QUEUE_KINDS, 0) | {"forward_backward": 5}
    assert snapshot.futures_pending == 7 and snapshot.runs_on_host == 4
    assert snapshot.device == "cuda:0 (NVIDIA H200)"
    assert snapshot.memory.device_allocated_bytes == 1 << 30
    assert snapshot.uptime_s == 42.0


def test_records_land_in_the_registry_that_metrics_serves(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock)
    telemetry.occupancy_source = lambda: Occupancy(3, 8, 2, 1, {"forward_backward": 5}, 7, runs_on_host=4)
    for tokens in (100, 20, 3):
        telemetry.record_pass(tokens=tokens, requests=2, runs=2, tenants=1, duration_s=0.3)
    telemetry.record_optim_step(runs=4, duration_s=0.02)
    for to in ("host", "host", "disk"):
        telemetry.record_park(to)
    telemetry.record_outcomes(5, {"server": 2})
    telemetry.record_engine_thread({"engine": 0.5, "durable": 0.0, "held": 0.0, "idle": 1.5, "other": 0.25})
    value = telemetry.registry.get_sample_value
    assert value("loraplex_pass_tokens_total") == 123
    assert value("loraplex_pass_duration_seconds_bucket", {"le": "0.5"}) == 3
    assert value("loraplex_pass_duration_seconds_bucket", {"le": "0.25"}) == 0
    assert value("loraplex_optim_step_runs_total") == 4
    assert value("loraplex_futures_finished_total", {"state": "failed"}) == 2
    assert value("loraplex_errors_total", {"category": "server", "source": "future"}) == 2
    assert value("loraplex_errors_total", {"category": "user", "source": "future"}) == 0
    assert value("loraplex_engine_busy_seconds_total") == 0.5
    assert value("loraplex_engine_thread_seconds_total", {"state": "idle"}) == 1.5
    assert value("loraplex_queue_depth", {"kind": "forward_backward"}) == 5
    assert value("loraplex_queue_depth", {"kind": "create"}) == 0
    assert value("loraplex_futures_pending") == 7
    assert value("loraplex_runs_on_host") == 4 and value("loraplex_runs_parked") == 2
    assert [value("loraplex_parks_total", {"to": to}) for to in ("host", "disk")] == [2, 1]


def test_device_memory_appears_once_reported_and_the_info_gauge_names_the_device(clock: FakeClock) -> None:
    telemetry = Telemetry(device="cuda:0", clock=clock, model_name="loraplex/tiny")
    value = telemetry.registry.get_sample_value
    telemetry.record_usage(EngineUsage(kv_cache_bytes=4096))  # off CUDA: no device memory
    assert value("loraplex_device_memory_total_bytes") is None
    assert value("loraplex_kv_cache_bytes") == 4096
    assert value("loraplex_server_info", {"model": "loraplex/tiny", "device": "cuda:0"}) == 1
    telemetry.record_usage(EngineUsage(device_name="NVIDIA H200", device_total_bytes=140 << 30))
    assert value("loraplex_device_memory_total_bytes") == 140 << 30
    assert value("loraplex_server_info", {"model": "loraplex/tiny", "device": "cuda:0 (NVIDIA H200)"}) == 1
    assert value("loraplex_server_info", {"model": "loraplex/tiny", "device": "cuda:0"}) is None
    assert telemetry.snapshot().memory.device_total_bytes == 140 << 30


def test_every_ranks_parameter_bytes_are_a_gauge_by_rank_and_kind(clock: FakeClock) -> None:
    telemetry = Telemetry(clock=clock)

    def gauge() -> dict[tuple[str, str], float | None]:
        read = telemetry.registry.get_sample_value
        return {
            (rank, kind): read("loraplex_rank_parameter_bytes", {"rank": rank, "kind": kind})
            for rank in ("0", "1")
            for kind in ("base", "adapter", "optimizer")
        }

    two_ranks = (ParameterBytes(1000, 20, 64), ParameterBytes(1000, 20, 48))
    telemetry.record_usage(EngineUsage(parameter_bytes=two_ranks))
    assert gauge() == {
        ("0", "base"): 1000,
        ("0", "adapter"): 20,
        ("0", "optimizer"): 64,
        ("1", "base"): 1000,
        ("1", "adapter"): 20,
        ("1", "optimizer"): 48,
    }
    telemetry.record_usage(EngineUsage(parameter_bytes=(ParameterBytes(1000, 0, 16), two_ranks[1])))
    assert (gauge()[("0", "adapter")], gauge()[("0", "optimizer")], gauge()[("1", "adapter")]) == (0, 16, 20)


def test_the_engines_bytes_are_exported_before_the_engine_loop_runs(tmp_path) -> None:
    engine = FakeEngine()
    runtime = Runtime.open(engine, ServerConfig(data_dir=tmp_path))  # no thread started
    try:
        read = runtime.telemetry.registry.get_sample_value
        assert read("loraplex_rank_parameter_bytes", {"rank": "0", "kind": "base"}) == engine.base.nbytes
        assert read("loraplex_rank_parameter_bytes", {"rank": "0", "kind": "adapter"}) == 0
    finally:
        runtime.store.close()


def test_the_service_reports_passes_steps_queues_and_slots(
    service_factory: Callable[..., Runtime],
) -> None:
    service = service_factory(FakeEngine(max_slots=2))
    run_id = create_run(service)
    with held(service):  # queued, not yet planned: the snapshot sees them
        records = [
            service.training.submit("local", run_id, 1, sft_pass()),
            service.training.submit("local", run_id, 2, OptimStep(AdamParams(learning_rate=0.01))),
        ]
        # seq 4 waits behind the missing seq 3
        behind = service.training.submit("local", run_id, 4, sft_pass(forward_only=True))
        queued = service.telemetry.snapshot()
    assert (queued.queue_depth["forward_backward"], queued.queue_depth["optim_step"]) == (1, 1)
    assert queued.queue_depth["forward"] == 1
    assert (queued.slots_used, queued.slots_total) == (1, 2)
    for record in records:
        assert result_of(service, record).status == "complete"
    service.training.submit("local", run_id, 3, sft_pass(forward_only=True))
    assert result_of(service, behind).status == "complete"
    snapshot = service.telemetry.snapshot()
    tokens = len(sft_pass().datums[0].tokens)
    assert snapshot.totals.pass_tokens == 3 * tokens
    assert snapshot.totals.pass_requests == 3
    assert (snapshot.totals.optim_steps, snapshot.totals.optim_step_runs) == (1, 1)
    assert snapshot.totals.futures_complete == 5  # create, three passes, one optim step
    assert snapshot.futures_pending == 0
    assert snapshot.queue_depth == dict.fromkeys(QUEUE_KINDS, 0)
    assert snapshot.db_call_duration["add_futures"].count >= 5


def test_the_engine_loop_summarises_each_busy_cycle_at_debug_level(
    service_factory: Callable[..., Runtime], caplog: pytest.LogCaptureFixture
) -> None:
    service = service_factory()
    run_id = create_run(service)
    with caplog.at_level(logging.DEBUG, logger="loraplex.runtime.core.engine_loop"):
        assert (
            result_of(service, service.training.submit("local", run_id, 1, sft_pass())).status == "complete"
        )
        deadline = time.monotonic() + 10  # the cycle logs after it has finished its futures
        while not [r for r in caplog.records if "work PassWork of 1," in r.getMessage()]:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.01)
