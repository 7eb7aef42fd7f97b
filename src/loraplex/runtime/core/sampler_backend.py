"""Where sampling requests are decoded: the sampler backend the engine loop drives.

Two backends serve the same Tinker sampling contract (docs/VLLM.md lists what each one supports):
- `EngineSampler`, the default: the training engine's own continuous-batching decoder, in process, on
  the engine thread's steps, interleaved with training.
- the vLLM backend (runtime/vllm/sampler.py, `serve --sampler vllm`): vLLM OpenAI servers in processes of
  their own, fed over HTTP; the engine thread only hands requests over and collects what finished.

The engine loop calls every method from its one thread. No tensors; no SQL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from loraplex.engine.interface import Engine
from loraplex.engine.types import SampleProgress, SampleRequest, SampleResult


@dataclass(frozen=True)
class SamplerServer:
    """One server of a backend that samples in other processes, as healthz and /metrics show it."""

    index: int  # its place in --vllm-url (0 for the one --vllm-python starts): /metrics labels it so
    url: str  # where it answers now (a restarted server of ours answers on a new port)
    up: bool
    restarts: int  # times it went down
    requests: int  # in flight on it now
    adapters: int  # snapshots loaded into it now
    failure: str  # why it last went down ("" if it never did)


class SamplerBackend(ABC):
    """Decodes sampling requests: queued by key, stepped by the engine loop, finished or cancelled."""

    name: str  # how healthz names it: "loraplex" or "vllm"

    @abstractmethod
    def validate_sample_request(self, request: SampleRequest) -> None:
        """Raise UserError naming the field this backend cannot serve; cheap, touches no state. Called on
        the API's threads."""

    @abstractmethod
    def add_sample(self, key: str, request: SampleRequest) -> None:
        """Queue a request under `key` (unique among unfinished ones)."""

    @abstractmethod
    def step_sampler(
        self, max_prefill_tokens: int | None = None
    ) -> list[tuple[str, SampleResult | Exception]]:
        """Advance the requests and return those that finished, each with its result or the error that
        failed it (a UserError for a request of its own making; anything else is the server's)."""

    @abstractmethod
    def cancel_sample(self, key: str) -> bool:
        """Forget the unfinished request `key`; False if none has that key."""

    @abstractmethod
    def take_sample_progress(self) -> dict[str, SampleProgress]:
        """The tokens each unfinished streaming request drew since the last call, by key."""

    @abstractmethod
    def has_sampling_work(self) -> bool:
        """Whether `step_sampler` has anything to do now (the loop waits for other work otherwise)."""

    @abstractmethod
    def sampling_rows(self) -> int:
        """Samples the backend decodes at once: handing it more only makes them wait inside it."""

    def servers(self) -> list[SamplerServer]:
        """The servers it samples on, when they are other processes (none for the in-process sampler).
        Any thread; a snapshot of counters, never a call to them."""
        return []

    def start(self) -> None:  # noqa: B027 (a backend may have nothing to start)
        """Start what the backend runs beside the engine loop (its threads, its processes)."""

    def offer_snapshot(self, directory: Path) -> None:  # noqa: B027 (a backend may load nothing ahead)
        """A snapshot was just saved in `directory` for sampling: a backend that loads snapshots may start
        now, ahead of the first request (never blocks, never fails). Engine thread."""

    def forget_snapshot(self, directory: Path) -> None:  # noqa: B027 (a backend may keep nothing)
        """Retention deleted the snapshot in `directory`: drop what the backend keeps of it. Any thread."""

    def close(self) -> None:  # noqa: B027 (a backend may hold nothing to close)
        """Stop what the backend started (its threads, its processes)."""


class EngineSampler(SamplerBackend):
    """The training engine's own sampler: every call goes to the engine (through the duty meter)."""

    name = "loraplex"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def validate_sample_request(self, request: SampleRequest) -> None:
        self.engine.validate_sample_request(request)

    def add_sample(self, key: str, request: SampleRequest) -> None:
        self.engine.add_sample(key, request)

    def step_sampler(
        self, max_prefill_tokens: int | None = None
    ) -> list[tuple[str, SampleResult | Exception]]:
        return list(self.engine.step_sampler(max_prefill_tokens))

    def cancel_sample(self, key: str) -> bool:
        return self.engine.cancel_sample(key)

    def take_sample_progress(self) -> dict[str, SampleProgress]:
        return self.engine.take_sample_progress()

    def has_sampling_work(self) -> bool:
        return self.engine.has_sampling_work()

    def sampling_rows(self) -> int:
        return self.engine.sampling_rows()
