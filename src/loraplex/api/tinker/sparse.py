"""Sparse CSR tensors as the Tinker wire carries them (the SDK's `TensorData.from_torch_sparse`, in
protobuf and in JSON): checking a structure, densifying it, and listing a dense array's chosen cells as
one. numpy only, no tensors.
"""

from __future__ import annotations

import numpy as np

# Cells densified per numpy call: np.repeat and fancy assignment hold the GIL, so one call over a
# (32768, 128) tensor held it ~400 ms (stalling the event loop's thread); a block of 64Ki cells, ~5 ms.
_BLOCK_CELLS = 1 << 16


def csr_problem(shape: list[int], num_values: int, crow: np.ndarray, cols: np.ndarray) -> str | None:
    """What is wrong with a CSR structure of `shape` holding `num_values` values, or None."""
    rows, width = shape
    if len(crow) != rows + 1:
        return f"{len(crow)} crow_indices, expected rows + 1 = {rows + 1}"
    if crow[0] != 0:
        return f"crow_indices start at {crow[0]}, not 0"
    if np.any(np.diff(crow) < 0):
        return "crow_indices decrease"
    if crow[-1] != num_values:
        return f"crow_indices end at {crow[-1]}, not at the {num_values} values"
    if len(cols) != num_values:
        return f"{len(cols)} col_indices for {num_values} values"
    if num_values and (cols.min() < 0 or cols.max() >= width):
        return f"a col_index is outside [0, {width})"
    return None


def densify(
    shape: list[int], values: np.ndarray, crow: np.ndarray, cols: np.ndarray, fill: int
) -> np.ndarray:
    """The dense array of a CSR structure that `csr_problem` accepts, `fill` in the unlisted cells.

    Semantics: `dense[np.repeat(np.arange(rows), np.diff(crow)), cols] = values` over `np.full(shape,
    fill)`, done a block of rows at a time.
    """
    dense = np.full(shape, fill, values.dtype)
    rows, width = shape
    block = max(1, _BLOCK_CELLS // max(width, 1))
    for start in range(0, rows, block):
        end = min(rows, start + block)
        listed = slice(crow[start], crow[end])
        rows_listed = np.repeat(np.arange(start, end), np.diff(crow[start : end + 1]))
        dense[rows_listed, cols[listed]] = values[listed]
    return dense


def to_csr(is_listed_RK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int64 crow_indices and col_indices that list the True cells of a 2-D mask, row by row."""
    rows, cols = np.nonzero(is_listed_RK)  # row-major, as CSR lists its values
    crow = np.zeros(is_listed_RK.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=is_listed_RK.shape[0]), out=crow[1:])
    return crow, cols.astype(np.int64)
