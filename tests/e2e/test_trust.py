"""No wedged runs, no silent corruption under slot pressure, through the official SDK against a real server.

A request refused once its run and seq_id are known fails alone, as that seq_id's user error, and the
run's next request goes on; a session that dies with a gap in its log gives its slot back; runs that take
turns on few slots (parked with their gradients, when a waiter has waited long enough) train exactly as
each would alone, their state kept in host memory (nothing written under parked/) while the host tier has
room, or on disk with `--host-slots 0`.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.e2e.conftest import Server
from tests.e2e.sdk import LR, PHRASE, base_model, client, create_key, sft_datum
from tests.e2e.test_observability import scrape, value

RESULT_TIMEOUT_S = 60  # a wedged request would wait forever: fail instead
REL = 1e-5


@pytest.fixture(scope="module")
def reference(module_server: Server) -> Server:
    """A default server (8 slots): every run of these tests alone, never parked."""
    return module_server


def _tokens(seed: int, n: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def _run(server: Server, seed: int, key: str = "tml-local") -> tinker.TrainingClient:
    service = client(server, key)
    return service.create_lora_training_client(base_model=base_model(server), rank=8, seed=seed).result(
        timeout=RESULT_TIMEOUT_S
    )


def _refused(future) -> str:
    """The message of a request the server refused, as the SDK raises it (a failed future, user error)."""
    with pytest.raises(tinker.RequestFailedError) as caught:
        future.result(timeout=RESULT_TIMEOUT_S)
    assert caught.value.category == types.RequestErrorCategory.User
    return caught.value.message


def _image_datum() -> types.Datum:
    """An SFT datum whose model input has an image between its text tokens."""
    image = types.ImageChunk(data=b"\x89PNG\r\n\x1a\n" + bytes(16), format="png", expected_tokens=4)
    chunks = [types.EncodedTextChunk(tokens=PHRASE[:4]), image, types.EncodedTextChunk(tokens=PHRASE[4:-1])]
    datum = sft_datum()
    return types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=datum.loss_fn_inputs)


# Each kind of request refused after its seq_id is consumed, and what its error must say.
REFUSALS: dict[str, tuple[Callable[[tinker.TrainingClient], object], str]] = {
    "dimuon optim_step": (
        lambda run: run.optim_step(types.DimuonParams(learning_rate=1e-3)),
        "the 'dimuon' optimizer is not supported by this server, only AdamW",
    ),
    "ttl below an hour": (
        lambda run: run.save_state("x", ttl_seconds=60),
        "ttl_seconds: Input should be greater than or equal to 3600",
    ),
    "image chunk": (
        lambda run: run.forward_backward([_image_datum()], "cross_entropy"),
        "datum 0: image chunks are not supported; send encoded_text tokens",
    ),
    "text loss_fn_config": (
        lambda run: run.forward_backward([sft_datum()], "ppo", {"clip_low_threshold": "low"}),
        "loss_fn_config['clip_low_threshold'] must be a number",
    ),
    "malformed age recipient": (
        lambda run: run.save_weights_external("x", age_encryption_recipients=["age1xyz"]),
        "age_encryption_recipients[0] 'age1xyz' is not an age recipient",
    ),
}


def _step(run: tinker.TrainingClient) -> float:
    """forward_backward + optim_step on PHRASE; the loss of the forward_backward."""
    fb = run.forward_backward([sft_datum()], "cross_entropy")
    opt = run.optim_step(types.AdamParams(learning_rate=LR))
    loss = fb.result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"]
    opt.result(timeout=RESULT_TIMEOUT_S)
    return loss


def test_each_refused_request_fails_alone_and_the_run_trains_on_as_if_it_never_came(reference) -> None:
    run, clean = _run(reference, seed=3), _run(reference, seed=3)
    losses, expected = [], []
    for kind in REFUSALS:
        send, message = REFUSALS[kind]
        assert message in _refused(send(run)), kind
        losses.append(_step(run))  # the next request of the run is not held behind the refused seq_id
        expected.append(_step(clean))
    assert losses == pytest.approx(expected, rel=REL)
    assert expected[-1] < expected[0]  # it trained


def test_refused_requests_on_every_slot_leave_room_for_a_new_tenant(start_server) -> None:
    server = start_server("--auth", "keys", "--max-slots", "2", "--slot-wait-s", "0.5")
    alice, bob = create_key(server.data_dir, "alice"), create_key(server.data_dir, "bob")
    first_losses = []
    for kind in REFUSALS:  # one wedge attempt per run: a refusal, then work that must still run
        run = _run(server, seed=1, key=alice)
        send, message = REFUSALS[kind]
        assert message in _refused(send(run)), kind
        fb = run.forward_backward([sft_datum()], "cross_entropy")  # gradients held: the run is pinned
        first_losses.append(fb.result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"])
    assert first_losses == pytest.approx([first_losses[0]] * len(REFUSALS), rel=REL)
    newcomer = _run(server, seed=1, key=bob)  # every slot holds alice's gradients: bob waits, then gets one
    assert _step(newcomer) == pytest.approx(first_losses[0], rel=REL)


def _post(server: Server, route: str, headers: dict[str, str] | None = None, **kwargs) -> dict:
    headers = {"X-API-Key": "tml-local", **(headers or {})}
    reply = httpx.post(f"{server.base_url}/api/v1/{route}", headers=headers, **kwargs)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _outcome(server: Server, request_id: str, deadline_s: float = RESULT_TIMEOUT_S) -> dict:
    """A future's outcome over raw HTTP: long-polls until it is no longer try_again."""
    deadline = time.monotonic() + deadline_s
    while True:
        reply = _post(server, "retrieve_future", json={"request_id": request_id})
        if reply.get("type") != "try_again":
            return reply
        assert time.monotonic() < deadline, f"{request_id} still pending"


def _run_status(server: Server, run_id: str) -> str:
    with sqlite3.connect(server.data_dir / "loraplex.db") as db:
        return db.execute("SELECT status FROM training_runs WHERE id = ?", (run_id,)).fetchone()[0]


def test_a_session_that_dies_with_a_gap_in_its_log_fails_what_waits_behind_it_and_frees_its_slot(
    start_server,
) -> None:
    server = start_server("--max-slots", "1", "--session-timeout-s", "1", "--long-poll-s", "1")
    session = types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version=tinker.__version__)
    session_id = _post(server, "create_session", json=session.model_dump(mode="json"))["session_id"]
    create = types.CreateModelRequest(
        session_id=session_id,
        model_seq_id=0,
        base_model=base_model(server),
        lora_config=types.LoraConfig(rank=8, seed=1),
    )
    created = _post(server, "create_model", json=create.model_dump(mode="json", exclude_none=True))
    run_id = created["model_id"]
    assert _outcome(server, created["request_id"])["model_id"] == run_id
    fb_input = types.ForwardBackwardInput(data=[sft_datum()], loss_fn="cross_entropy")
    skipped = types.ForwardBackwardRequest(model_id=run_id, seq_id=2, forward_backward_input=fb_input)
    body = forward_backward_request_to_proto(skipped).SerializeToString()
    stuck = _post(
        server, "forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}
    )
    # No heartbeat, and seq_id 1 never comes: once the lease lapses, seq 2 fails and the run is parked.
    outcome = _outcome(server, stuck["request_id"], deadline_s=30)
    assert outcome["category"] == "user"
    assert outcome["error"] == (
        f"training run {run_id} never received seq_id 1 (its session expired, or it was refused before its "
        "seq_id could be read); this request waited behind it and is dropped"
    )
    deadline = time.monotonic() + 30
    while _run_status(server, run_id) != "parked":
        assert time.monotonic() < deadline, "the run kept its slot"
        time.sleep(0.1)
    newcomer = _run(server, seed=1)  # the one slot is free for another client
    first = _step(newcomer)
    assert first > 0 and _step(newcomer) < first


def _train(server: Server, seed: int, key: str = "tml-local") -> list[np.ndarray]:
    """3 rounds of (2-3 forward_backwards, optim_step) on the client's own data; per forward_backward
    its loss:sum followed by its logprobs."""
    run, rng = _run(server, seed, key), np.random.default_rng(seed)
    out = []
    for round_ in range(3):
        passes = [
            run.forward_backward([sft_datum(_tokens(int(rng.integers(1 << 30))))], "cross_entropy")
            for _ in range(2 + (seed + round_) % 2)
        ]
        step = run.optim_step(types.AdamParams(learning_rate=LR))
        for fb in passes:
            result = fb.result(timeout=RESULT_TIMEOUT_S)
            out.append(np.array([result.metrics["loss:sum"]]))
            out.append(result.loss_fn_outputs[0]["logprobs"].to_numpy())
        step.result(timeout=RESULT_TIMEOUT_S)
    return out


def _assert_close(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=REL, atol=1e-6)


def _parks(server: Server) -> dict[str, float]:
    """loraplex_parks_total by where the runs' state went (host memory or disk)."""
    samples = scrape(server)
    return {to: value(samples, "loraplex_parks_total", to=to) for to in ("host", "disk")}


def _parked_entries(server: Server) -> list[str]:
    """What parked/ holds: a run's state, or the hidden directory it is written to first."""
    try:
        return [entry.name for entry in (server.data_dir / "parked").iterdir()]
    except FileNotFoundError:  # nothing parked yet
        return []


@pytest.mark.parametrize("host_slots", [[], ["--host-slots", "0"]], ids=["host-tier", "disk-only"])
def test_six_clients_taking_turns_on_two_slots_each_train_exactly_as_alone(
    start_server, reference, host_slots: list[str]
) -> None:
    server = start_server("--max-slots", "2", *host_slots)
    seeds = [11, 12, 13, 14, 15, 16]
    written: list[str] = []  # whatever appears under parked/ while the clients train
    training = threading.Event()
    training.set()

    def watch_parked() -> None:
        while training.is_set():
            written.extend(_parked_entries(server))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch_parked)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(seeds)) as pool:
            together = dict(zip(seeds, pool.map(lambda seed: _train(server, seed), seeds), strict=True))
    finally:
        training.clear()
        watcher.join()
    parks = _parks(server)
    if host_slots:  # disk only: every turn writes the run's state under parked/ and reads it back
        assert parks["host"] == 0 and parks["disk"] >= 4 and written
    else:  # the host tier (sized from free memory) has room for all six: nothing touches the disk
        assert parks["disk"] == 0 and parks["host"] >= 4 and written == []
    for seed in seeds:
        _assert_close(together[seed], _train(reference, seed))


def test_a_run_parked_with_pending_gradients_for_a_starved_waiter_gets_them_back_exactly(
    start_server, reference
) -> None:
    server = start_server("--max-slots", "1", "--slot-wait-s", "0.3")

    def pinned_then_stepped(target: Server, while_pinned: Callable[[], None]) -> list[float]:
        run = _run(target, seed=5)
        fb = run.forward_backward([sft_datum()], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        while_pinned()  # the run holds gradients not yet stepped
        step = run.optim_step(types.AdamParams(learning_rate=LR)).result(timeout=RESULT_TIMEOUT_S)
        return [fb.metrics["loss:sum"], step.metrics["grad_norm"], _step(run), _step(run)]

    other_done = threading.Event()
    other: list[float] = []

    def other_client() -> None:  # needs the only slot, which a pinned run holds: it waits slot_wait_s
        other.append(_step(_run(server, seed=6)))
        other_done.set()

    def let_the_other_client_train() -> None:
        thread = threading.Thread(target=other_client)
        thread.start()
        assert other_done.wait(RESULT_TIMEOUT_S), "the waiting client never got the slot"
        thread.join()

    parked = pinned_then_stepped(server, let_the_other_client_train)
    alone = pinned_then_stepped(reference, lambda: None)
    assert parked == pytest.approx(alone, rel=REL)
    assert alone[1] > 0  # the step saw the gradients
    assert other == pytest.approx([_step(_run(reference, seed=6))], rel=REL)
