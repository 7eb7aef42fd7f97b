"""The KV cache: every layer's keys and values (after rope) for rows of sequences, and the steps that fill it.

A row holds one sequence's prefix. A `PrefillStep` packs new sequences back to back (they attend within
themselves through `packed_attention`, as in training) and writes their keys and values from position 0;
a `DecodeStep` runs one new token per row against that row's cache (`decode_attention`). Steps are built
once per forward and passed to every layer, like the packing metadata. Storage is one zero-filled
(R, K, C, H) tensor per layer for keys and one for values, grown by doubling when a row needs more
capacity or more rows are live, and dropped when no row is. Under tensor parallelism a rank caches
its own K/T kv heads, the ones its attention computes. Knows nothing of requests, sampling, slots or
snapshots.

Layout choice, measured for one decode layer on 2 CPU cores (heads K=2, G=2, H=64 as in the tiny model;
cached lengths uniform in 32..512, a quarter of the rows free), median µs for B = 8 / 16 / 32 / 64:
    in-place view of the first rows, padding mask, one SDPA call      125 /  312 /  600 / 1075
    gather the rows into batch order (index_select), mask, one SDPA   326 /  649 / 1228 / 2580
    one SDPA call per sequence over its own slice, no padding         124 /  314 /  663 / 1359
Gathering copies every cached key each step and loses; the in-place view and the loop do the same
arithmetic, the view wasting it on padding and the loop paying ~15 µs of Python per sequence and layer.
We keep the single call: its cost does not grow with Python work per sequence, and it is also the one
that suits a GPU. A paged layout (no per-row capacity) is left for when long contexts need it.

Shapes: T packed new tokens, B sequences of a decode step, R cache rows, C capacity in tokens,
N query heads, K kv heads, H head dim, L longest cached span of a step.
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
    """Keys and values of every layer for up to R rows, each holding one sequence's first tokens; the
    decoder's `tp` says which of its kv heads this rank holds."""

    def __init__(
        self,
        config: DecoderConfig,
        device: torch.device | str | None,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self._num_layers = config.num_hidden_layers
        self._head_shape = (config.num_key_value_heads // tp.size, config.head_dim)
        self._factory = {"device": device, "dtype": dtype}
        self._itemsize = dtype.itemsize
        self._lengths: list[int | None] = []  # tokens cached per row; None = the row is free
        self._reserved: list[int] = []  # capacity each live row was allocated for
        self.keys: list[Tensor] = []  # per layer (R, K, C, H)
        self.values: list[Tensor] = []
        self._resize(0, 0)

    @property
    def capacity(self) -> int:
        """C, the tokens every row can hold."""
        return self.keys[0].shape[2]

    @property
    def num_live_rows(self) -> int:
        """Rows holding a sequence."""
        return sum(length is not None for length in self._lengths)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens held in the live rows."""
        return sum(length for length in self._lengths if length is not None)

    @property
    def stored_bytes(self) -> int:
        """Bytes of storage allocated now (every row at the current capacity, live or free)."""
        return len(self._lengths) * self.capacity * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes in a row: its keys and values in every layer."""
        num_kv_heads, head_dim = self._head_shape
        return 2 * self._num_layers * num_kv_heads * head_dim * self._itemsize

    def bytes_after(self, max_lengths: Sequence[int]) -> int:
        """Bytes of storage once rows for sequences of `max_lengths` are allocated, as `allocate` would
        grow it (every row at the largest capacity), without allocating anything."""
        num_rows, capacity, num_live = len(self._lengths), self.capacity, self.num_live_rows
        for max_length in max_lengths:
            num_rows, capacity = _grown(num_rows, num_live, capacity, max_length)
            num_live += 1
        return num_rows * capacity * self.bytes_per_token

    def allocate(self, max_length: int) -> int:
        """A free row (the lowest) for a sequence of up to `max_length` tokens, growing storage if needed."""
        row = next((r for r, length in enumerate(self._lengths) if length is None), len(self._lengths))
        num_rows, capacity = _grown(len(self._lengths), self.num_live_rows, self.capacity, max_length)
        if (num_rows, capacity) != (len(self._lengths), self.capacity):
            self._resize(num_rows, capacity)
        self._lengths[row] = 0
        self._reserved[row] = max_length
        return row

    def free(self, row: int) -> None:
        """Release a row; storage is dropped once no row is live."""
        self.length(row)
        self._lengths[row] = None
        self._reserved[row] = 0
        if self.num_live_rows == 0:
            self._resize(0, 0)

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
        for cache in (*self.keys, *self.values):
            cache[target, :, :length] = cache[source, :, :length]
        self._lengths[target] = length

    def prefill(self, rows: Sequence[int], lengths: Sequence[int]) -> PrefillStep:
        """A step writing sequences of `lengths` (packed in this order) into empty `rows` from position 0."""
        for row, length in zip(rows, lengths, strict=True):
            if self.length(row) != 0 or length > self._reserved[row]:
                raise ValueError(f"row {row} is not empty or was not allocated for {length} tokens")
        device = self._factory["device"]
        packing = PackedSequences.from_lengths(lengths, device)
        rows_T = to_device(np.repeat(np.array(rows, dtype=np.int64), lengths), device)
        for row, length in zip(rows, lengths, strict=True):
            self._lengths[row] = length
        return PrefillStep(self, packing, rows_T)

    def decode(self, rows: Sequence[int]) -> DecodeStep:
        """A step appending one token to each of the distinct live `rows` (in batch order)."""
        if len(set(rows)) != len(rows):
            raise ValueError(f"a decode step takes each row once; got {list(rows)}")
        positions = [self.length(row) for row in rows]
        for row, position in zip(rows, positions, strict=True):
            if position >= self._reserved[row]:
                raise ValueError(f"row {row} is full: it was allocated for {self._reserved[row]} tokens")
            self._lengths[row] = position + 1
        device = self._factory["device"]
        num_rows = max(rows) + 1
        # Rows outside the step (free or idle) see position 0 only, so their discarded outputs stay finite.
        visible_R = np.array([max(1, length or 0) for length in self._lengths[:num_rows]])
        is_visible_RL = np.arange(visible_R.max())[None, :] < visible_R[:, None]
        return DecodeStep(
            self,
            to_device(np.array(rows, dtype=np.int64), device),
            to_device(np.array(positions, dtype=np.int64), device),
            to_device(is_visible_RL, device),
        )

    def write(self, layer: int, rows_T: Tensor, positions_T: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> None:
        """Store each new token's k and v of `layer` at (its row, its position)."""
        # Advanced indices around a slice: the indexed view is (T, K, H), the new tokens' own shape.
        self.keys[layer][rows_T, :, positions_T] = k_TKH
        self.values[layer][rows_T, :, positions_T] = v_TKH

    def _resize(self, num_rows: int, capacity: int) -> None:
        """Reallocate storage as (num_rows, K, capacity, H) per layer, keeping what live rows hold."""
        old_rows = len(self._lengths)
        keep_rows = min(old_rows, num_rows)
        keep_tokens = min(self.capacity, capacity) if self.keys else 0
        num_kv_heads, head_dim = self._head_shape
        for caches in (self.keys, self.values):
            old = list(caches)
            caches.clear()
            for layer in range(self._num_layers):
                grown = torch.zeros(num_rows, num_kv_heads, capacity, head_dim, **self._factory)
                if keep_rows and keep_tokens:
                    grown[:keep_rows, :, :keep_tokens] = old[layer][:keep_rows, :, :keep_tokens]
                caches.append(grown)
        self._lengths = self._lengths[:num_rows] + [None] * (num_rows - old_rows)
        self._reserved = self._reserved[:num_rows] + [0] * (num_rows - old_rows)


def _grown(num_rows: int, num_live_rows: int, capacity: int, max_length: int) -> tuple[int, int]:
    """(rows, capacity) of storage holding one more live row of up to `max_length` tokens: rows double (to
    at least 8) when none is free; capacity grows to a power of two (at least 64) when too small."""
    if num_live_rows == num_rows:
        num_rows = max(8, 2 * num_rows)
    if max_length > capacity:
        capacity = max(64, 1 << (max_length - 1).bit_length())
    return num_rows, capacity


@dataclass(frozen=True)
class PrefillStep:
    """New sequences packed back to back, attending within themselves; k, v go to their rows from 0."""

    cache: KVCache
    packing: PackedSequences
    rows_T: Tensor  # (T,) int64 cache row of each new token

    @property
    def positions_T(self) -> Tensor:
        """(T,) position of each new token: its index in its own sequence."""
        return self.packing.positions_T

    def attend(self, layer: int, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> Tensor:
        """Write the layer's k, v, then attend causally within each new sequence."""
        self.cache.write(layer, self.rows_T, self.positions_T, k_TKH, v_TKH)
        return packed_attention(q_TNH, k_TKH, v_TKH, self.packing)


@dataclass(frozen=True)
class DecodeStep:
    """One new token per row, in batch order, attending to its row's cached tokens and itself."""

    cache: KVCache
    rows_B: Tensor  # (B,) int64 distinct cache rows
    positions_T: Tensor  # (B,) int64 position of each new token = tokens its row held before
    is_visible_RL: Tensor  # (R, L) bool: the cached positions each of the first R rows attends to

    def attend(self, layer: int, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor) -> Tensor:
        """Write the layer's k, v, then attend over each row's cache (see `decode_attention`)."""
        self.cache.write(layer, self.rows_B, self.positions_T, k_TKH, v_TKH)
        return decode_attention(
            q_TNH, self.cache.keys[layer], self.cache.values[layer], self.rows_B, self.is_visible_RL
        )
