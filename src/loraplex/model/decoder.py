"""One decoder for the Llama 3, Qwen2/2.5, Qwen3 and Qwen3-MoE families, run over a packed token batch.

What differs per family (each a DecoderConfig field, never a branch on the family's name):
- q/k/v bias: Qwen2 always, without an o_proj bias; Llama and Qwen3 on all four when `attention_bias`.
- q/k RMSNorm over each head before rope: Qwen3 and Qwen3-MoE (`qk_norm`).
- head_dim may differ from hidden_size / num_attention_heads: Qwen3.
- rope: Llama 3.1+ rescales low frequencies (`rope_scaling` of type llama3); Qwen uses plain rope.
- MLP bias: Llama when `mlp_bias`.
- sparse MoE MLP (router + experts, moe.py) in the layers `is_moe_layer` names: Qwen3-MoE.
- lm_head tied to embed_tokens: any family, when `tie_word_embeddings`.
Shared: pre-norm RMSNorm blocks, grouped-query attention, SwiGLU MLP, rope in HF's half-split layout.
The elementwise math between the matmuls (norms, rope, SwiGLU, the residual add before the MLP's norm)
is elementwise.py's: eager, or fused by torch.compile when the engine asks (`use_elementwise`).

Module names follow HF's (`model.layers.0.self_attn.q_proj`, `lm_head`), so checkpoint keys and PEFT
module paths are our own names; the one exception is an MoE layer's experts, stacked per projection
(`mlp.experts.gate_proj` holds every expert's gate_proj; hf_checkpoint.py maps HF's per-expert keys).
The base is frozen; LoRA slots attach to the MultiLoRALinear and ExpertLinear layers.
Two forwards share every block: `forward` over a packed batch of whole sequences, and `forward_cached`
over new tokens that extend sequences held in a KV cache (prefill, then one token per decode step).
Under tensor parallelism (a `TensorParallel` of several ranks, tensor_parallel.py) each rank holds a part
of every block: attention by heads (N/T query and K/T kv heads; the per-head q/k norms whole), the dense
MLP by its width, an MoE layer's experts E/T whole experts a rank (its router whole: moe.py), the embedding
and lm_head by vocabulary rows; everything else is whole on every rank.
Hidden states are whole on every rank, and `lm_head` gives this rank's vocabulary rows of the logits.
`lm_head`'s logits are fp32 whatever the weights' dtype (fp32_linear.py: logprobs are outputs too).
Knows nothing of HTTP, SQL, runs, tenants or files (hf_checkpoint.py reads checkpoints).

Shapes: T packed tokens, D hidden, N query heads, K kv heads, H head dim, F MLP width, V vocab,
L MoE layers, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from loraplex.model.attention import RotaryEmbedding, packed_attention
from loraplex.model.config import DecoderConfig
from loraplex.model.elementwise import EAGER, Elementwise
from loraplex.model.kv_cache import CacheStep
from loraplex.model.moe import ExpertLinear, SparseMoE
from loraplex.model.multi_lora import LoRARouting, LoRATarget, MultiLoRALinear
from loraplex.model.packing import PackedSequences
from loraplex.model.tensor_parallel import (
    SINGLE,
    Split,
    TensorParallel,
    VocabShard,
    check_shardable,
    copy_to_tp,
    vocab_parallel_embedding,
)

Device = torch.device | str | None
# attend(q_TNH, k_TKH, v_TKH) -> out_TNH: one layer's attention between projections, bound per forward.
AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]

# PEFT target name -> the `train_*` group of a slot that trains it (an MoE layer's expert projections too).
LORA_GROUPS = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "lm_head": "unembed",
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, normalised in fp32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float, device: Device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.elementwise = EAGER

    def forward(self, x: Tensor) -> Tensor:
        return self.elementwise.rms_norm(x, self.weight, self.eps)


class Embedding(nn.Module):
    """Token id -> its row of `weight` (V, D); under tensor parallelism this rank holds a range of rows."""

    def __init__(
        self, config: DecoderConfig, tp: TensorParallel, device: Device, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.split = tp.split(config.vocab_size, 0)
        shape = (config.vocab_size, config.hidden_size)
        if self.split is not None:
            shape = self.split.part_shape(shape)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))

    def parameter_splits(self) -> dict[str, Split]:
        """Parameter name -> this rank's part of the whole embedding's, when split."""
        return {} if self.split is None else {"weight": self.split}

    def forward(self, tokens_T: Tensor) -> Tensor:
        if self.split is None:
            return nn.functional.embedding(tokens_T, self.weight)
        return vocab_parallel_embedding(tokens_T, self.weight, self.split, self.tp)


class Attention(nn.Module):
    """Project, (q/k norm), rotate, attend (packed or over a KV cache, as bound by the forward), project;
    under tensor parallelism over this rank's heads only."""

    def __init__(
        self, config: DecoderConfig, tp: TensorParallel, device: Device, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        D, H = config.hidden_size, config.head_dim
        N, K = config.num_attention_heads, config.num_key_value_heads
        self.tp = tp
        # check_shardable ensures tp.size divides both: a rank's query heads share its kv heads.
        self.num_heads, self.num_kv_heads, self.head_dim = N // tp.size, K // tp.size, H
        self.q_proj = MultiLoRALinear(D, N * H, config.qkv_bias, device, dtype, tp)
        self.k_proj = MultiLoRALinear(D, K * H, config.qkv_bias, device, dtype, tp)
        self.v_proj = MultiLoRALinear(D, K * H, config.qkv_bias, device, dtype, tp)
        self.o_proj = MultiLoRALinear(N * H, D, config.o_bias, device, dtype, tp, is_row_parallel=True)
        self.q_norm = RMSNorm(H, config.rms_norm_eps, device, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(H, config.rms_norm_eps, device, dtype) if config.qk_norm else None
        self.elementwise = EAGER

    def forward(
        self, x_TD: Tensor, rope_TH: tuple[Tensor, Tensor], attend: AttendFn, routing: LoRARouting | None
    ) -> Tensor:
        T = x_TD.shape[0]
        x_TD = copy_to_tp(x_TD, self.tp)  # once for q, k and v: one gradient all-reduce
        q_TNH = self.q_proj(x_TD, routing).view(T, self.num_heads, self.head_dim)
        k_TKH = self.k_proj(x_TD, routing).view(T, self.num_kv_heads, self.head_dim)
        v_TKH = self.v_proj(x_TD, routing).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_TNH, k_TKH = self.q_norm(q_TNH), self.k_norm(k_TKH)
        rotate = self.elementwise.apply_rope
        q_TNH, k_TKH = rotate(q_TNH, *rope_TH), rotate(k_TKH, *rope_TH)
        out_TNH = attend(q_TNH, k_TKH, v_TKH)
        return self.o_proj(out_TNH.reshape(T, self.num_heads * self.head_dim), routing)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); under tensor parallelism over this rank's part of the width F."""

    def __init__(
        self, config: DecoderConfig, tp: TensorParallel, device: Device, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        D, F = config.hidden_size, config.intermediate_size
        self.tp = tp
        self.gate_proj = MultiLoRALinear(D, F, config.mlp_bias, device, dtype, tp)
        self.up_proj = MultiLoRALinear(D, F, config.mlp_bias, device, dtype, tp)
        self.down_proj = MultiLoRALinear(F, D, config.mlp_bias, device, dtype, tp, is_row_parallel=True)
        self.elementwise = EAGER

    def forward(self, x_TD: Tensor, routing: LoRARouting | None) -> Tensor:
        x_TD = copy_to_tp(x_TD, self.tp)  # once for gate and up: one gradient all-reduce
        hidden_TF = self.elementwise.swiglu(self.gate_proj(x_TD, routing), self.up_proj(x_TD, routing))
        return self.down_proj(hidden_TF, routing)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is sparse in MoE layers."""

    def __init__(
        self,
        config: DecoderConfig,
        layer: int,
        tp: TensorParallel,
        device: Device,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = Attention(config, tp, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, device, dtype, tp)
            if config.is_moe_layer(layer)
            else MLP(config, tp, device, dtype)
        )
        self.elementwise = EAGER

    def forward(
        self, x_TD: Tensor, rope_TH: tuple[Tensor, Tensor], attend: AttendFn, routing: LoRARouting | None
    ) -> Tensor:
        attended_TD = self.self_attn(self.input_layernorm(x_TD), rope_TH, attend, routing)
        norm = self.post_attention_layernorm
        x_TD, normed_TD = self.elementwise.add_rms_norm(x_TD, attended_TD, norm.weight, norm.eps)
        return x_TD + self.mlp(normed_TD, routing)


class Decoder(nn.Module):
    """The frozen base model: embed, blocks, final norm; `lm_head` is applied separately, in chunks.

    Weights are allocated uninitialised (load_decoder fills them); on the meta device it only
    describes shapes. Activations take the weights' dtype. Under tensor parallelism (`tp`) every weight
    is allocated at this rank's part's shape (no rank holds a whole split weight), and the group is used
    by forwards only, so a meta-device Decoder of any `tp` describes that rank's shapes.
    """

    def __init__(
        self,
        config: DecoderConfig,
        device: Device = None,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        check_shardable(config, tp, config.model_type)
        self.config = config
        self.tp = tp
        self.model = nn.ModuleDict(
            {
                "embed_tokens": Embedding(config, tp, device, dtype),
                "layers": nn.ModuleList(
                    Block(config, layer, tp, device, dtype) for layer in range(config.num_hidden_layers)
                ),
                "norm": RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype),
            }
        )
        self.rotary = RotaryEmbedding(config, device)
        # fp32 logits from bf16 weights at the bf16 product's cost: logprobs, not just argmax, are outputs.
        self.lm_head = MultiLoRALinear(
            config.hidden_size, config.vocab_size, False, device, dtype, tp, is_fp32_output=True
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Only slot tensors (held by reference, not registered here) are ever trained.
        self.requires_grad_(False)
        self.elementwise = EAGER

    def use_elementwise(self, elementwise: Elementwise) -> None:
        """Run every block's norms, rope, SwiGLU and residual adds with `elementwise`: EAGER, or fused()
        (elementwise.py: the same functions through torch.compile)."""
        self.elementwise = elementwise
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP | Block | SparseMoE):
                module.elementwise = elementwise

    def forward(
        self, tokens_T: Tensor, packing: PackedSequences, routing: LoRARouting | None = None
    ) -> Tensor:
        """Final-normed hidden states (T, D) of a packed batch; routing None = base model only.

        Under tensor parallelism they enter `lm_head` (column-parallel): their gradient is summed over
        the ranks in backward, so a caller's backward from this rank's vocabulary rows is complete.
        """
        if tokens_T.shape[0] != packing.num_tokens:
            raise ValueError(f"{tokens_T.shape[0]} tokens but the packing describes {packing.num_tokens}")

        def attend(layer: int, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> Tensor:
            return packed_attention(q_TNH, k_TKH, v_TKH, packing)

        return self._blocks(tokens_T, packing.positions_T, attend, routing)

    def forward_cached(self, tokens_T: Tensor, step: CacheStep, routing: LoRARouting | None = None) -> Tensor:
        """Final-normed hidden states (T, D) of new tokens that extend cached sequences; writes their K/V.

        Semantics: equals the rows of `forward` over each whole sequence (cached prefix + new tokens) at
        the new tokens' positions, with the same routing per sequence.
        """
        if tokens_T.shape[0] != step.positions_T.shape[0]:
            raise ValueError(f"{tokens_T.shape[0]} tokens but the cache step has {step.positions_T.shape[0]}")
        return self._blocks(tokens_T, step.positions_T, step.attend, routing)

    def _blocks(
        self,
        tokens_T: Tensor,
        positions_T: Tensor,
        attend: Callable[[int, Tensor, Tensor, Tensor], Tensor],
        routing: LoRARouting | None,
    ) -> Tensor:
        """Embed, run every block with `attend` bound to its layer index, final norm."""
        x_TD = self.model.embed_tokens(tokens_T)
        rope_TH = self.rotary(positions_T, x_TD.dtype)
        for layer, block in enumerate(self.model.layers):
            x_TD = block(x_TD, rope_TH, partial(attend, layer), routing)
        return copy_to_tp(self.model.norm(x_TD), self.tp)

    def logits(
        self, tokens_T: Tensor, packing: PackedSequences, routing: LoRARouting | None = None
    ) -> Tensor:
        """Full (T, V) logits in one go, for tests and small batches; the engine chunks `lm_head` itself.
        Under tensor parallelism, this rank's vocabulary rows (T, V/T) of them (`vocab_shard`)."""
        return self.lm_head(self.forward(tokens_T, packing, routing), routing)

    @property
    def vocab_shard(self) -> VocabShard | None:
        """The vocabulary rows of the logits `lm_head` gives on this rank; None when it gives all of them."""
        split = self.lm_head.split
        return None if split is None else VocabShard(split, self.tp)

    def parameter_splits(self) -> dict[str, Split]:
        """State-dict key -> this rank's part of that tensor of the whole model, for every tensor split over
        tensor-parallel ranks (none with one rank); a tied lm_head.weight is listed under both keys."""
        return {
            f"{name}.{parameter}": split
            for name, module in self.named_modules()
            if isinstance(module, MultiLoRALinear | Embedding | ExpertLinear)
            for parameter, split in module.parameter_splits().items()
        }

    def lora_targets(self) -> dict[str, tuple[LoRATarget, str]]:
        """Module path -> (layer, group in {"attn", "mlp", "unembed"}), layers in forward order; the path
        is PEFT's module path except on expert projections (peft_format.py maps those)."""
        return {
            name: (module, LORA_GROUPS[name.rsplit(".", 1)[-1]])
            for name, module in self.named_modules()
            if isinstance(module, MultiLoRALinear | ExpertLinear)
        }

    def expert_load(self) -> Tensor | None:
        """(L, E) rows each MoE layer routed to each expert in the last forward (tokens × experts per
        token in all); None for a dense model or before the first forward. Under expert parallelism every
        rank has every expert's: each routes every token itself (no collective)."""
        loads = [block.mlp.load_E for block in self.model.layers if isinstance(block.mlp, SparseMoE)]
        if not loads or any(load is None for load in loads):
            return None
        return torch.stack(loads)  # type: ignore[arg-type]  # checked above
