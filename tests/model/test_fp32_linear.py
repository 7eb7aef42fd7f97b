"""fp32 outputs of a frozen low-precision linear layer (the lm_head): fp32 sums of exact bf16 products,
the input's gradient in its own dtype, fp32 weights bitwise what F.linear gives."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from loraplex.model.config import DecoderConfig
from loraplex.model.decoder import Decoder
from loraplex.model.fp32_linear import linear_fp32
from loraplex.model.multi_lora import LoRARouting, MultiLoRALinear, Segment, add_lora_delta
from loraplex.model.tensor_parallel import SINGLE, TensorParallel
from tests.model.rounding import BF16_U, gamma

T, I, O = 9, 96, 50  # tokens, in features, out features


def _operands(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(T, I, generator=generator).to(device, dtype)
    weight = torch.randn(O, I, generator=generator).to(device, dtype)
    bias = torch.randn(O, generator=generator).to(device, dtype)
    return x, weight, bias


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_weights_give_fp32_outputs_within_fp32_summation_of_the_exact_product(device: str) -> None:
    """Each output is an I-term dot product of exact bf16 products plus the bias: I + 1 fp32 roundings,
    |error| <= gamma_(I+1)·(|x||W|ᵀ + |b|). bf16 outputs (F.linear) round once more, by up to 2⁻⁸ relative,
    and miss that bound."""
    x, weight, bias = _operands(device, torch.bfloat16)
    got = linear_fp32(x, weight, bias)
    assert got.dtype == torch.float32
    exact = x.double() @ weight.double().T + bias.double()
    magnitude = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    bound = gamma(I + 1) * magnitude
    assert torch.all((got.double() - exact).abs() <= bound)
    assert not torch.all((F.linear(x, weight, bias).double() - exact).abs() <= bound)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_input_gradient_keeps_the_input_dtype_and_sums_in_fp32(device: str) -> None:
    """grad_x = g·W: g rounds to bf16 (2⁻⁸ relative), the O-term sum is fp32 (gamma_O), the result
    rounds to bf16 (2⁻⁸ of |g·W| <= |g||W|): within (2·2⁻⁸ + gamma_O)·|g||W| to first order, twice that
    for the rest. W and b get no gradient."""
    x, weight, bias = _operands(device, torch.bfloat16)
    x.requires_grad_()
    grad_y = torch.randn(T, O, generator=torch.Generator().manual_seed(1)).to(device)
    linear_fp32(x, weight, bias).backward(grad_y)
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    exact = grad_y.double() @ weight.double()
    magnitude = grad_y.double().abs() @ weight.double().abs()
    assert torch.all((x.grad.double() - exact).abs() <= 2 * (2 * BF16_U + gamma(O)) * magnitude)
    assert weight.grad is None and bias.grad is None


@pytest.mark.gpu
def test_on_cuda_the_weight_is_never_copied_to_fp32() -> None:
    """The out_dtype kernel reads the bf16 weight as it is: a pass allocates far less than the (O, I)
    fp32 copy an upcast would make."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(8192, 1024, generator=generator).to("cuda", torch.bfloat16)
    x = torch.randn(4, 1024, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    linear_fp32(x, weight).sum().backward()  # once first: cuBLAS allocates its workspace on first use
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    linear_fp32(x, weight).sum().backward()
    torch.cuda.synchronize()
    fp32_copy_bytes = weight.numel() * 4
    assert torch.cuda.max_memory_allocated() - before < fp32_copy_bytes // 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_and_float64_weights_give_f_linear_bit_for_bit(dtype: torch.dtype) -> None:
    x, weight, bias = _operands("cpu", dtype)
    x_plain = x.clone().requires_grad_()
    x.requires_grad_()
    got = linear_fp32(x, weight, bias)
    want = F.linear(x_plain, weight, bias)
    assert got.dtype == dtype and torch.equal(got, want)
    grad_y = torch.randn(T, O, dtype=dtype)
    got.backward(grad_y)
    want.backward(grad_y)
    assert torch.equal(x.grad, x_plain.grad)


def _layer(dtype: torch.dtype, is_fp32_output: bool) -> MultiLoRALinear:
    _, weight, bias = _operands("cpu", dtype)
    layer = MultiLoRALinear(I, O, True, dtype=dtype, is_fp32_output=is_fp32_output)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)  # type: ignore[union-attr]
    generator = torch.Generator().manual_seed(3)
    A, B = torch.randn(4, I, generator=generator), torch.randn(O, 4, generator=generator)
    layer.attach(7, A.requires_grad_(), B.requires_grad_(), scale=0.5)
    return layer


ROUTING = LoRARouting((Segment(None, 0, 3), Segment(7, 3, T)))


def test_an_fp32_output_layer_adds_the_slot_delta_in_fp32_into_the_fp32_projection() -> None:
    layer = _layer(torch.bfloat16, is_fp32_output=True)
    x = _operands("cpu", torch.bfloat16)[0]
    got = layer(x, ROUTING)
    assert got.dtype == torch.float32
    want = add_lora_delta(linear_fp32(x, layer.weight, layer.bias), x, ROUTING, layer._slots)
    assert torch.equal(got, want)


def test_with_fp32_weights_the_fp32_output_flag_changes_no_bit_of_outputs_or_gradients() -> None:
    results = []
    for is_fp32_output in (False, True):
        layer = _layer(torch.float32, is_fp32_output)
        x = _operands("cpu", torch.float32)[0].requires_grad_()
        y = layer(x, ROUTING)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        slot = layer._slots[7]
        results.append((y.detach(), x.grad, slot.A_RI.grad, slot.B_OR.grad))
    for plain, flagged in zip(*results, strict=True):
        assert torch.equal(plain, flagged)


SMALL_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@pytest.mark.parametrize("is_tied", [False, True])
@pytest.mark.parametrize("tp", [SINGLE, TensorParallel(None, 1, 2)], ids=["one rank", "rank 1 of 2"])
def test_the_lm_head_is_the_decoders_one_fp32_output_layer(is_tied: bool, tp: TensorParallel) -> None:
    """Tied to the embedding or not, whole or this rank's vocabulary rows: the lm_head is one layer."""
    config = DecoderConfig.from_hf({**SMALL_QWEN3, "tie_word_embeddings": is_tied})
    decoder = Decoder(config, device="meta", dtype=torch.bfloat16, tp=tp)
    flagged = [name for name, m in decoder.named_modules() if getattr(m, "is_fp32_output", False)]
    assert flagged == ["lm_head"]
    assert (decoder.lm_head.weight is decoder.model.embed_tokens.weight) == is_tied
