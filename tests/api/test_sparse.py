"""Densifying a CSR structure a block of rows at a time gives what one numpy assignment over all of it
gives (sparse.py's Semantics), across blocks, empty rows and widths."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.api.tinker.sparse import csr_problem, densify, to_csr


@pytest.mark.parametrize(("rows", "width"), [(0, 4), (1, 1), (70_000, 1), (1000, 128), (3, 0), (600, 129)])
def test_densifying_by_blocks_equals_one_assignment_over_the_whole_structure(rows: int, width: int) -> None:
    rng = np.random.default_rng(rows * 1000 + width)
    is_listed = rng.random((rows, width)) < 0.3
    is_listed[::3] = False  # empty rows
    crow, cols = to_csr(is_listed)
    values = rng.integers(1, 100, int(is_listed.sum())).astype(np.int64)
    assert csr_problem([rows, width], len(values), crow, cols) is None
    expected = np.full((rows, width), -1, np.int64)
    expected[np.repeat(np.arange(rows), np.diff(crow)), cols] = values
    np.testing.assert_array_equal(densify([rows, width], values, crow, cols, fill=-1), expected)
