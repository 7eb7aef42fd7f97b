"""Metric history: every training request's metrics are kept per run and step, written with the request's
outcome, and retention keeps the table bounded (per run, and by how long ago a run was used). The store's
queries run on SQLite and on PostgreSQL (Debian's server, which .ci/run installs)."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from loraplex.cli import main
from loraplex.engine.types import LoraConfig, PassResult, SampleRequest, SamplingParams
from loraplex.runtime.control.futures import FutureTable
from loraplex.runtime.control.retention import Retention, RetentionPolicy
from loraplex.runtime.control.store import Batch, Store
from loraplex.runtime.control.store.schema import RunRow
from loraplex.runtime.control.writer import JournalWriter
from loraplex.runtime.core.checkpoints import DiskLayout
from loraplex.runtime.core.commands import SaveSnapshot
from loraplex.runtime.core.journal import FORWARD_BACKWARD, MetricsRecorded, Record
from loraplex.runtime.observability.history import LatestValue, MetricHistory
from loraplex.timestamps import utcnow
from tests.fakes import FakeEngine
from tests.runtime.conftest import PHRASE, create_run, result_of, rl_pass, sft_pass, train_steps


def _series(history: MetricHistory, run_id: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    return {(s.kind, s.name): list(s.points) for s in history.series(run_id)}


def test_each_step_records_its_loss_grad_norm_and_learning_rate_under_its_number(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    losses = train_steps(service, run, 3, lr=0.05)
    series = _series(service.history, run)
    assert series["forward_backward", "loss:sum"] == [(1, losses[0]), (2, losses[1]), (3, losses[2])]
    assert [step for step, _ in series["optim_step", "grad_norm"]] == [1, 2, 3]
    assert series["optim_step", "learning_rate"] == [(1, 0.05), (2, 0.05), (3, 0.05)]
    assert service.store.get_run(run).last_step == 3


def test_a_forward_is_recorded_under_the_steps_already_taken(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 2)
    evaluation = service.training.submit("local", run, 5, sft_pass(forward_only=True))
    loss = result_of(service, evaluation).result.metrics["loss:sum"]  # type: ignore[union-attr]
    assert _series(service.history, run)["forward", "loss:sum"] == [(2, loss)]


def test_a_passes_health_goes_to_the_history_and_to_metrics_but_never_to_the_client(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    done = result_of(service, service.training.submit("local", run, 1, rl_pass("ppo")))
    assert set(done.result.metrics) == {"loss:sum", "clip_fraction:mean"}  # type: ignore[union-attr]
    series = _series(service.history, run)
    n = len(rl_pass("ppo").datums[0].tokens)  # q = −3 everywhere: every position is trained
    assert series["forward_backward", "train/tokens"] == [(1, n)]
    advantages = np.linspace(-1.0, 1.0, n)
    ((_, mean),) = series["forward_backward", "rl/advantage_mean"]
    ((_, std),) = series["forward_backward", "rl/advantage_std"]
    assert (mean, std) == (pytest.approx(0.0, abs=1e-7), pytest.approx(advantages.std(), rel=1e-6))
    diff = -3.0 - done.result.outputs[0]["logprobs"].astype(np.float64)  # type: ignore[union-attr]
    assert series["forward_backward", "rl/kl_sample_train_v1"] == [(1, pytest.approx(diff.mean(), rel=1e-6))]
    assert series["forward_backward", "rl/logprob_abs_diff_max"] == [
        (1, pytest.approx(abs(diff).max(), rel=1e-6))
    ]
    exported = service.telemetry.registry.get_sample_value
    assert exported("loraplex_trained_tokens_total", {"loss_fn": "ppo"}) == n


def test_requests_of_a_snapshot_that_finish_together_make_one_sample_row_at_the_snapshots_step(
    service_factory,
) -> None:
    engine = FakeEngine()
    service = service_factory(engine)
    run = create_run(service)
    train_steps(service, run, 2)
    sampler = run.replace(":train:0", ":sample:0")
    result_of(service, service.training.submit("local", run, 5, SaveSnapshot(None, sampler_id=sampler)))
    train_steps(service, run, 1, first_seq=6)  # the snapshot stays at step 2
    engine.holds_samples = True  # both requests enter the engine's batch, then finish in one step
    requests = [
        SampleRequest(PHRASE, SamplingParams(max_tokens=4, seed=1, stop=()), num_samples=2),
        SampleRequest(PHRASE, SamplingParams(max_tokens=6, seed=2, stop=()), num_samples=1),
    ]
    records = [service.samplers.sample("local", sampler, seq, r) for seq, r in enumerate(requests)]
    deadline = time.monotonic() + 10
    while len(engine.sample_queue) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.holds_samples = False
    for record in records:
        result_of(service, record)
    series = _series(service.history, run)
    assert series["sample", "sample/sequences"] == [(2, 3.0)]
    assert series["sample", "sample/tokens"] == [(2, 14.0)]
    assert series["sample", "sample/length_mean"] == [(2, pytest.approx(14 / 3))]
    assert series["sample", "sample/stop_reason_length"] == [(2, 3.0)]
    assert series["sample", "sample/stop_reason_stop"] == [(2, 0.0)]


def test_a_restarted_run_numbers_its_steps_on_from_where_it_stopped(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 2)
    service.stop()  # parks the run
    after = service_factory(subdir="data")
    train_steps(after, run, 1, first_seq=5)
    steps = [step for step, _ in _series(after.history, run)["forward_backward", "loss:sum"]]
    assert steps == [1, 2, 3]


def test_a_requests_metrics_are_written_with_its_outcome_and_a_refused_write_keeps_neither(
    store: Store,
) -> None:
    futures = FutureTable(store, 3600.0)
    writer = JournalWriter(store, futures, retry_pauses_s=())
    writer.start()
    refused, kept = (futures.create("t", "ForwardBackward", "r:train:0", seq) for seq in (1, 2))

    def record(future_id: str, seq: int) -> Record:
        metrics = {"loss:sum": 2.0 * seq, "nan": float("nan")}
        return Record(
            {future_id: PassResult([], metrics)},
            [MetricsRecorded("r:train:0", seq, seq, FORWARD_BACKWARD, metrics)],
        )

    real_write = store.write_batch
    store.write_batch = lambda *_: (_ for _ in ()).throw(OSError("disk full"))  # type: ignore[method-assign]
    assert not writer.append(record(refused.id, 1)).wait()
    assert futures.get(refused.id, "t").category == "server" and store.count_metrics() == 0
    store.write_batch = real_write  # type: ignore[method-assign]
    assert writer.append(record(kept.id, 2)).wait()
    assert futures.get(kept.id, "t").status == "complete"
    assert [(s.kind, s.name, s.points) for s in MetricHistory(store).series("r:train:0")] == [
        ("forward_backward", "loss:sum", ((2, 4.0),))  # the non-finite value is left out
    ]
    writer.close()


def test_a_long_history_is_thinned_for_charts_keeping_its_last_point(store: Store) -> None:
    _add_history(store, "r:train:0", 10)
    (series,) = MetricHistory(store).series("r:train:0", max_points=4)
    # ceil(10 / 4) = 3: every third record from the first, and the last.
    assert [step for step, _ in series.points] == [1, 4, 7, 10]
    assert series.total == 10


def test_retention_keeps_each_runs_newest_records_and_drops_the_history_of_runs_long_unused(
    store: Store, tmp_path: Path
) -> None:
    now = utcnow()
    _add_run(store, "busy:train:0", last_request_at=now)
    _add_run(store, "quiet:train:0", last_request_at=now)
    _add_run(store, "old:train:0", last_request_at=now - timedelta(days=40))
    _add_history(store, "busy:train:0", 10)
    _add_history(store, "quiet:train:0", 3)
    _add_history(store, "old:train:0", 2)
    policy = RetentionPolicy(86400.0, 3600.0, 300.0, metric_retention_s=30 * 86400.0, max_metrics_per_run=4)
    retention = Retention(store, DiskLayout(tmp_path), policy)

    due = retention.due(now)
    assert due.metrics == 6 + 2  # busy's 6 oldest, all of old's
    assert retention.sweep(now).metrics == due.metrics
    assert store.count_metrics() == 4 + 3
    (busy,) = MetricHistory(store).series("busy:train:0")
    assert [step for step, _ in busy.points] == [7, 8, 9, 10]
    assert MetricHistory(store).series("old:train:0") == []
    assert retention.due(now).metrics == 0


def test_doctor_reports_and_gc_removes_metric_history_past_its_bounds(tmp_path: Path, capsys) -> None:
    data = tmp_path / "data"
    data.mkdir()
    store = Store(f"sqlite:///{(data / 'loraplex.db').resolve()}")
    _add_run(store, "r:train:0", last_request_at=utcnow())
    _add_history(store, "r:train:0", 5)
    store.close()
    args = ["--data-dir", str(data), "--max-metrics-per-run", "2"]
    assert main(["doctor", *args]) == 0
    assert "5 metric history records" in capsys.readouterr().out
    assert main(["gc", *args]) == 0
    assert "3 metric records" in capsys.readouterr().out
    store = Store(f"sqlite:///{(data / 'loraplex.db').resolve()}")
    assert store.count_metrics() == 2


def test_the_engine_loop_writes_history_within_moments_without_being_asked(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 1)
    _wait_for(lambda: service.store.count_metrics() == 2)  # written with the outcomes, idle or not


def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _add_run(store: Store, run_id: str, last_request_at) -> None:
    row = RunRow(
        id=run_id,
        session_id=run_id.split(":")[0],
        tenant="t",
        base_model="m",
        lora_config=vars(LoraConfig(rank=4)),
        user_metadata={},
        status="parked",
        created_at=last_request_at,
        last_request_at=last_request_at,
    )
    store.write_batch(Batch(runs=[row]))


def _add_history(store: Store, run_id: str, steps: int) -> None:
    """`steps` optim_step records, steps 1..steps, grad_norm = step."""
    rows = [
        {
            "run_id": run_id,
            "seq_id": step,
            "step": step,
            "kind": "optim_step",
            "metrics": json.dumps({"grad_norm": float(step)}),
            "recorded_at": utcnow(),
        }
        for step in range(1, steps + 1)
    ]
    store.write_batch(Batch(metrics=rows, last_steps={run_id: steps}))


def test_the_newest_values_of_a_page_of_runs_come_from_each_runs_newest_record_of_each_kind_in_one_query(
    store: Store,
) -> None:
    now = utcnow()
    for run_id in ("a:train:0", "b:train:0", "c:train:0"):
        _add_run(store, run_id, last_request_at=now)
    _add_history(store, "a:train:0", 3)
    _add_history(store, "b:train:0", 2)
    losses = [
        {
            "run_id": "a:train:0",
            "seq_id": 100 + step,
            "step": step,
            "kind": FORWARD_BACKWARD,
            "metrics": json.dumps({"loss:sum": 10.0 - step, "clip_fraction:mean": 0.25}),
            "recorded_at": now,
        }
        for step in (1, 2, 3, 4)
    ]
    store.write_batch(Batch(metrics=losses))
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    sa.event.listen(sa.Engine, "before_cursor_execute", count)
    try:
        latest = MetricHistory(store).latest(["a:train:0", "b:train:0", "c:train:0"])
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", count)
    assert len(statements) == 1
    assert latest == {
        "a:train:0": [
            LatestValue(FORWARD_BACKWARD, "loss:sum", 4, 6.0),
            LatestValue(FORWARD_BACKWARD, "clip_fraction:mean", 4, 0.25),
            LatestValue("optim_step", "grad_norm", 3, 3.0),
        ],
        "b:train:0": [LatestValue("optim_step", "grad_norm", 2, 2.0)],
    }
