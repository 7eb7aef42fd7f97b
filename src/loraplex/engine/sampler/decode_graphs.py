"""A decode step's forward and logits as one CUDA graph replay per bucket, on CUDA (`serve --cuda-graphs`).

A decode step of a large model is hundreds of small kernels (per layer: projections, their pooled LoRA
deltas, norms, rope, the KV write, the gather and attention), and at small batches the host's launching
them is the step's time. Captured once per (rows, span) bucket (decode_buckets.py: the padded step's
ops and shapes depend on the bucket alone), a step is: copy its inputs (tokens, KV slots, positions,
visibility, pool indices) into the bucket's static buffers, replay the graph, read its static logits.
Sampling (`Sampler._draw`) stays outside: its per-request parameters and generators are host state.

A graph holds the addresses of everything it reads: the weights, the snapshot pools (loaded in place,
lora_pool.py, so snapshots come and go under a captured step) and the KV cache's pools. The KV pools are
dropped while the sampler is idle and may come back elsewhere, so every step compares their addresses
with those the graphs were captured against and drops every graph when they differ.

Capture follows torch's recipe: warm up on a side stream (lazy initialisations, cuBLAS's per-stream
workspace, the compiled elementwise functions' compiles, happen outside the capture), then capture on that
same stream into one memory pool shared by every graph (replays run one at a time on one stream and keep
nothing in the pool alive between them, the logits going to buffers of their own, so the intermediates of
one graph may reuse those of another). Only dense models on one rank: an MoE layer routes LoRA by the
step's host-side segments, which a replay would not see, and tensor parallelism would put collectives into
the graph.

Memory: each graph keeps its static inputs (about 9·B·L bytes: the (B, L) slots and mask), and the graphs
of one row count B write their logits into one (B, V) fp32 buffer (an extra copy of B·V floats a step,
a few microseconds); the shared pool holds the intermediates of the largest step captured (a few (B, D)
and (B, F) activations a layer, its (B, L, K, H) key/value gathers, the (B, V) logits). At most
`MAX_GRAPHS` graphs, the least recently replayed dropped beyond. For Qwen3-4B (V = 151936) the logits
buffers are 0.6 MB a row of each row count met: 665 MB if a --max-sampling-batch 128 server meets all 19.

Shapes: B rows of the bucket, L its span, V vocab.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from loraplex.errors import UserError
from loraplex.model.decoder import Decoder
from loraplex.model.kv_cache import DecodeStep, KVCache
from loraplex.model.multi_lora import LoRARouting

# Graphs held at once; the least recently replayed one is dropped beyond.
MAX_GRAPHS = 64
# Eager runs before a capture, as torch's docs do: lazy initialisations happen there, not in the graph.
_WARMUP_RUNS = 3

# (tokens_B, step, routing) -> (B, V) fp32 logits: the eager step a graph captures.
StepLogits = Callable[[Tensor, DecodeStep, LoRARouting], Tensor]


class CaptureError(RuntimeError):
    """A decode step could not be captured; its KV writes (the warm-up's) are those the eager step makes."""


def use_cuda_graphs(setting: str, decoder: Decoder) -> bool:
    """The `--cuda-graphs` setting for `decoder`: "auto" on where graphs apply (CUDA, one rank, no MoE
    layer), "off" never, "on" there too but a UserError naming why elsewhere."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"cuda graphs setting {setting!r}: expected auto, on or off")
    config = decoder.config
    why_not = [
        reason
        for reason, applies in (
            ("the device is not CUDA", decoder.lm_head.weight.device.type != "cuda"),
            ("tensor parallelism would capture collectives", decoder.tp.size > 1),
            (
                "MoE layers route LoRA by host-side segments",
                any(config.is_moe_layer(layer) for layer in range(config.num_hidden_layers)),
            ),
        )
        if applies
    ]
    if setting == "on" and why_not:
        raise UserError(f"--cuda-graphs on: {'; '.join(why_not)}")
    return setting != "off" and not why_not


@dataclass
class _Graph:
    """One bucket's captured step, the static inputs it reads (`_inputs` order), and the logits it writes
    (shared with the other graphs of B rows)."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]
    logits_BV: Tensor

    def load(self, tokens_B: Tensor, step: DecodeStep, routing: LoRARouting) -> None:
        """Copy a step's inputs into the static ones, on the device (no host sync)."""
        for static, value in zip(self.inputs, _inputs(tokens_B, step, routing), strict=True):
            static.copy_(value, non_blocking=True)


class DecodeGraphs:
    """Lazily captured graphs of `step_logits`, one per (B, L) bucket, at most `max_graphs` held."""

    def __init__(self, step_logits: StepLogits, max_graphs: int = MAX_GRAPHS) -> None:
        self._step_logits = step_logits
        self._max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()  # least recently used first
        self._logits: dict[int, Tensor] = {}  # B -> the (B, V) logits every graph of B rows writes
        self._pool: tuple[int, int] | None = None  # the graphs' shared memory pool (graph_pool_handle)
        self._stream: torch.cuda.Stream | None = None  # where every graph warms up and is captured
        self._kv_addresses: tuple[int, ...] = ()  # where the KV pools were when the graphs were captured

    def __len__(self) -> int:
        return len(self._graphs)

    def logits(self, tokens_B: Tensor, step: DecodeStep, routing: LoRARouting) -> Tensor:
        """The step's (B, V) fp32 logits, from its bucket's graph (captured now if new); valid until the
        next call."""
        kv_addresses = _addresses(step.cache)
        if kv_addresses != self._kv_addresses:
            self.clear()
            self._kv_addresses = kv_addresses
        bucket = (step.slots_BL.shape[0], step.slots_BL.shape[1])
        graph = self._graphs.get(bucket)
        if graph is None:
            try:
                graph = self._graphs[bucket] = self._capture(tokens_B, step, routing)
            except Exception as exc:  # an op that cannot be captured, on some torch or driver
                self.clear()
                raise CaptureError(f"capturing the decode step of bucket {bucket} failed: {exc}") from exc
            if len(self._graphs) > self._max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(bucket)
            graph.load(tokens_B, step, routing)
        graph.graph.replay()
        return graph.logits_BV

    def clear(self) -> None:
        """Drop every graph; their memory pool goes with the last of them."""
        self._graphs.clear()
        self._logits.clear()
        self._pool = None
        self._kv_addresses = ()

    def _capture(self, tokens_B: Tensor, step: DecodeStep, routing: LoRARouting) -> _Graph:
        """Capture the step on static copies of its inputs (which the replay that follows then computes).

        The warm-up runs are the step itself, so the keys and values they write are those the replay
        writes again."""
        inputs = tuple(value.clone() for value in _inputs(tokens_B, step, routing))
        static = _with_inputs(inputs, step, routing)
        device = tokens_B.device
        if self._stream is None or self._pool is None:
            self._stream, self._pool = torch.cuda.Stream(device), torch.cuda.graph_pool_handle()
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            for _ in range(_WARMUP_RUNS):
                warm_logits_BV = self._step_logits(*static)
        torch.cuda.current_stream(device).wait_stream(self._stream)
        logits_BV = self._logits.get(len(tokens_B))
        if logits_BV is None:
            logits_BV = self._logits[len(tokens_B)] = torch.empty_like(warm_logits_BV)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a metrics read) do not break this capture.
        capture = torch.cuda.graph(graph, self._pool, self._stream, capture_error_mode="thread_local")
        with capture:
            logits_BV.copy_(self._step_logits(*static))
        return _Graph(graph, inputs, logits_BV)


def _addresses(cache: KVCache) -> tuple[int, ...]:
    """Where the cache's key and value pools are now, and their block count: what a graph reads."""
    return (cache.num_blocks, *(pool.data_ptr() for pool in (*cache.keys, *cache.values)))


def _inputs(tokens_B: Tensor, step: DecodeStep, routing: LoRARouting) -> tuple[Tensor, ...]:
    """What a decode step's forward reads besides the weights and the pools, in one order."""
    assert routing.pool_index_T is not None  # a decode step routes by the snapshot pools
    return tokens_B, step.slots_B, step.positions_T, step.slots_BL, step.is_visible_BL, routing.pool_index_T


def _with_inputs(
    inputs: tuple[Tensor, ...], step: DecodeStep, routing: LoRARouting
) -> tuple[Tensor, DecodeStep, LoRARouting]:
    """`step_logits`' arguments reading `inputs` (`_inputs` order) instead of the step's own."""
    tokens_B, slots_B, positions_T, slots_BL, is_visible_BL, pool_index_T = inputs
    static_step = replace(
        step, slots_B=slots_B, positions_T=positions_T, slots_BL=slots_BL, is_visible_BL=is_visible_BL
    )
    return tokens_B, static_step, replace(routing, pool_index_T=pool_index_T)
