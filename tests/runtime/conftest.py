"""Runtime fixtures: a Runtime over the FakeEngine and a SQLite file in a temp directory."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loraplex.config import ServerConfig
from loraplex.engine.types import AdamParams, DatumInput, LoraConfig
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.futures import FutureRecord
from loraplex.runtime.control.store import Store
from loraplex.runtime.core.commands import CreateRun, ForwardBackward, OptimStep
from tests.fakes import FakeEngine

PHRASE = np.array([3, 17, 9, 41, 5, 22, 8], dtype=np.int64)


def make_service(data_dir: Path, engine: FakeEngine | None = None, **config: Any) -> Runtime:
    """A started service on `data_dir` (a second call on the same dir is a restart)."""
    cfg = ServerConfig(data_dir=data_dir, **config)
    service = Runtime.open(engine or FakeEngine(), cfg)
    service.start()
    return service


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty store on each supported database (a test module may define its own `store` instead)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    else:
        from tests.e2e.postgres import create_database

        url = create_database(
            request.getfixturevalue("postgres_url_prefix"), f"store_{uuid.uuid4().hex[:12]}"
        )
    opened = Store(url)
    yield opened
    opened.close()


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., Runtime]]:
    started: list[Runtime] = []

    def factory(engine: FakeEngine | None = None, subdir: str = "data", **config: Any) -> Runtime:
        started.append(make_service(tmp_path / subdir, engine, **config))
        return started[-1]

    yield factory
    for service in started:
        service.stop()


@contextmanager
def held(service: Runtime) -> Iterator[None]:
    """Keep the worker from planning, so everything submitted meanwhile is planned together."""
    with service.state.cond:
        yield


def result_of(service: Runtime, record: FutureRecord, tenant: str = "local") -> FutureRecord:
    """Wait for a future's outcome (fails the test after one long-poll)."""
    done = asyncio.run(service.futures.retrieve(tenant, record.id))
    assert done.is_done, f"{record.request_type} future still pending"
    return done


def sft_pass(tokens: np.ndarray = PHRASE, forward_only: bool = False, weight: float = 1.0) -> ForwardBackward:
    """cross_entropy over one next-token datum."""
    inputs = {"target_tokens": tokens[1:], "weights": np.full(len(tokens) - 1, weight, np.float32)}
    return ForwardBackward("cross_entropy", {}, [DatumInput(tokens[:-1], inputs)], forward_only)


def rl_pass(loss_fn: str, tokens: np.ndarray = PHRASE, **config: float) -> ForwardBackward:
    """An RL-loss datum with fixed sampler logprobs and advantages."""
    n = len(tokens) - 1
    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": np.full(n, -3.0, np.float32),
        "advantages": np.linspace(-1.0, 1.0, n).astype(np.float32),
    }
    return ForwardBackward(loss_fn, dict(config), [DatumInput(tokens[:-1], inputs)], False)


def create_run(service: Runtime, tenant: str = "local", seed: int = 1, rank: int = 4) -> str:
    """A session and a created run; returns the run id."""
    session = service.sessions.create(tenant, {})
    command = CreateRun(LoraConfig(rank=rank, seed=seed), service.info.model_name)
    record = service.training.create_run(tenant, session, 0, command)
    assert result_of(service, record, tenant).result == {
        "model_id": f"{session}:train:0",
        "type": "create_model",
    }
    return f"{session}:train:0"


def train_steps(
    service: Runtime,
    run_id: str,
    steps: int,
    tenant: str = "local",
    first_seq: int = 1,
    lr: float = 0.05,
) -> list[float]:
    """`steps` rounds of forward_backward + optim_step; returns each round's loss:sum."""
    losses, seq = [], first_seq
    for _ in range(steps):
        fb = service.training.submit(tenant, run_id, seq, sft_pass())
        opt = service.training.submit(tenant, run_id, seq + 1, OptimStep(AdamParams(learning_rate=lr)))
        losses.append(result_of(service, fb, tenant).result.metrics["loss:sum"])  # type: ignore[union-attr]
        assert result_of(service, opt, tenant).status == "complete"
        seq += 2
    return losses
