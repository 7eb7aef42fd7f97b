"""What every rank of tests/model/test_tensor_parallel.py runs: rank 0 in the test process, rank 1 as
`python -m tests.model.tensor_parallel_scenarios MODEL_DIR ...` (tests/model/two_ranks.py). With `SINGLE`
the same functions give the single-rank reference, and in float64 its twin.

A scenario loads a decoder (this rank's part of it), attaches slots of several ranks, runs a packed batch
through both logprob paths with a backward, and a prefill and decode steps through the KV cache. Every
tensor it returns is whole: logprobs are whole on every rank; split gradients and logits are gathered,
whole-tensor gradients summed over the ranks (`all_reduce_whole_grads`), as the engine will. On an MoE
model each rank also reports the expert load of its first forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from loraplex.engine.logprobs import chunked_token_logprobs, chunked_token_logprobs_backward
from loraplex.model import hf_checkpoint
from loraplex.model.decoder import Decoder
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.kv_cache import KVCache
from loraplex.model.multi_lora import LoRARouting, MultiLoRALinear, init_slot_weights
from loraplex.model.packing import PackedSequences
from loraplex.model.tensor_parallel import (
    LoRASharding,
    Split,
    TensorParallel,
    VocabShard,
    all_reduce_whole_grads,
    copy_to_tp,
    gather_split,
    gather_vocab,
)
from tests.model.two_ranks import rank_main

LENGTHS = (6, 4, 9, 5, 7)
SEQUENCE_SLOTS = (0, 0, 1, None, 2)  # one base-only sequence between the slots
SLOT_RANKS = {0: 4, 1: 8, 2: 2}  # every slot at its own rank, unpadded
SLOT_GROUPS = {0: {"attn", "mlp", "unembed"}, 1: {"attn", "mlp", "unembed"}, 2: {"attn", "unembed"}}
CHUNK = 8  # tokens per lm_head chunk: several chunks, one cut inside a sequence
TOP_K = 2
PROMPTS = ((0, 5), (None, 3))  # (slot, prompt length) of the sequences the KV cache runs
DECODE_STEPS = 2
# A column-parallel target of slot 0, whose A every rank holds whole: ModelRun.partial_A is its gradient on
# one rank before the sum over the ranks.
PARTIAL_KEY = "0/model.layers.0.self_attn.q_proj"


@dataclass
class ReadCounter:
    """Tensor bytes a loader read out of safetensors files, by file key, and the keys it read whole."""

    by_key: dict[str, int] = field(default_factory=dict)
    whole_keys: set[str] = field(default_factory=set)

    @property
    def bytes(self) -> int:
        """Every byte read."""
        return sum(self.by_key.values())

    def add(self, key: str, tensor: Tensor) -> None:
        """Count a tensor read out of the file tensor `key` (all of it or a slice)."""
        self.by_key[key] = self.by_key.get(key, 0) + tensor.nbytes


@dataclass
class ModelRun:
    """One scenario's results on one rank, every tensor whole."""

    lp_top_k: Tensor  # (T, K) by chunked_token_logprobs, then backward of a weighted sum
    lp_per_token: Tensor  # (T,) by chunked_token_logprobs_backward, the per-token objective path
    grads_top_k: dict[str, Tensor]  # "slot/<target path>/A" -> the gradient of that slot tensor
    grads_per_token: dict[str, Tensor]
    decode_logits: list[Tensor]  # (B, V) of the prefill's last tokens, then of each decode step
    partial_A: Tensor  # this rank's gradient of PARTIAL_KEY's A before the sum over the ranks
    base_bytes: int  # bytes of this rank's base parameters (a tied weight once)
    read: ReadCounter
    expert_load: Tensor | None  # (L, E) of the first forward; None for a dense model


@contextmanager
def counting_reads() -> Iterator[ReadCounter]:
    """Count what hf_checkpoint reads out of safetensors files, while within."""
    counter = ReadCounter()
    real_open = hf_checkpoint.safe_open

    class Slice:
        def __init__(self, part: Any, key: str) -> None:
            self.part, self.key = part, key

        def get_shape(self) -> list[int]:
            return self.part.get_shape()

        def __getitem__(self, index: Any) -> Tensor:
            tensor = self.part[index]
            counter.add(self.key, tensor)
            return tensor

    class File:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = real_open(*args, **kwargs)

        def __enter__(self) -> File:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.file.keys()

        def get_slice(self, key: str) -> Slice:
            return Slice(self.file.get_slice(key), key)

        def get_tensor(self, key: str) -> Tensor:
            tensor = self.file.get_tensor(key)
            counter.add(key, tensor)
            counter.whole_keys.add(key)
            return tensor

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_checkpoint, "safe_open", File)
        yield counter


def part(tensor: Tensor, split: Split | None) -> Tensor:
    """This rank's part of a whole tensor."""
    return tensor if split is None else split.of(tensor).contiguous()


def _inputs(vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Packed tokens, (T, K) targets and (T, K) loss weights, the same on every rank."""
    generator = torch.Generator().manual_seed(7)
    T = sum(LENGTHS)
    tokens_T = torch.randint(0, vocab_size, (T,), generator=generator)
    targets_TK = torch.randint(0, vocab_size, (T, TOP_K), generator=generator)
    return tokens_T, targets_TK, torch.rand(T, TOP_K, generator=generator)


def _whole_grads(
    slot_tensors: dict[str, tuple[LoRASharding, Tensor, Tensor]], tp: TensorParallel
) -> tuple[dict[str, Tensor], Tensor]:
    """Every slot tensor's gradient whole (see the module docstring), and this rank's part of PARTIAL_KEY's
    A gradient; clears the gradients."""
    grads = {
        key: tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in (A, B))
        for key, (_, A, B) in slot_tensors.items()
    }
    partial_A = grads[PARTIAL_KEY][0].clone()
    all_reduce_whole_grads([(s, *grads[key]) for key, (s, _, _) in slot_tensors.items()], tp)
    whole = {}
    for key, (sharding, A, B) in slot_tensors.items():
        grad_A, grad_B = grads[key]
        whole[f"{key}/A"] = gather_split(grad_A, sharding.A, tp)
        whole[f"{key}/B"] = gather_split(grad_B, sharding.B, tp)
        A.grad = B.grad = None
    return whole, partial_A


def run_model(model_dir: Path, tp: TensorParallel, dtype: torch.dtype = torch.float32) -> ModelRun:
    """The scenario of the module docstring on one model; every rank of `tp` must run it."""
    with counting_reads() as read:
        decoder = load_decoder(model_dir, "cpu", dtype, tp)
    base_bytes = sum(p.nbytes for p in decoder.parameters())
    targets = decoder.lora_targets()
    generator = torch.Generator().manual_seed(3)
    slot_tensors: dict[str, tuple[LoRASharding, Tensor, Tensor]] = {}
    for slot, rank in SLOT_RANKS.items():
        initial = init_slot_weights(targets, rank, seed=10 + slot, groups=SLOT_GROUPS[slot])
        for path, (A, _) in initial.items():
            layer = targets[path][0]
            sharding = layer.lora_sharding(rank)
            _, whole_B = sharding.whole_shapes(layer.lora_shapes(rank))
            # B non-zero (not its initial zero), so that every A has a gradient to compare.
            B_OR = 0.1 * torch.randn(whole_B, generator=generator)
            A, B = A.clone().requires_grad_(), part(B_OR, sharding.B).requires_grad_()
            layer.attach(slot, A, B, scale=32.0 / rank)
            slot_tensors[f"{slot}/{path}"] = (sharding, A, B)

    tokens_T, targets_TK, weights_TK = _inputs(decoder.config.vocab_size)
    packing = PackedSequences.from_lengths(LENGTHS)
    routing = LoRARouting.from_sequences(LENGTHS, SEQUENCE_SLOTS)
    vocab = decoder.vocab_shard

    def head_fn(hidden_CD: Tensor, start: int, end: int) -> Tensor:
        return decoder.lm_head(hidden_CD, routing.slice(start, end))

    with torch.enable_grad():
        hidden_TD = decoder(tokens_T, packing, routing)
        lp_top_k = chunked_token_logprobs(hidden_TD, head_fn, targets_TK, CHUNK, vocab)
        (lp_top_k * weights_TK).sum().backward()
    expert_load = decoder.expert_load()
    grads_top_k, partial_A = _whole_grads(slot_tensors, tp)

    def objective_fn(lp_C: Tensor, start: int, end: int) -> Tensor:
        return (lp_C[:, 0] * weights_TK[start:end, 0]).sum()

    with torch.enable_grad():
        hidden_TD = decoder(tokens_T, packing, routing)
        lp_per_token, grad_TD = chunked_token_logprobs_backward(
            hidden_TD, head_fn, targets_TK[:, :1], CHUNK, objective_fn, vocab
        )
        hidden_TD.backward(grad_TD)
    grads_per_token, _ = _whole_grads(slot_tensors, tp)

    with torch.no_grad():
        decode_logits = _decode(decoder, tokens_T, dtype, vocab)
    return ModelRun(
        lp_top_k.detach(),
        lp_per_token[:, 0],
        grads_top_k,
        grads_per_token,
        decode_logits,
        partial_A,
        base_bytes,
        read,
        expert_load,
    )


def _decode(decoder: Decoder, tokens_T: Tensor, dtype: torch.dtype, vocab: VocabShard | None) -> list[Tensor]:
    """Whole logits of a prefill's last tokens and of each decode step after it (KV cache of this rank's
    kv heads)."""
    slots, lengths = zip(*PROMPTS, strict=True)
    cache = KVCache(decoder.config, "cpu", dtype, decoder.tp, max_tokens=1024)
    rows = [cache.allocate(n + DECODE_STEPS) for n in lengths]
    hidden = decoder.forward_cached(
        tokens_T[: sum(lengths)], cache.prefill(rows, lengths), LoRARouting.from_sequences(lengths, slots)
    )
    last = torch.tensor(lengths).cumsum(0) - 1
    logits = [decoder.lm_head(hidden[last], LoRARouting.from_sequences([1] * len(rows), slots))]
    for step in range(DECODE_STEPS):
        new_B = tokens_T[sum(lengths) + step * len(rows) :][: len(rows)]
        routing = LoRARouting.from_sequences([1] * len(rows), slots)
        logits.append(decoder.lm_head(decoder.forward_cached(new_B, cache.decode(rows), routing), routing))
    return [gather_vocab(x, vocab) for x in logits]


@dataclass
class HeadRun:
    """The vocab-parallel logprob paths alone: a LoRA head over a vocabulary the ranks do not divide."""

    lp_top_k: Tensor
    lp_per_token: Tensor
    grads: dict[str, Tensor]  # "<path>/<tensor>" -> whole gradient: hidden, W, A, B per path


HEAD_T, HEAD_D, HEAD_V, HEAD_R = 23, 8, 29, 4  # V odd: 15 and 14 rows


def run_head(tp: TensorParallel, dtype: torch.dtype = torch.float32) -> HeadRun:
    """lm_head-shaped logits h·(W + B·A)ᵀ, W and B split by vocabulary rows, through both logprob paths."""
    generator = torch.Generator().manual_seed(5)
    whole = {
        "W": torch.randn(HEAD_V, HEAD_D, generator=generator, dtype=dtype),
        "A": 0.3 * torch.randn(HEAD_R, HEAD_D, generator=generator, dtype=dtype),
        "B": 0.3 * torch.randn(HEAD_V, HEAD_R, generator=generator, dtype=dtype),
    }
    hidden_TD = torch.randn(HEAD_T, HEAD_D, generator=generator, dtype=dtype)
    targets_TK = torch.randint(0, HEAD_V, (HEAD_T, 3), generator=generator)
    weights_TK = torch.randn(HEAD_T, 3, generator=generator)
    split = tp.split(HEAD_V, 0)
    vocab = None if split is None else VocabShard(split, tp)
    splits = {"W": split, "A": None, "B": split}
    grads: dict[str, Tensor] = {}
    lps = []
    for path in ("top_k", "per_token"):
        params = {name: part(t, splits[name]).requires_grad_() for name, t in whole.items()}
        leaf_TD = hidden_TD.clone().requires_grad_()

        def head_fn(h_CD: Tensor, start: int, end: int, p: dict[str, Tensor] = params) -> Tensor:
            return h_CD @ p["W"].T + (h_CD @ p["A"].T) @ p["B"].T

        with torch.enable_grad():
            h_TD = copy_to_tp(leaf_TD, tp)
            if path == "top_k":
                lp = chunked_token_logprobs(h_TD, head_fn, targets_TK, 5, vocab)
                (lp * weights_TK).sum().backward()
            else:
                lp, grad_TD = chunked_token_logprobs_backward(
                    h_TD, head_fn, targets_TK[:, 0], 5, lambda x, s, e: (x * weights_TK[s:e, 0]).sum(), vocab
                )
                h_TD.backward(grad_TD)
        lps.append(lp.detach())
        # A column-parallel LoRA: A whole, B split by vocabulary rows.
        all_reduce_whole_grads([(LoRASharding(None, split), params["A"].grad, params["B"].grad)], tp)
        grads[f"{path}/hidden"] = leaf_TD.grad
        for name, t in params.items():
            grads[f"{path}/{name}"] = gather_split(t.grad, splits[name], tp)
    return HeadRun(lps[0], lps[1], grads)


@dataclass
class Bf16HeadRun:
    """A bf16 lm_head (fp32 output) with a LoRA slot, split by vocabulary rows: its inputs, whole logits,
    the logprobs of both chunked paths and the hidden states' gradient (bf16, summed over the ranks)."""

    inputs: dict[str, Tensor]  # W (V, D) and hidden (T, D) bf16; A, B fp32; targets (T,)
    logits: Tensor
    lp_chunked: Tensor
    lp_per_token: Tensor
    grad_hidden: Tensor


BF16_HEAD_SCALE = 2.0


def run_bf16_head(tp: TensorParallel) -> Bf16HeadRun:
    """The lm_head as the decoder builds it, in bf16, over HEAD_V vocabulary rows (15 and 14 a rank)."""
    generator = torch.Generator().manual_seed(6)
    D = 64
    inputs = {
        "W": torch.randn(HEAD_V, D, generator=generator).bfloat16(),
        "A": 0.3 * torch.randn(HEAD_R, D, generator=generator),
        "B": 0.3 * torch.randn(HEAD_V, HEAD_R, generator=generator),
        "hidden": torch.randn(HEAD_T, D, generator=generator).bfloat16(),
        "targets": torch.randint(0, HEAD_V, (HEAD_T,), generator=generator),
    }
    layer = MultiLoRALinear(D, HEAD_V, False, dtype=torch.bfloat16, tp=tp, is_fp32_output=True)
    with torch.no_grad():
        layer.weight.copy_(part(inputs["W"], layer.split))
    layer.attach(0, inputs["A"], part(inputs["B"], layer.lora_sharding(HEAD_R).B), BF16_HEAD_SCALE)
    routing = LoRARouting.from_sequences([HEAD_T], [0])
    vocab = None if layer.split is None else VocabShard(layer.split, tp)

    def head_fn(h_CD: Tensor, start: int, end: int) -> Tensor:
        return layer(h_CD, routing.slice(start, end))

    with torch.no_grad():
        logits = gather_vocab(layer(inputs["hidden"], routing), vocab)
        lp_chunked = chunked_token_logprobs(inputs["hidden"], head_fn, inputs["targets"], 5, vocab)
    leaf_TD = inputs["hidden"].clone().requires_grad_()
    with torch.enable_grad():
        h_TD = copy_to_tp(leaf_TD, tp)
        lp_per_token, grad_TD = chunked_token_logprobs_backward(
            h_TD, head_fn, inputs["targets"], 5, lambda lp_C, s, e: lp_C.sum(), vocab
        )
        h_TD.backward(grad_TD)
    assert leaf_TD.grad is not None
    return Bf16HeadRun(inputs, logits, lp_chunked, lp_per_token, leaf_TD.grad)


def run_all(model_dirs: list[Path], tp: TensorParallel) -> dict[str, Any]:
    """Every scenario, in one order on every rank; per model its ModelRun, the head's HeadRun, and what
    each rank read and holds (gathered to every rank)."""
    results: dict[str, Any] = {"head": run_head(tp), "bf16_head": run_bf16_head(tp)}
    for model_dir in model_dirs:
        run = run_model(model_dir, tp)
        per_rank = [None] * tp.size
        # Plain values: rank 1 runs this module as __main__, whose classes rank 0 cannot unpickle.
        mine = (
            run.base_bytes,
            run.read.bytes,
            run.read.whole_keys,
            run.lp_top_k,
            run.read.by_key,
            run.expert_load,
        )
        dist.all_gather_object(per_rank, mine, group=tp.group)
        results[model_dir.name] = (run, per_rank)
    return results


if __name__ == "__main__":
    rank_main(run_all)
