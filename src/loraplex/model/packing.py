"""Packing metadata of one variable-length batch: sequences concatenated into one flat token axis.

Built once per batch from the sequence lengths and passed down to every layer; no layer recomputes it.
Knows nothing of slots, losses or who sent a sequence.

Shapes: T packed tokens, Q sequences in the pack, M sequences of one length group, L that length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loraplex.model.host_copy import to_device


@dataclass(frozen=True)
class LengthGroup:
    """All sequences of one length, attended together as a batch of M rows of L tokens."""

    length: int  # L
    num_seqs: int  # M
    # (M, L) int64 packed-token indices of the group's rows; None when the group is the whole pack in order,
    # so attention can view the packed tensors as (M, L, ...) without copying.
    token_index_ML: Tensor | None


@dataclass(frozen=True)
class PackedSequences:
    """Where each sequence sits in the pack, its tokens' positions, and how attention groups them."""

    lengths: tuple[int, ...]  # (Q,) tokens per sequence, in pack order
    positions_T: Tensor  # (T,) int64, restarting at 0 for every sequence
    cu_seqlens_Q1: Tensor  # (Q+1,) int32 sequence boundaries, the layout varlen kernels take
    groups: tuple[LengthGroup, ...]  # one per distinct length, ascending
    # (T,) int64: row of each packed token in the concatenation of the groups' outputs; None when the
    # groups' outputs already come out in pack order (one group covering the pack).
    restore_index_T: Tensor | None

    @property
    def num_tokens(self) -> int:
        """T, the total number of tokens in the pack."""
        return int(self.positions_T.shape[0])

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int], device: torch.device | str | None = None
    ) -> PackedSequences:
        """Lay out sequences of the given lengths back to back, in the given order."""
        lengths = tuple(int(n) for n in lengths)  # accepts numpy integers too
        if not lengths or min(lengths) < 1:
            raise ValueError(
                f"a pack needs at least one sequence and no empty ones; got lengths {list(lengths)}"
            )
        # On the host, in numpy (see host_copy.py); each tensor crosses to the device once.
        lengths_Q = np.array(lengths, dtype=np.int64)
        cu_seqlens_Q1 = np.concatenate([[0], lengths_Q.cumsum()])
        num_tokens = int(cu_seqlens_Q1[-1])
        starts_Q = cu_seqlens_Q1[:-1]
        positions_T = np.arange(num_tokens) - starts_Q.repeat(lengths_Q)

        distinct = sorted(set(lengths))
        if len(distinct) == 1:
            groups = (LengthGroup(distinct[0], len(lengths), token_index_ML=None),)
            restore_index_T = None
        else:
            index_blocks = [
                starts_Q[lengths_Q == length][:, None] + np.arange(length)[None, :] for length in distinct
            ]
            groups = tuple(
                LengthGroup(length, int(block.shape[0]), to_device(block, device))
                for length, block in zip(distinct, index_blocks, strict=True)
            )
            # Inverse of the permutation "pack order -> group order".
            restore_index_T = to_device(np.argsort(np.concatenate([b.ravel() for b in index_blocks])), device)
        return cls(
            lengths=lengths,
            positions_T=to_device(positions_T, device),
            cu_seqlens_Q1=to_device(cu_seqlens_Q1.astype(np.int32), device),
            groups=groups,
            restore_index_T=restore_index_T,
        )
