"""Fused passes: the requests of many slots and losses packed into one forward and at most one backward.

A pass validates every request first (a rejected request changes no state), orders the surviving
requests' datums so that each slot's tokens are contiguous, runs the decoder once over the pack,
computes learner logprobs in token chunks, applies each request's own loss to its own slice, and
backpropagates the sum of the training requests' losses into the slots' gradient accumulators. When
every training request's loss is per token, the lm_head's backward runs inside its chunked forward
(each chunk's logits computed once), and the decoder's backward starts from the collected gradient.
Engine code: no HTTP, no SQL.

Shapes: T packed tokens, D hidden, K widest target form in the pack (1 for (N,) targets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import numpy as np
import torch
from torch import Tensor

from loraplex.engine.health import health_stats
from loraplex.engine.logprobs import chunked_token_logprobs, chunked_token_logprobs_backward
from loraplex.engine.losses import LossBatch, compute_loss, is_per_token_loss, pack_loss_inputs
from loraplex.engine.phases import phase
from loraplex.engine.types import PassRequest, PassResult
from loraplex.errors import UserError
from loraplex.model.decoder import Decoder
from loraplex.model.host_copy import to_device
from loraplex.model.multi_lora import LoRARouting
from loraplex.model.packing import PackedSequences

# Validates one request and returns its resolved loss config, or raises UserError.
Validator = Callable[[PassRequest], dict[str, float]]
# A request's detached outputs on the device: per-datum logprobs, per-datum losses, metrics and health
# statistics (0-D each).
_Outputs = tuple[list[Tensor], list[Tensor], dict[str, Tensor], dict[str, Tensor]]


@dataclass(frozen=True)
class _Placed:
    """A validated request and where its datums sit in the pack."""

    index: int  # position in the caller's request list
    request: PassRequest
    config: dict[str, float]
    start: int  # first packed token of its first datum
    end: int
    width: int | None  # K of (N, K) targets; None for (N,) targets


def run_pass(
    decoder: Decoder, requests: Sequence[PassRequest], validate: Validator, chunk_size: int
) -> list[PassResult | UserError]:
    """Run all requests in one packed pass; per request its result, or the UserError that rejected it.

    Semantics: equal to running each request alone, in order: per datum, full-vocabulary fp32 logprobs
    of its targets under its slot's adapter, its loss per docs/LOSSES.md, and for training requests
    `loss.sum().backward()` into the slot's accumulators. Reference: tests/engine/test_passes.py.
    """
    results: list[PassResult | UserError | None] = [None] * len(requests)
    accepted: list[tuple[int, PassRequest, dict[str, float]]] = []
    for index, request in enumerate(requests):
        try:
            accepted.append((index, request, validate(request)))
        except UserError as error:
            results[index] = error
    if accepted:
        # Stable sort: each slot's tokens become one contiguous run; a request's datums stay in order.
        accepted.sort(key=lambda item: -1 if item[1].slot is None else item[1].slot)
        placed = _place(accepted)
        # Only adapters train: a base-only (slot None) forward_backward has no accumulator, and a pack
        # without a slot's training datum has nothing to backpropagate into.
        is_training = any(not p.request.forward_only and p.request.slot is not None for p in placed)
        with torch.enable_grad() if is_training else torch.no_grad():
            for p, result in zip(placed, _compute(decoder, placed, chunk_size, is_training), strict=True):
                results[p.index] = result
    return results  # type: ignore[return-value]  # every slot was filled above


def _place(accepted: list[tuple[int, PassRequest, dict[str, float]]]) -> list[_Placed]:
    placed = []
    start = 0
    for index, request, config in accepted:
        end = start + sum(len(d.tokens) for d in request.datums)
        targets = np.asarray(request.datums[0].loss_fn_inputs["target_tokens"])
        width = int(targets.shape[1]) if targets.ndim == 2 else None
        placed.append(_Placed(index, request, config, start, end, width))
        start = end
    return placed


def _compute(decoder: Decoder, placed: list[_Placed], chunk_size: int, is_training: bool) -> list[PassResult]:
    device = decoder.lm_head.weight.device
    with phase("pass.inputs"):
        datums = [d for p in placed for d in p.request.datums]
        lengths = [len(d.tokens) for d in datums]
        packing = PackedSequences.from_lengths(lengths, device)
        slots = [p.request.slot for p in placed for _ in p.request.datums]
        routing = LoRARouting.from_sequences(lengths, slots)
        tokens_T = to_device(np.concatenate([np.asarray(d.tokens, dtype=np.int64) for d in datums]), device)
        targets = to_device(_padded_targets(placed), device)
        batches = [
            pack_loss_inputs(
                p.request.loss_fn, p.config, [d.loss_fn_inputs for d in p.request.datums], device
            )
            for p in placed
        ]
    with phase("pass.forward"):
        hidden_TD = decoder(tokens_T, packing, routing)

    def head_fn(hidden_CD: Tensor, start: int, end: int) -> Tensor:
        return decoder.lm_head(hidden_CD, routing.slice(start, end))

    if is_training and all(p.request.forward_only or is_per_token_loss(p.request.loss_fn) for p in placed):
        # The lm_head's backward runs inside its chunked forward; the decoder's follows from its gradient.
        objective_fn = partial(_chunk_objective, placed, batches)
        with phase("pass.head_and_loss"):
            lp_TK, grad_TD = chunked_token_logprobs_backward(
                hidden_TD, head_fn, targets, chunk_size, objective_fn, decoder.vocab_shard
            )
        if grad_TD is not None:  # None when only the lm_head's LoRA trains
            with phase("pass.backward"):
                hidden_TD.backward(grad_TD)
        with torch.no_grad():
            return _to_results(
                [_request_outputs(p, batch, lp_TK)[1:] for p, batch in zip(placed, batches, strict=True)]
            )

    with phase("pass.head_and_loss"):
        lp_TK = chunked_token_logprobs(hidden_TD, head_fn, targets, chunk_size, decoder.vocab_shard)
        objective: list[Tensor] = []
        per_request: list[_Outputs] = []
        for p, batch in zip(placed, batches, strict=True):
            outputs = _request_outputs(p, batch, lp_TK)
            if not p.request.forward_only:
                objective.append(outputs[0].sum())
            per_request.append(outputs[1:])
    if is_training:
        with phase("pass.backward"):
            torch.stack(objective).sum().backward()
    return _to_results(per_request)


def _request_lp(p: _Placed, lp_TK: Tensor, start: int, end: int) -> Tensor:
    """Rows [start, end) of lp_TK in the request's target form: (N,) or (N, K) with its own K."""
    lp = lp_TK[start:end]
    return lp[:, 0] if p.width is None else lp[:, : p.width]


def _request_outputs(
    p: _Placed, batch: LossBatch, lp_TK: Tensor
) -> tuple[Tensor, list[Tensor], list[Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """A request's per-token loss (with autograd), and its detached per-datum logprobs, losses, metrics
    and health statistics."""
    lp = _request_lp(p, lp_TK, p.start, p.end)
    loss_T, metrics = compute_loss(p.request.loss_fn, lp, batch, p.config)
    lps, losses = list(lp.detach().split(batch.lengths)), list(loss_T.detach().split(batch.lengths))
    return loss_T, lps, losses, metrics, health_stats(lp, batch, metrics)


def _chunk_objective(
    placed: list[_Placed], batches: list[LossBatch], lp_CK: Tensor, start: int, end: int
) -> Tensor:
    """Σ ℓ over the training tokens among packed tokens [start, end); per-token losses only."""
    terms = []
    for p, batch in zip(placed, batches, strict=True):
        low, high = max(start, p.start), min(end, p.end)
        if p.request.forward_only or low >= high:
            continue
        lp = _request_lp(p, lp_CK, low - start, high - start)
        loss_T, _ = compute_loss(
            p.request.loss_fn, lp, _slice_batch(batch, low - p.start, high - p.start), p.config
        )
        terms.append(loss_T.sum())
    return torch.stack(terms).sum() if terms else lp_CK.new_zeros(())


def _slice_batch(batch: LossBatch, start: int, end: int) -> LossBatch:
    """Tokens [start, end) of a request's LossBatch: its datums cut to the range, renumbered from 0."""
    bounds = np.cumsum((0, *batch.lengths))
    first = int(np.searchsorted(bounds, start, side="right")) - 1
    lengths = tuple(
        int(min(high, end) - max(low, start))
        for low, high in pairwise(bounds)
        if max(low, start) < min(high, end)
    )
    inputs = {key: value[start:end] for key, value in batch.inputs.items()}
    return LossBatch(inputs, batch.seq_index_T[start:end] - first, lengths)


def _padded_targets(placed: list[_Placed]) -> np.ndarray:
    """All packed targets as one (T, K) int64 array; narrower rows padded with token 0 (ignored)."""
    width = max(p.width or 1 for p in placed)
    rows = []
    for p in placed:
        for datum in p.request.datums:
            targets = np.asarray(datum.loss_fn_inputs["target_tokens"], dtype=np.int64)
            targets = targets.reshape(len(datum.tokens), -1)
            rows.append(np.pad(targets, ((0, 0), (0, width - targets.shape[1]))))
    return np.concatenate(rows)


def _to_results(per_request: Sequence[_Outputs]) -> list[PassResult]:
    """Each request's (per-datum logprobs, per-datum losses, metrics, health) read back to the host in one
    copy, the pass's one host sync, after all its device work is queued."""
    tensors = [
        t
        for lps, losses, metrics, health in per_request
        for t in (*lps, *losses, *metrics.values(), *health.values())
    ]
    with phase("pass.read_back"):
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors]).cpu().numpy()
    values = iter(np.split(flat, np.cumsum([t.numel() for t in tensors])[:-1]))
    results = []
    for lps, losses, metrics, health in per_request:
        lp_arrays = [next(values).reshape(lp.shape) for lp in lps]
        loss_arrays = [next(values).reshape(loss.shape) for loss in losses]
        pairs = zip(lp_arrays, loss_arrays, strict=True)
        outputs = [{"logprobs": lp, "elementwise_loss": loss} for lp, loss in pairs]
        request_metrics = {name: float(next(values)[0]) for name in metrics}
        request_health = {name: float(next(values)[0]) for name in health}
        results.append(PassResult(outputs, request_metrics, request_health))
    return results
