"""A pass split by tokens, across engine ranks or into passes within a token budget, and the pieces'
results merged back into request order.

The accepted requests' datums, in order, are cut into contiguous runs: one per rank with about equal
tokens, or as many as keep each within the budget; a request may be cut between them. Each datum's
outputs depend only on the datum and its slot's adapter (attention never crosses sequences), so the
merged outputs are the unsplit pass's outputs, and request metrics are recomputed from them. No HTTP,
no SQL.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from loraplex.engine.health import health_stats
from loraplex.engine.losses import compute_loss, pack_loss_inputs, resolve_loss_config
from loraplex.engine.types import PassRequest, PassResult


@dataclass(frozen=True)
class Piece:
    """Datums start..end-1 of request `request` (an index into the split requests)."""

    request: int
    start: int
    end: int


def split_by_tokens(requests: Sequence[PassRequest], world_size: int) -> list[list[Piece]]:
    """Per rank, in rank order, the pieces of requests it runs.

    Cut k lies at the datum boundary nearest to k/world_size of all tokens, so every rank's tokens are
    within one datum's length of the mean. Concatenating the ranks' pieces gives back every datum in
    order.
    """
    owners = [
        (index, datum) for index, request in enumerate(requests) for datum in range(len(request.datums))
    ]
    # offsets[b] = tokens before datum b: the token position of each possible cut b = 0..len(owners).
    offsets = [0, *itertools.accumulate(len(requests[i].datums[d].tokens) for i, d in owners)]
    bounds = [0]
    for k in range(1, world_size):
        target = k * offsets[-1] / world_size
        cut = bisect.bisect_left(offsets, target)  # the first cut at or past the target
        if cut > 0 and target - offsets[cut - 1] < offsets[cut] - target:
            cut -= 1
        bounds.append(max(bounds[-1], cut))
    bounds.append(len(owners))
    return [_pieces(owners[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


def split_by_budget(requests: Sequence[PassRequest], budget: int) -> list[list[Piece]]:
    """The requests' datums, in order, cut into consecutive groups of at most `budget` tokens each (a
    longer datum alone): the passes one oversized pass becomes. Concatenating the groups gives back every
    datum in order."""
    groups: list[list[tuple[int, int]]] = [[]]
    tokens = 0
    for index, request in enumerate(requests):
        for datum in range(len(request.datums)):
            length = len(request.datums[datum].tokens)
            if groups[-1] and tokens + length > budget:
                groups.append([])
                tokens = 0
            groups[-1].append((index, datum))
            tokens += length
    return [_pieces(group) for group in groups if group]


def _pieces(owners: list[tuple[int, int]]) -> list[Piece]:
    """Runs of consecutive datums of one request as pieces."""
    pieces = []
    for request, run in itertools.groupby(owners, key=lambda owner: owner[0]):
        datums = [datum for _, datum in run]
        pieces.append(Piece(request, datums[0], datums[-1] + 1))
    return pieces


def piece_requests(requests: Sequence[PassRequest], pieces: list[Piece]) -> list[PassRequest]:
    """The requests one rank runs: each piece as its request with only the piece's datums."""
    return [replace(requests[p.request], datums=requests[p.request].datums[p.start : p.end]) for p in pieces]


def merge_results(
    requests: Sequence[PassRequest], shares: list[list[Piece]], results: list[list[PassResult]]
) -> list[PassResult]:
    """Per request, its pieces' outputs joined in datum order and its metrics and health recomputed from
    them."""
    outputs: list[list[dict[str, np.ndarray]]] = [[] for _ in requests]
    for pieces, rank_results in zip(shares, results, strict=True):
        for piece, result in zip(pieces, rank_results, strict=True):
            outputs[piece.request].extend(result.outputs)
    return [_recomputed(r, out) for r, out in zip(requests, outputs, strict=True)]


@torch.no_grad()
def _recomputed(request: PassRequest, outputs: list[dict[str, np.ndarray]]) -> PassResult:
    """A request's result with its metrics and health recomputed from its per-datum logprobs, as the
    single-rank pass computes them.

    Semantics: the metrics and health `passes.run_pass` reports for the whole request. Both are pure
    functions of the logprobs and the loss inputs, so recomputing them is exact, where combining the
    pieces' would not be (clip_fraction:mean is a mean over counted tokens, logprob_abs_diff_max a maximum).
    """
    config = resolve_loss_config(request.loss_fn, request.loss_fn_config)
    batch = pack_loss_inputs(request.loss_fn, config, [d.loss_fn_inputs for d in request.datums])
    lp = torch.from_numpy(np.concatenate([out["logprobs"] for out in outputs]))
    _, metrics = compute_loss(request.loss_fn, lp, batch, config)
    health = health_stats(lp, batch, metrics)
    values = torch.stack([m.float() for m in (*metrics.values(), *health.values())]).tolist()
    return PassResult(
        outputs,
        dict(zip(metrics, values[: len(metrics)], strict=True)),
        dict(zip(health, values[len(metrics) :], strict=True)),
    )
