"""`bench sample --sampler vllm`: the same snapshots and prompts sampled by a vLLM OpenAI server, started
here as `serve --sampler vllm --vllm-python` starts one (runtime/vllm/process.py), with every snapshot
loaded as an adapter before the first round.

A round sends every prompt of every snapshot at once, each as the /v1/completions body the vLLM sampler
sends (runtime/vllm/requests.py: greedy, `stop=()` so exactly `new_tokens` tokens), and ends when the last
answer is in: the time a loraplex server on vLLM would take for the same requests, less its own HTTP hop.
The server's CPU is its own process's, not this one's: on a CPU host, it and the engine share the cores
only by turns (rounds alternate).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import httpx
import numpy as np

from loraplex.engine.types import SampleRequest, SamplingParams
from loraplex.runtime.vllm.process import VllmProcess, lora_server
from loraplex.runtime.vllm.requests import completion_body

_START_TIMEOUT_S = 900.0


class VllmSampling:
    """A vLLM server with the snapshots loaded; `__call__` samples every prompt of every snapshot once."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        prompts: list[list[np.ndarray]],
        snapshots: list[Path],
        new_tokens: int,
        rank: int,
        on_cpu: bool,
        log_path: Path,
    ) -> None:
        longest = max(len(p) for ps in prompts for p in ps)
        self.process: VllmProcess = lora_server(
            python,
            model_dir,
            "base",
            longest + new_tokens,
            rank,
            len(snapshots),
            max_logprobs=0,
            on_cpu=on_cpu,
            log_path=log_path,
        )
        self.new_tokens = new_tokens
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
        self.url = self.process.start()
        try:
            self._wait_until_up()
            for k, directory in enumerate(snapshots):
                load = {"lora_name": f"snapshot{k}", "lora_path": str(directory.resolve())}
                httpx.post(f"{self.url}/v1/load_lora_adapter", json=load, timeout=120).raise_for_status()
        except BaseException:
            self.process.stop()
            raise
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, stop=())
        self.bodies = [
            completion_body(SampleRequest(prompt, params), f"snapshot{k}", new_tokens)
            for k, snapshot_prompts in enumerate(prompts)
            for prompt in snapshot_prompts
        ]

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if (code := self.process.exit_code()) is not None:
                raise RuntimeError(f"the vLLM server exited with code {code}:\n{self.process.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the vLLM server did not answer within {_START_TIMEOUT_S:g} s")

    def __call__(self) -> None:
        asyncio.run(self._round())

    async def _round(self) -> None:
        limits = httpx.Limits(max_connections=len(self.bodies))
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            answers = await asyncio.gather(
                *(client.post(f"{self.url}/v1/completions", json=body) for body in self.bodies)
            )
        for answer in answers:
            if answer.status_code != 200:
                raise RuntimeError(
                    f"vLLM answered {answer.status_code}: {answer.text[:500]}\n{self.process.log_tail()}"
                )
            (choice,) = answer.json()["choices"]
            if len(choice["token_ids"]) != self.new_tokens:
                raise RuntimeError(f"vLLM generated {len(choice['token_ids'])} tokens, not {self.new_tokens}")

    def close(self) -> None:
        self.process.stop()
