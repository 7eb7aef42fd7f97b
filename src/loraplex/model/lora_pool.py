"""Snapshot pool: every resident adapter of one layer stacked in one tensor, routed by a per-token index.

The decode step routes each token to its sequence's adapter with one gather per weight and two batched
matmuls, whatever the number of distinct adapters in the batch: the same aten ops, the same shapes,
no host sync (no segment lengths or distinct slots read on the host), so its launch count does not grow
with the adapters and the step can be captured. The price is a per-token copy of the adapter it uses,
(T, R, I) and (T, O, R), which at decode batch sizes is small beside the base weights it reads anyway
(punica's BGMV kernel avoids the copy; plain torch has none). Prefill and training keep the segmented
path of multi_lora.py, whose copies would be (tokens × adapter) there.

Every entry has the pool's rank R (the largest the server allows): a snapshot of rank r < R fills rows
/ columns [0, r) and leaves the rest zero, and a zero row of A gives a zero element of x·Aᵀ, which times
B's zero column adds exactly 0 to every output. The last entry stays zero: index -1 selects it (torch
indexing counts from the end), so base-only and padding tokens add exactly 0 with no mask and no
data-dependent shape. Knows nothing of snapshots' files, ids or eviction (engine/sampler/snapshot_cache.py).

Shapes: T tokens, I in features, O out features, P entries (+1: the zero entry), R the pool's rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loraplex.model.fp32_matmul import bmm_fp32


class LoRAPool:
    """One layer's `entries` adapters of rank at most `rank`: A (P+1, R, I), B (P+1, O, R) in the compute
    dtype, the scale of each entry in fp32; entry P (index -1) is all zero."""

    def __init__(
        self,
        entries: int,
        rank: int,
        in_features: int,
        out_features: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if entries < 1 or rank < 1:
            raise ValueError(f"a LoRA pool needs at least one entry and rank 1, got {entries} and {rank}")
        self.A_PRI = torch.zeros(entries + 1, rank, in_features, device=device, dtype=dtype)
        self.B_POR = torch.zeros(entries + 1, out_features, rank, device=device, dtype=dtype)
        self.scale_P = torch.zeros(entries + 1, device=device, dtype=torch.float32)

    @property
    def entries(self) -> int:
        """P, the adapters the pool holds at once (the zero entry not counted)."""
        return self.A_PRI.shape[0] - 1

    @property
    def rank(self) -> int:
        """R, the largest rank an entry may have."""
        return self.A_PRI.shape[1]

    @property
    def nbytes(self) -> int:
        """What the pool holds on the device."""
        return self.A_PRI.nbytes + self.B_POR.nbytes + self.scale_P.nbytes

    def load(self, entry: int, A_rI: Tensor, B_Or: Tensor, scale: float) -> None:
        """Write an adapter of rank r <= R into `entry`, zero-padded to R, converted to the pool's dtype."""
        if not 0 <= entry < self.entries:
            raise ValueError(f"pool entry {entry} is outside [0, {self.entries})")
        rank = A_rI.shape[0]
        fits_A = rank <= self.rank and A_rI.shape[1:] == self.A_PRI.shape[2:]
        if not fits_A or B_Or.shape != (self.B_POR.shape[1], rank):
            raise ValueError(
                f"A {tuple(A_rI.shape)} and B {tuple(B_Or.shape)} do not fit a pool of A "
                f"{tuple(self.A_PRI.shape[1:])} and B {tuple(self.B_POR.shape[1:])}"
            )
        self.clear(entry)
        self.A_PRI[entry, :rank].copy_(A_rI)
        self.B_POR[entry, :, :rank].copy_(B_Or)
        self.scale_P[entry] = scale

    def clear(self, entry: int) -> None:
        """Zero `entry`: its tokens then add exactly 0 (an adapter that does not adapt this layer)."""
        self.A_PRI[entry].zero_()
        self.B_POR[entry].zero_()
        self.scale_P[entry] = 0.0


def add_pooled_lora_delta_(y_TO: Tensor, x_TI: Tensor, index_T: Tensor, pool: LoRAPool) -> Tensor:
    """y += each token's pool entry's scaled low-rank update of x, in place; index -1 = base only.

    Semantics (the test compares it with multi_lora's `add_lora_delta_reference`):
        for t in range(T):
            A, B, scale = pool entry index[t]      # -1: the zero entry
            y[t] += (scale * B @ (A @ x[t])).to(y.dtype)   # products accumulated in fp32
    The same ops for any index values: two gathers and a scale lookup, two batched matmuls, an add.
    """
    A_TRI = pool.A_PRI[index_T]
    B_TOR = pool.B_POR[index_T]
    # Scale the narrow (T, 1, R) intermediate rather than the (T, O) result, as the segmented path does.
    shrunk_T1R = bmm_fp32(x_TI.unsqueeze(1).to(A_TRI.dtype), A_TRI.transpose(1, 2))
    shrunk_T1R = shrunk_T1R * pool.scale_P[index_T].view(-1, 1, 1)
    delta_T1O = bmm_fp32(shrunk_T1R.to(B_TOR.dtype), B_TOR.transpose(1, 2))
    return y_TO.add_(delta_T1O.view_as(y_TO).to(y_TO.dtype))
