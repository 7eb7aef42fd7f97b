"""Sampling through the Runtime and fake engine: futures, idempotency, ownership, backpressure,
snapshots of every kind, interleaving with training, restarts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from loraplex.engine.types import AdamParams, SampleRequest, SamplingParams
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.control.recovery import RESTART_ERROR
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import OptimStep, SaveSnapshot, SaveState
from loraplex.runtime.core.sampling import SamplingBackpressureError
from tests.fakes import FakeEngine
from tests.runtime.conftest import PHRASE, create_run, held, result_of, sft_pass, train_steps


class StepwiseEngine(FakeEngine):
    """A FakeEngine whose sampler finishes one request per step (or none while `stalled`), logging every
    engine call in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.prefill_budgets: list[int | None] = []
        self.stalled = False

    def run_pass(self, requests, keep_undo=False):
        self.events.append("pass")
        return super().run_pass(requests, keep_undo)

    def apply_step(self, prepared):
        self.events.append("optim")
        return super().apply_step(prepared)

    def add_sample(self, key, request):
        self.events.append("add")
        super().add_sample(key, request)

    def step_sampler(self, max_prefill_tokens=None):
        if self.stalled:  # the worker polls again at once: log nothing, yield the CPU
            time.sleep(0.001)
            return []
        self.events.append("sample")
        self.prefill_budgets.append(max_prefill_tokens)
        key, request = self.sample_queue.pop(0)
        return [(key, self._sample(request))]


def _request(num_samples: int = 2, max_tokens: int = 4, seed: int = 1) -> SampleRequest:
    return SampleRequest(PHRASE, SamplingParams(max_tokens=max_tokens, seed=seed), num_samples)


def _base_sampler(service, tenant: str = "local") -> str:
    session = service.sessions.create(tenant, {})
    return service.samplers.create_sampler(tenant, session, 0, None, service.info.model_name)


def _sampler_over(service, path: str) -> str:
    session = service.sessions.create("local", {})
    return service.samplers.create_sampler("local", session, 0, path, None)


def _tokens(service, sampler: str, seq_id: int = 0, **request) -> list[list[int]]:
    result = result_of(service, service.samplers.sample("local", sampler, seq_id, _request(**request))).result
    return [s.tokens.tolist() for s in result.sequences]


def test_asample_completes_with_num_samples_sequences_each_with_per_token_logprobs(service_factory) -> None:
    service = service_factory()
    record = result_of(service, service.samplers.sample("local", _base_sampler(service), 0, _request(3, 5)))
    assert record.request_type == "Sample" and record.status == "complete"
    sequences = record.result.sequences
    assert [(len(s.tokens), len(s.logprobs), s.stop_reason) for s in sequences] == [(5, 5, "length")] * 3
    assert all(np.all(s.logprobs < 0) for s in sequences)


def test_a_resent_sampler_seq_id_returns_the_first_future_and_samples_once(service_factory) -> None:
    engine = StepwiseEngine()
    service = service_factory(engine)
    sampler = _base_sampler(service)
    with held(service):
        first = service.samplers.sample("local", sampler, 7, _request())
        again = service.samplers.sample("local", sampler, 7, _request())
    assert again.id == first.id
    result_of(service, first)
    assert (
        service.samplers.sample("local", sampler, 7, _request()).id == first.id
    )  # also once it has finished
    assert engine.events.count("add") == 1


def test_sampling_seq_ids_may_have_gaps_and_each_id_is_its_own_request(service_factory) -> None:
    service = service_factory()
    sampler = _base_sampler(service)
    ids = {service.samplers.sample("local", sampler, seq, _request()).id for seq in (0, 5, 10**18)}
    assert len(ids) == 3


def test_another_tenants_sampler_looks_like_a_missing_one(service_factory) -> None:
    service = service_factory()
    sampler = _base_sampler(service, "alice")
    with pytest.raises(NotFoundError, match="not found"):
        service.samplers.sample("mallory", sampler, 0, _request())
    record = service.samplers.sample("alice", sampler, 0, _request())
    with pytest.raises(NotFoundError):
        service.futures.get(record.id, "mallory")


def test_an_invalid_request_is_refused_at_submission_naming_the_problem(service_factory) -> None:
    service = service_factory()
    bad = SampleRequest(np.array([1, 10**6]), SamplingParams(max_tokens=2))
    with pytest.raises(UserError, match="token ids"):
        service.samplers.sample("local", _base_sampler(service), 0, bad)


def test_past_the_queue_limit_asample_is_backpressured_and_accepted_once_there_is_room(
    service_factory,
) -> None:
    engine = StepwiseEngine()
    engine.stalled = True
    service = service_factory(engine, max_queued_samples=4)
    sampler = _base_sampler(service)
    first = service.samplers.sample("local", sampler, 0, _request(num_samples=3))
    with pytest.raises(SamplingBackpressureError, match="3 samples are queued"):
        service.samplers.sample("local", sampler, 1, _request(num_samples=2))
    assert (
        service.samplers.sample("local", sampler, 0, _request(num_samples=3)).id == first.id
    )  # resends still answer
    engine.stalled = False
    assert result_of(service, first).status == "complete"
    assert (
        result_of(service, service.samplers.sample("local", sampler, 1, _request(num_samples=2))).status
        == "complete"
    )


def test_a_request_larger_than_the_limit_still_runs_alone(service_factory) -> None:
    service = service_factory(max_queued_samples=2)
    record = service.samplers.sample("local", _base_sampler(service), 0, _request(num_samples=5))
    assert len(result_of(service, record).result.sequences) == 5


def test_each_worker_cycle_runs_one_training_plan_and_one_sampler_step(service_factory) -> None:
    engine = StepwiseEngine()
    service = service_factory(engine, max_prefill_tokens=123)
    run, sampler = create_run(service), _base_sampler(service)
    engine.events.clear()
    with held(service):  # everything is queued before the worker plans
        samples = [service.samplers.sample("local", sampler, seq, _request()) for seq in range(3)]
        training = []
        for seq in range(1, 7, 2):
            training.append(service.training.submit("local", run, seq, sft_pass()))
            training.append(service.training.submit("local", run, seq + 1, OptimStep(AdamParams())))
    for record in samples + training:
        result_of(service, record)
    # A plan is one pass, or one fused optim step (with any barriers); while requests are sampling
    # (one finishes per sampler step here), a sampler step follows each plan.
    first_step = ["pass", "add", "add", "add", "sample", "optim", "sample"]
    assert engine.events == [*first_step, "pass", "sample", "optim", "pass", "optim"]
    assert set(engine.prefill_budgets) == {123}


def test_sampling_never_waits_for_a_training_run_held_at_a_gap(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    sampler = run.replace(":train:0", ":sample:0")
    result_of(service, service.training.submit("local", run, 1, SaveSnapshot(None, sampler_id=sampler)))
    blocked = service.training.submit(
        "local", run, 3, OptimStep(AdamParams())
    )  # waits for a seq 2 that never comes
    assert len(_tokens(service, sampler)) == 2
    assert not service.futures.get(blocked.id, "local").is_done


def test_an_older_snapshot_keeps_sampling_the_weights_it_was_saved_with(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 2)
    old = run.replace(":train:0", ":sample:0")
    result_of(service, service.training.submit("local", run, 5, SaveSnapshot(None, sampler_id=old)))
    before = _tokens(service, old, max_tokens=12)
    train_steps(service, run, 3, first_seq=6)
    new = run.replace(":train:0", ":sample:1")
    result_of(service, service.training.submit("local", run, 12, SaveSnapshot(None, sampler_id=new)))
    assert _tokens(service, old, seq_id=1, max_tokens=12) == before
    assert _tokens(service, new, max_tokens=12) != before


def test_a_training_checkpoint_samples_exactly_like_a_sampler_checkpoint_of_the_same_weights(
    service_factory,
) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 3)
    weights = result_of(service, service.training.submit("local", run, 7, SaveState("w"))).result["path"]
    snapshot = result_of(service, service.training.submit("local", run, 8, SaveSnapshot("s"))).result["path"]
    over_weights, over_snapshot = _sampler_over(service, weights), _sampler_over(service, snapshot)
    expected = _tokens(service, over_snapshot, max_tokens=12)
    assert _tokens(service, over_weights, max_tokens=12) == expected
    assert _tokens(service, over_weights, seq_id=1, max_tokens=12) == expected  # the export is reused
    assert service.engine.slots.keys() == {0}  # the slot borrowed for the export was given back
    assert _tokens(service, _base_sampler(service), max_tokens=12) != expected


def test_a_sampler_checkpoint_deleted_from_disk_is_a_clear_not_found(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    path = result_of(service, service.training.submit("local", run, 1, SaveSnapshot("gone"))).result["path"]
    sampler = _sampler_over(service, path)
    service.catalog.delete_checkpoint("local", CheckpointPath.parse(path))
    with pytest.raises(NotFoundError, match="gone"):
        service.samplers.sample("local", sampler, 0, _request())


def test_a_failed_sampler_step_fails_its_requests_as_server_errors_and_the_next_ones_run(
    service_factory,
) -> None:
    class FailsOnce(FakeEngine):
        failed = False

        def step_sampler(self, max_prefill_tokens=None):
            if not self.failed:
                self.failed, self.sample_queue = True, []
                raise RuntimeError("device fell over")
            return super().step_sampler(max_prefill_tokens)

    service = service_factory(FailsOnce())
    sampler = _base_sampler(service)
    lost = result_of(service, service.samplers.sample("local", sampler, 0, _request()))
    assert (lost.status, lost.category) == ("failed", "server")
    assert lost.error.startswith("internal server error (request ")  # the cause stays in the log
    assert result_of(service, service.samplers.sample("local", sampler, 1, _request())).status == "complete"
    assert service.state.samples.queued_samples == 0


def test_after_a_restart_sample_results_remain_and_in_flight_samples_fail_as_server_errors(
    service_factory,
) -> None:
    engine = StepwiseEngine()
    before = service_factory(engine)
    sampler = _base_sampler(before)
    done = result_of(before, before.samplers.sample("local", sampler, 0, _request(3, 6)))
    engine.stalled = True
    in_flight = before.samplers.sample("local", sampler, 1, _request())
    before.engine_loop.stop()
    before.store.close()

    after = service_factory()
    restored = result_of(after, done).result
    for got, expected in zip(restored.sequences, done.result.sequences, strict=True):
        np.testing.assert_array_equal(got.tokens, expected.tokens)
        np.testing.assert_array_equal(got.logprobs, expected.logprobs)
    lost = result_of(after, in_flight)
    assert (lost.category, lost.error) == ("server", RESTART_ERROR)
    assert after.samplers.sample("local", sampler, 1, _request()).id == in_flight.id


def test_two_copies_of_an_asample_racing_past_the_resend_check_share_one_future(
    service_factory, monkeypatch
) -> None:
    # The second copy read "no future yet" before the first wrote its row (the race, made certain here):
    # the database's unique (sampler, seq_id) then answers it with the first future, never a 500.
    service = service_factory()
    sampler = _base_sampler(service)
    first = service.samplers.sample("local", sampler, 3, _request())
    real_lookup, lookups = service.store.future_id_for, []

    def stale_once(run_id, seq_id):
        lookups.append(seq_id)
        return None if len(lookups) == 1 else real_lookup(run_id, seq_id)

    monkeypatch.setattr(service.store, "future_id_for", stale_once)
    second = service.samplers.sample("local", sampler, 3, _request())
    assert second.id == first.id and len(lookups) == 2
    assert result_of(service, second).status == "complete"
