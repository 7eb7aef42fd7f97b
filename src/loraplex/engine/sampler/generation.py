"""Continuous batching: many requests of many snapshots share every prefill and every decode step.

A request waits until admitted: FIFO, while decode rows, the prefill budget and the KV-cache budget
(SamplingLimits.kv_budget_bytes, the blocks the cache would then reserve) allow; a request alone always
runs. Admission prefills its prompt once (packed with the other prompts
admitted in the same step) into a KV-cache row, copies that row for each further sample, scores the
prompt if asked and draws every sample's first token from the prompt's last position. Each step then
feeds every active sequence's last token at once, the batch ordered by snapshot so that each
snapshot's rows form one LoRA routing segment, and draws the next tokens (and, for the rows that ask,
the top-k of the distribution each was drawn from). A decode step is padded to fixed shapes, its rows and
its span each rounded up to a bucket (decode_buckets.py), and on CUDA its forward and logits are one graph
replay per bucket (decode_graphs.py); sampling runs after it, outside any graph. A sequence leaves the batch
(and frees its row) when it stops; a request finishes when all its samples have.
Under tensor parallelism every rank of the decoder's group makes the same calls in the same order: each
caches its own kv heads and computes its vocabulary rows of the logits, which one all_gather per forward
joins (`gather_vocab`), so every rank draws the same tokens with the same generators and returns the same
results. With one rank nothing is gathered.
Engine code: no HTTP, no SQL; knows nothing of runs, tenants or futures (keys are the caller's).

Shapes: Q prompts in a prefill, T their packed tokens, B sequences of a step, D hidden, V vocab.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from loraplex.engine.phases import phase
from loraplex.engine.sampler.decode_buckets import batch_bucket, span_bucket
from loraplex.engine.sampler.decode_graphs import CaptureError, DecodeGraphs
from loraplex.engine.sampler.prompt_scores import PromptAsks, PromptScores, score_prompt
from loraplex.engine.sampler.sampling import draw_tokens, top_logprobs
from loraplex.engine.sampler.snapshot_cache import SnapshotCache
from loraplex.engine.sampler.stops import StopChecker, read_eos_token_ids
from loraplex.engine.sampler.validation import (
    ModelLimits,
    SamplingLimits,
    resolved_max_tokens,
    validate_sample_request,
)
from loraplex.engine.types import (
    SampledSequence,
    SampleProgress,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from loraplex.errors import UserError
from loraplex.model.decoder import Decoder
from loraplex.model.host_copy import to_device
from loraplex.model.kv_cache import BLOCK_TOKENS, DecodeStep, KVCache
from loraplex.model.memory_plan import kv_bytes_per_token
from loraplex.model.multi_lora import LoRARouting
from loraplex.model.tensor_parallel import gather_vocab

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
_UNIFORMS_AHEAD = 64  # uniforms a sample draws from its generator at once (_Sequence.next_uniform)


@dataclass
class _Sequence:
    """One sample being generated, in its own cache row, with its own generator and stop state."""

    row: int
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator
    stops: StopChecker
    topk_width: int = 0  # topk_sample_logprobs: how many of the likeliest ids each drawn token reports
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[np.ndarray] = field(default_factory=list)  # per token, (topk_width,) int32
    topk_logprobs: list[np.ndarray] = field(default_factory=list)  # per token, (topk_width,) float32
    stop_reason: str | None = None  # "stop" or "length" once finished
    reported: int = 0  # tokens a streaming request has been told of (take_progress)
    uniforms_ahead: list[float] = field(default_factory=list)  # drawn from the generator, not used yet

    def next_uniform(self) -> float:
        """The uniform of this sample's next draw: its generator's next float64. They are drawn up to
        _UNIFORMS_AHEAD at a time (a generator call per row each step cost about 0.8 ms a step at 128
        rows, docs/BENCHMARKS.md); torch's CPU generator fills a float64 tensor serially, so the stream
        is the one a call per draw gives and a seed samples what it did (tests/engine/test_sampler.py)."""
        if not self.uniforms_ahead:
            # torch.rand's stream, written straight into host memory: nothing a device would wait on.
            drawn = np.empty(max(1, min(_UNIFORMS_AHEAD, self.max_tokens - len(self.tokens))))
            torch.from_numpy(drawn).uniform_(generator=self.generator)
            self.uniforms_ahead = drawn[::-1].tolist()
        return self.uniforms_ahead.pop()

    def to_result(self) -> SampledSequence:
        """The finished sample as plain arrays."""
        assert self.stop_reason is not None  # only finished sequences are returned
        tokens, logprobs = np.asarray(self.tokens, np.int32), np.asarray(self.logprobs, np.float32)
        if not self.topk_width:
            return SampledSequence(tokens, logprobs, self.stop_reason)
        topk_ids, topk_logprobs = np.stack(self.topk_ids), np.stack(self.topk_logprobs)
        return SampledSequence(tokens, logprobs, self.stop_reason, topk_ids, topk_logprobs)


@dataclass
class _Job:
    """An admitted request until its result is returned."""

    request: SampleRequest
    snapshot_id: int | None  # None = the base model alone
    sequences: list[_Sequence]
    alt_uniforms_RA: Tensor | None = None  # (P - 1, prompt_alt_tokens_k) float64, from the request's seed
    scores: PromptScores | None = None

    @property
    def batch_order(self) -> int:
        """Sort key that makes each snapshot's sequences contiguous (base first)."""
        return -1 if self.snapshot_id is None else self.snapshot_id


class Sampler:
    """Generation from the base model and any snapshot, over one decoder and one KV cache."""

    def __init__(
        self,
        decoder: Decoder,
        model_dir: Path,
        max_context_length: int,
        max_batch: int,
        snapshot_capacity: int,
        max_rank: int,
        chunk_size: int,
        cuda_graphs: bool = False,
    ) -> None:
        self.decoder = decoder
        self.model_dir = Path(model_dir)
        self.max_context_length = max_context_length
        self.max_batch = max_batch  # rows of a decode step; a request's samples are never split
        self.chunk_size = chunk_size
        self._limits = SamplingLimits()  # none beyond the model's until the server sets its own
        self.cache = self._new_cache()
        self.snapshots = SnapshotCache(decoder.lora_targets(), snapshot_capacity, max_rank)
        # Decode steps replayed from CUDA graphs (decode_graphs.py: use_cuda_graphs says where they apply).
        self.graphs = DecodeGraphs(self._eager_step_logits) if cuda_graphs else None
        self._waiting: deque[tuple[str, SampleRequest]] = deque()
        self._jobs: dict[str, _Job] = {}  # admitted, in admission order
        self.prefill_tokens = 0  # prompt tokens prefilled since start, for telemetry
        self.sampled_tokens = 0  # tokens drawn since start, for telemetry

    @property
    def limits(self) -> SamplingLimits:
        """The server's sampling limits; setting them sizes a new KV cache pool, so only while idle."""
        return self._limits

    @limits.setter
    def limits(self, limits: SamplingLimits) -> None:
        if self.cache.num_live_rows:
            raise RuntimeError("sampling limits change only while no request holds a cache row")
        self._limits = limits
        self._replace_cache()

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The model directory's tokenizer (for stop strings); None when it has none."""
        path = self.model_dir / TOKENIZER_FILE
        return Tokenizer.from_file(str(path)) if path.is_file() else None

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a sequence unless `stop=[]`."""
        return read_eos_token_ids(self.model_dir)

    def validate(self, request: SampleRequest) -> None:
        """Raise UserError naming the first field this model cannot serve."""
        limits = ModelLimits(
            vocab_size=self.decoder.config.vocab_size,
            max_context_length=self.max_context_length,
            max_samples=self.max_batch,
            can_match_strings=self.tokenizer is not None,
            kv_bytes_per_token=self.cache.bytes_per_token,
            sampling=self.limits,
        )
        validate_sample_request(request, limits)

    def add(self, key: str, request: SampleRequest) -> None:
        """Queue a request under a key unique among unfinished ones; UserError if it is invalid."""
        if key in self._jobs or any(key == waiting for waiting, _ in self._waiting):
            raise ValueError(f"sample key {key!r} is already in flight")
        self.validate(request)
        self._waiting.append((key, request))

    def cancel(self, key: str) -> bool:
        """Drop a waiting or generating request: its live cache rows are freed and its snapshot released,
        and no step returns it. False if no unfinished request has that key."""
        for i, (waiting, _) in enumerate(self._waiting):
            if waiting == key:
                del self._waiting[i]
                return True
        job = self._jobs.pop(key, None)
        if job is None:
            return False
        for sequence in job.sequences:
            if sequence.stop_reason is None:  # a stopped sequence freed its row when it stopped
                self.cache.free(sequence.row)
        if job.snapshot_id is not None:
            self.snapshots.release(job.snapshot_id)
        return True

    def take_progress(self) -> dict[str, SampleProgress]:
        """What each unfinished streaming request's samples drew since the last call (the tokens are already
        on the host: `_draw` reads them back to check stops), by key; finished requests are not here."""
        progress: dict[str, SampleProgress] = {}
        for key, job in self._jobs.items():
            if not job.request.streams or all(s.reported == len(s.tokens) for s in job.sequences):
                continue
            sequences = job.sequences
            progress[key] = SampleProgress(
                [s.tokens[s.reported :] for s in sequences], [s.logprobs[s.reported :] for s in sequences]
            )
            for sequence in job.sequences:
                sequence.reported = len(sequence.tokens)
        return progress

    def has_work(self) -> bool:
        """Whether a request is waiting or generating."""
        return bool(self._waiting or self._jobs)

    def step(self, max_prefill_tokens: int | None = None) -> list[tuple[str, SampleResult | UserError]]:
        """Admit waiting requests (one prefill), run one decode step, return the requests that finished.

        `max_prefill_tokens` bounds the prompt tokens admitted in this step (None = no bound); the first
        waiting request is admitted whatever its length when nothing else is admitted in this step.
        If the step raises (a bug, out of memory), every request added so far is dropped, so the caller
        fails them all, and the sampler is left empty and usable.
        """
        try:
            return self._step(max_prefill_tokens)
        except BaseException:
            self.drop_everything()
            raise

    def drop_everything(self) -> None:
        """Forget every request, cache row and snapshot use, whatever state a failed step left."""
        self._jobs.clear()
        self._waiting.clear()
        self._replace_cache()
        self.snapshots.release_all()

    def _replace_cache(self) -> None:
        """A new, empty KV cache; the graphs go with the old one, whose pools they read (and hold, through
        their steps, until dropped)."""
        self.cache = self._new_cache()
        if self.graphs is not None:
            self.graphs.clear()

    def _new_cache(self) -> KVCache:
        weight = self.decoder.lm_head.weight
        config, tp = self.decoder.config, self.decoder.tp
        max_tokens = self._kv_pool_tokens(kv_bytes_per_token(config, tp.size, weight.dtype.itemsize))
        return KVCache(config, weight.device, weight.dtype, tp, max_tokens=max_tokens)

    def _kv_pool_tokens(self, bytes_per_token: int) -> int:
        """Tokens the cache's pool holds: what the KV budget holds, or one request's cap where that is more
        (a request alone always runs), never more than max_batch rows of the whole context; plus a block
        per row, the most their rounding up to whole blocks adds."""
        budget, request_cap = self.limits.kv_budget_bytes, self.limits.max_request_kv_bytes
        tokens = self.max_batch * self.max_context_length
        if budget is not None and request_cap is not None:
            tokens = min(tokens, max(budget, request_cap) // bytes_per_token)
        return tokens + self.max_batch * BLOCK_TOKENS

    def _logits(self, hidden_TD: Tensor, routing: LoRARouting) -> Tensor:
        """(T, V) fp32 logits over the whole vocabulary (gathered from every rank's rows under tensor
        parallelism), with each token's adapter; fp32 from the lm_head itself, so no step casts them."""
        return gather_vocab(self.decoder.lm_head(hidden_TD, routing), self.decoder.vocab_shard)

    @torch.no_grad()
    def _step(self, max_prefill_tokens: int | None) -> list[tuple[str, SampleResult | UserError]]:
        finished: list[tuple[str, SampleResult | UserError]] = []
        with phase("sampler.admit"):
            admitted = self._admit(max_prefill_tokens, finished)
        if admitted:
            with phase("sampler.prefill"):
                self._prefill(admitted)
        active = [
            (job, sequence)
            for job in sorted(self._jobs.values(), key=lambda job: job.batch_order)
            for sequence in job.sequences
            if sequence.stop_reason is None
        ]
        if active:
            self._decode(active)
        for key in [key for key, job in self._jobs.items() if _is_done(job)]:
            finished.append((key, self._finish(self._jobs.pop(key))))
        return finished

    # --- admission and prefill
    def _admit(self, budget: int | None, finished: list[tuple[str, SampleResult | UserError]]) -> list[_Job]:
        """Move waiting requests to jobs, FIFO, while rows, the token budget and snapshot capacity allow."""
        admitted: list[_Job] = []
        rows = self.cache.num_live_rows
        prompt_tokens = 0
        while self._waiting:
            key, request = self._waiting[0]
            rows += request.num_samples
            prompt_tokens += len(request.prompt)
            over_budget = budget is not None and prompt_tokens > budget
            if rows > self.max_batch or (admitted and over_budget):
                break
            if self._jobs and not self._fits_kv_budget(request):  # waits for running requests to finish
                break
            snapshot_id = None
            if request.snapshot is not None:
                try:
                    snapshot_id = self.snapshots.acquire(request.snapshot)
                except UserError as error:
                    self._waiting.popleft()
                    finished.append((key, error))
                    continue
                if snapshot_id is None:  # every resident snapshot is in use: wait for a release
                    break
            self._waiting.popleft()
            self._jobs[key] = self._new_job(request, snapshot_id)
            admitted.append(self._jobs[key])
        return admitted

    def _fits_kv_budget(self, request: SampleRequest) -> bool:
        """Whether the cache, once it holds rows for the request's samples, stays within the KV budget."""
        budget = self.limits.kv_budget_bytes
        lengths = [self._row_length(request)] * request.num_samples
        return budget is None or self.cache.bytes_after(lengths) <= budget

    def _row_length(self, request: SampleRequest) -> int:
        """Tokens a cache row of the request holds at most: the last sampled token is never fed back."""
        return len(request.prompt) + resolved_max_tokens(request, self.max_context_length) - 1

    def _new_job(self, request: SampleRequest, snapshot_id: int | None) -> _Job:
        """Cache rows, generators (one per sample, from the request's seed) and stop state per sample."""
        max_tokens = resolved_max_tokens(request, self.max_context_length)
        params = request.params
        stop_ids = _stop_token_ids(params.stop, self.eos_token_ids)
        stop_strings = [item for item in params.stop or () if isinstance(item, str)]
        # One generator per sample, and one more for the prompt's draws: spawning one more leaves the
        # samples' generators as they were.
        generators = [
            torch.Generator().manual_seed(int(seed.generate_state(1, np.uint64)[0]))
            for seed in np.random.SeedSequence(params.seed).spawn(request.num_samples + 1)
        ]
        sequences = [
            _Sequence(
                row=self.cache.allocate(self._row_length(request)),
                params=params,
                max_tokens=max_tokens,
                generator=generator,
                stops=StopChecker(stop_ids, stop_strings, self.tokenizer),
                topk_width=request.topk_sample_logprobs,
            )
            for generator in generators[:-1]
        ]
        alt_uniforms_RA = None
        if request.prompt_alt_tokens_k:
            shape = (len(request.prompt) - 1, request.prompt_alt_tokens_k)
            alt_uniforms_RA = torch.rand(shape, generator=generators[-1], dtype=torch.float64)
        return _Job(request, snapshot_id, sequences, alt_uniforms_RA)

    def _prefill(self, jobs: list[_Job]) -> None:
        """One packed forward over the admitted prompts; scores and first tokens for every sample."""
        jobs = sorted(jobs, key=lambda job: job.batch_order)
        device = self.decoder.lm_head.weight.device
        prompts = [np.asarray(job.request.prompt, dtype=np.int64) for job in jobs]
        lengths = [len(prompt) for prompt in prompts]
        self.prefill_tokens += sum(lengths)
        snapshot_ids = [job.snapshot_id for job in jobs]
        step = self.cache.prefill([job.sequences[0].row for job in jobs], lengths)
        routing = LoRARouting.from_sequences(lengths, snapshot_ids)
        tokens_T = to_device(np.concatenate(prompts), device)
        hidden_TD = self.decoder.forward_cached(tokens_T, step, routing)

        hidden_per_prompt = hidden_TD.split(lengths)
        for job, prompt_P, hidden_PD in zip(jobs, tokens_T.split(lengths), hidden_per_prompt, strict=True):
            for sequence in job.sequences[1:]:
                self.cache.copy_prefix(job.sequences[0].row, sequence.row)
            job.scores = self._score(job, prompt_P, hidden_PD)
        last_hidden_QD = torch.stack([hidden_PD[-1] for hidden_PD in hidden_per_prompt])
        last_routing = LoRARouting.from_sequences([1] * len(jobs), snapshot_ids)
        logits_QV = self._logits(last_hidden_QD, last_routing)
        prompt_of_sample = [q for q, job in enumerate(jobs) for _ in job.sequences]
        logits_BV = logits_QV.index_select(0, to_device(np.array(prompt_of_sample, dtype=np.int64), device))
        self._draw(logits_BV, [sequence for job in jobs for sequence in job.sequences])

    def _score(self, job: _Job, prompt_P: Tensor, hidden_PD: Tensor) -> PromptScores | None:
        request = job.request
        last_n = request.prompt_logprobs_last_n
        targets = request.target_prompt_ids
        asks = PromptAsks(
            first=1 if last_n is None else max(1, len(prompt_P) - last_n),
            want_logprobs=request.prompt_logprobs,
            top_k=request.topk_prompt_logprobs,
            target_ids_RT=None if targets is None else np.asarray(targets, dtype=np.int64),
            alt_uniforms_RA=job.alt_uniforms_RA,
            temperature=request.params.temperature,
        )
        if asks.is_empty:
            return None

        def head_fn(hidden_CD: Tensor) -> Tensor:
            routing = LoRARouting.from_sequences([len(hidden_CD)], [job.snapshot_id])
            return self._logits(hidden_CD, routing)

        return score_prompt(hidden_PD, prompt_P, head_fn, asks, self.chunk_size)

    # --- decoding
    def _decode(self, active: list[tuple[_Job, _Sequence]]) -> None:
        """Feed every active sequence's last token (one KV-cache decode step, padded to its bucket) and draw
        the next ones."""
        sequences = [sequence for _, sequence in active]
        with phase("sampler.decode_inputs"):
            tokens_B, step, routing = self._bucketed_step(
                [sequence.row for sequence in sequences],
                [sequence.tokens[-1] for sequence in sequences],
                [job.snapshot_id for job, _ in active],
            )
        with phase("sampler.decode_forward"):
            logits_BV = self._step_logits(tokens_B, step, routing)[: len(sequences)]
        self._draw(logits_BV, sequences)

    def _step_logits(self, tokens_B: Tensor, step: DecodeStep, routing: LoRARouting) -> Tensor:
        """The step's (B, V) logits: replayed from its bucket's graph where graphs are on; eager where they
        are off, or from the first capture that fails on (logged: a decode that works beats a fast one)."""
        if self.graphs is not None:
            try:
                return self.graphs.logits(tokens_B, step, routing)
            except CaptureError:
                log.exception("decoding without CUDA graphs from now on (serve --cuda-graphs off skips them)")
                self.graphs = None
        return self._eager_step_logits(tokens_B, step, routing)

    def _bucketed_step(
        self, rows: list[int], tokens: list[int], snapshot_ids: list[int | None]
    ) -> tuple[Tensor, DecodeStep, LoRARouting]:
        """A decode step feeding `tokens` to cache `rows` of `snapshot_ids`: its tokens, cache step and
        routing, padded to its bucket's rows and span (decode_buckets.py). Padding rows feed token 0 at
        position 0 with the pools' zero entry (index -1), in the cache's scratch block, so they add
        nothing to any live row.

        Dense layers route each row by its snapshot's pool entry (the same ops for any mix of snapshots);
        expert layers by the segments, the padding rows base-only."""
        device = self.decoder.lm_head.weight.device
        num_rows = batch_bucket(len(rows), self.max_batch)
        span = span_bucket(max(self.cache.length(row) for row in rows) + 1, self.max_context_length)
        step = self.cache.decode(rows, num_rows, span)
        num_padding = num_rows - len(rows)
        snapshot_ids = snapshot_ids + [None] * num_padding
        pool_index_B = np.array([self.snapshots.pool_index(i) for i in snapshot_ids], np.int64)
        segments = LoRARouting.from_sequences([1] * num_rows, snapshot_ids).segments
        tokens_B = to_device(np.array(tokens + [0] * num_padding, np.int64), device)
        return tokens_B, step, LoRARouting(segments, to_device(pool_index_B, device))

    def _eager_step_logits(self, tokens_B: Tensor, step: DecodeStep, routing: LoRARouting) -> Tensor:
        """(B, V) fp32 logits of a decode step's forward, run op by op (what a CUDA graph captures)."""
        return self._logits(self.decoder.forward_cached(tokens_B, step, routing), routing)

    def _draw(self, logits_BV: Tensor, sequences: Sequence[_Sequence]) -> None:
        """Draw one token per sequence, append it, and retire the sequences that stop."""
        with phase("sampler.draw"):
            uniforms = [sequence.next_uniform() for sequence in sequences]
            uniforms_B = torch.tensor(uniforms, dtype=torch.float64)
            params = [sequence.params for sequence in sequences]
            tokens_B, logprobs_B = draw_tokens(logits_BV, params, uniforms_B)
            self._record_top_logprobs(logits_BV, sequences)
        with phase("sampler.read_back"):
            drawn = _read_back(tokens_B, logprobs_B)
        self.sampled_tokens += len(sequences)
        for sequence, token, logprob in zip(sequences, *drawn, strict=True):
            sequence.tokens.append(token)
            sequence.logprobs.append(logprob)
            if sequence.stops.is_stop(token):
                sequence.stop_reason = "stop"
            elif len(sequence.tokens) >= sequence.max_tokens:
                sequence.stop_reason = "length"
            if sequence.stop_reason is not None:
                self.cache.free(sequence.row)

    @staticmethod
    def _record_top_logprobs(logits_BV: Tensor, sequences: Sequence[_Sequence]) -> None:
        """Append each asking row's top-k (topk_sample_logprobs) for the token just drawn; one top-k over
        the asking rows alone, so a step whose rows do not ask costs nothing more."""
        rows = [b for b, sequence in enumerate(sequences) if sequence.topk_width]
        if not rows:
            return
        width = max(sequences[b].topk_width for b in rows)
        logits_MV = logits_BV.index_select(0, to_device(np.array(rows, dtype=np.int64), logits_BV.device))
        ids_MK, logprobs_MK = top_logprobs(logits_MV, [sequences[b].params for b in rows], width)
        ids_MK, logprobs_MK = ids_MK.int().cpu().numpy(), logprobs_MK.cpu().numpy()
        for m, b in enumerate(rows):
            sequence = sequences[b]
            sequence.topk_ids.append(ids_MK[m, : sequence.topk_width])
            sequence.topk_logprobs.append(logprobs_MK[m, : sequence.topk_width])

    def _finish(self, job: _Job) -> SampleResult:
        if job.snapshot_id is not None:
            self.snapshots.release(job.snapshot_id)
        scores = job.scores
        return SampleResult(
            sequences=[sequence.to_result() for sequence in job.sequences],
            prompt_logprobs=scores.logprobs_P if scores else None,
            topk_prompt_ids=scores.topk_ids_PK if scores else None,
            topk_prompt_logprobs=scores.topk_logprobs_PK if scores else None,
            target_prompt_logprobs=scores.target_logprobs_RT if scores else None,
            target_prompt_is_sparse=job.request.target_prompt_is_sparse,
            prompt_alt_ids=scores.alt_ids_RA if scores else None,
            prompt_alt_logprobs=scores.alt_logprobs_RA if scores else None,
        )


def _read_back(tokens_B: Tensor, logprobs_B: Tensor) -> tuple[list[int], list[float]]:
    """The drawn tokens and their logprobs on the host, where stops are checked: where a step waits for
    the device, once (the second copy finds it idle); tests/model/test_host_syncs.py checks that nothing
    else in the step syncs."""
    return tokens_B.tolist(), logprobs_B.tolist()


def _is_done(job: _Job) -> bool:
    return all(sequence.stop_reason is not None for sequence in job.sequences)


def _stop_token_ids(stop: tuple[str | int, ...] | None, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """None: EOS. (): nothing. Otherwise the listed ids and EOS, which renderers rely on still stopping."""
    if stop is None:
        return eos_token_ids
    if not stop:
        return frozenset()
    return eos_token_ids | {int(item) for item in stop if not isinstance(item, str)}
