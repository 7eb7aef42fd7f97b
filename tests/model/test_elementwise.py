"""The fused elementwise math (torch.compile, elementwise.py) equals eager's within fp32 rounding, in values
and gradients, and one compile serves every packed length.

One decoder runs both ways (`use_elementwise`), so the two differ only in the elementwise functions.
The first fused pass compiles (about a minute on 2 CPU cores with an empty inductor cache, seconds with a
warm one); every test here shares that compile.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

from loraplex.model.decoder import Decoder
from loraplex.model.elementwise import EAGER, Elementwise, elementwise_for, fused
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.packing import PackedSequences
from loraplex.model.tiny import ensure_tiny_model
from tests.model.rounding import assert_within_rounding

LENGTHS = (9, 4, 13)


def logits_and_gradients(
    decoder: Decoder, elementwise: Elementwise, lengths: tuple[int, ...], seed: int = 0
) -> dict[str, Tensor]:
    """Logits of a pack of random tokens and the gradient of every weight of a random linear function of
    them (exact: its gradient w.r.t. the logits is its weights), so every elementwise step's backward runs."""
    decoder.use_elementwise(elementwise)
    generator = torch.Generator().manual_seed(seed)
    tokens_T = torch.randint(0, decoder.config.vocab_size, (sum(lengths),), generator=generator)
    weights_TV = torch.randn(sum(lengths), decoder.config.vocab_size, generator=generator)
    decoder.zero_grad(set_to_none=True)
    logits_TV = decoder.logits(tokens_T, PackedSequences.from_lengths(lengths))
    (logits_TV * weights_TV.to(logits_TV.dtype)).sum().backward()
    return {"logits": logits_TV.detach()} | {
        name: parameter.grad for name, parameter in decoder.named_parameters() if parameter.grad is not None
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def trainable_tiny(tiny_dir: Path) -> Decoder:
    """The tiny decoder (Qwen3: q/k norms, tied embedding) with every weight trainable, so the backward
    reaches the norms' weights too."""
    return load_decoder(tiny_dir).requires_grad_(True)


def test_fused_values_and_gradients_equal_eager_within_fp32_rounding(
    trainable_tiny: Decoder, tiny_dir: Path
) -> None:
    eager = logits_and_gradients(trainable_tiny, EAGER, LENGTHS)
    compiled = logits_and_gradients(trainable_tiny, fused(), LENGTHS)
    exact = logits_and_gradients(
        load_decoder(tiny_dir, "cpu", torch.float64).requires_grad_(True), EAGER, LENGTHS
    )
    assert compiled.keys() == eager.keys() == exact.keys()
    assert len(eager) > 2 and "model.layers.0.self_attn.q_norm.weight" in eager
    for name, want in eager.items():
        assert_within_rounding(compiled[name], want, exact[name], name)


def test_one_compile_serves_every_packed_length(trainable_tiny: Decoder) -> None:
    logits_and_gradients(trainable_tiny, fused(), LENGTHS)  # compiled here, or by the test above
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "the fused pass compiled nothing"
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lengths in ((30, 20), (17,), (5, 1, 40, 2)):
            logits_and_gradients(trainable_tiny, fused(), lengths)
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_setting_fuses_on_cuda_by_default_and_where_asked() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert elementwise_for("auto", cpu) is EAGER and elementwise_for("auto", cuda) is fused()
    assert elementwise_for("on", cpu) is fused() and elementwise_for("off", cuda) is EAGER
    with pytest.raises(ValueError, match="'yes'"):
        elementwise_for("yes", cpu)
