"""Helpers shared by the e2e tests: SDK clients, datums and training loops (public `tinker` API only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from tinker import types

from tests.e2e.conftest import REPO, Server

PHRASE = [3, 17, 9, 41, 5, 22, 8, 30, 12, 7]
# A learning rate at which 30 steps on PHRASE converge smoothly on the tiny model.
LR = 2e-3


def client(server: Server, key: str = "tml-local", **options: Any) -> tinker.ServiceClient:
    """An SDK client of `server` (ServiceClient `options` such as project_id), closed (its session
    finished) before the server stops: one left open would send heartbeats to a stopped server for the
    rest of the pytest process."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key, **options)
    server.clients.append(service)
    return service


def base_model(server: Server) -> str:
    """The model the server serves, as the SDK learns it (get_server_capabilities)."""
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-local")
    name = rest.get_server_capabilities().result().supported_models[0].model_name
    assert name is not None
    return name


def new_run(service: tinker.ServiceClient, server: Server, seed: int = 1) -> tinker.TrainingClient:
    """A fresh rank-8 LoRA run."""
    return service.create_lora_training_client(base_model=base_model(server), rank=8, seed=seed).result()


def sft_datum(tokens: list[int] = PHRASE) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64), "weights": np.ones(n, np.float32)},
    )


def rl_datum(tokens: list[int] = PHRASE, **overrides: np.ndarray) -> types.Datum:
    n = len(tokens) - 1
    inputs = {
        "target_tokens": np.array(tokens[1:], np.int64),
        "logprobs": np.full(n, -2.0, np.float32),
        "advantages": np.linspace(-1.0, 1.0, n).astype(np.float32),
        **overrides,
    }
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def sft_steps(run: tinker.TrainingClient, steps: int, datum: types.Datum | None = None) -> list[float]:
    """forward_backward + optim_step, submitted back to back as the cookbook does; each step's loss:sum."""
    losses = []
    for _ in range(steps):
        fb = run.forward_backward([datum or sft_datum()], "cross_entropy")
        opt = run.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def logprobs(run: tinker.TrainingClient, datum: types.Datum | None = None) -> np.ndarray:
    out = run.forward([datum or sft_datum()], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def create_key(data_dir: Path, tenant: str, admin: bool = False) -> str:
    """A key from the real `loraplex keys create` command (`--admin`: the console shows it every tenant)."""
    cmd = [
        sys.executable,
        "-m",
        "loraplex.cli",
        "keys",
        "create",
        "--tenant",
        tenant,
        "--data-dir",
        str(data_dir),
        *(["--admin"] if admin else []),
    ]
    return subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
