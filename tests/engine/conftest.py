"""Fixtures and helpers the engine tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import pytest
import torch
from torch import Tensor

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.sampler.validation import SamplingLimits


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    """The built-in tiny model with 2 slots of rank up to 8 (a module may define its own)."""
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 2, 8, None)


@pytest.fixture
def set_limits(engine: LocalEngine) -> Iterator[Callable[..., None]]:
    """set_limits(**fields) puts SamplingLimits on the engine's sampler for this test."""

    def put(**fields: int) -> None:
        engine.sampler.limits = SamplingLimits(**fields)

    yield put
    engine.sampler.limits = SamplingLimits()


@torch.no_grad()
def randomize_lora_b(weights: Mapping[str, Tensor], scale: float, generator: torch.Generator) -> None:
    """Give a slot's lora_B tensors random values (a fresh slot's are zero, so its adapter does nothing)."""
    for name, tensor in weights.items():
        if ".lora_B." in name:
            tensor.copy_(scale * torch.randn(tensor.shape, generator=generator))
