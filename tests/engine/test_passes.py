"""Fused passes against an unpacked reference: every loss, isolation, additivity, validation (issue #3).

The reference runs one datum at a time through `Decoder.logits` (one sequence, one routing segment, the
full [N × V] logits), takes `log_softmax` + gather, applies the per-token formula of docs/LOSSES.md written
out here (never losses.py), and differentiates each datum's summed loss with autograd. The engine under
test packs many requests of many slots and losses into one `run_pass`; per datum its logprobs,
elementwise_loss, loss:sum and the slots' accumulated A/B gradients must equal the reference.

The model is a micro Qwen3 (q/k norm, untied lm_head) with random weights and a 64-token vocabulary, so
full logits are cheap; every slot's B is random, so LoRA changes the logits and every A and B gets a
gradient. Its float64 twin (the `twin` fixture) runs what a comparison's expected side runs; the distance
between the two is that side's rounding, of which a comparison allows a multiple (tests/model/rounding.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
from torch import Tensor

from loraplex.engine import local
from loraplex.engine.interface import EngineInfo
from loraplex.engine.local import LocalEngine
from loraplex.engine.types import AdamParams, DatumInput, LoraConfig, PassRequest, PassResult
from loraplex.errors import UserError
from loraplex.model.config import DecoderConfig
from loraplex.model.decoder import Decoder
from loraplex.model.multi_lora import LoRARouting
from loraplex.model.packing import PackedSequences
from tests.engine.conftest import randomize_lora_b
from tests.model.rounding import assert_at_most, assert_within_rounding, rounding_bound, sums_bound

VOCAB = 64
MICRO_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# Three slots of different ranks (so different scales alpha/r) and different target sets.
SLOT_CONFIGS = (
    LoraConfig(rank=2, seed=11),
    LoraConfig(rank=4, seed=12, train_mlp=False),
    LoraConfig(rank=8, seed=13, train_attn=False),
)
# Per slot, the lengths of its request's datums: distinct lengths and a repeat (one length group of two).
LENGTHS = ((9, 4), (12, 7), (7, 10))
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
ALL_LOSSES = ("cross_entropy", *RL_LOSSES)
# docs/LOSSES.md's defaults, as literals (not read from the registry under test).
DEFAULT_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}
# Designed ratios r = exp(lp − q): below, inside and above every clip window used here.
RATIOS = (0.5, 1.0, 5.0)
PROMPT = 2  # RL datums: the first PROMPT positions are prompt (q = 0, A = 0), outside the RL mask
TOP_K = 3

Grads = dict[str, Tensor]


# --- the engine under test -------------------------------------------------------------------------


def _micro_engine(seed: int = 0, dtype: torch.dtype = torch.float32) -> LocalEngine:
    """A LocalEngine over the random micro Qwen3 with the three SLOT_CONFIGS slots, B random; in float64,
    the same weights and slots (these fp32, as the slot pool keeps them)."""
    generator = torch.Generator().manual_seed(seed)
    decoder = Decoder(DecoderConfig.from_hf(MICRO_QWEN3), device="cpu", dtype=dtype)
    with torch.no_grad():
        for name, parameter in decoder.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    info = EngineInfo(
        model_name="test/micro-qwen3",
        arch="qwen3",
        tokenizer_dir="",
        vocab_size=VOCAB,
        max_context_length=MICRO_QWEN3["max_position_embeddings"],
        max_rank=8,
        base_model_digest="0" * 64,
        device="cpu",
    )
    engine = LocalEngine(decoder, info, max_slots=len(SLOT_CONFIGS) + 1)
    for config in SLOT_CONFIGS:
        randomize_lora_b(engine.pool.get(engine.create_slot(config)).weights, 0.01, generator)
    return engine


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """Micro tensors gain nothing from threads, and on 2 shared cores OpenMP's spinning barriers make
    each pass ~100x slower whenever another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def engine() -> LocalEngine:
    return _micro_engine()


@pytest.fixture
def twin() -> LocalEngine:
    """The engine's float64 twin: given what the expected side of a comparison was given."""
    return _micro_engine(dtype=torch.float64)


def slot_grads(engine: LocalEngine, slot: int) -> Grads:
    """A copy of the slot's gradient accumulators by PEFT name."""
    return {name: p.grad.clone() for name, p in engine.pool.get(slot).weights.items()}


def slot_weights(engine: LocalEngine, slot: int) -> Grads:
    """A copy of the slot's A/B tensors by PEFT name."""
    return {name: p.detach().clone() for name, p in engine.pool.get(slot).weights.items()}


def all_grads(engine: LocalEngine) -> dict[int, Grads]:
    return {slot: slot_grads(engine, slot) for slot in engine.pool.live_slots}


def zero_grads(engine: LocalEngine) -> None:
    for slot in engine.pool.live_slots:
        for p in engine.pool.get(slot).weights.values():
            p.grad.zero_()


def ok(result: PassResult | UserError) -> PassResult:
    """The result of a request that must have been accepted."""
    assert isinstance(result, PassResult), f"request was rejected: {result}"
    return result


# --- the reference: one datum at a time, full logits, docs/LOSSES.md's formulas -------------------------


def reference_logprobs(decoder: Decoder, slot: int | None, tokens: np.ndarray, targets: np.ndarray) -> Tensor:
    """log_softmax of the full logits of one sequence run alone, gathered at its (N,) or (N,K) targets."""
    n = len(tokens)
    routing = LoRARouting.from_sequences([n], [slot])
    logits_NV = decoder.logits(torch.from_numpy(tokens), PackedSequences.from_lengths([n]), routing)
    lp_NV = torch.log_softmax(logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32)), dim=-1)
    return lp_NV.gather(-1, torch.from_numpy(targets).reshape(n, -1)).reshape(targets.shape)


def reference_token_loss(
    loss_fn: str, lp: Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]
) -> Tensor:
    """ℓ_t (N,) of one datum, straight from the table of docs/LOSSES.md."""
    c = {**DEFAULT_CONFIG[loss_fn], **config}
    f32 = {key: torch.from_numpy(np.asarray(value, dtype=np.float32)) for key, value in inputs.items()}
    w = f32.get("weights", torch.ones_like(lp))
    if loss_fn == "cross_entropy":
        loss = -(w * lp)
        return loss.sum(-1) if loss.dim() == 2 else loss
    q, a = f32["logprobs"], f32["advantages"]
    mask = ((a != 0) | (q != 0)).float() * w  # the RL mask, times weights when sent
    on = mask != 0
    log_ratio = torch.where(on, lp - q, 0.0)  # exp only where the mask is on
    lo, hi = c.get("clip_low_threshold"), c.get("clip_high_threshold")
    if loss_fn == "importance_sampling":
        value = -torch.exp(log_ratio) * a
    elif loss_fn == "ppo":
        r = torch.exp(log_ratio)
        value = -torch.minimum(r * a, torch.clamp(r, lo, hi) * a)
    elif loss_fn == "cispo":
        value = -torch.clamp(torch.exp(log_ratio), lo, hi).detach() * a * lp
    elif loss_fn == "dro":
        value = -(a * lp - (c["beta"] / 2) * (lp - q) ** 2)
    elif loss_fn == "gspo":
        in_m = f32["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in f32 else on
        count = int(in_m.sum())
        s = torch.exp((lp.detach() - q)[in_m].sum() / count) if count else torch.tensor(1.0)
        s_t = s * torch.exp(lp - lp.detach())
        value = -torch.minimum(s_t * a, torch.clamp(s_t, lo, hi) * a)
        on = on & in_m
    else:
        raise AssertionError(loss_fn)
    return torch.where(on, mask * value, 0.0)


@dataclass
class Expected:
    """What one request must return, per the reference."""

    outputs: list[dict[str, np.ndarray]]
    loss_sum: float


def reference_run(
    engine: LocalEngine, requests: Sequence[PassRequest]
) -> tuple[list[Expected], dict[int, Grads]]:
    """Per request its expected outputs; per slot the gradient its training datums add, one at a time."""
    expected: list[Expected] = []
    grads = {
        slot: {n: torch.zeros_like(p) for n, p in slot_grads(engine, slot).items()}
        for slot in engine.pool.live_slots
    }
    for request in requests:
        outputs = []
        for datum in request.datums:
            targets = np.asarray(datum.loss_fn_inputs["target_tokens"])
            lp = reference_logprobs(engine.decoder, request.slot, np.asarray(datum.tokens), targets)
            loss_N = reference_token_loss(request.loss_fn, lp, datum.loss_fn_inputs, request.loss_fn_config)
            outputs.append({"logprobs": lp.detach().numpy(), "elementwise_loss": loss_N.detach().numpy()})
            if not request.forward_only and request.slot is not None:
                params = engine.pool.get(request.slot).weights
                datum_grads = torch.autograd.grad(loss_N.sum(), list(params.values()), allow_unused=True)
                for name, grad in zip(params, datum_grads, strict=True):
                    if grad is not None:
                        grads[request.slot][name] += grad
        loss_sum = float(sum(o["elementwise_loss"].astype(np.float64).sum() for o in outputs))
        expected.append(Expected(outputs, loss_sum))
    return expected, grads


def run_alone(
    engine: LocalEngine, requests: Sequence[PassRequest]
) -> tuple[list[PassResult | UserError], dict[int, Grads]]:
    """Each request in its own pass from zeroed accumulators; results and the summed gradients."""
    zero_grads(engine)
    results = [engine.run_pass([request])[0] for request in requests]
    return results, all_grads(engine)


# --- assertions --------------------------------------------------------------------------------------


def assert_grads_close(
    actual: Mapping[int, Grads], expected: Mapping[int, Grads], exact: Mapping[int, Grads]
) -> None:
    """Every slot's every gradient within rounding of `expected`, whose float64 twin's is `exact`."""
    assert actual.keys() == expected.keys()
    for slot in expected:
        assert actual[slot].keys() == expected[slot].keys()
        for name, grad in expected[slot].items():
            assert_within_rounding(actual[slot][name], grad, exact[slot][name], f"slot {slot}, {name}")


def assert_grads_equal(actual: Grads, expected: Grads) -> None:
    """Bit-identical accumulators."""
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def _outputs(outputs: Sequence[Mapping[str, np.ndarray]], key: str) -> np.ndarray:
    return np.concatenate([o[key].reshape(-1) for o in outputs])


def assert_result_matches(result: PassResult | UserError, expected: Expected, exact: Expected) -> None:
    """Per datum the reference's outputs (fp32), all within rounding of the reference's run in float64;
    loss:sum within the rounding of summing the elementwise losses (sums_bound)."""
    result = ok(result)
    assert len(result.outputs) == len(expected.outputs)
    for got, want in zip(result.outputs, expected.outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert got[key].dtype == np.float32 and got[key].shape == want[key].shape
    for key in ("logprobs", "elementwise_loss"):
        assert_within_rounding(*(_outputs(r.outputs, key) for r in (result, expected, exact)), key)
    losses = _outputs(result.outputs, "elementwise_loss"), _outputs(expected.outputs, "elementwise_loss")
    assert_at_most(abs(result.metrics["loss:sum"] - expected.loss_sum), sums_bound(*losses), "loss:sum")


def assert_results_match(
    actual: PassResult | UserError, expected: PassResult | UserError, exact: PassResult | UserError
) -> None:
    """Same outputs (per datum, in order) within rounding of `expected`, whose float64 twin's are
    `exact`; loss:sum within the rounding of its sums, the other metrics within rounding too."""
    actual, expected, exact = ok(actual), ok(expected), ok(exact)
    assert len(actual.outputs) == len(expected.outputs)
    for got, want in zip(actual.outputs, expected.outputs, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].shape == want[key].shape
    for key in expected.outputs[0]:
        assert_within_rounding(*(_outputs(r.outputs, key) for r in (actual, expected, exact)), key)
    assert actual.metrics.keys() == expected.metrics.keys()
    for key, value in expected.metrics.items():
        error = abs(actual.metrics[key] - value)
        if key == "loss:sum":
            losses = (_outputs(r.outputs, "elementwise_loss") for r in (actual, expected))
            assert_at_most(error, sums_bound(*losses), key)
        else:
            assert_within_rounding(np.float64(actual.metrics[key]), value, exact.metrics[key], key)


def assert_results_identical(actual: PassResult | UserError, expected: PassResult | UserError) -> None:
    """Same outputs and metrics, bit for bit."""
    actual, expected = ok(actual), ok(expected)
    assert len(actual.outputs) == len(expected.outputs)
    for got, want in zip(actual.outputs, expected.outputs, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert np.array_equal(got[key], want[key]), key
    assert actual.metrics == expected.metrics


# --- request building --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A loss, its config, and how its datums' inputs are shaped."""

    loss_fn: str
    config: dict[str, float] = field(default_factory=dict)
    # "" plain; "unit_weights" CE without weights; "top_k" CE with (N,K) targets; "weights" RL with
    # fractional weights (some 0); "sequence_ratio_mask" gspo with an explicit mask.
    variant: str = ""

    def __str__(self) -> str:
        parts = [self.loss_fn, *(f"{k}={v}" for k, v in self.config.items())]
        return "-".join(parts + ([self.variant] if self.variant else []))


def make_request(
    engine: LocalEngine,
    rng: np.random.Generator,
    slot: int | None,
    case: Case,
    lengths: Iterable[int],
    forward_only: bool = False,
    datum_offset: int = 0,
) -> PassRequest:
    """A request of random datums. RL datums: q = lp_ref − log(ratio) on completion positions, ratios
    cycling over RATIOS per token (per datum for gspo, whose ratio is the datum's), advantages of both
    signs, one completion position with A = 0 but q ≠ 0 (inside the RL mask)."""
    datums = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(0, VOCAB, n)
        targets = rng.integers(0, VOCAB, (n, TOP_K) if case.variant == "top_k" else n)
        inputs: dict[str, np.ndarray] = {"target_tokens": targets}
        if case.loss_fn == "cross_entropy":
            if case.variant != "unit_weights":
                inputs["weights"] = rng.uniform(-1.5, 1.5, targets.shape).astype(np.float32)
        else:
            with torch.no_grad():
                lp_ref = reference_logprobs(engine.decoder, slot, tokens, targets).numpy().astype(np.float64)
            c = np.arange(n - PROMPT)  # completion position index
            if case.loss_fn == "gspo":
                log_ratio = np.full(len(c), math.log(RATIOS[(datum_offset + i) % len(RATIOS)]))
            else:
                log_ratio = np.log(np.asarray(RATIOS)[c % len(RATIOS)])
            sign = np.where((c // len(RATIOS)) % 2 == 0, 1.0, -1.0)
            advantages = np.zeros(n)
            advantages[PROMPT:] = sign * rng.uniform(0.5, 2.0, len(c))
            advantages[-1] = 0.0
            logprobs = np.zeros(n)
            logprobs[PROMPT:] = lp_ref[PROMPT:] - log_ratio  # so r = exp(lp − q) = ratio
            inputs["advantages"] = advantages.astype(np.float32)
            inputs["logprobs"] = logprobs.astype(np.float32)
            if case.variant == "weights":
                weights = rng.uniform(0.0, 2.0, n)
                weights[::4] = 0.0
                inputs["weights"] = weights.astype(np.float32)
            if case.variant == "sequence_ratio_mask":
                mask = np.zeros(n, dtype=np.float32)
                mask[PROMPT - 1 :] = 1.0  # one prompt position in, the first completion position out
                mask[PROMPT] = 0.0
                inputs["sequence_ratio_mask"] = mask
        datums.append(DatumInput(tokens, inputs))
    return PassRequest(slot, case.loss_fn, dict(case.config), datums, forward_only)


def slot_requests(engine: LocalEngine, rng: np.random.Generator, case: Case) -> list[PassRequest]:
    """One training request per slot, LENGTHS[i] datums each."""
    return [
        make_request(engine, rng, slot, case, lengths, datum_offset=2 * i)
        for i, (slot, lengths) in enumerate(zip(engine.pool.live_slots, LENGTHS, strict=True))
    ]


# --- every loss against the reference ----------------------------------------------------------------

CASES = [
    Case("cross_entropy", variant="unit_weights"),
    Case("cross_entropy"),  # negative and fractional weights
    Case("cross_entropy", variant="top_k"),
    Case("importance_sampling"),
    Case("importance_sampling", variant="weights"),
    Case("ppo"),
    Case("ppo", {"clip_low_threshold": 0.6, "clip_high_threshold": 2.5}),
    Case("ppo", variant="weights"),
    Case("cispo"),
    Case("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 2.0}),
    Case("dro"),
    Case("dro", {"beta": 0.3}, variant="weights"),
    Case("gspo"),
    Case("gspo", {"clip_low_threshold": 0.6, "clip_high_threshold": 2.5}),
    Case("gspo", variant="sequence_ratio_mask"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_loss_equals_the_unpacked_full_logit_reference_in_outputs_and_gradients(
    engine: LocalEngine, twin: LocalEngine, case: Case
) -> None:
    requests = slot_requests(engine, np.random.default_rng(0), case)
    expected, expected_grads = reference_run(engine, requests)
    exact, exact_grads = reference_run(twin, requests)

    results = engine.run_pass(requests)

    for result, want, want_exact in zip(results, expected, exact, strict=True):
        assert_result_matches(result, want, want_exact)
    assert_grads_close(all_grads(engine), expected_grads, exact_grads)
    assert all(any(g.abs().max() > 0 for g in grads.values()) for grads in expected_grads.values())


@pytest.mark.parametrize(
    "case", [c for c in CASES if "clip_low_threshold" in {**DEFAULT_CONFIG[c.loss_fn], **c.config}], ids=str
)
def test_reference_data_crosses_both_clip_edges_with_both_advantage_signs(
    engine: LocalEngine, case: Case
) -> None:
    """The data of the reference test reaches every branch of the clipped losses (a check on the test)."""
    config = {**DEFAULT_CONFIG[case.loss_fn], **case.config}
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    seen = set()
    for request in slot_requests(engine, np.random.default_rng(0), case):
        for datum in request.datums:
            inputs = datum.loss_fn_inputs
            with torch.no_grad():
                lp = reference_logprobs(engine.decoder, request.slot, datum.tokens, inputs["target_tokens"])
            a = inputs["advantages"]
            counted = ((a != 0) | (inputs["logprobs"] != 0)) & (inputs.get("weights", 1.0) != 0)
            log_ratio = lp.numpy() - inputs["logprobs"]
            if case.loss_fn == "gspo":  # every token carries the datum's sequence ratio
                in_m = inputs["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inputs else counted
                log_ratio = np.full_like(log_ratio, log_ratio[in_m].mean())
                counted &= in_m
            on = counted & (a != 0)  # where A = 0 every branch gives 0
            for r, a_t in zip(np.exp(log_ratio[on]), a[on], strict=True):
                seen.add(("below" if r < lo else "above" if r > hi else "inside", bool(a_t > 0)))
    edges = {"below", "above"} if lo > 0 else {"above"}  # lo = 0 (cispo's default) cannot be crossed
    assert {(edge, sign) for edge in edges for sign in (True, False)} <= seen


# --- zero rows ---------------------------------------------------------------------------------------


def zero_datum(
    engine: LocalEngine, rng: np.random.Generator, slot: int, loss_fn: str, kind: str
) -> DatumInput:
    """A datum whose every weight (kind "weights") or RL mask (kind "rl_mask") is 0.

    With zero weights the sampler logprobs are −200, so an unguarded exp(lp − q) overflows to inf.
    """
    datum = make_request(engine, rng, slot, Case(loss_fn), [8]).datums[0]
    inputs = dict(datum.loss_fn_inputs)
    shape = np.shape(inputs["target_tokens"])
    if kind == "weights":
        inputs["weights"] = np.zeros(shape, dtype=np.float32)
        if loss_fn != "cross_entropy":
            inputs["logprobs"] = np.full(shape, -200.0, dtype=np.float32)
    else:
        inputs["advantages"] = np.zeros(shape, dtype=np.float32)
        inputs["logprobs"] = np.zeros(shape, dtype=np.float32)
    return DatumInput(datum.tokens, inputs)


ZERO_KINDS = [("cross_entropy", "weights")] + [(fn, k) for fn in RL_LOSSES for k in ("weights", "rl_mask")]


@pytest.mark.parametrize(("loss_fn", "kind"), ZERO_KINDS)
def test_a_zero_mask_datum_adds_exactly_zero_loss_and_zero_gradient(
    engine: LocalEngine, twin: LocalEngine, loss_fn: str, kind: str
) -> None:
    rng = np.random.default_rng(1)
    slot = engine.pool.live_slots[0]
    live = make_request(engine, rng, slot, Case(loss_fn), [9, 6])
    zero = zero_datum(engine, rng, slot, loss_fn, kind)
    untouched = slot_grads(engine, slot)

    alone = ok(engine.run_pass([replace(live, datums=[zero])])[0])
    assert alone.metrics["loss:sum"] == 0.0
    assert np.all(alone.outputs[0]["elementwise_loss"] == 0.0)
    assert np.all(np.isfinite(alone.outputs[0]["logprobs"]))
    assert_grads_equal(slot_grads(engine, slot), untouched)

    without, grads_without = run_alone(engine, [live])
    exact, exact_grads = run_alone(twin, [live])
    with_zero, grads_with = run_alone(
        engine, [replace(live, datums=[*live.datums[:1], zero, *live.datums[1:]])]
    )
    result = ok(with_zero[0])
    assert np.all(result.outputs[1]["elementwise_loss"] == 0.0)
    assert_results_match(
        replace(result, outputs=[result.outputs[0], result.outputs[2]]), without[0], exact[0]
    )
    assert_grads_close(grads_with, grads_without, exact_grads)


# --- chunk additivity --------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", ALL_LOSSES)
def test_datums_split_across_two_passes_accumulate_the_same_gradient_as_one_pass(
    engine: LocalEngine, twin: LocalEngine, loss_fn: str
) -> None:
    rng = np.random.default_rng(2)
    slots = engine.pool.live_slots[:2]
    requests = [make_request(engine, rng, s, Case(loss_fn), [9, 4, 12, 6], datum_offset=s) for s in slots]

    engine.run_pass(requests)
    one_pass = all_grads(engine)
    twin.run_pass(requests)
    exact = all_grads(twin)
    zero_grads(engine)
    engine.run_pass([replace(r, datums=r.datums[:2]) for r in requests])
    engine.run_pass([replace(r, datums=r.datums[2:]) for r in requests])

    split = all_grads(engine)
    assert_grads_close(split, one_pass, exact)
    # Issue #3's bound: each slot's whole accumulated gradient within 1e-6 relative (norm-wise),
    # the sense in which the optimizer sees it (grad norm, clipping, update direction).
    for slot, grads in one_pass.items():
        expected = torch.cat([torch.as_tensor(grads[name]).flatten() for name in grads])
        actual = torch.cat([torch.as_tensor(split[slot][name]).flatten() for name in grads])
        assert float((actual - expected).norm()) <= 1e-6 * float(expected.norm())
    # A datum lost between the passes is over a thousand rounding bounds away.
    zero_grads(engine)
    engine.run_pass([replace(r, datums=r.datums[:2]) for r in requests])
    engine.run_pass([replace(r, datums=r.datums[2:3]) for r in requests])
    for slot in slots:
        for name, grad in slot_grads(engine, slot).items():
            error = float((grad - one_pass[slot][name]).norm())
            assert error > 1000 * rounding_bound(one_pass[slot][name], exact[slot][name]), name


@pytest.mark.parametrize("loss_fn", ALL_LOSSES)
def test_logprob_chunk_size_changes_neither_outputs_nor_gradients(
    engine: LocalEngine, twin: LocalEngine, loss_fn: str
) -> None:
    requests = slot_requests(engine, np.random.default_rng(3), Case(loss_fn))

    engine.logprob_chunk = 1024
    wide_results = engine.run_pass(requests)
    wide_grads = all_grads(engine)
    exact_results, exact_grads = twin.run_pass(requests), all_grads(twin)
    zero_grads(engine)
    engine.logprob_chunk = 3
    narrow_results = engine.run_pass(requests)

    for narrow, wide, exact in zip(narrow_results, wide_results, exact_results, strict=True):
        assert_results_match(narrow, wide, exact)
    assert_grads_close(all_grads(engine), wide_grads, exact_grads)


def test_the_same_pass_twice_gives_bit_identical_outputs_and_gradients(engine: LocalEngine) -> None:
    requests = slot_requests(engine, np.random.default_rng(3), Case("ppo"))

    first_results = engine.run_pass(requests)
    first_grads = all_grads(engine)
    zero_grads(engine)
    second_results = engine.run_pass(requests)

    for second, first in zip(second_results, first_results, strict=True):
        assert_results_identical(second, first)
    for slot, grads in first_grads.items():
        assert_grads_equal(slot_grads(engine, slot), grads)


# --- slot isolation and forward-only -----------------------------------------------------------------


def test_datums_of_one_slot_never_change_another_slots_accumulators_or_weights(engine: LocalEngine) -> None:
    rng = np.random.default_rng(4)
    trained, bystander, idle = engine.pool.live_slots
    engine.run_pass([make_request(engine, rng, bystander, Case("ppo"), [6, 9])])  # non-zero accumulators
    bystander_grads, bystander_weights = slot_grads(engine, bystander), slot_weights(engine, bystander)
    idle_grads, idle_weights = slot_grads(engine, idle), slot_weights(engine, idle)
    trained_before = slot_grads(engine, trained)
    assert all(g.abs().max() > 0 for g in bystander_grads.values())

    engine.run_pass([make_request(engine, rng, trained, Case(fn), [7, 5]) for fn in ALL_LOSSES])

    assert all(not torch.equal(g, trained_before[n]) for n, g in slot_grads(engine, trained).items())
    engine.optim_step({trained: AdamParams(learning_rate=1e-2, weight_decay=0.1)})
    for slot, grads, weights in (
        (bystander, bystander_grads, bystander_weights),
        (idle, idle_grads, idle_weights),
    ):
        assert_grads_equal(slot_grads(engine, slot), grads)
        assert_grads_equal(slot_weights(engine, slot), weights)


@pytest.mark.parametrize("loss_fn", ALL_LOSSES)
def test_forward_only_leaves_accumulators_bit_identical_and_returns_what_forward_backward_would(
    engine: LocalEngine, twin: LocalEngine, loss_fn: str
) -> None:
    rng = np.random.default_rng(5)
    slot, other = engine.pool.live_slots[:2]
    engine.run_pass([make_request(engine, rng, slot, Case("cross_entropy"), [8])])  # non-zero accumulators
    forward = make_request(engine, rng, slot, Case(loss_fn), [9, 5, 11], forward_only=True)
    other_training = make_request(engine, rng, other, Case("ppo"), [7, 10])
    accumulated = slot_grads(engine, slot)

    alone = engine.run_pass([forward])[0]
    assert_grads_equal(slot_grads(engine, slot), accumulated)
    mixed = engine.run_pass([other_training, forward])[1]
    assert_grads_equal(slot_grads(engine, slot), accumulated)
    assert any(g.abs().max() > 0 for g in slot_grads(engine, other).values())  # the other slot did train

    backward = engine.run_pass([replace(forward, forward_only=False)])[0]
    assert_results_identical(alone, backward)
    assert_results_match(mixed, backward, twin.run_pass([forward])[0])


@pytest.mark.parametrize("beside_forward_only", [False, True], ids=["alone", "beside_forward_only"])
def test_a_pass_in_which_no_datum_needs_a_gradient_still_returns_outputs(
    engine: LocalEngine, twin: LocalEngine, beside_forward_only: bool
) -> None:
    """Base-only (slot None) forward_backward has no adapter to train: alone or beside a slot's forward-only
    request, the pass answers every request with the reference outputs and touches no accumulator."""
    rng = np.random.default_rng(9)
    requests = [
        make_request(engine, rng, None, Case("cross_entropy"), [6, 9]),
        make_request(engine, rng, None, Case("ppo"), [8]),
    ]
    if beside_forward_only:
        requests.append(
            make_request(engine, rng, engine.pool.live_slots[0], Case("dro"), [7], forward_only=True)
        )
    expected, _ = reference_run(engine, requests)
    exact, _ = reference_run(twin, requests)
    before = all_grads(engine)

    results = engine.run_pass(requests)

    for result, want, want_exact in zip(results, expected, exact, strict=True):
        assert_result_matches(result, want, want_exact)
    for slot, grads in before.items():
        assert_grads_equal(slot_grads(engine, slot), grads)


# --- one mixed pass ----------------------------------------------------------------------------------


def test_one_mixed_pass_equals_each_request_run_alone_in_input_order(
    engine: LocalEngine, twin: LocalEngine
) -> None:
    rng = np.random.default_rng(6)
    s0, s1, s2 = engine.pool.live_slots
    requests = [  # interleaved slots, so the engine must reorder the pack and restore input order
        make_request(
            engine, rng, s2, Case("ppo", {"clip_low_threshold": 0.6, "clip_high_threshold": 2.5}), [9, 4]
        ),
        make_request(engine, rng, s0, Case("cross_entropy", variant="top_k"), [6, 11]),
        make_request(engine, rng, None, Case("cross_entropy"), [5, 8]),
        make_request(engine, rng, s1, Case("dro"), [10]),
        make_request(engine, rng, s0, Case("cispo"), [7, 3], forward_only=True),
        make_request(engine, rng, s2, Case("cross_entropy", variant="unit_weights"), [12], forward_only=True),
        make_request(engine, rng, s1, Case("gspo"), [4, 9, 6], datum_offset=1),
        make_request(engine, rng, None, Case("importance_sampling"), [6], forward_only=True),
    ]
    expected, expected_grads = reference_run(engine, requests)
    exact, exact_grads = reference_run(twin, requests)

    mixed = engine.run_pass(requests)
    mixed_grads = all_grads(engine)
    alone, alone_grads = run_alone(engine, requests)
    alone_exact, alone_exact_grads = run_alone(twin, requests)

    for result, single, single_exact, want, want_exact in zip(
        mixed, alone, alone_exact, expected, exact, strict=True
    ):
        assert_results_match(result, single, single_exact)
        assert_result_matches(result, want, want_exact)
    assert_grads_close(mixed_grads, alone_grads, alone_exact_grads)
    assert_grads_close(mixed_grads, expected_grads, exact_grads)


# --- forward_backward_custom: linear in real weights, forward and backward see the same logprobs -----


def test_cross_entropy_gradient_is_linear_in_real_weights_and_forward_logprobs_equal_backward_bit_for_bit(
    engine: LocalEngine, twin: LocalEngine
) -> None:
    rng = np.random.default_rng(7)
    slot = engine.pool.live_slots[1]
    request = make_request(engine, rng, slot, Case("cross_entropy"), [9, 5, 12])
    w1 = [d.loss_fn_inputs["weights"] for d in request.datums]  # negative and fractional
    w2 = [rng.uniform(-3.0, 3.0, w.shape).astype(np.float32) for w in w1]
    c = np.float32(-0.37)

    def with_weights(weights: list[np.ndarray], forward_only: bool = False) -> PassRequest:
        datums = [
            DatumInput(d.tokens, {**d.loss_fn_inputs, "weights": w})
            for d, w in zip(request.datums, weights, strict=True)
        ]
        return replace(request, datums=datums, forward_only=forward_only)

    def forward_backward(e: LocalEngine, weights: list[np.ndarray]) -> tuple[PassResult, Grads]:
        zero_grads(e)
        result = ok(e.run_pass([with_weights(weights)])[0])
        return result, slot_grads(e, slot)

    # The SDK's first request: forward with cross_entropy and zero weights, for the logprobs.
    forward = ok(engine.run_pass([with_weights([np.zeros_like(w) for w in w1], forward_only=True)])[0])
    r1, g1 = forward_backward(engine, w1)
    r2, g2 = forward_backward(engine, w2)
    r_sum, g_sum = forward_backward(engine, [a + b for a, b in zip(w1, w2, strict=True)])
    r_scaled, g_scaled = forward_backward(engine, [c * w for w in w1])
    (x1, xg1), (x2, xg2) = forward_backward(twin, w1), forward_backward(twin, w2)

    for result in (r1, r2, r_sum, r_scaled):
        for got, want in zip(result.outputs, forward.outputs, strict=True):
            assert np.array_equal(got["logprobs"], want["logprobs"])
    # Linear combinations of fp32 results, against the same combinations of their float64 twins' (in
    # float64): the rounding of w1 + w2 and c·w is one ulp of each weight, within the bounds' floor.
    exact_sum = {n: xg1[n].double() + xg2[n].double() for n in g1}
    assert_grads_close({slot: g_sum}, {slot: {n: g1[n] + g2[n] for n in g1}}, {slot: exact_sum})
    exact_scaled = {n: float(c) * xg1[n].double() for n in g1}
    assert_grads_close({slot: g_scaled}, {slot: {n: c * g1[n] for n in g1}}, {slot: exact_scaled})
    for combined, parts, exact_parts in (
        (r_sum, [(1.0, r1), (1.0, r2)], [(1.0, x1), (1.0, x2)]),
        (r_scaled, [(c, r1)], [(c, x1)]),
    ):
        losses = _outputs(combined.outputs, "elementwise_loss")
        want = sum(k * _outputs(r.outputs, "elementwise_loss") for k, r in parts)
        exact = sum(
            float(k) * _outputs(r.outputs, "elementwise_loss").astype(np.float64) for k, r in exact_parts
        )
        assert_within_rounding(losses, want, exact, "elementwise_loss")
        terms = np.concatenate([float(k) * _outputs(r.outputs, "elementwise_loss") for k, r in parts])
        error = abs(combined.metrics["loss:sum"] - sum(k * r.metrics["loss:sum"] for k, r in parts))
        assert_at_most(error, sums_bound(losses, terms), "loss:sum")


# --- validation before compute -----------------------------------------------------------------------


def _corrupt(request: PassRequest, kind: str) -> tuple[PassRequest, tuple[str, ...]]:
    """The request broken in datum 1 (or as a whole), and the words its error message must contain."""
    datum = request.datums[1]
    tokens, inputs = datum.tokens.copy(), {k: v.copy() for k, v in datum.loss_fn_inputs.items()}
    names: tuple[str, ...] = ("datum 1",)
    if kind == "target_tokens_too_short":
        inputs["target_tokens"] = inputs["target_tokens"][:-1]
        names += ("target_tokens",)
    elif kind == "model_input_id_out_of_vocab":
        tokens[2] = VOCAB
        names += ("model_input", str(VOCAB))
    elif kind == "target_id_out_of_vocab":
        inputs["target_tokens"][3] = VOCAB
        names += ("target_tokens", str(VOCAB))
    elif kind == "nan_advantages":
        inputs["advantages"][4] = np.nan
        names += ("advantages",)
    elif kind == "missing_logprobs":
        del inputs["logprobs"]
        names += ("logprobs",)
    elif kind == "unknown_config_key":
        return replace(request, loss_fn_config={"clip_epsilon": 0.2}), ("clip_epsilon",)
    elif kind == "empty_datum_list":
        return replace(request, datums=[]), ("at least one datum",)
    elif kind == "empty_model_input":
        tokens, inputs = tokens[:0], {k: v[:0] for k, v in inputs.items()}
        names += ("model_input has 0 tokens; expected 1..",)
    else:
        raise AssertionError(kind)
    datums = [request.datums[0], DatumInput(tokens, inputs), *request.datums[2:]]
    return replace(request, datums=datums), names


BAD_KINDS = (
    "target_tokens_too_short",
    "model_input_id_out_of_vocab",
    "target_id_out_of_vocab",
    "nan_advantages",
    "missing_logprobs",
    "unknown_config_key",
    "empty_datum_list",
    "empty_model_input",
)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_request_fails_alone_as_a_user_error_and_changes_no_state(
    engine: LocalEngine, twin: LocalEngine, kind: str
) -> None:
    rng = np.random.default_rng(8)
    s0, s1, s2 = engine.pool.live_slots
    engine.run_pass([make_request(engine, rng, s0, Case("cross_entropy"), [5])])  # non-zero accumulators
    good = [
        make_request(engine, rng, s1, Case("ppo"), [7, 9]),
        make_request(engine, rng, s2, Case("cross_entropy"), [6]),
        make_request(engine, rng, None, Case("dro"), [8], forward_only=True),
    ]
    bad, names = _corrupt(make_request(engine, rng, s0, Case("ppo"), [6, 8, 5]), kind)
    s0_grads, s0_weights = slot_grads(engine, s0), slot_weights(engine, s0)

    results = engine.run_pass([good[0], bad, good[1], good[2]])

    error = results[1]
    assert isinstance(error, UserError), error
    assert all(name in str(error) for name in names), str(error)
    assert_grads_equal(slot_grads(engine, s0), s0_grads)
    assert_grads_equal(slot_weights(engine, s0), s0_weights)
    passed_grads = {s: slot_grads(engine, s) for s in (s1, s2)}
    alone, alone_grads = run_alone(engine, good)
    exact, exact_grads = run_alone(twin, good)
    for result, single, single_exact in zip([results[0], *results[2:]], alone, exact, strict=True):
        assert_results_match(result, single, single_exact)
    passed = (s1, s2)
    assert_grads_close(passed_grads, {s: alone_grads[s] for s in passed}, {s: exact_grads[s] for s in passed})


def test_a_pass_past_the_token_budget_runs_in_pieces_within_it_and_equals_the_whole_pass(
    engine: LocalEngine, twin: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(11)
    s0, s1, _ = engine.pool.live_slots
    requests = [
        make_request(engine, rng, s0, Case("ppo"), [7, 9, 5]),  # 21 tokens
        make_request(engine, rng, s1, Case("cross_entropy"), [6, 13]),  # 19 tokens
        make_request(engine, rng, None, Case("dro"), [8], forward_only=True),
    ]
    zero_grads(engine)
    whole = engine.run_pass(requests)
    whole_grads = all_grads(engine)
    exact = twin.run_pass(requests)
    exact_grads = all_grads(twin)

    packs: list[int] = []
    original = local.run_pass

    def counting(decoder, pieces, validate, chunk):
        packs.append(sum(len(d.tokens) for r in pieces for d in r.datums))
        return original(decoder, pieces, validate, chunk)

    monkeypatch.setattr(local, "run_pass", counting)
    zero_grads(engine)
    engine.max_pass_tokens = 16  # the 13-token datum fits alone; no two of 7, 9, 5 together exceed 16
    split = engine.run_pass(requests)
    assert packs == [16, 11, 13, 8], packs  # [7 9] [5 6] [13] [8]: consecutive datums, each pass <= 16
    for got, want, want_exact in zip(split, whole, exact, strict=True):
        assert_results_match(got, want, want_exact)
    assert_grads_close(all_grads(engine), whole_grads, exact_grads)
