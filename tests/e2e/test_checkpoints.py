"""Checkpoints through the SDK: exact resume, weights-only resume, rolling deletion, restart after kill -9."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker

from loraplex.runtime.control.recovery import RESTART_ERROR
from tests.e2e.conftest import Server
from tests.e2e.sdk import client, logprobs, new_run, sft_steps


def test_save_state_then_resume_with_optimizer_takes_the_same_next_steps(server) -> None:
    service = client(server)
    run = new_run(service, server)
    sft_steps(run, 2)
    path = run.save_state("step2").result().path
    assert path == f"tinker://{run.model_id}/weights/step2"
    uninterrupted = sft_steps(run, 2)
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id == f"{resumed.holder.get_session_id()}:train:1"  # the second model of the session
    np.testing.assert_allclose(sft_steps(resumed, 2), uninterrupted, rtol=1e-5)


def test_create_training_client_from_state_loads_the_weights_with_a_fresh_optimizer(server) -> None:
    service = client(server)
    run = new_run(service, server)
    sft_steps(run, 2)
    path = run.save_state("weights-only").result().path
    loaded = service.create_training_client_from_state(path).result()
    assert loaded.get_info().lora_rank == 8
    np.testing.assert_allclose(logprobs(loaded), logprobs(run), rtol=1e-6)


def test_rolling_checkpoints_delete_the_previous_one(server) -> None:
    service = client(server)
    run = new_run(service, server)
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-local")
    old = run.save_state("000001").result().path
    run.save_state("000002").result()
    rest.delete_checkpoint_from_tinker_path(old).result()
    listed = rest.list_checkpoints(run.model_id).result().checkpoints
    assert [c.checkpoint_id for c in listed] == ["weights/000002"]
    with pytest.raises(tinker.NotFoundError, match="not found"):
        service.create_training_client_from_state(old).result()


def _post(server: Server, route: str, body: dict) -> dict:
    reply = httpx.post(
        f"{server.base_url}/api/v1/{route}", json=body, headers={"X-API-Key": "tml-local"}, timeout=40
    )
    return reply.json()


def test_after_kill_9_runs_checkpoints_and_results_survive_and_training_resumes(
    start_server, database_args: list[str]
) -> None:
    server = start_server(*database_args)
    service = client(server)
    run = new_run(service, server)
    sft_steps(run, 1)  # seq 1, 2
    path = run.save_state("before-crash").result().path  # seq 3
    expected = sft_steps(run, 1)  # seq 4, 5
    finished = _post(server, "save_weights", {"model_id": run.model_id, "seq_id": 6, "path": "raw"})[
        "request_id"
    ]
    assert _post(server, "retrieve_future", {"request_id": finished})["path"].endswith("/weights/raw")
    held = _post(server, "optim_step", {"model_id": run.model_id, "seq_id": 8, "adam_params": {}})[
        "request_id"
    ]
    server.kill()  # seq 8 waits for the missing seq 7 when the process dies

    restarted = start_server(*database_args, after=server)
    rest = tinker.RestClient(base_url=restarted.base_url, api_key="tml-local")
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [run.model_id]
    listed = rest.list_checkpoints(run.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [path, path.replace("before-crash", "raw")]
    assert _post(restarted, "retrieve_future", {"request_id": finished})["path"].endswith("/weights/raw")
    assert _post(restarted, "retrieve_future", {"request_id": held}) == {
        "error": RESTART_ERROR,
        "category": "server",
    }
    resumed = client(restarted).create_training_client_from_state_with_optimizer(path).result()
    np.testing.assert_allclose(sft_steps(resumed, 1), expected, rtol=1e-5)
