"""Runtime with the fake engine: ordering, idempotency, packing across tenants, errors."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.engine.losses import LOSSES
from loraplex.engine.types import AdamParams, DatumInput, LoraConfig
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.core.commands import CreateRun, ForwardBackward, OptimStep
from tests.runtime.conftest import PHRASE, create_run, held, result_of, rl_pass, sft_pass, train_steps


def test_sft_on_one_phrase_cuts_the_loss_five_fold(service_factory) -> None:
    service = service_factory()
    losses = train_steps(service, create_run(service), steps=30)
    assert losses[-1] * 5 <= losses[0]


def test_out_of_order_submissions_execute_in_seq_id_order(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    with held(service):  # all three arrive before anything runs
        late_fwd = service.training.submit("local", run, 3, sft_pass(forward_only=True))
        step = service.training.submit("local", run, 2, OptimStep(AdamParams(learning_rate=0.1)))
        fb = service.training.submit("local", run, 1, sft_pass())
    before = result_of(service, fb).result.metrics["loss:sum"]
    after = result_of(service, late_fwd).result.metrics["loss:sum"]
    assert result_of(service, step).status == "complete"
    assert after < before  # the forward at seq 3 saw the step at seq 2


def test_a_resent_seq_id_returns_the_first_future_and_never_runs_twice(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    first = service.training.submit("local", run, 1, sft_pass())
    again = service.training.submit("local", run, 1, sft_pass())
    assert again.id == first.id
    result_of(service, first)
    step = result_of(service, service.training.submit("local", run, 2, OptimStep(AdamParams())))
    # one accumulated gradient, not two: the fused step saw the norm of a single datum's gradient
    single = service_factory_norm(service)
    assert step.result["metrics"]["grad_norm"] == pytest.approx(single)


def service_factory_norm(service) -> float:
    """Grad norm of one sft_pass on a fresh run of the same seed (the expected value, computed apart)."""
    run = create_run(service)
    result_of(service, service.training.submit("local", run, 1, sft_pass()))
    return result_of(service, service.training.submit("local", run, 2, OptimStep(AdamParams()))).result[
        "metrics"
    ]["grad_norm"]


def test_two_tenants_share_one_engine_pass_and_each_gets_what_it_would_alone(service_factory) -> None:
    alone = service_factory()
    run_a, run_b = create_run(alone, "alice", seed=1), create_run(alone, "bob", seed=2)
    expected_a = result_of(alone, alone.training.submit("alice", run_a, 1, sft_pass()), "alice").result
    expected_b = result_of(alone, alone.training.submit("bob", run_b, 1, rl_pass("ppo")), "bob").result

    shared = service_factory(subdir="shared")
    run_a, run_b = create_run(shared, "alice", seed=1), create_run(shared, "bob", seed=2)
    with held(shared):
        fa = shared.training.submit("alice", run_a, 1, sft_pass())
        fb = shared.training.submit("bob", run_b, 1, rl_pass("ppo"))
    got_a, got_b = result_of(shared, fa, "alice").result, result_of(shared, fb, "bob").result
    assert sorted(shared.engine.pass_log[-1]) == [0, 1]  # one pass held both tenants' requests
    assert got_a.metrics == expected_a.metrics and got_b.metrics == expected_b.metrics
    np.testing.assert_array_equal(got_b.outputs[0]["logprobs"], expected_b.outputs[0]["logprobs"])


def test_optim_steps_of_different_runs_fuse_into_one_engine_call(service_factory) -> None:
    service = service_factory()
    runs = [create_run(service, seed=s) for s in (1, 2)]
    with held(service):
        futures = [
            service.training.submit("local", r, seq, c)
            for r in runs
            for seq, c in ((1, sft_pass()), (2, OptimStep(AdamParams())))
        ]
    for f in futures:
        result_of(service, f)
    assert service.engine.optim_log == [[0, 1]]


def test_a_bad_request_fails_alone_as_a_user_error_and_its_seq_id_is_consumed(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    bad = service.training.submit("local", run, 1, ForwardBackward("nope", {}, sft_pass().datums, False))
    good = service.training.submit("local", run, 2, sft_pass())
    failed = result_of(service, bad)
    assert (failed.status, failed.category) == ("failed", "user")
    assert "unknown loss_fn 'nope'" in failed.error
    assert result_of(service, good).status == "complete"


@pytest.mark.parametrize(
    ("limit", "datums", "message"),
    [
        ({"max_datums_per_request": 2}, 3, "3 datums; this server allows at most 2"),
        ({"max_tokens_per_datum": 4}, 1, "datum 0 has 6 tokens; this server allows at most 4"),
        ({"max_tokens_per_request": 10}, 2, "12 tokens; this server allows at most 10"),
    ],
)
def test_oversized_requests_fail_with_the_limit_named(service_factory, limit, datums, message) -> None:
    service = service_factory(**limit)
    run = create_run(service)
    one = sft_pass().datums[0]
    record = result_of(
        service,
        service.training.submit("local", run, 1, ForwardBackward("cross_entropy", {}, [one] * datums, False)),
    )
    assert record.category == "user" and message in record.error


def test_another_tenants_run_and_future_look_missing(service_factory) -> None:
    service = service_factory()
    run = create_run(service, "alice")
    record = service.training.submit("alice", run, 1, sft_pass())
    with pytest.raises(NotFoundError):
        service.training.submit("mallory", run, 2, sft_pass())
    with pytest.raises(NotFoundError):
        service.futures.get(record.id, "mallory")


def test_seq_id_zero_is_rejected_before_anything_is_queued(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    with pytest.raises(UserError, match="seq_id must be >= 1"):
        service.training.submit("local", run, 0, sft_pass())


def test_gradients_accumulate_across_requests_until_the_step(service_factory) -> None:
    service = service_factory()
    run_split, run_whole = create_run(service, seed=3), create_run(service, seed=3)
    half = sft_pass(weight=0.5)
    for seq in (1, 2):
        service.training.submit("local", run_split, seq, half)
    service.training.submit("local", run_whole, 1, sft_pass())
    split = result_of(service, service.training.submit("local", run_split, 3, OptimStep(AdamParams())))
    whole = result_of(service, service.training.submit("local", run_whole, 2, OptimStep(AdamParams())))
    assert split.result["metrics"]["grad_norm"] == pytest.approx(whole.result["metrics"]["grad_norm"])


def test_forward_only_leaves_gradients_untouched(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    result_of(
        service,
        service.training.submit(
            "local",
            run,
            1,
            ForwardBackward(
                "cross_entropy", {}, [DatumInput(PHRASE[:-1], {"target_tokens": PHRASE[1:]})], True
            ),
        ),
    )
    step = result_of(service, service.training.submit("local", run, 2, OptimStep(AdamParams())))
    assert step.result["metrics"]["grad_norm"] == 0.0


def test_requests_behind_a_seq_id_that_never_arrives_fail_after_the_gap_timeout_and_the_run_goes_on(
    service_factory,
) -> None:
    service = service_factory(seq_gap_timeout_s=0.3)
    run = create_run(service)
    stuck = service.training.submit("local", run, 2, sft_pass())  # seq 1 was refused before it could be read
    outcome = result_of(service, stuck)
    assert (outcome.category, outcome.error) == (
        "user",
        f"training run {run} never received seq_id 1 (its session expired, or it was refused before its "
        "seq_id could be read); this request waited behind it and is dropped",
    )
    assert result_of(service, service.training.submit("local", run, 3, sft_pass())).status == "complete"


def test_a_run_whose_session_lapsed_and_whose_gap_went_stale_in_the_same_check_fails_its_waiting_requests(
    service_factory,
) -> None:
    # Both conditions hold at the engine loop's next lease check: the gap must be given up once, its
    # requests failed, never dropped unanswered (an earlier loop asked each condition for the gap apart).
    service = service_factory(session_timeout_s=0.3, seq_gap_timeout_s=0.3)
    run = create_run(service)
    stuck = service.training.submit("local", run, 2, sft_pass())  # seq 1 never comes, nor a heartbeat
    outcome = result_of(service, stuck)
    assert (outcome.category, outcome.error) == (
        "user",
        f"training run {run} never received seq_id 1 (its session expired, or it was refused before its "
        "seq_id could be read); this request waited behind it and is dropped",
    )


def test_a_create_model_whose_future_could_not_be_written_leaves_nothing_behind_and_its_retry_creates_it(
    service_factory, monkeypatch
) -> None:
    service = service_factory()
    session = service.sessions.create("local", {})
    command = CreateRun(LoraConfig(rank=4, seed=1), service.info.model_name)
    real_add, calls = service.store.add_futures, []

    def refuse_once(rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise OSError("database is locked (injected)")
        return real_add(rows)

    monkeypatch.setattr(service.store, "add_futures", refuse_once)
    with pytest.raises(OSError, match="injected"):
        service.training.create_run("local", session, 0, command)
    retried = service.training.create_run("local", session, 0, command)  # the SDK resends a 5xx
    assert result_of(service, retried).result == {"model_id": f"{session}:train:0", "type": "create_model"}


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_every_loss_of_the_engines_registry_trains_through_the_runtime(service_factory, loss_fn: str) -> None:
    # The fake engine applies the engine's own rules and loss code, so the runtime is tested on every loss
    # the server offers: each returns per-token outputs and a finite loss, and its step moves the adapter.
    service = service_factory()
    run = create_run(service)
    command = sft_pass() if loss_fn == "cross_entropy" else rl_pass(loss_fn)
    done = result_of(service, service.training.submit("local", run, 1, command)).result
    assert (
        np.isfinite(done.metrics["loss:sum"]) and len(done.outputs[0]["elementwise_loss"]) == len(PHRASE) - 1
    )
    step = result_of(service, service.training.submit("local", run, 2, OptimStep(AdamParams())))
    assert step.result["metrics"]["grad_norm"] > 0


def test_a_request_the_engine_refuses_is_refused_by_the_fake_alike(service_factory) -> None:
    # The engine refuses a request without datums and float target ids; a fake with rules of its own
    # accepted both, and the runtime's tests then passed on requests no server would run.
    service = service_factory()
    run = create_run(service)
    empty = ForwardBackward("cross_entropy", {}, [], False)
    floats = ForwardBackward(
        "cross_entropy",
        {},
        [DatumInput(PHRASE[:-1], {"target_tokens": PHRASE[1:].astype(np.float32)})],
        False,
    )
    outcomes = [
        result_of(service, service.training.submit("local", run, seq, c))
        for seq, c in ((1, empty), (2, floats))
    ]
    assert [o.category for o in outcomes] == ["user", "user"]
    assert "needs at least one datum" in outcomes[0].error
    assert "target_tokens" in outcomes[1].error
