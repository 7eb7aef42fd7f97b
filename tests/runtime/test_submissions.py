"""`Runtime.submit_many`: a burst of submissions, their futures written in one transaction (group
commit), each answered as it would be alone."""

from __future__ import annotations

import pytest

from loraplex.engine.types import AdamParams
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.futures import FutureRecord
from loraplex.runtime.control.service import Submission
from loraplex.runtime.core.commands import OptimStep
from tests.runtime.conftest import create_run, result_of, sft_pass


def _record_writes(service: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each add_futures call (each call is one transaction)."""
    writes: list[int] = []
    add_futures = service.store.add_futures

    def recorded(rows):
        writes.append(len(rows))
        return add_futures(rows)

    monkeypatch.setattr(service.store, "add_futures", recorded)
    return writes


def _fb(run: str, seq_id: int, tenant: str = "local") -> Submission:
    command = sft_pass()
    return Submission(tenant, run, seq_id, command.request_type, command)


def test_a_burst_is_written_in_one_transaction_and_each_request_gets_its_own_outcome(
    service_factory, monkeypatch
) -> None:
    service = service_factory()
    runs = [create_run(service, seed=seed) for seed in (1, 2)]
    writes = _record_writes(service, monkeypatch)
    step = OptimStep(AdamParams(learning_rate=0.1))
    burst = [
        _fb(runs[0], 1),
        _fb(runs[1], 1),
        _fb("nobody:train:0", 1),  # refused: no such run
        Submission("local", runs[0], 0, "ForwardBackward", sft_pass()),  # refused: seq_id 0
        _fb(runs[0], 1),  # a copy of the first: the same future
        Submission("local", runs[1], 2, "OptimStep", refusal=UserError("adam_params: bad")),  # recorded
        Submission("local", runs[0], 2, step.request_type, step),
    ]
    outcomes = service.training.submit_many(burst)
    assert writes == [4]  # the four new futures, once
    assert isinstance(outcomes[2], NotFoundError) and isinstance(outcomes[3], UserError)
    assert outcomes[4] is outcomes[0]
    records = [o for i, o in enumerate(outcomes) if i not in (2, 3, 4)]
    assert all(isinstance(o, FutureRecord) for o in records)
    done = [result_of(service, record) for record in records]  # type: ignore[arg-type]
    assert [d.status for d in done] == ["complete", "complete", "failed", "complete"]
    assert done[2].error == "adam_params: bad" and done[2].category == "user"
    assert done[3].result["metrics"]["grad_norm"] > 0  # run 0 stepped the gradients of its seq 1


def test_a_failed_write_fails_every_request_it_carried_and_frees_their_seq_ids(
    service_factory, monkeypatch
) -> None:
    service = service_factory()
    run = create_run(service)
    add_futures = service.store.add_futures

    def refuse(rows):
        raise OSError("disk full")

    monkeypatch.setattr(service.store, "add_futures", refuse)
    outcomes = service.training.submit_many([_fb(run, 1), _fb(run, 2), _fb("nobody:train:0", 1)])
    assert [type(o) for o in outcomes] == [OSError, OSError, NotFoundError]
    assert service.futures.pending_count() == 0  # the claimed futures were let go with the write
    monkeypatch.setattr(service.store, "add_futures", add_futures)
    retried = service.training.submit_many([_fb(run, 1), _fb(run, 2)])  # the client's retry: same seq_ids
    assert [result_of(service, r).status for r in retried] == ["complete", "complete"]  # type: ignore[arg-type]


def test_a_row_that_cannot_be_written_refuses_its_own_request_not_the_others_beside_it(
    service_factory, monkeypatch
) -> None:
    service = service_factory()
    good, bad = create_run(service, seed=1), create_run(service, seed=2)
    add_futures = service.store.add_futures
    writes: list[list[str]] = []

    def refuse_bad(rows):
        writes.append([row.run_id for row in rows])
        if any(row.run_id == bad for row in rows):
            raise OSError("this row cannot be written")
        return add_futures(rows)

    monkeypatch.setattr(service.store, "add_futures", refuse_bad)
    outcomes = service.training.submit_many([_fb(good, 1), _fb(bad, 1), _fb(good, 2)])
    assert writes == [[good, bad, good], [good], [bad], [good]]  # the group, then each row alone
    assert isinstance(outcomes[1], OSError)
    assert [result_of(service, outcomes[i]).status for i in (0, 2)] == ["complete", "complete"]  # type: ignore[arg-type]
    monkeypatch.setattr(service.store, "add_futures", add_futures)
    assert (
        result_of(service, service.training.submit("local", bad, 1, sft_pass())).status == "complete"
    )  # its retry


def test_submit_is_a_burst_of_one_and_a_refusal_is_its_seq_ids_failed_future(
    service_factory, monkeypatch
) -> None:
    service = service_factory()
    run = create_run(service)
    writes = _record_writes(service, monkeypatch)
    assert result_of(service, service.training.submit("local", run, 1, sft_pass())).status == "complete"
    (refused,) = service.training.submit_many(
        [Submission("local", run, 2, "OptimStep", refusal=UserError("no"))]
    )
    assert result_of(service, refused).error == "no"
    with pytest.raises(NotFoundError):
        service.training.submit("local", "nobody:train:0", 1, sft_pass())
    assert writes == [1, 1]
