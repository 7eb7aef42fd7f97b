"""Fixtures of the vLLM sampler's tests: a real `loraplex serve --sampler vllm` that starts vLLM from the
.venv-vllm `make vllm` builds, and the built-in sampler, in this process, as the reference.

Their servers give vLLM a 1 GiB KV cache on the CPU (VLLM_CPU_KVCACHE_SPACE): vLLM's own default takes
nearly all the host's memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import SampleRequest, SampleResult
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout
from tests.e2e.conftest import REPO, Server, _servers

VLLM_ENV = REPO / ".venv-vllm"


def vllm_python() -> Path:
    """The python of .venv-vllm; the test is skipped, saying why, where vLLM could not be installed."""
    if (unavailable := VLLM_ENV / "UNAVAILABLE").exists():
        pytest.skip(f"vLLM cannot run on this platform: {unavailable.read_text().strip()}")
    python = VLLM_ENV / "bin" / "python"
    if not python.exists():
        pytest.skip("vLLM is not installed: `make vllm` builds .venv-vllm (`make test` builds it first)")
    return python


def vllm_server_args(*extra: str) -> list[str]:
    """The arguments of a server that samples on a vLLM server it starts."""
    return ["--sampler", "vllm", "--vllm-python", str(vllm_python()), *extra]


@pytest.fixture(scope="module")
def start_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """start(*args) -> a healthy server sampling on vLLM, its vLLM server up; stopped after the module."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with _servers(tmp_path_factory.mktemp("vllm")) as start:

        def start_with_vllm(*args: str) -> Server:
            server = start(*vllm_server_args(*args))
            wait_until_sampler_up(server)
            return server

        yield start_with_vllm


def wait_until_sampler_up(server: Server, downs: int = 0, timeout_s: float = 600.0) -> dict:
    """The server's healthz once its vLLM server is up (loading the model takes it tens of seconds), after
    going down at least `downs` times."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.base_url}/api/v1/healthz", timeout=5).json()
        if all(s["up"] and s["restarts"] >= downs for s in health["sampler"]["servers"]):
            return health
        time.sleep(0.5)
    raise TimeoutError(f"the vLLM server did not come up; see {server.data_dir / 'logs' / 'vllm-0.log'}")


class Reference:
    """The built-in sampler on the server's own base model (its data dir holds it), in this process."""

    def __init__(self, data_dir: Path) -> None:
        self.layout = DiskLayout(data_dir)
        self.engine: LocalEngine = build_local_engine(
            "tiny", data_dir, "cpu", max_slots=1, max_rank=64, model_name=None
        )

    def snapshot(self, tinker_path: str) -> Path:
        """The directory of a snapshot saved with save_weights_for_sampler."""
        return self.layout.checkpoint_dir(CheckpointPath.parse(tinker_path))

    def sample(self, request: SampleRequest) -> SampleResult:
        self.engine.add_sample("reference", request)
        while True:
            for _, result in self.engine.step_sampler():
                assert isinstance(result, SampleResult), result
                return result


def ids(values: object) -> list[int]:
    return [int(v) for v in np.asarray(values).tolist()]
