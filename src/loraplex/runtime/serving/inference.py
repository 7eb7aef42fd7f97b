"""Inference for the OpenAI-compatible endpoints, on the same sampler, futures and limits as Tinker sampling.

A `model` names the base model, one of the caller's `tinker://` sampler_weights or weights checkpoints, or
one of the caller's aliases. Each request goes through SamplerService.sample on a sampler the tenant
owns: one per (tenant, model), made on first use in a per-tenant session this server opens for them, so
it returns exactly what an SDK `sample` of the same request returns. Alternatives to sampled tokens
(top_logprobs) come from one more request that scores prompt + completion, as compute_logprobs does.
Queue room for every sample a request may need is reserved before anything is queued (queued.py), so a
request is refused whole or never; and its sampling is cancelled when its caller is (its client went
away) or one of its prompts fails. The coroutines do their database work on worker threads, never on the
caller's event loop. No tensors, no HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial

import numpy as np

from loraplex.engine.interface import EngineInfo
from loraplex.engine.sampler.validation import resolved_max_tokens
from loraplex.errors import FieldError, NotFoundError, ServerError, UnavailableError, UserError
from loraplex.runtime.control.aliases import AliasTable, validate_alias
from loraplex.runtime.control.catalog import Catalog
from loraplex.runtime.control.futures import FAILED, RETRYABLE, FutureRecord, FutureTable
from loraplex.runtime.control.samplers import SamplerService
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.sampling import (
    SampleProgress,
    SampleRequest,
    SampleResult,
    SampleRoom,
    SamplingParams,
)
from loraplex.runtime.serving.completions import Choice, Completion, to_choice, to_prompt, with_top
from loraplex.runtime.serving.queued import CLIENT_GONE, PART_FAILED, QueuedRequests
from loraplex.runtime.serving.streaming import LiveGeneration, PromptStream
from loraplex.runtime.serving.text_codec import TextCodec

# What compute_logprobs sends: one token drawn at temperature 1 and ignored; only the prompt scores count.
# The error a failed future's category stands for (a /v1 request answers it with its status).
_ERRORS: dict[str, type[Exception]] = {"user": UserError, RETRYABLE: UnavailableError}
_SCORING_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_k=-1, top_p=1.0)


class ModelNotFoundError(NotFoundError):
    """`model` names nothing this tenant may sample (OpenAI's 404 with code model_not_found)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model {model!r} does not exist or you do not have access to it.")


@dataclass(frozen=True)
class Generation:
    """An OpenAI completion request in the sampler's terms: each prompt completed `n` times."""

    model: str
    prompts: list[list[int]]
    params: SamplingParams  # params.stop holds stop strings only; None = EOS alone
    n: int = 1
    is_sampled: bool = True  # False (max_tokens=0): the prompts are only scored
    echo: bool = False  # return each prompt's tokens with its choices
    scores_prompt: bool = False  # with their logprobs
    top_logprobs: int = 0  # alternatives per token, at scored prompt positions and sampled ones


@dataclass(frozen=True)
class ModelCard:
    """One entry of /v1/models."""

    model_id: str
    created: datetime
    owned_by: str
    root: str  # what the id resolves to: the base model name or a tinker:// path
    parent: str | None  # the base model under an adapter


class InferenceService:
    """Resolves model names, keeps the tenants' samplers, and runs generations through SamplerService."""

    def __init__(
        self,
        info: EngineInfo,
        samplers: SamplerService,
        futures: FutureTable,
        sessions: SessionTable,
        catalog: Catalog,
        aliases: AliasTable,
        codec: TextCodec | None,
    ) -> None:
        self.info, self.samplers, self.futures, self.sessions = info, samplers, futures, sessions
        self.catalog, self.aliases, self._codec = catalog, aliases, codec
        self.started_at = datetime.now().astimezone()
        self._lock = threading.Lock()
        self._sessions: dict[str, str] = {}  # tenant -> the session its samplers belong to
        self._samplers: dict[tuple[str, str | None], str] = {}  # (tenant, tinker path | None) -> sampler
        self._sampler_seqs = itertools.count()
        self._sample_seqs = itertools.count()  # one counter for every sampler: seq_ids never repeat

    @property
    def base_model(self) -> str:
        """The served model's name."""
        return self.info.model_name

    @property
    def codec(self) -> TextCodec:
        """The model's tokenizer (UserError if the model directory has none)."""
        if self._codec is None:
            raise UserError("this server's model has no tokenizer.json, which the /v1 endpoints need")
        return self._codec

    # --- models and aliases
    async def models(self, tenant: str) -> list[ModelCard]:
        """The base model, the tenant's sampler checkpoints and its aliases."""
        return await asyncio.to_thread(self._models, tenant)

    async def model(self, tenant: str, model_id: str) -> ModelCard:
        """The entry of models(tenant) with this id (ModelNotFoundError if there is none)."""
        cards = await self.models(tenant)
        card = next((card for card in cards if card.model_id == model_id), None)
        if card is None:
            raise ModelNotFoundError(model_id)
        return card

    async def set_alias(self, tenant: str, alias: str, model: str) -> None:
        """Name one of the tenant's checkpoints (an alias of an alias or of the base model is refused)."""
        validate_alias(alias)
        if alias == self.base_model:
            raise FieldError("alias", f"{alias!r} is the base model's name")
        if not model.startswith("tinker://"):
            raise FieldError("model", f"of an alias must be a tinker:// checkpoint path, not {model!r}")
        await self.resolve(tenant, model)
        await asyncio.to_thread(self.aliases.set, tenant, alias, model)

    async def resolve(self, tenant: str, model: str) -> str | None:
        """The checkpoint path `model` names for `tenant`, None for the base model; ModelNotFoundError."""
        return await asyncio.to_thread(self._resolve, tenant, model)

    def _models(self, tenant: str) -> list[ModelCard]:
        cards = [ModelCard(self.base_model, self.started_at, "loraplex", self.base_model, None)]
        offset, page = 0, 1000
        while True:
            views, total = self.catalog.tenant_checkpoints(tenant, page, offset)
            cards += [
                ModelCard(str(v.path), v.created_at, tenant, str(v.path), self.base_model)
                for v in views
                if v.path.kind == "sampler_weights"
            ]
            offset += page
            if offset >= total:
                break
        cards += [
            ModelCard(str(v.path), v.created_at, "published", str(v.path), self.base_model)
            for v in self.catalog.published_checkpoints(tenant)
            if v.path.kind == "sampler_weights"
        ]
        for alias, target in self.aliases.of(tenant).items():
            cards.append(ModelCard(alias, self.started_at, tenant, target, self.base_model))
        return cards

    def _resolve(self, tenant: str, model: str) -> str | None:
        if model == self.base_model:
            return None
        target = self.aliases.target(tenant, model) or model
        if not target.startswith("tinker://"):
            raise ModelNotFoundError(model)
        try:
            path = CheckpointPath.parse(target)
            self.catalog.readable_checkpoint(tenant, path)  # the tenant's own, or published
        except UserError as exc:  # malformed, missing, deleted, or another tenant's: all look alike
            raise ModelNotFoundError(model) from exc
        return str(path)

    # --- generation
    async def stream(self, tenant: str, generation: Generation) -> LiveGeneration:
        """`complete` as a stream of events (streaming.py), returned once every prompt is queued: what
        refuses the generation is raised here, before a response starts. Tokens are streamed as they are
        drawn unless the generation scores them after sampling (then each choice arrives whole)."""
        stop_strings = [s for s in generation.params.stop or () if isinstance(s, str)]
        live = LiveGeneration(self.codec, generation.prompts, generation.n, stop_strings)
        live.echo = generation.echo
        live.streams_tokens = not generation.scores_prompt and not generation.top_logprobs
        await live.start(partial(self.complete, tenant, generation))
        return live

    async def complete(
        self, tenant: str, generation: Generation, live: LiveGeneration | None = None
    ) -> list[Completion]:
        """Every prompt's completion, in order; the prompts are sampled concurrently. With `live`, each
        prompt's tokens and completion are handed to it as they come (`stream`).

        UserError (400) if the request needs more samples than the queue ever holds, and
        SamplingBackpressureError (429) if they do not fit now, both before anything is queued. If this
        coroutine is cancelled or a prompt fails, whatever it queued that is unfinished is cancelled.
        """
        num_samples = self._samples_needed(generation)
        model_path = await self.resolve(tenant, generation.model)
        codec = self.codec
        if generation.top_logprobs and generation.is_sampled:
            for prompt in generation.prompts:
                self._check_room_to_score(prompt, generation.params)
        queued = QueuedRequests(self.samplers, self.samplers.reserve(num_samples, tenant))
        streams = [None if live is None else live.prompt(i) for i in range(len(generation.prompts))]
        tasks = [
            asyncio.ensure_future(
                self._complete(tenant, model_path, codec, prompt, generation, queued, stream)
            )
            for prompt, stream in zip(generation.prompts, streams, strict=True)
        ]
        try:
            completions = list(await asyncio.gather(*tasks))
        except asyncio.CancelledError:  # gather has cancelled every prompt's task
            queued.close(CLIENT_GONE)
            raise
        except BaseException:
            for task in tasks:
                task.cancel()
            queued.close(PART_FAILED)
            raise
        queued.close()
        return completions

    def _samples_needed(self, generation: Generation) -> int:
        """Samples the generation may queue in all: `n` per prompt, and as many again to score them when
        it asks for top_logprobs; UserError if that is more than the queue holds (it never fits)."""
        is_scored = generation.top_logprobs > 0 and generation.is_sampled
        needed = len(generation.prompts) * generation.n * (2 if is_scored else 1)
        limit = self.samplers.max_queued_samples
        if needed > limit:
            scoring = " x 2 (top logprobs score each choice once more)" if is_scored else ""
            raise FieldError(
                "n",
                f"is {generation.n}: {len(generation.prompts)} prompts x {generation.n}{scoring} = {needed} "
                f"samples, over the {limit} this server queues at once ({self.samplers.queue_limit_flag}); "
                "send fewer prompts or a smaller n",
            )
        return needed

    async def _complete(
        self,
        tenant: str,
        model_path: str | None,
        codec: TextCodec,
        prompt: list[int],
        generation: Generation,
        queued: QueuedRequests,
        stream: PromptStream | None,
    ) -> Completion:
        # max_tokens=0 has no Tinker form: one token is drawn, as compute_logprobs does, and dropped.
        params = generation.params if generation.is_sampled else replace(generation.params, max_tokens=1)
        request = SampleRequest(
            np.asarray(prompt, np.int64),
            params,
            num_samples=generation.n,
            prompt_logprobs=generation.scores_prompt,
            topk_prompt_logprobs=generation.top_logprobs if generation.scores_prompt else 0,
        )
        result = await self._sample(tenant, model_path, request, queued, stream)
        echoed = (
            to_prompt(codec, prompt, result if generation.scores_prompt else None) if generation.echo else ()
        )
        if not generation.is_sampled:
            choices = [Choice("", (), "length") for _ in result.sequences]
        else:
            stop_strings = [s for s in params.stop or () if isinstance(s, str)]
            choices = [to_choice(codec, sequence, stop_strings) for sequence in result.sequences]
        if generation.top_logprobs and generation.is_sampled:
            choices = await asyncio.gather(
                *(
                    self._with_top(tenant, model_path, codec, prompt, c, generation.top_logprobs, queued)
                    for c in choices
                )
            )
        completion = Completion(len(prompt), echoed, tuple(choices))
        if stream is not None:
            stream.done(completion)
        return completion

    async def _with_top(
        self,
        tenant: str,
        model_path: str | None,
        codec: TextCodec,
        prompt: list[int],
        choice: Choice,
        k: int,
        queued: QueuedRequests,
    ) -> Choice:
        """`choice` with the top-k alternatives at its tokens: prompt + its tokens scored in one request."""
        if not choice.tokens:
            return choice
        tokens = [*prompt, *(t.token_id for t in choice.tokens)]
        request = SampleRequest(
            np.asarray(tokens, np.int64),
            _SCORING_PARAMS,
            topk_prompt_logprobs=k,
            prompt_logprobs_last_n=len(choice.tokens),
        )
        return with_top(codec, choice, await self._sample(tenant, model_path, request, queued), len(prompt))

    def _check_room_to_score(self, prompt: list[int], params: SamplingParams) -> None:
        context = self.info.max_context_length
        max_tokens = resolved_max_tokens(SampleRequest(np.asarray(prompt), params), context)
        if len(prompt) + max_tokens >= context:
            raise FieldError(
                "top_logprobs",
                f"scores the completion after it is sampled, so the prompt ({len(prompt)} tokens) plus "
                f"max_tokens ({max_tokens}) must stay below the context length {context}",
            )

    async def _sample(
        self,
        tenant: str,
        model_path: str | None,
        request: SampleRequest,
        queued: QueuedRequests,
        stream: PromptStream | None = None,
    ) -> SampleResult:
        """Queue `request` on the tenant's sampler of the model, with its generation's room, and wait for
        its result; with `stream`, tell it once queued, and hand it the tokens as they are drawn."""
        on_progress = None if stream is None else stream.on_progress
        submit = partial(self._submit, tenant, model_path, request, on_progress=on_progress)
        record = await asyncio.to_thread(queued.queue, submit)
        if stream is not None:
            stream.queued()
        record = await self.futures.retrieve(tenant, record.id)
        while not record.is_done:
            record = await self.futures.retrieve(tenant, record.id)
        if record.status == FAILED:
            error = record.error or "sampling failed"
            raise _ERRORS.get(record.category or "", ServerError)(error)
        assert isinstance(record.result, SampleResult)
        return record.result

    def _submit(
        self,
        tenant: str,
        model_path: str | None,
        request: SampleRequest,
        room: SampleRoom,
        on_progress: Callable[[SampleProgress], None] | None = None,
    ) -> FutureRecord:
        """Queue `request` on the tenant's sampler of the model, its samples taken from `room`."""
        submit = partial(self._submit_to_sampler, tenant, model_path, request, room, on_progress)
        try:
            return submit()
        except NotFoundError:
            # Retention removes samplers unused for a while: a new one is made, once. A second miss means
            # the weights themselves are gone.
            try:
                return submit()
            except NotFoundError as exc:
                raise ModelNotFoundError(model_path or self.base_model) from exc

    def _submit_to_sampler(
        self,
        tenant: str,
        model_path: str | None,
        request: SampleRequest,
        room: SampleRoom,
        on_progress: Callable[[SampleProgress], None] | None,
    ) -> FutureRecord:
        """One try on the tenant's sampler of the model; a sampler that is gone is forgotten."""
        sampler_id = self._sampler(tenant, model_path)
        seq = next(self._sample_seqs)
        try:
            return self.samplers.sample(tenant, sampler_id, seq, request, room, on_progress)
        except NotFoundError:
            with self._lock:
                if self._samplers.get((tenant, model_path)) == sampler_id:
                    del self._samplers[(tenant, model_path)]
            raise

    def _sampler(self, tenant: str, model_path: str | None) -> str:
        with self._lock:
            sampler_id = self._samplers.get((tenant, model_path))
            session_id = self._sessions.get(tenant)
        if sampler_id is not None:
            return sampler_id
        if session_id is None:
            session_id = self.sessions.create(tenant, {"client": "openai-compatible endpoints"})
        base_model = self.base_model if model_path is None else None
        sampler_id = self.samplers.create_sampler(
            tenant, session_id, next(self._sampler_seqs), model_path, base_model
        )
        with self._lock:
            self._sessions.setdefault(tenant, session_id)
            return self._samplers.setdefault((tenant, model_path), sampler_id)
