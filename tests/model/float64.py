"""Float64 twins of the models and layers the tests compare: the `exact` side of tests/model/rounding.py.

A twin runs the same computation in float64, except where the code casts on purpose (RMSNorm and rope
angles in fp32, as transformers does; our LoRA delta and logprobs in fp32): its rounding there is
independent of the fp32 run's, so its distance to the fp32 run still measures at least that run's error.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
import torch
from torch import Tensor, nn

from loraplex.model import moe
from loraplex.model.grouped_mm import grouped_mm, grouped_mm_reference

Module = TypeVar("Module", bound=nn.Module)


def float64_copy(model: Module) -> Module:
    """A float64 deep copy of a module (a transformers or PEFT model too), its experts as plain matmuls:
    torch._grouped_mm, transformers' default for experts, has no float64 kernel."""
    twin = copy.deepcopy(model).double()
    for module in twin.modules():
        if callable(getattr(module, "set_experts_implementation", None)):
            module.set_experts_implementation("eager")
    return twin


def _grouped_mm_any_dtype(
    a_NC: Tensor, b_GCM: Tensor, offsets_G: Tensor, has_ungrouped_rows: bool = False
) -> Tensor:
    kernel = grouped_mm_reference if a_NC.dtype == torch.float64 else grouped_mm
    return kernel(a_NC, b_GCM, offsets_G, has_ungrouped_rows)


@contextmanager
def float64_experts() -> Iterator[None]:
    """Within, our float64 expert layers run grouped_mm_reference (the loop grouped_mm must equal), as
    torch._grouped_mm has no float64 kernel; other dtypes run grouped_mm as always."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "grouped_mm", _grouped_mm_any_dtype)
        yield
