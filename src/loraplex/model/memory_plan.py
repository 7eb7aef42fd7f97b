"""Memory per rank, stated before anything is loaded: the bytes of the frozen base, the LoRA adapters,
their optimizer state and the KV cache that one rank holds when a model is trained on N ranks in N/T
data-parallel groups of T tensor-parallel ranks. Arithmetic over a DecoderConfig: no tensor is allocated.

Sharding rules (the tensor-parallel layout the engine runs: model/tensor_parallel.py, model/moe.py):
- attention by heads: q/k/v column-parallel (N/T query heads, K/T KV heads a rank), o_proj row-parallel.
  T must divide both head counts: KV heads are never replicated.
- a dense MLP by its width: gate/up column-parallel, down row-parallel; ceil(F/T) columns on the
  largest rank (the split is uneven where T does not divide F, as model/tensor_parallel.py makes it).
- embed_tokens and lm_head by vocabulary: ceil(V/T) rows a rank (one shard when tied).
- replicated: RMSNorm weights, Qwen3's q/k norms, the rope frequencies, row-parallel biases, the router.
- MoE experts whole, E/T of them a rank (expert parallelism inside the group); T must divide E.
LoRA follows its base layer: on a column-parallel one A (R, in) is whole and B (out/T, R) split by
output; on a row-parallel one A (R, in/T) is split by input and B (out, R) whole; an expert's A and B
live with the expert; lm_head's B is split by vocabulary.

A slot holds what the engine allocates for it (engine/optimizer.py: AdamSlot; engine/transactions.py):
- adapter: its A and B weights, fp32;
- optimizer: the fp32 gradient accumulators (allocated in whole rows of GRADIENT_ROW elements), both
  fp32 AdamW moments, and the pass undo buffer's fp32 copy of its gradients. That buffer holds the
  accumulators a pass trains that already hold gradients and keeps its largest size, so the plan counts
  one copy of every slot's: a pass of all slots during gradient accumulation.
tests/engine/test_parameter_bytes.py checks base, adapter and optimizer against a live engine at T = 1;
tests/model/test_memory_plan.py the base and LoRA of each rank of an MoE decoder at T = 2.

The sampler's snapshot pool (model/lora_pool.py; on the ranks that sample) holds, on every dense LoRA
target, P + 1 entries (--max-sampling-snapshots, and a zero entry) of the server's largest rank R in the
base dtype: (P + 1)·R·(in + out) values, whatever the snapshots' own ranks (`snapshot_pool_bytes`).

Not planned here: activations, which a pass's --pass-token-budget bounds rather than the model (hence the
headroom of `fits`), the resident snapshots' fp32 copies that prefill routes by (a snapshot's adapter
bytes each, on the expert layers too), the CUDA context and the allocator's slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loraplex.model.config import DecoderConfig

# The LoRA target groups, as a slot's train_attn / train_mlp / train_unembed switch them on.
LORA_GROUP_NAMES = ("attn", "mlp", "unembed")
# engine/optimizer.py's _NORM_ROW: gradient accumulators are allocated in whole rows of this many elements.
GRADIENT_ROW = 4096
_FP32 = 4  # adapter weights, gradients, moments and the rope frequencies are fp32 whatever the base dtype


class ShardingError(ValueError):
    """The model cannot be split over T ranks by the sharding rules; the message says which count T must
    divide."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters planned for: each slot's rank and the target groups it trains."""

    rank: int
    groups: frozenset[str] = frozenset(LORA_GROUP_NAMES)


@dataclass(frozen=True)
class Card:
    """An accelerator's memory, as the device reports its total."""

    name: str
    total_bytes: int


# nvidia-smi's totals: H100 80GB HBM3 81559 MiB (A100 80GB: 81920), H200 143771 MiB.
CARDS = (Card("80 GB", 81559 << 20), Card("141 GB", 143771 << 20))
# Left free on every rank by `fits`: the CUDA context and NCCL's buffers (1-3 GiB), the caching
# allocator's slack, and the activations of a modest pass. Activations grow with --pass-token-budget, not
# with the model (~170 KB per token per layer measured on the Qwen3-4B shape in bf16, docs/BENCHMARKS.md):
# the plan's free column is what a pass can have, and the operator sets the budget from it.
DEFAULT_HEADROOM_BYTES = 16 << 30


@dataclass(frozen=True)
class SlotBytes:
    """One slot on one rank: its LoRA parameters and the bytes the engine allocates for them."""

    parameters: int
    weights: int  # A and B, fp32: the adapter
    gradients: int  # fp32 accumulators, whole rows of GRADIENT_ROW
    moments: int  # exp_avg and exp_avg_sq, fp32
    undo: int  # the pass undo buffer's fp32 copy of the gradients

    @classmethod
    def of(cls, parameters: int) -> SlotBytes:
        """The bytes of a slot of `parameters` LoRA parameters."""
        rows = -(-parameters // GRADIENT_ROW)
        return cls(
            parameters=parameters,
            weights=_FP32 * parameters,
            gradients=_FP32 * rows * GRADIENT_ROW,
            moments=2 * _FP32 * parameters,
            undo=_FP32 * parameters,
        )

    @property
    def optimizer(self) -> int:
        """Gradients, moments and the undo copy."""
        return self.gradients + self.moments + self.undo

    @property
    def total(self) -> int:
        """Everything the slot holds."""
        return self.weights + self.optimizer


@dataclass(frozen=True)
class RankPlan:
    """What one rank of a group of `tp` holds, by kind."""

    tp: int
    base: int  # the frozen model's parameters and buffers
    slot: SlotBytes
    slots: int
    kv: int  # the KV cache of `kv_tokens` tokens (on the ranks that sample)

    @property
    def adapter(self) -> int:
        """Every slot's weights."""
        return self.slots * self.slot.weights

    @property
    def optimizer(self) -> int:
        """Every slot's gradients, moments and undo copy."""
        return self.slots * self.slot.optimizer

    @property
    def total(self) -> int:
        """Base, adapters, optimizer and KV cache."""
        return self.base + self.adapter + self.optimizer + self.kv

    def free_bytes(self, card: Card) -> int:
        """What the card has left beyond the plan (negative when it does not hold even that)."""
        return card.total_bytes - self.total

    def fits(self, card: Card, headroom: int = DEFAULT_HEADROOM_BYTES) -> bool:
        """Whether the plan leaves `headroom` bytes of the card free."""
        return self.free_bytes(card) >= headroom

    def slots_that_fit(self, card: Card, headroom: int = DEFAULT_HEADROOM_BYTES) -> int:
        """The most slots like this plan's that leave `headroom` free beside the base and the KV cache."""
        room = card.total_bytes - headroom - self.base - self.kv
        return max(0, room // self.slot.total)


@dataclass(frozen=True)
class _Linear:
    """One base linear map (or `copies` experts of one shape) as one rank holds it."""

    group: str | None  # the LoRA group that trains it; None: never trained (the router)
    in_features: int
    out_features: int
    copies: int = 1
    bias: int = 0
    is_expert: bool = False  # a projection of every expert (no snapshot pool: lora_pool.py)

    @property
    def parameters(self) -> int:
        return self.copies * self.in_features * self.out_features + self.bias

    def lora_parameters(self, rank: int) -> int:
        """A (R, in) and B (out, R) per copy: an expert projection's (E·R, in) and (out, E·R)."""
        return self.copies * rank * (self.in_features + self.out_features)


def _linears(config: DecoderConfig, tp: int) -> list[_Linear]:
    """Every linear map of the decoder, in forward order, with the shape one rank of `tp` holds."""
    D, H = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * H // tp, config.num_key_value_heads * H // tp
    linears: list[_Linear] = []
    for layer in range(config.num_hidden_layers):
        linears += [
            _Linear("attn", D, q_out, bias=q_out if config.qkv_bias else 0),
            _Linear("attn", D, kv_out, bias=kv_out if config.qkv_bias else 0),
            _Linear("attn", D, kv_out, bias=kv_out if config.qkv_bias else 0),
            _Linear("attn", q_out, D, bias=D if config.o_bias else 0),  # row-parallel: bias whole
        ]
        if config.is_moe_layer(layer):
            F, experts = config.moe_intermediate_size, config.num_experts // tp
            linears += [
                _Linear(None, D, config.num_experts),  # the router, replicated
                _Linear("mlp", D, F, copies=experts, is_expert=True),
                _Linear("mlp", D, F, copies=experts, is_expert=True),
                _Linear("mlp", F, D, copies=experts, is_expert=True),
            ]
        else:
            F = math.ceil(config.intermediate_size / tp)  # the largest rank's part of an uneven split
            bias = config.mlp_bias
            linears += [
                _Linear("mlp", D, F, bias=F if bias else 0),
                _Linear("mlp", D, F, bias=F if bias else 0),
                _Linear("mlp", F, D, bias=D if bias else 0),
            ]
    linears.append(_Linear("unembed", D, math.ceil(config.vocab_size / tp)))  # lm_head
    return linears


def check_sharding(config: DecoderConfig, tp: int) -> None:
    """ShardingError unless every split the rules make is whole at `tp` ranks."""
    if tp < 1:
        raise ShardingError(f"T = {tp}: a group has at least one rank")
    counts = [
        (config.num_attention_heads, "query heads"),
        (config.num_key_value_heads, "KV heads"),
    ]
    if any(config.is_moe_layer(layer) for layer in range(config.num_hidden_layers)):
        counts.append((config.num_experts, "experts"))
    for count, what in counts:
        if count % tp:
            raise ShardingError(f"T = {tp} does not divide the {count} {what}")


def base_parameters(config: DecoderConfig, tp: int = 1) -> int:
    """The frozen model's parameters on one rank of `tp` (at 1: the model's total)."""
    check_sharding(config, tp)
    D, H = config.hidden_size, config.head_dim
    vocab_rows = math.ceil(config.vocab_size / tp)
    linears = sum(linear.parameters for linear in _linears(config, tp))
    embedding = 0 if config.tie_word_embeddings else vocab_rows * D  # tied: lm_head's shard is it
    norms_per_layer = 2 * D + (2 * H if config.qk_norm else 0)
    return linears + embedding + config.num_hidden_layers * norms_per_layer + D  # + the final norm


def lora_parameters(config: DecoderConfig, tp: int, lora: LoraSpec) -> int:
    """One slot's LoRA parameters on one rank of `tp`."""
    check_sharding(config, tp)
    unknown = lora.groups - set(LORA_GROUP_NAMES)
    if unknown or not lora.groups:
        raise ValueError(
            f"LoRA groups must be a non-empty subset of {LORA_GROUP_NAMES}, got {sorted(lora.groups)}"
        )
    return sum(
        linear.lora_parameters(lora.rank) for linear in _linears(config, tp) if linear.group in lora.groups
    )


def kv_bytes_per_token(config: DecoderConfig, tp: int, dtype_bytes: int) -> int:
    """One cached token's keys and values in every layer, on one rank of `tp` (K/T heads)."""
    check_sharding(config, tp)
    heads = config.num_key_value_heads // tp
    return 2 * config.num_hidden_layers * heads * config.head_dim * dtype_bytes


def _pool_dtype_bytes(linear: _Linear, dtype_bytes: int) -> int:
    return max(dtype_bytes, _FP32) if linear.group == "unembed" else dtype_bytes


def snapshot_pool_bytes(config: DecoderConfig, tp: int, dtype_bytes: int, entries: int, rank: int) -> int:
    """The sampler's snapshot pools on one rank of `tp`: `entries` snapshots (and the zero entry) of rank
    `rank` on every dense LoRA target (expert layers have none), A and B in a dtype of `dtype_bytes` (the
    lm_head's in fp32 at least: its fp32 logits take their deltas in fp32), plus each entry's fp32 scale
    per target."""
    check_sharding(config, tp)
    dense = [linear for linear in _linears(config, tp) if linear.group is not None and not linear.is_expert]
    per_entry = sum(
        _pool_dtype_bytes(linear, dtype_bytes) * linear.lora_parameters(rank) + _FP32 for linear in dense
    )
    return (entries + 1) * per_entry


def plan_rank(
    config: DecoderConfig, tp: int, dtype_bytes: int, lora: LoraSpec, slots: int, kv_tokens: int
) -> RankPlan:
    """The bytes one rank of a tensor-parallel group of `tp` holds, by kind, with the base in a dtype of
    `dtype_bytes` bytes (2: bf16 on GPUs; 4: fp32 on CPUs), `slots` slots of `lora`, and a KV cache of
    `kv_tokens` tokens in the base dtype; ShardingError if the rules cannot split the model over `tp`."""
    rope = _FP32 * (config.head_dim // 2)  # the inv_freq buffer
    return RankPlan(
        tp=tp,
        base=base_parameters(config, tp) * dtype_bytes + rope,
        slot=SlotBytes.of(lora_parameters(config, tp, lora)),
        slots=slots,
        kv=kv_tokens * kv_bytes_per_token(config, tp, dtype_bytes),
    )
