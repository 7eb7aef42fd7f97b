"""A vLLM OpenAI server process this server starts (`serve --vllm-python`), and stops, kills and restarts.

The server runs in a process group of its own (vLLM starts an engine-core and worker processes under
it), so that a kill reaches all of them and none outlives a restart. Its output goes to a log file in
the data directory, whose tail an error quotes when the server does not come up. No tensors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.errors import UserError

log = logging.getLogger(__name__)

_CPU_KV_CACHE_GIB = 4  # vLLM's own default on a CPU takes nearly all the host's memory
_STOP_WAIT_S = 15.0  # a vLLM server stopped with SIGTERM is killed if still running after this long
_LOG_TAIL_BYTES = 4000


@dataclass
class VllmProcess:
    """How to start one vLLM server, and the running one (None when stopped)."""

    python: Path
    arguments: list[str]  # everything after `-m vllm.entrypoints.openai.api_server`, but the port
    log_path: Path
    environment: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    port: int = 0  # of the running server
    popen: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if not os.access(self.python, os.X_OK):
            raise UserError(
                f"--vllm-python {self.python} is not an executable python; `make vllm` builds one at "
                ".venv-vllm/bin/python"
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start the server on a free port; its base URL. (It answers once it has loaded the model.)"""
        self.port = _free_port()
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", *self.arguments]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as output:
            output.write(f"\n--- loraplex starts: {' '.join(command)}\n".encode())
            output.flush()
            self.popen = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.environment},
                start_new_session=True,  # its own process group: a kill reaches its engine and workers
            )
        log.info(
            "started a vLLM server (pid %d) on %s; its output goes to %s",
            self.popen.pid,
            self.url,
            self.log_path,
        )
        return self.url

    def exit_code(self) -> int | None:
        """The exit code of a server that ended; None while it runs (or was never started)."""
        return None if self.popen is None else self.popen.poll()

    def kill(self) -> None:
        """Kill the server's whole process group at once (a stalled server answers no SIGTERM)."""
        self._signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()
            self.popen = None

    def stop(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL if it has not ended within seconds."""
        if self.popen is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "the vLLM server (pid %d) did not stop within %g s; killing it", self.popen.pid, _STOP_WAIT_S
            )
        self.kill()

    def log_tail(self) -> str:
        """The end of the server's output (what an error about it quotes)."""
        try:
            with open(self.log_path, "rb") as output:
                output.seek(max(0, output.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                return output.read().decode(errors="replace")
        except OSError:
            return ""

    def _signal(self, sig: signal.Signals) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):  # already gone, with its group
            os.killpg(self.popen.pid, sig)


def lora_server(
    python: Path,
    model_dir: Path,
    served_name: str,
    max_model_len: int,
    max_rank: int,
    max_loras: int,
    max_logprobs: int,
    on_cpu: bool,
    log_path: Path,
    extra_arguments: Sequence[str] = (),
    devices: list[str] | None = None,
) -> VllmProcess:
    """How loraplex starts a vLLM server for sampling LoRA snapshots of `model_dir` (docs/VLLM.md has the
    table): adapters up to `max_rank` loaded at run time, `max_loras` at once, logprobs of the distribution
    each token was drawn from; on a CPU fp32 (as the engine computes there), a KV cache of
    _CPU_KV_CACHE_GIB and no worker process, unless their variables are set; on `devices` (CUDA ids)
    only, with tensor parallelism across them; `extra_arguments` last (they win)."""
    arguments = [
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--max-model-len",
        str(max_model_len),
        "--enable-lora",
        "--max-lora-rank",
        str(_vllm_rank(max_rank)),
        "--max-loras",
        str(max_loras),
        "--max-cpu-loras",
        str(max_loras),
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        str(max_logprobs),
    ]
    environment = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    if on_cpu:  # bf16 matmuls are ~100x slower on CPUs, and the engine computes in fp32
        arguments += ["--dtype", "float32"]
        cpu_defaults = {
            "VLLM_CPU_KVCACHE_SPACE": str(_CPU_KV_CACHE_GIB),
            # The model runs in the engine core's process, not in a worker process of its own: on a
            # CPU nothing overlaps with the model's work, and the worker costs ~10 s of start-up and
            # an inter-process hop per step (docs/VLLM.md has the measurement).
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        environment |= {name: value for name, value in cpu_defaults.items() if name not in os.environ}
    if devices is not None:
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        arguments += ["--tensor-parallel-size", str(len(devices))]
    return VllmProcess(python, [*arguments, *extra_arguments], log_path, environment)


def _vllm_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts at or above `rank` (it takes a fixed set of sizes)."""
    sizes = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    return next((size for size in sizes if size >= rank), rank)


def _free_port() -> int:
    """A port free on the loopback interface now (the server binds it moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
