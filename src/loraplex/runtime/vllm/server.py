"""One vLLM OpenAI server as the vLLM sampler uses it: its health, the snapshots loaded into it, its requests.

Everything here runs on the vLLM sampler's event loop (sampler.py), one coroutine at a time, so its
state needs no lock.

- Health: `supervise` (re)starts the server when this server started it (`VllmProcess`), waits for it to
  answer, then checks `/health` every few seconds. A server whose process ended, or that has not answered
  for `timeout_s`, is down: its requests fail with UnavailableError (the SDK sends them again), and a
  process of ours is killed and started again. A server given by URL is probed until it answers again.
- Snapshots: loaded by name (`adapter_name`: the directory and the identity of its weights file, so a
  snapshot overwritten in place is a new name, never a stale adapter) with `/v1/load_lora_adapter`, at
  most `max_loras` at once: past it the least recently used one no request is using is unloaded. A load
  answered "already loaded" counts as loaded, so loads are idempotent across restarts of either side; a
  restart of the vLLM server forgets what it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from loraplex.engine.snapshots import WEIGHTS_FILE
from loraplex.errors import ServerError, UnavailableError, UserError
from loraplex.runtime.core.sampler_backend import SamplerServer
from loraplex.runtime.vllm.process import VllmProcess
from loraplex.runtime.vllm.staging import SnapshotStaging

log = logging.getLogger(__name__)

_PROBE_S = 2.0  # between two health checks of a server that is up
_PROBE_TIMEOUT_S = 5.0
_RESTART_PAUSE_S = 1.0  # after a server went down, before it is started (or probed) again
_MAX_RESTART_PAUSE_S = 60.0


def adapter_name(snapshot: Path) -> str:
    """The name a snapshot is loaded into vLLM under: its directory and its weights file's identity (an
    overwritten snapshot is a new file, so a new name)."""
    weights = (snapshot / WEIGHTS_FILE).stat()
    identity = f"{snapshot.resolve()}|{weights.st_ino}|{weights.st_size}|{weights.st_mtime_ns}"
    return "lp-" + hashlib.sha256(identity.encode()).hexdigest()[:24]


class VllmServer:
    """A vLLM server: given by URL, or started (and restarted) from `process`."""

    def __init__(
        self,
        index: int,
        url: str | None,
        process: VllmProcess | None,
        max_loras: int,
        timeout_s: float,
        start_timeout_s: float,
        staging: SnapshotStaging | None = None,
    ) -> None:
        assert (url is None) != (process is None), "a vLLM server is given by URL or started, not both"
        self.index, self.url, self.process = index, url or "", process
        self.max_loras, self.timeout_s, self.start_timeout_s = max_loras, timeout_s, start_timeout_s
        self.staging = staging or SnapshotStaging()
        self.base_model = ""  # the name it serves its base model under (learned from /v1/models)
        # Raises ServerError if the server serves another base model than the engine's (the sampler's
        # check, base_check.py); run each time the server comes up, before it takes requests.
        self.check_base_model: Callable[[VllmServer], Awaitable[None]] | None = None
        self.up = asyncio.Event()
        self.restarts = 0  # times it went down and came back
        self.failure = ""  # why it last went down
        self.adapters: OrderedDict[str, Path] = OrderedDict()  # loaded: name -> snapshot, least recent first
        self.users: Counter[str] = Counter()  # requests using each loaded adapter now
        self.requests: set[asyncio.Task[Any]] = set()  # in flight on it
        self._load_lock = asyncio.Lock()
        self._check_now = asyncio.Event()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=_PROBE_TIMEOUT_S))

    @property
    def where(self) -> str:
        return f"vLLM server {self.index} ({self.url or 'starting'})"

    # --- health
    def report(self) -> SamplerServer:
        """Its state for healthz and /metrics (read from any thread: plain fields, no call)."""
        return SamplerServer(
            self.index,
            self.url,
            self.up.is_set(),
            self.restarts,
            len(self.requests),
            len(self.adapters),
            self.failure,
        )

    async def supervise(self) -> None:
        """Keep the server up, for as long as the sampler runs (cancelled when it closes). A server that
        fails to come up is tried again after a pause that doubles each time, up to a minute."""
        failed_starts = 0
        while True:
            try:
                if self.process is not None:
                    self.url = await asyncio.to_thread(self.process.start)
                await self._wait_until_answering()
            except (UserError, ServerError, httpx.HTTPError) as error:
                failed_starts += 1
                pause = min(_RESTART_PAUSE_S * 2 ** (failed_starts - 1), _MAX_RESTART_PAUSE_S)
                log.error("%s did not come up: %s; trying again in %g s", self.where, error, pause)
                self.failure = str(error)
                self.adapters.clear()  # what the check loaded may be gone by the next try
                if self.process is not None:
                    self.process.kill()
                await asyncio.sleep(pause)
                continue
            failed_starts = 0
            self.up.set()
            log.info("%s is up, serving %s", self.where, self.base_model)
            why = await self._watch()
            self._go_down(why)
            await asyncio.sleep(_RESTART_PAUSE_S)

    async def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + (self.start_timeout_s if self.process is not None else float("inf"))
        while time.monotonic() < deadline:
            if self.process is not None and (code := self.process.exit_code()) is not None:
                tail = self.process.log_tail()
                raise ServerError(f"it exited with code {code}; the end of its log:\n{tail}")
            if await self._answers():
                self.base_model = await self._served_base_model()
                if self.check_base_model is not None:
                    await self.check_base_model(self)
                return
            await asyncio.sleep(0.5)
        assert self.process is not None
        self.process.kill()
        raise ServerError(f"it did not answer within {self.start_timeout_s:g} s (--vllm-start-timeout-s)")

    async def _watch(self) -> str:
        """Check the server until it is down; why it is."""
        last_answer = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):  # a check every _PROBE_S, or at once when asked
                await asyncio.wait_for(self._check_now.wait(), _PROBE_S)
            self._check_now.clear()
            if self.process is not None and (code := self.process.exit_code()) is not None:
                return f"its process exited with code {code}"
            if await self._answers():
                last_answer = time.monotonic()
            elif time.monotonic() - last_answer > self.timeout_s:
                return f"it has not answered its health check for {self.timeout_s:g} s (--vllm-timeout-s)"

    def check_soon(self) -> None:
        """A request met an error that may mean the server is down: check its health now."""
        self._check_now.set()

    async def _answers(self) -> bool:
        try:
            answer = await self.client.get(f"{self.url}/health", timeout=_PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    async def _served_base_model(self) -> str:
        answer = await self.client.get(f"{self.url}/v1/models", timeout=_PROBE_TIMEOUT_S)
        answer.raise_for_status()
        models = [m for m in answer.json()["data"] if m.get("parent") is None]
        if not models:
            raise ServerError("it serves no base model (/v1/models)")
        return models[0]["id"]

    def _go_down(self, why: str) -> None:
        """Fail its requests (they may be sent again) and, if it is ours, kill it for a restart."""
        self.up.clear()
        self.failure = why
        self.restarts += 1
        self.adapters.clear()  # whether it restarts or comes back, what it held is not known to be there
        self.users.clear()
        log.error("%s is down: %s; failing its %d requests", self.where, why, len(self.requests))
        for task in list(self.requests):
            task.cancel(f"{self.where} went down: {why}")
        if self.process is not None:
            self.process.kill()

    async def close(self) -> None:
        await self.client.aclose()
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)

    # --- snapshots
    async def use_adapter(self, snapshot: Path) -> str:
        """Load `snapshot` if it is not loaded (making room within max_loras) and count a user of it;
        its name. The caller gives it back with `release_adapter`."""
        name = adapter_name(snapshot)
        async with self._load_lock:
            if name in self.adapters:
                self.adapters.move_to_end(name)
            else:
                await self._make_room()
                path = await asyncio.to_thread(self.staging.path_for, snapshot, name)
                load = {"lora_name": name, "lora_path": path}
                await self._post("/v1/load_lora_adapter", load, loading=True)
                self.adapters[name] = snapshot
            self.users[name] += 1
        return name

    def release_adapter(self, name: str) -> None:
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]

    async def forget(self, snapshot: Path) -> None:
        """Unload every adapter of a deleted snapshot that no request uses."""
        async with self._load_lock:
            for name in [n for n, s in self.adapters.items() if s == snapshot and not self.users[n]]:
                await self._unload(name)

    async def _make_room(self) -> None:
        while len(self.adapters) >= self.max_loras:
            idle = next((name for name in self.adapters if not self.users[name]), None)
            if idle is None:  # every loaded adapter is in use: vLLM swaps them through its own cache
                return
            await self._unload(idle)

    async def _unload(self, name: str) -> None:
        del self.adapters[name]
        try:
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        except (UserError, UnavailableError) as error:  # unknown to it (it restarted): nothing to unload
            log.info("%s did not unload adapter %s: %s", self.where, name, error)

    # --- requests
    async def complete(self, body: dict[str, Any], on_tokens: TokenSink | None = None) -> dict[str, Any]:
        """POST /v1/completions; its answer. With `on_tokens`, vLLM streams it: each chunk's new tokens and
        their logprobs go to `on_tokens(index, tokens, logprobs)` as they come, and the chunks are joined
        into the answer a request without a stream gets."""
        if on_tokens is None:
            return await self._post("/v1/completions", body)
        choices: dict[int, dict[str, Any]] = {}
        try:
            async with self.client.stream(
                "POST", f"{self.url}/v1/completions", json={**body, "stream": True}
            ) as answer:
                if answer.status_code != 200:
                    await answer.aread()
                    raise self._refusal(answer)
                async for line in answer.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:  # vLLM failed after the stream began
                        self.check_soon()
                        raise UnavailableError(f"{self.where} failed: {_message(chunk)}")
                    for delta in chunk.get("choices", []):
                        _join(choices, delta, on_tokens)
        except httpx.HTTPError as error:
            raise self._unreachable(error) from error
        return {"choices": list(choices.values())}

    async def _post(self, path: str, body: dict[str, Any], loading: bool = False) -> dict[str, Any]:
        """POST to the server: its JSON answer; UnavailableError if it cannot be reached or fails inside,
        UserError for a request it refuses."""
        try:
            answer = await self.client.post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as error:
            raise self._unreachable(error) from error
        if answer.status_code == 200:
            is_json = answer.headers.get("content-type", "").startswith("application/json")
            return answer.json() if is_json else {}
        message = _error_message(answer)
        if loading and answer.status_code == 400 and "already" in message and "loaded" in message:
            return {}  # loaded before: by us before a restart of ours, or by another loraplex
        raise self._refusal(answer)

    def _unreachable(self, error: httpx.HTTPError) -> UnavailableError:
        self.check_soon()
        return UnavailableError(f"{self.where} could not be reached: {error!r}")

    def _refusal(self, answer: httpx.Response) -> UnavailableError | UserError:
        """The error of an answer other than 200: UnavailableError for the server's own failure (5xx),
        UserError for a request it refuses."""
        message = _error_message(answer)
        if answer.status_code >= 500:
            self.check_soon()
            return UnavailableError(f"{self.where} failed: {message}")
        return UserError(f"{self.where} refused the request ({answer.status_code}): {message}")


# Called with a choice's index and the tokens and logprobs a stream chunk added to it.
TokenSink = Callable[[int, list[int], list[float]], None]


def _join(choices: dict[int, dict[str, Any]], delta: dict[str, Any], on_tokens: TokenSink) -> None:
    """Add one stream chunk's choice to the joined answer, and hand its new tokens on."""
    index = delta["index"]
    joined = choices.setdefault(
        index,
        {
            "index": index,
            "token_ids": [],
            "logprobs": {"token_logprobs": [], "top_logprobs": []},
            "finish_reason": None,
        },
    )
    tokens = delta.get("token_ids") or []
    scored = delta.get("logprobs") or {}
    logprobs = scored.get("token_logprobs") or []
    joined["token_ids"] += tokens
    joined["logprobs"]["token_logprobs"] += logprobs
    joined["logprobs"]["top_logprobs"] += scored.get("top_logprobs") or []
    if delta.get("finish_reason") is not None:
        joined["finish_reason"] = delta["finish_reason"]
    if tokens:
        on_tokens(index, tokens, [float("-inf") if v is None else float(v) for v in logprobs])


def _error_message(answer: httpx.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return answer.text[:500]
    return _message(body)


def _message(body: Any) -> str:
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]
