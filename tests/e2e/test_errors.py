"""Bad input through the SDK: each fails alone with a precise user error; the run and the server carry on."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker

from tests.e2e.sdk import PHRASE, base_model, client, create_key, logprobs, new_run, rl_datum, sft_datum

N = len(PHRASE) - 1


@pytest.fixture(scope="module")
def run(module_server) -> tinker.TrainingClient:
    return new_run(client(module_server), module_server)


def _user_error(future) -> str:
    with pytest.raises(tinker.RequestFailedError) as caught:
        future.result()
    assert caught.value.category == tinker.types.RequestErrorCategory.User
    return str(caught.value)


BAD_PASSES = {
    "unknown loss": (lambda: [sft_datum()], "no_such_loss", None, "no_such_loss"),
    "target length mismatch": (
        lambda: [_with(sft_datum(), target_tokens=np.array(PHRASE, np.int64))],
        "cross_entropy",
        None,
        "target_tokens",
    ),
    "token id beyond the vocabulary": (
        lambda: [_with(sft_datum(), target_tokens=np.full(N, 10**6, np.int64))],
        "cross_entropy",
        None,
        "target_tokens",
    ),
    "NaN advantages": (
        lambda: [rl_datum(advantages=np.full(N, np.nan, np.float32))],
        "ppo",
        None,
        "advantages",
    ),
    "missing advantages": (
        lambda: [_without(rl_datum(), "advantages")],
        "importance_sampling",
        None,
        "advantages",
    ),
    "unknown config key": (lambda: [rl_datum()], "ppo", {"clip_bogus": 1.0}, "clip_bogus"),
}


@pytest.mark.parametrize("case", sorted(BAD_PASSES))
def test_a_malformed_forward_backward_fails_alone_with_a_user_error_naming_the_problem(
    run, case: str
) -> None:
    make_data, loss_fn, config, mentioned = BAD_PASSES[case]
    before = logprobs(run)
    message = _user_error(run.forward_backward(make_data(), loss_fn, config))
    assert mentioned in message
    np.testing.assert_array_equal(logprobs(run), before)  # the run still answers, and nothing changed


DIMUON_REFUSED = (
    "the 'dimuon' optimizer is not supported by this server, only AdamW: create the run with "
    'optimizer_config {"type": "adamw"} (the default) and step it with adam_params'
)


def test_the_sdks_dimuon_optimizer_is_refused_by_name_at_create_and_at_optim_step(module_server, run) -> None:
    service = client(module_server)
    dimuon = tinker.types.DimuonOptimizerConfig()
    with pytest.raises(tinker.UnprocessableEntityError) as refused:  # 422: the SDK does not retry it
        service.create_lora_training_client(base_model=base_model(module_server), optimizer=dimuon).result()
    assert refused.value.body == {
        "detail": f"invalid request body: body.optimizer_config: Value error, {DIMUON_REFUSED}"
    }
    before = logprobs(run)
    step = run.optim_step(tinker.types.DimuonParams(learning_rate=1e-3))
    assert _user_error(step).startswith(
        f"Request failed: invalid request body: optimizer_params: Value error, {DIMUON_REFUSED} for "
    )
    np.testing.assert_array_equal(logprobs(run), before)


def test_saving_under_an_existing_name_without_overwrite_is_a_user_error(run) -> None:
    run.save_state("taken").result()
    assert "already exists" in _user_error(run.save_state("taken"))
    assert run.save_state("taken", overwrite=True).result().path.endswith("/weights/taken")


@pytest.mark.parametrize("name", ["../escape", "a/b", ".."])
def test_a_checkpoint_name_with_traversal_is_refused(run, name: str) -> None:
    assert "invalid checkpoint name" in _user_error(run.save_state(name))


def test_a_request_over_the_datum_limit_fails_with_the_limit_named(start_server) -> None:
    server = start_server("--max-datums-per-request", "2")
    small = new_run(client(server), server)
    message = _user_error(small.forward_backward([sft_datum()] * 3, "cross_entropy"))
    assert "3 datums; this server allows at most 2" in message
    assert small.forward_backward([sft_datum()] * 2, "cross_entropy").result().metrics["loss:sum"] > 0


def test_another_tenants_run_checkpoint_and_future_answer_404_with_a_body(start_server) -> None:
    server = start_server("--auth", "keys")
    alice_key, mallory_key = create_key(server.data_dir, "alice"), create_key(server.data_dir, "mallory")
    alice = new_run(client(server, alice_key), server)
    path = alice.save_state("private").result().path
    future = httpx.post(
        f"{server.base_url}/api/v1/optim_step",
        headers={"X-API-Key": alice_key},
        json={"model_id": alice.model_id, "seq_id": 2, "adam_params": {}},
    ).json()["request_id"]  # (seq 2 is free: alice's SDK client only used seq 1, the save)

    def as_mallory(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.base_url}/api/v1/{route}", headers={"X-API-Key": mallory_key}, json=body)

    foreign_run = as_mallory("optim_step", {"model_id": alice.model_id, "seq_id": 3, "adam_params": {}})
    foreign_ckpt = as_mallory("weights_info", {"tinker_path": path})
    foreign_future = as_mallory("retrieve_future", {"request_id": future})
    for reply, what in (
        (foreign_run, "training run"),
        (foreign_ckpt, "checkpoint"),
        (foreign_future, "future"),
    ):
        assert reply.status_code == 404 and what in reply.json()["detail"]
    with pytest.raises(tinker.NotFoundError):
        client(server, mallory_key).create_training_client_from_state(path).result()
    unknown = httpx.post(
        f"{server.base_url}/api/v1/create_session", headers={"X-API-Key": "tml-unknown"}, json={}
    )
    assert unknown.status_code == 401
    own = httpx.post(
        f"{server.base_url}/api/v1/retrieve_future",
        headers={"X-API-Key": alice_key},
        json={"request_id": future},
    )
    assert own.json()["metrics"]["grad_norm"] == 0.0  # alice is unaffected and still reads her own future
    assert (
        client(server, alice_key).create_training_client_from_state(path).result().get_info().lora_rank == 8
    )


def _with(datum: tinker.types.Datum, **inputs: np.ndarray) -> tinker.types.Datum:
    return tinker.types.Datum(
        model_input=datum.model_input, loss_fn_inputs={**datum.loss_fn_inputs, **inputs}
    )


def _without(datum: tinker.types.Datum, key: str) -> tinker.types.Datum:
    kept = {k: v for k, v in datum.loss_fn_inputs.items() if k != key}
    return tinker.types.Datum(model_input=datum.model_input, loss_fn_inputs=kept)
