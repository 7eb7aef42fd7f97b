"""The KV cache: every layer's keys and values (after rope) for rows of sequences, and the steps that fill it.

A row holds one sequence's prefix. A `PrefillStep` packs new sequences back to back (they attend within
themselves through `packed_attention`, as in training) and writes their keys and values from position 0;
a `DecodeStep` runs one new token per row against that row's cache (`decode_attention`). Steps are built
once per forward and passed to every layer, like the packing metadata. Under tensor parallelism a rank
caches its own K/T kv heads, the ones its attention computes. Knows nothing of requests, sampling, slots
or snapshots.

Storage is paged, as vLLM's: one pool per layer for keys and one for values, (P, S, K, H) blocks of S
tokens (torch's varlen paged layout), sized once for `max_tokens` and allocated when the first row is,
dropped when no row is live; never grown, so two caches are never held. A row owns a block table (its
blocks in position order) that grows a block at a time as its tokens arrive, so rows grow independently
and one long row costs no other row anything. `allocate` reserves the blocks a row may come to need, so a
step never runs out of them and an admission that cannot be served fails at once, naming the numbers;
`free` gives a row's blocks back. Token t of a row lives at slot table[t // S] * S + t % S of the pool
viewed flat. One more block, the scratch block, follows the `num_blocks` rows may hold: no row ever owns
it, and the padding rows of a decode step padded to a fixed shape (`decode`'s `num_rows`) write their
keys and values there and attend to nothing else, so padding costs no row's state.

Decode gathers each step's rows' keys and values through their tables into batch order (one
index_select per layer for each) and runs one SDPA call under a padding mask. Against the contiguous
cache this replaced (every row at one power-of-two capacity, attended in place as a view), measured on
the tiny model's sampler (12 requests of 1-3 samples, prompts up to 300 tokens, one thread, torch
profiler self time): 673 ms of SDPA over the padded view before; 461 ms of SDPA plus 341 ms of gathers
now, about 4% of a ~3 s run. That is the price of rows that grow independently on the CPU; on CUDA this
pool and the block tables are the layout torch's paged varlen_attn takes.

Shapes: T packed new tokens, B sequences of a decode step (padding rows included), X its padding rows,
P blocks in the pool, S tokens a block, N query heads, K kv heads, H head dim, L the span of a step (its
longest cached span, or more when padded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from loraplex.model.attention import decode_attention, packed_attention
from loraplex.model.config import DecoderConfig
from loraplex.model.host_copy import to_device
from loraplex.model.packing import PackedSequences
from loraplex.model.tensor_parallel import SINGLE, TensorParallel

# vLLM's default block size: a row wastes under one block, and a table stays short.
BLOCK_TOKENS = 16


class CacheStep(Protocol):
    """One forward over new tokens whose keys and values go into the cache (see `Decoder.forward_cached`)."""

    @property
    def positions_T(self) -> Tensor:
        """(T,) int64 position of each new token in its sequence."""
        ...

    def attend(self, layer: int, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> Tensor:
        """Store the new tokens' k, v of `layer`, then return their attention output (T, N, H)."""
        ...


class KVCache:
    """Keys and values of every layer for rows each holding one sequence's first tokens, in a pool of
    blocks for `max_tokens` tokens; the decoder's `tp` says which of its kv heads this rank holds."""

    def __init__(
        self,
        config: DecoderConfig,
        device: torch.device | str | None,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        *,
        max_tokens: int,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        self._num_layers = config.num_hidden_layers
        self._head_shape = (config.num_key_value_heads // tp.size, config.head_dim)
        self._factory = {"device": device, "dtype": dtype}
        self._itemsize = dtype.itemsize
        self.block_tokens = block_tokens
        self.num_blocks = -(-max_tokens // block_tokens)  # blocks rows may hold; the scratch block follows
        self._lengths: list[int | None] = []  # tokens cached per row; None = the row is free
        self._reserved: list[int] = []  # tokens each live row was allocated for
        # Each row's blocks in position order, then its first block again up to the width (the most
        # blocks a row reserved since the cache was last empty): kept as one array, updated a block at a
        # time, so a step's tables are one fancy index: 0.023 ms at 128 rows and 80 blocks, where making
        # them from each row's list took 0.47 ms (docs/BENCHMARKS.md).
        self._table_RW = np.zeros((0, 0), np.int64)
        self._num_row_blocks: list[int] = []  # blocks each row holds
        self._free_blocks: list[int] = []  # blocks no row holds, the next one handed out last
        self.keys: list[Tensor] = []  # per layer (P, S, K, H) while a row is live, else none
        self.values: list[Tensor] = []

    @property
    def num_live_rows(self) -> int:
        """Rows holding a sequence."""
        return sum(length is not None for length in self._lengths)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens held in the live rows."""
        return sum(length for length in self._lengths if length is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks of the pool no row holds (all of them while no row is live)."""
        return len(self._free_blocks) if self.keys else self.num_blocks

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks the live rows may come to hold, as `allocate` reserved them."""
        return sum(self._blocks_for(tokens) for tokens in self._reserved)

    @property
    def stored_bytes(self) -> int:
        """Bytes of storage allocated now: the whole pool (the scratch block too) while a row is live, else
        nothing."""
        return (self.num_blocks + 1) * self.block_bytes if self.keys else 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes: its keys and values in every layer."""
        num_kv_heads, head_dim = self._head_shape
        return 2 * self._num_layers * num_kv_heads * head_dim * self._itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in every layer's keys and values."""
        return self.block_tokens * self.bytes_per_token

    def bytes_after(self, max_lengths: Sequence[int]) -> int:
        """Bytes of the blocks the live rows and new rows for sequences of `max_lengths` reserve, without
        allocating anything: what admission weighs against a budget."""
        new_blocks = sum(self._blocks_for(max_length) for max_length in max_lengths)
        return (self.num_reserved_blocks + new_blocks) * self.block_bytes

    def allocate(self, max_length: int) -> int:
        """A free row (the lowest) for a sequence of up to `max_length` tokens, its blocks reserved;
        ValueError, naming the numbers, when the pool has not that many unreserved blocks."""
        need, unreserved = self._blocks_for(max_length), self.num_blocks - self.num_reserved_blocks
        if need > unreserved:
            raise ValueError(
                f"a cache row of {max_length} tokens needs {need} blocks of {self.block_tokens} tokens; "
                f"the pool has {unreserved} of its {self.num_blocks} blocks unreserved"
            )
        if not self.keys:
            self._allocate_pool()
        row = next((r for r, length in enumerate(self._lengths) if length is None), len(self._lengths))
        if row == len(self._lengths):
            self._lengths.append(None)
            self._reserved.append(0)
            self._num_row_blocks.append(0)
        self._fit_tables(len(self._lengths), need)
        self._lengths[row] = 0
        self._reserved[row] = max_length
        return row

    def free(self, row: int) -> None:
        """Release a row and give its blocks back; the pool is dropped once no row is live."""
        self.length(row)
        self._free_blocks.extend(reversed(self._table_RW[row, : self._num_row_blocks[row]].tolist()))
        self._lengths[row], self._reserved[row], self._num_row_blocks[row] = None, 0, 0
        if self.num_live_rows == 0:
            self._lengths, self._reserved, self._num_row_blocks, self._free_blocks = [], [], [], []
            self._table_RW = np.zeros((0, 0), np.int64)
            self.keys, self.values = [], []

    def length(self, row: int) -> int:
        """Tokens cached in a live row."""
        length = self._lengths[row] if 0 <= row < len(self._lengths) else None
        if length is None:
            raise ValueError(f"cache row {row} is not live")
        return length

    def copy_prefix(self, source: int, target: int) -> None:
        """Make empty row `target` hold the same tokens as `source` (samples sharing one prompt prefill)."""
        length = self.length(source)
        if self.length(target) != 0 or length > self._reserved[target]:
            raise ValueError(f"row {target} is not empty or too small for row {source}'s {length} tokens")
        self._grow(target, length)
        num_blocks = self._blocks_for(length)
        device = self._factory["device"]
        # Copies, not views: on the CPU the tensors share the arrays' memory.
        source_blocks = to_device(self._table_RW[source, :num_blocks].copy(), device)
        target_blocks = to_device(self._table_RW[target, :num_blocks].copy(), device)
        for pool in (*self.keys, *self.values):
            pool.index_copy_(0, target_blocks, pool.index_select(0, source_blocks))
        self._lengths[target] = length

    def prefill(self, rows: Sequence[int], lengths: Sequence[int]) -> PrefillStep:
        """A step writing sequences of `lengths` (packed in this order) into empty `rows` from position 0."""
        for row, length in zip(rows, lengths, strict=True):
            if self.length(row) != 0 or length > self._reserved[row]:
                raise ValueError(f"row {row} is not empty or was not allocated for {length} tokens")
        device = self._factory["device"]
        packing = PackedSequences.from_lengths(lengths, device)
        for row, length in zip(rows, lengths, strict=True):
            self._grow(row, length)
            self._lengths[row] = length
        is_new_QL = np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]
        slots_T = self._slots(rows, max(lengths))[is_new_QL]  # row-major: the pack's order
        return PrefillStep(self, packing, to_device(slots_T, device))

    def decode(self, rows: Sequence[int], num_rows: int | None = None, span: int | None = None) -> DecodeStep:
        """A step appending one token to each of the distinct live `rows` (in batch order), padded to
        `num_rows` rows and a span of `span` positions where given (at least the rows and the longest span:
        a step of fixed shapes, whatever its live rows).

        A padding row (after the live ones) is token position 0 writing and attending to its own slot of
        the scratch block, which no row owns; live rows' positions past their own are masked out.
        """
        if len(set(rows)) != len(rows):
            raise ValueError(f"a decode step takes each row once; got {list(rows)}")
        positions = [self.length(row) for row in rows]
        for row, position in zip(rows, positions, strict=True):
            if position >= self._reserved[row]:
                raise ValueError(f"row {row} is full: it was allocated for {self._reserved[row]} tokens")
        num_rows = len(rows) if num_rows is None else num_rows
        span = max(positions) + 1 if span is None else span
        if num_rows < len(rows) or span <= max(positions):
            raise ValueError(
                f"a step of {len(rows)} rows up to position {max(positions)} does not fit {num_rows} rows "
                f"of span {span}"
            )
        for row, position in zip(rows, positions, strict=True):
            self._grow(row, position + 1)
            self._lengths[row] = position + 1
        num_blocks, num_padding = self._blocks_for(span), num_rows - len(rows)
        # Only the block tables, positions and offsets cross to the device (B·L/S + 2B integers, not the
        # 2·B·L of the slots and mask they expand to there): a padding row's table is the scratch block,
        # and its offset (padding row i: i mod S) gives each padding row a slot of its own.
        table_BN = self._block_table(rows, num_blocks, num_padding)
        positions_B = np.array(positions + [0] * num_padding, np.int64)
        offsets_B = np.array([0] * len(rows) + [i % self.block_tokens for i in range(num_padding)], np.int64)
        device = self._factory["device"]
        table_BN, positions_B, offsets_B = (to_device(a, device) for a in (table_BN, positions_B, offsets_B))
        return DecodeStep.expand(self, table_BN, positions_B, offsets_B, span)

    def write(self, layer: int, slots_T: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> None:
        """Store each new token's k and v of `layer` at its pool slot."""
        self.keys[layer].flatten(0, 1).index_copy_(0, slots_T, k_TKH)
        self.values[layer].flatten(0, 1).index_copy_(0, slots_T, v_TKH)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _block_table(self, rows: Sequence[int], num_blocks: int, num_padding: int = 0) -> np.ndarray:
        """(len(rows) + num_padding, num_blocks) int64: each row's first `num_blocks` blocks, its first
        block again past its own (their positions are masked out, and read a written token), then
        `num_padding` rows of the scratch block."""
        width = self._table_RW.shape[1]
        table_BN = self._table_RW[list(rows), : min(num_blocks, width)]  # a fancy index: a copy
        if num_blocks > width:  # a span padded past every row's reservation
            table_BN = np.concatenate([table_BN, table_BN[:, :1].repeat(num_blocks - width, axis=1)], axis=1)
        if num_padding:
            scratch_XN = np.full((num_padding, num_blocks), self.num_blocks, np.int64)
            table_BN = np.concatenate([table_BN, scratch_XN])
        return table_BN

    def _slots(self, rows: Sequence[int], span: int) -> np.ndarray:
        """(len(rows), span) int64 pool slots, on the host, of each row's first `span` positions;
        positions past a row's blocks read its first block again (the caller leaves them out)."""
        table_BN = self._block_table(rows, self._blocks_for(span))
        slots = table_BN[:, :, None] * self.block_tokens + np.arange(self.block_tokens)
        return slots.reshape(len(rows), -1)[:, :span]

    def _grow(self, row: int, length: int) -> None:
        """Hand a row blocks from the pool until they hold `length` tokens (reserved, so they are there)."""
        for index in range(self._num_row_blocks[row], self._blocks_for(length)):
            block = self._free_blocks.pop()
            if index == 0:
                self._table_RW[row] = block  # past its own blocks a row's table repeats its first
            else:
                self._table_RW[row, index] = block
            self._num_row_blocks[row] = index + 1

    def _fit_tables(self, num_rows: int, num_blocks: int) -> None:
        """Widen the tables to `num_blocks` and lengthen them to `num_rows` where they fall short; a wider
        row repeats its first block, as a row's tables always do past its own blocks."""
        rows, width = self._table_RW.shape
        if rows >= num_rows and width >= num_blocks:
            return
        table_RW = np.zeros((max(rows, num_rows, 2 * rows), max(width, num_blocks)), np.int64)
        table_RW[:rows, :width] = self._table_RW
        if width:
            table_RW[:rows, width:] = self._table_RW[:, :1]
        self._table_RW = table_RW

    def _allocate_pool(self) -> None:
        """Every layer's (P, S, K, H) keys and values, the scratch block last, uninitialised: a slot is read
        only once written."""
        shape = (self.num_blocks + 1, self.block_tokens, *self._head_shape)
        self.keys = [torch.empty(shape, **self._factory) for _ in range(self._num_layers)]
        self.values = [torch.empty(shape, **self._factory) for _ in range(self._num_layers)]
        self._free_blocks = list(reversed(range(self.num_blocks)))


@dataclass(frozen=True)
class PrefillStep:
    """New sequences packed back to back, attending within themselves; k, v go to their rows from 0."""

    cache: KVCache
    packing: PackedSequences
    slots_T: Tensor  # (T,) int64 pool slot of each new token

    @property
    def positions_T(self) -> Tensor:
        """(T,) position of each new token: its index in its own sequence."""
        return self.packing.positions_T

    def attend(self, layer: int, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> Tensor:
        """Write the layer's k, v, then attend causally within each new sequence."""
        self.cache.write(layer, self.slots_T, k_TKH, v_TKH)
        return packed_attention(q_TNH, k_TKH, v_TKH, self.packing)


@dataclass(frozen=True)
class DecodeStep:
    """One new token per row, in batch order, attending to its row's cached tokens and itself."""

    cache: KVCache
    slots_B: Tensor  # (B,) int64 pool slot of each new token
    positions_T: Tensor  # (B,) int64 position of each new token = tokens its row held before
    slots_BL: Tensor  # (B, L) int64 pool slot of each row's positions up to the step's longest
    is_visible_BL: Tensor  # (B, L) bool: the positions each row attends to (its own, new token included)

    @classmethod
    def expand(
        cls, cache: KVCache, table_BN: Tensor, positions_B: Tensor, offsets_B: Tensor, span: int
    ) -> DecodeStep:
        """The step of rows with block tables `table_BN` (on the device) at `positions_B`, over `span`
        positions, each slot moved by its row's offset (a padding row's own slot of the scratch block).
        A position past its row's end reads the row's first token, which is written, so the masked-out
        scores and values stay finite (the pool is never zeroed)."""
        S, device = cache.block_tokens, table_BN.device
        slots_BL = (table_BN[:, :, None] * S + torch.arange(S, device=device)).flatten(1)[:, :span]
        is_visible_BL = torch.arange(span, device=device)[None, :] <= positions_B[:, None]
        slots_BL = torch.where(is_visible_BL, slots_BL, slots_BL[:, :1]) + offsets_B[:, None]
        slots_B = slots_BL.gather(1, positions_B[:, None]).squeeze(1)
        return cls(cache, slots_B, positions_B, slots_BL, is_visible_BL)

    def attend(self, layer: int, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> Tensor:
        """Write the layer's k, v, then attend over each row's cached tokens (see `decode_attention`)."""
        self.cache.write(layer, self.slots_B, k_TKH, v_TKH)
        return decode_attention(
            q_TNH, self.cache.keys[layer], self.cache.values[layer], self.slots_BL, self.is_visible_BL
        )
