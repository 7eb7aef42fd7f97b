"""The vLLM sampler backend (`serve --sampler vllm`): sampling requests decoded by vLLM OpenAI servers.

The engine thread only hands requests over and collects what finished: each request becomes one
/v1/completions call on the least busy server that is up (runtime/vllm/requests.py builds it), made on
this backend's own event loop thread, which also supervises the servers (server.py). A finished call is
queued for the engine loop's next `step_sampler`, and the loop is woken for it.

Prompt logprobs (and their top-k) are computed by the training engine's own sampler, beside the vLLM
call, and joined to its samples: vLLM 0.32's CPU build fails on prompt logprobs once LoRA is enabled (its
lm_head LoRA kernel is handed the sampled rows' adapter indices for the prompt's rows, raises, and the
failure kills the server's engine), and the engine's scores are the built-in sampler's, exactly.
docs/VLLM.md lists what each backend serves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shlex
import shutil
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loraplex.config import ServerConfig
from loraplex.engine.interface import Engine
from loraplex.engine.sampler.validation import resolved_max_tokens
from loraplex.engine.types import (
    DatumInput,
    LoraConfig,
    PassRequest,
    SampleProgress,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from loraplex.errors import ServerError, UnavailableError, UserError
from loraplex.os_threads import name_os_thread
from loraplex.runtime.core.sampler_backend import EngineSampler, SamplerBackend, SamplerServer
from loraplex.runtime.vllm.base_check import (
    base_model_mismatch,
    check_body,
    check_prompt,
    logprob_gap,
    served_logprobs,
)
from loraplex.runtime.vllm.process import VllmProcess, lora_server
from loraplex.runtime.vllm.requests import calls, completion_body, refuse_unsupported, sample_result
from loraplex.runtime.vllm.server import VllmServer
from loraplex.runtime.vllm.staging import SnapshotStaging

log = logging.getLogger(__name__)

# Samples handed to one vLLM server at once (vLLM batches and queues them itself): enough to keep a GPU's
# batch full, few enough that the runtime's per-tenant turns still decide the order.
ROWS_PER_SERVER = 256
# Prompt scoring on the training engine: the prompt's own logprobs, one token drawn (as /v1 scores).
_SCORING_PARAMS = SamplingParams(max_tokens=1, temperature=1.0)


@dataclass
class _Pending:
    """A request in flight: its vLLM call, and the engine's scoring of its prompt when it asked for it."""

    call: concurrent.futures.Future[SampleResult]
    scored: bool  # its prompt is scored on the engine
    samples: SampleResult | Exception | None = None
    scores: SampleResult | Exception | None = None

    def outcome(self) -> SampleResult | Exception | None:
        """The finished request's result or error; None while a part is missing."""
        parts = [self.samples, self.scores] if self.scored else [self.samples]
        if (error := next((part for part in parts if isinstance(part, Exception)), None)) is not None:
            return error
        if any(part is None for part in parts):
            return None
        assert isinstance(self.samples, SampleResult)
        if isinstance(self.scores, SampleResult):
            self.samples.prompt_logprobs = self.scores.prompt_logprobs
            self.samples.topk_prompt_ids = self.scores.topk_prompt_ids
            self.samples.topk_prompt_logprobs = self.scores.topk_prompt_logprobs
        return self.samples


class VllmSampler(SamplerBackend):
    """Samples on vLLM servers; scores prompts on the engine."""

    name = "vllm"

    def __init__(
        self,
        engine: Engine,
        servers: list[VllmServer],
        max_logprobs: int,
        wake: Callable[[], None],
        staging: SnapshotStaging,
        base_adapter: Path,
    ) -> None:
        self.engine, self._servers, self.max_logprobs, self.wake = engine, servers, max_logprobs, wake
        # The base model is sampled through an adapter whose B is zero, never as vLLM's base model: vLLM
        # 0.32's CPU build gives a request without an adapter the delta of its last LoRA slot once that
        # slot holds one (measured: the tiny model's greedy logprobs moved from -5.44 to -4.20 after three
        # adapters had taken turns), and a zero delta adds exactly nothing.
        self.base_adapter = base_adapter
        self.staging = staging  # where the servers load snapshots from (shared by them)
        self.scorer = EngineSampler(engine)
        self._pending: dict[str, _Pending] = {}  # engine thread only
        self._finished: deque[tuple[str, SampleResult | Exception]] = deque()  # vLLM calls done (any thread)
        # Streaming requests' tokens not yet taken: key -> per sample (tokens, logprobs), under the lock.
        self._progress: dict[str, list[tuple[list[int], list[float]]]] = {}
        self._progress_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="loraplex-vllm", daemon=True)
        self._supervisors: list[concurrent.futures.Future[None]] = []
        self._check_prompt = check_prompt(engine.info.vocab_size)
        self._engine_logprobs = np.zeros(0)  # the check prompt's, scored by the engine at start
        for server in servers:
            server.check_base_model = self._check_base_model

    @classmethod
    def from_config(cls, config: ServerConfig, engine: Engine, wake: Callable[[], None]) -> VllmSampler:
        """The backend `config` describes: servers at --vllm-url, or one started with --vllm-python."""
        if (config.vllm_url is None) == (config.vllm_python is None):
            raise UserError("--sampler vllm needs either --vllm-url (running vLLM servers) or --vllm-python")
        if config.vllm_url is not None and config.vllm_devices is not None:
            raise UserError("--vllm-devices places the servers --vllm-python starts, not those of --vllm-url")
        max_logprobs = config.max_topk_sample_logprobs
        staging = SnapshotStaging(config.vllm_snapshot_dir)
        servers = []
        if config.vllm_url is not None:
            urls = [url.strip().rstrip("/") for url in config.vllm_url.split(",") if url.strip()]
            servers = [cls._server(config, index, url, None, staging) for index, url in enumerate(urls)]
        else:
            assert config.vllm_python is not None
            info = engine.info
            for index, devices in enumerate(device_groups(config.vllm_devices)):
                process = lora_server(
                    config.vllm_python,
                    Path(info.tokenizer_dir),
                    info.model_name,
                    info.max_context_length,
                    info.max_rank,
                    config.vllm_max_loras,
                    max_logprobs,
                    on_cpu=info.device == "cpu",
                    log_path=config.data_dir / "logs" / f"vllm-{index}.log",
                    extra_arguments=shlex.split(config.vllm_args),
                    devices=devices,
                )
                servers.append(cls._server(config, index, None, process, staging))
        if not servers:
            raise UserError(f"--vllm-url {config.vllm_url!r} names no server")
        return cls(engine, servers, max_logprobs, wake, staging, config.data_dir / "vllm" / "base-adapter")

    @staticmethod
    def _server(
        config: ServerConfig,
        index: int,
        url: str | None,
        process: VllmProcess | None,
        staging: SnapshotStaging,
    ) -> VllmServer:
        timeouts = config.vllm_timeout_s, config.vllm_start_timeout_s
        return VllmServer(index, url, process, config.vllm_max_loras, *timeouts, staging)

    # --- lifecycle
    def start(self) -> None:
        """Write the base model's zero adapter (before the engine loop runs: a slot for a moment) and score
        the base-model check's prompt on the engine, then start the servers."""
        shutil.rmtree(self.base_adapter, ignore_errors=True)
        slot = self.engine.create_slot(LoraConfig(rank=1))  # B starts at zero
        try:
            self.engine.save_snapshot(slot, self.base_adapter)
        finally:
            self.engine.free_slot(slot)
        prompt = np.array(self._check_prompt)
        datum = DatumInput(prompt[:-1], {"target_tokens": prompt[1:]})
        (scored,) = self.engine.run_pass([PassRequest(None, "cross_entropy", {}, [datum], forward_only=True)])
        if isinstance(scored, UserError):
            raise scored
        self._engine_logprobs = np.asarray(scored.outputs[0]["logprobs"], dtype=np.float64)
        self._thread.start()
        self._supervisors = [
            asyncio.run_coroutine_threadsafe(server.supervise(), self._loop) for server in self._servers
        ]

    def close(self) -> None:
        if not self._thread.is_alive():
            if self._thread.ident is None:  # never started: its loop never ran
                self._loop.close()
            return
        for supervisor in self._supervisors:
            supervisor.cancel()
        for pending in self._pending.values():
            pending.call.cancel()
        closing = [asyncio.run_coroutine_threadsafe(server.close(), self._loop) for server in self._servers]
        concurrent.futures.wait(closing, timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _run_loop(self) -> None:
        name_os_thread("lp-vllm")
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        # Stopped by close(): what is left is cancelled and the loop closed here, in its own thread, as
        # asyncio.run ends a loop.
        left = asyncio.all_tasks(self._loop)
        for task in left:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self._loop.close()

    # --- the engine loop's calls
    def validate_sample_request(self, request: SampleRequest) -> None:
        self.engine.validate_sample_request(request)
        refuse_unsupported(request, self.max_logprobs)

    def add_sample(self, key: str, request: SampleRequest) -> None:
        sampled = replace(request, prompt_logprobs=False, topk_prompt_logprobs=0, prompt_logprobs_last_n=None)
        scored = request.prompt_logprobs or request.topk_prompt_logprobs > 0
        if scored:
            scoring = replace(request, params=_SCORING_PARAMS, num_samples=1, topk_sample_logprobs=0)
            self.scorer.add_sample(key, replace(scoring, streams=False))
        call = asyncio.run_coroutine_threadsafe(self._sample(key, sampled), self._loop)
        self._pending[key] = _Pending(call, scored)
        call.add_done_callback(lambda done: self._call_done(key, done))

    def step_sampler(
        self, max_prefill_tokens: int | None = None
    ) -> list[tuple[str, SampleResult | Exception]]:
        if self.scorer.has_sampling_work():
            try:
                scored = self.scorer.step_sampler(max_prefill_tokens)
            except Exception as error:  # the engine dropped every scoring it held: those requests fail
                log.exception("scoring prompts on the engine failed")
                scored = [(key, error) for key, pending in self._pending.items() if pending.scored]
            for key, scores in scored:
                if (pending := self._pending.get(key)) is not None:
                    pending.scores = scores
        while self._finished:
            key, samples = self._finished.popleft()
            if (pending := self._pending.get(key)) is not None:
                pending.samples = samples
        finished = []
        for key, pending in list(self._pending.items()):
            if (outcome := pending.outcome()) is not None:
                del self._pending[key]
                self._forget_progress(key)  # the result holds every token
                if isinstance(outcome, Exception):  # the other part is no longer needed
                    self._drop(key, pending)
                finished.append((key, outcome))
        return finished

    def cancel_sample(self, key: str) -> bool:
        pending = self._pending.pop(key, None)
        if pending is None:
            return False
        self._drop(key, pending)
        return True

    def _drop(self, key: str, pending: _Pending) -> None:
        pending.call.cancel()
        self.scorer.cancel_sample(key)
        self._forget_progress(key)

    def take_sample_progress(self) -> dict[str, SampleProgress]:
        with self._progress_lock:
            taken, self._progress = self._progress, {}
        return {
            key: SampleProgress([tokens for tokens, _ in samples], [logprobs for _, logprobs in samples])
            for key, samples in taken.items()
            if key in self._pending
        }

    def _forget_progress(self, key: str) -> None:
        with self._progress_lock:
            self._progress.pop(key, None)

    def has_sampling_work(self) -> bool:
        return bool(self._finished) or bool(self._progress) or self.scorer.has_sampling_work()

    def sampling_rows(self) -> int:
        return ROWS_PER_SERVER * len(self._servers)

    def servers(self) -> list[SamplerServer]:
        return [server.report() for server in self._servers]

    def offer_snapshot(self, directory: Path) -> None:
        asyncio.run_coroutine_threadsafe(self._preload(directory), self._loop)

    async def _preload(self, directory: Path) -> None:
        """Load a new snapshot into every server that is up, so its first request does not wait for it (an
        RL loop samples each step's snapshot at once): the least recently used idle one makes room."""
        for server in [server for server in self._servers if server.up.is_set()]:
            try:
                server.release_adapter(await server.use_adapter(directory))
            except Exception as error:  # its first request loads it, or says why it cannot
                log.warning("%s did not load snapshot %s ahead: %s", server.where, directory, error)

    def forget_snapshot(self, directory: Path) -> None:
        asyncio.run_coroutine_threadsafe(self._forget(directory), self._loop)

    async def _forget(self, directory: Path) -> None:
        """Unload a deleted snapshot from every server, then delete its staged copies."""
        await asyncio.gather(*(server.forget(directory) for server in self._servers))
        await asyncio.to_thread(self.staging.drop, directory)

    # --- on the event loop
    def _call_done(self, key: str, done: concurrent.futures.Future[SampleResult]) -> None:
        """A vLLM call ended (any thread): queue its outcome for the engine loop, and wake it."""
        if done.cancelled():
            return  # cancelled by the engine loop: nobody waits for it
        error = done.exception()
        self._finished.append((key, done.result() if error is None else _as_outcome(error)))
        self.wake()

    def _on_tokens(self, key: str, request: SampleRequest) -> Callable[[int, list[int], list[float]], None]:
        """Where a streaming request's new tokens go (on the event loop): its progress, for the engine loop's
        next take, which it is woken for. A greedy request's one vLLM sample stands for all of them."""

        def note(index: int, tokens: list[int], logprobs: list[float]) -> None:
            with self._progress_lock:
                samples = self._progress.setdefault(key, [([], []) for _ in range(request.num_samples)])
                for sample in samples if calls(request) < request.num_samples else [samples[index]]:
                    sample[0].extend(tokens)
                    sample[1].extend(logprobs)
            self.wake()

        return note

    async def _sample(self, key: str, request: SampleRequest) -> SampleResult:
        server = await self._pick_server()
        task = asyncio.current_task()
        assert task is not None
        server.requests.add(task)
        try:
            name = await server.use_adapter(Path(request.snapshot or self.base_adapter))
            try:
                max_tokens = resolved_max_tokens(request, self.engine.info.max_context_length)
                body = completion_body(request, name, max_tokens)
                answer = await server.complete(
                    body, self._on_tokens(key, request) if request.streams else None
                )
            finally:
                server.release_adapter(name)
            return sample_result(answer, request)
        except asyncio.CancelledError:
            if server.up.is_set() or not server.failure:  # cancelled by the engine loop, not by a failure
                raise
            raise UnavailableError(f"{server.where} went down while sampling: {server.failure}") from None
        finally:
            server.requests.discard(task)

    async def _check_base_model(self, server: VllmServer) -> None:
        """ServerError if `server` serves another base model than the engine's (base_check.py)."""
        name = await server.use_adapter(self.base_adapter)
        try:
            answer = await server.complete(check_body(name, self._check_prompt))
        except UserError as error:
            raise ServerError(f"it refused the base-model check's prompt: {error}") from error
        finally:
            server.release_adapter(name)
        gap = logprob_gap(self._engine_logprobs, served_logprobs(answer, self._check_prompt))
        if why := base_model_mismatch(gap):
            raise ServerError(why)
        log.info("%s serves the engine's base model (logprobs %.3g nats apart on average)", server.where, gap)

    async def _pick_server(self) -> VllmServer:
        """The server that is up with the fewest requests; waits a while for one to come up."""
        up = [server for server in self._servers if server.up.is_set()]
        if not up:
            waits = [asyncio.ensure_future(server.up.wait()) for server in self._servers]
            timeout = max(server.timeout_s for server in self._servers)
            _, waiting = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for wait in waiting:
                wait.cancel()
            up = [server for server in self._servers if server.up.is_set()]
            if not up:
                why = "; ".join(f"{s.where}: {s.failure or 'starting'}" for s in self._servers)
                raise UnavailableError(f"no vLLM server is up ({why})")
        return min(up, key=lambda server: len(server.requests))


def _as_outcome(error: BaseException) -> Exception:
    if isinstance(error, Exception):
        return error
    return UnavailableError(f"the vLLM call ended: {error!r}")


def device_groups(spec: str | None) -> list[list[str] | None]:
    """--vllm-devices "0,1;2,3" as [["0", "1"], ["2", "3"]]: one vLLM server per group; None: one server,
    on the devices it sees."""
    if spec is None:
        return [None]
    groups = [[d.strip() for d in group.split(",") if d.strip()] for group in spec.split(";")]
    if not all(groups) or len({d for g in groups for d in g}) != sum(len(g) for g in groups):
        raise UserError(
            f"--vllm-devices {spec!r}: give groups of device ids, ';' between groups and ',' within one "
            "(e.g. '0,1;2,3'), each device in one group"
        )
    return groups
