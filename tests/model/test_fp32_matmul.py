"""fp32-accumulated products of bf16 operands: exact products summed in fp32, on every device."""

from __future__ import annotations

import pytest
import torch

from loraplex.model.fp32_matmul import bmm_fp32, mm_fp32
from tests.model.rounding import U


def _operands(device: str, batch: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(*batch, 33, 257, generator=generator).to(device, torch.bfloat16)
    b = torch.randn(*batch, 257, 19, generator=generator).to(device, torch.bfloat16)
    return a, b


def _check_fp32_accumulated(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """got is fp32 and within fp32 summation error of the exact product of the bf16 values: each of the K
    partial sums rounds with unit U, so |error| <= K·U·Σ|a·b| (Higham's bound, first order); a result
    rounded to bf16 would be off by up to 2⁻⁸ relative, far outside it."""
    assert got.dtype == torch.float32
    exact = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    K = a.shape[-1]
    assert torch.all((got.double() - exact).abs() <= K * U * magnitude)
    # And it is not the bf16-rounded product: that one misses the bound somewhere.
    rounded = (a @ b).double()
    assert not torch.all((rounded - exact).abs() <= K * U * magnitude)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_products_accumulate_and_return_fp32(device: str) -> None:
    a, b = _operands(device, ())
    _check_fp32_accumulated(mm_fp32(a, b), a, b)
    a, b = _operands(device, (3,))
    _check_fp32_accumulated(bmm_fp32(a, b), a, b)


def test_fp32_operands_take_the_plain_product_bitwise() -> None:
    a, b = (t.float() for t in _operands("cpu", ()))
    assert torch.equal(mm_fp32(a, b), a @ b)
    a, b = (t.float() for t in _operands("cpu", (3,)))
    assert torch.equal(bmm_fp32(a, b), torch.bmm(a, b))
    assert mm_fp32(a[0].double(), b[0].double()).dtype == torch.float64
