"""No host syncs in a training pass or a decode step but the results they read back at the end.

The detector (tests/model/host_syncs.py) first finds each op it forbids in a tiny case of its own, and
passes their sync-free spellings, so that an empty finding means something. Then, on the built-in tiny
dense model (fp32, as the engine runs on CPUs) and on a tiny bf16 Qwen3-MoE, with two slots attached
and packed sequences of several lengths, a training pass (per-token losses, whose lm_head backward runs
inside the chunked forward, and a sequence-level one) and the sampler's steps (a prefill that also scores
a prompt, and a decode, a snapshot's rows beside base-only ones) find nothing but the deliberate reads
listed in `READBACKS`, and an optimizer step nothing but its grad norms. On a GPU, torch's own sync check
confirms it (`test_on_cuda_nothing_syncs_but_the_deliberate_reads`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loraplex.engine import passes
from loraplex.engine.local import LocalEngine, PassMetrics, build_local_engine
from loraplex.engine.sampler import generation
from loraplex.engine.types import (
    AdamParams,
    DatumInput,
    LoraConfig,
    PassRequest,
    SampleRequest,
    SamplingParams,
)
from loraplex.model.grouped_mm import grouped_mm
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.host_copy import to_device
from loraplex.model.moe import count_ids
from tests.engine.conftest import randomize_lora_b
from tests.model.host_syncs import HostSyncs, cuda_syncs_raise, host_syncs
from tests.model.test_decoder_parity import save_random_hf_model
from tests.model.test_moe import moe_config

aten = torch.ops.aten

# The reads the engine makes on purpose, once its compute is queued: 'file:function' (HostSync.function)
# -> where the function lives.
READBACKS: dict[str, tuple[object, str]] = {
    # every request's logprobs, losses and metrics, in one copy at the end of a pass
    "passes.py:_to_results": (passes, "_to_results"),
    # a MoE model's expert load, once per forward (a dense model has none)
    "local.py:add_expert_load": (PassMetrics, "add_expert_load"),
    # a sampler step's drawn tokens and their logprobs, to check stops and append
    "generation.py:_read_back": (generation, "_read_back"),
    # a prefill's prompt scores, a chunk at a time (patched where the sampler calls it)
    "prompt_scores.py:score_prompt": (generation, "score_prompt"),
}
PASS_KINDS = ["per_token_losses_backward_inside_the_chunked_lm_head", "a_sequence_loss_backward_after_it"]
VOCAB = 128  # of the MoE model; the tiny model's is larger


# --- the detector finds what it must, and only that ---------------------------------------------------


def _ids() -> torch.Tensor:
    return torch.tensor([2, 0, 2, 3])


def _assign_by_mask(x: torch.Tensor) -> None:
    x[x > 0] = 0.0


# (what the case calls, the op the detector must name)
SYNCING: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "item": (lambda x: x.sum().item(), "aten._local_scalar_dense.default"),
    "bool": (lambda x: bool(x.sum() > 0), "aten._local_scalar_dense.default"),
    "int": (lambda x: int(x[0]), "aten._local_scalar_dense.default"),
    "torch_equal": (lambda x: torch.equal(x, x), "aten.equal.default"),
    "tolist": (lambda x: x.tolist(), "tolist"),
    "numpy": (lambda x: x.numpy(), "numpy"),
    "np_asarray": (lambda x: np.asarray(x), "__array__"),
    "cpu": (lambda x: x.cpu(), "cpu"),
    "nonzero": (lambda x: x.nonzero(), "aten.nonzero.default"),
    "argwhere": (lambda x: torch.argwhere(x), "aten.nonzero.default"),
    "where_of_a_condition": (lambda x: torch.where(x > 0), "aten.nonzero.default"),
    "masked_select": (lambda x: x.masked_select(x > 0), "aten.masked_select.default"),
    "index_by_mask": (lambda x: x[x > 0], "aten.index.Tensor"),
    "assign_by_mask": (_assign_by_mask, "aten.index_put_.default"),
    "bincount": (lambda x: torch.bincount(_ids()), "aten.bincount.default"),
    "unique": (lambda x: torch.unique(_ids()), "aten._unique2.default"),
    "unique_consecutive": (lambda x: torch.unique_consecutive(_ids()), "aten.unique_consecutive.default"),
    "repeat_interleave": (lambda x: _ids().repeat_interleave(_ids()), "aten.repeat_interleave.Tensor"),
    "to_a_device": (lambda x: x.to("cpu"), "to"),
    "to_another_tensors_device": (lambda x: x.to(x), "to"),
    "tensor_on_a_device": (lambda x: torch.tensor([1.0], device=x.device), "tensor"),
    "as_tensor_on_a_device": (lambda x: torch.as_tensor([1.0], device=x.device), "as_tensor"),
    "asarray_on_a_device": (lambda x: torch.asarray([1.0], device=x.device), "asarray"),
    "new_tensor_of_host_data": (lambda x: x.new_tensor([1.0, 2.0]), "new_tensor"),
    "grouped_mm_in_fp32": (
        lambda x: torch._grouped_mm(torch.ones(4, 4), torch.ones(2, 4, 4), offs=torch.tensor([2, 4]).int()),
        "aten._grouped_mm.default",
    ),
}

SYNC_FREE: dict[str, Callable[[torch.Tensor], object]] = {
    "arithmetic_and_reductions": lambda x: (x * 2 + 1).sum().max(),
    "masked_fill": lambda x: x.masked_fill(x > 0, 0.0),
    "where_of_three": lambda x: torch.where(x > 0, x, 0.0),
    "index_select": lambda x: x.index_select(0, _ids()),
    "repeat_interleave_with_output_size": lambda x: _ids().repeat_interleave(_ids(), output_size=7),
    "count_ids": lambda x: count_ids(_ids(), 4),
    "to_a_dtype": lambda x: x.to(torch.float64),
    "to_a_device_without_blocking": lambda x: x.to("cpu", non_blocking=True),
    "to_device": lambda x: to_device(np.arange(3), x.device),
    "tensor_on_the_host": lambda x: torch.tensor([1.0]),
    "grouped_mm_in_bf16": lambda x: grouped_mm(
        x[:, None].bfloat16(),
        torch.ones(2, 1, 16, dtype=torch.bfloat16),
        torch.tensor([2, 4], dtype=torch.int32),
    ),
}


@pytest.mark.parametrize("case", SYNCING)
def test_the_detector_names_each_syncing_call_and_where_it_was_made(case: str) -> None:
    call, op = SYNCING[case]
    with host_syncs() as found:
        call(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    assert op in [sync.op for sync in found]
    assert all(sync.where.startswith("tests/model/test_host_syncs.py:") for sync in found)


@pytest.mark.parametrize("case", SYNC_FREE)
def test_the_detector_passes_the_sync_free_spellings(case: str) -> None:
    with host_syncs() as found:
        SYNC_FREE[case](torch.tensor([1.0, -2.0, 3.0, 0.5]))
    assert not found


def test_the_detector_records_every_aten_op_in_order() -> None:
    x = torch.ones(3, requires_grad=True)
    with host_syncs() as found:
        (x * 2).sum().backward()
    assert found.recorded_ops[:2] == [aten.mul.Tensor, aten.sum.default]
    # The backward's ops are recorded too: sum's gradient expands, mul's multiplies.
    assert aten.expand.default in found.recorded_ops[2:]
    assert aten.mul.Tensor in found.recorded_ops[2:]


# --- the engine's paths ---------------------------------------------------------------------------------


def _build(kind: str, device: str, directory: Path) -> LocalEngine:
    """The tiny dense model in the engine's dtype for `device` (fp32 on CPUs, bf16 on GPUs), or a tiny
    Qwen3-MoE in bf16 (a GPU's dtype, the one with a grouped GEMM kernel); with slots 0 and 1, of ranks 4
    and 2 (so different scales), their B random (a fresh B is zero)."""
    if kind == "dense":
        engine = build_local_engine("tiny", directory, device, 2, 8, None)
    else:
        save_random_hf_model(moe_config(), directory)
        info = build_local_engine(str(directory), directory, "cpu", 2, 8, "moe").info
        engine = LocalEngine(load_decoder(directory, device, torch.bfloat16), info, max_slots=2)
    generator = torch.Generator().manual_seed(0)
    for rank in (4, 2):
        slot = engine.create_slot(LoraConfig(rank=rank, seed=rank))
        randomize_lora_b(engine.pool.get(slot).weights, 0.05, generator)
    return engine


@pytest.fixture(scope="module", params=["dense", "moe_bf16"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return _build(request.param, "cpu", tmp_path_factory.mktemp(request.param))


def _datum(rng: np.random.Generator, length: int) -> DatumInput:
    """`length` random tokens and their next-token targets, with the inputs of every loss."""
    tokens = rng.integers(0, VOCAB, length + 1)
    inputs = {
        "target_tokens": tokens[1:],
        "weights": np.ones(length, np.float32),
        "logprobs": rng.uniform(-3.0, -0.5, length).astype(np.float32),
        "advantages": rng.normal(size=length).astype(np.float32),
    }
    return DatumInput(tokens[:-1], inputs)


def _train(
    engine: LocalEngine, second_loss: str, check: Callable[[], AbstractContextManager[object]]
) -> HostSyncs:
    """One pass of two slots' training requests (cross_entropy and `second_loss`, sequences of several
    lengths) and a base-only forward, under the detector and `check`."""
    rng = np.random.default_rng(0)
    requests = [
        PassRequest(0, "cross_entropy", {}, [_datum(rng, 5), _datum(rng, 7)], forward_only=False),
        PassRequest(1, second_loss, {}, [_datum(rng, 6), _datum(rng, 7)], forward_only=False),
        PassRequest(None, "cross_entropy", {}, [_datum(rng, 4)], forward_only=True),
    ]
    with host_syncs() as found, check():
        engine.run_pass(requests)
    assert engine.pool.get(0).adam.has_gradients and engine.pool.get(1).adam.has_gradients
    return found


def _sample(
    engine: LocalEngine, snapshot_dir: Path, check: Callable[[], AbstractContextManager[object]]
) -> list[HostSyncs]:
    """A prefill step and a decode step of a snapshot's two samples (top-k) beside a base-only greedy
    request that also scores its prompt, each under the detector and `check`, once the snapshot is in the
    sampler's cache: its load (from disk, with blocking copies of its weights) happens once per snapshot,
    not per step."""
    engine.save_snapshot(0, snapshot_dir)
    engine.add_sample(
        "load", SampleRequest(np.arange(30, 33), SamplingParams(max_tokens=1), snapshot=snapshot_dir)
    )
    assert [key for key, _ in engine.step_sampler()] == ["load"]
    keep_going = {"max_tokens": 8, "stop": ()}
    top_k = SamplingParams(temperature=1.0, top_k=5, seed=1, **keep_going)
    engine.add_sample("snapshot_top_k", SampleRequest(np.arange(40, 45), top_k, 2, snapshot=snapshot_dir))
    named_ids = np.array([[-1, -1], [7, -1], [8, 9], [-1, 3], [4, 5]])  # the first row names none
    scored = SampleRequest(
        np.arange(50, 56),
        SamplingParams(temperature=0.0, **keep_going),
        prompt_logprobs=True,
        topk_prompt_logprobs=2,
        target_prompt_ids=named_ids,
    )
    engine.add_sample("base_greedy_scored", scored)
    steps = []
    for _ in ("prefill", "decode"):
        with host_syncs() as found, check():
            assert engine.step_sampler() == []  # nobody finishes yet
        steps.append(found)
    engine.drop_samples()
    return steps


def _functions(found: HostSyncs) -> set[str]:
    return {sync.function for sync in found}


@pytest.mark.parametrize("second_loss", ["importance_sampling", "gspo"], ids=PASS_KINDS)
def test_a_training_pass_reads_back_only_its_results(engine: LocalEngine, second_loss: str) -> None:
    found = _train(engine, second_loss, nullcontext)
    expert_load = {"local.py:add_expert_load"} if engine.decoder.expert_load() is not None else set()
    assert _functions(found) == {"passes.py:_to_results"} | expert_load
    assert aten.mm.default in found.recorded_ops  # the backward's weight gradients: it ran under the detector


def test_an_optimizer_step_reads_back_only_its_grad_norms(engine: LocalEngine) -> None:
    """Once per step, for its metrics and its non-finite skips (engine/optimizer.py prepare_slots)."""
    _train(engine, "importance_sampling", nullcontext)
    clipped = AdamParams(learning_rate=1e-3, grad_clip_norm=0.1)
    with host_syncs() as found:
        engine.optim_step({0: AdamParams(learning_rate=1e-3), 1: clipped})
    assert [(sync.function, sync.op) for sync in found] == [("optimizer.py:prepare_slots", "tolist")]
    assert aten._fused_adamw_.default in found.recorded_ops


def test_the_sampler_steps_read_back_only_the_drawn_tokens(engine: LocalEngine, tmp_path: Path) -> None:
    prefill, decode = _sample(engine, tmp_path, nullcontext)
    assert _functions(prefill) == {"generation.py:_read_back", "prompt_scores.py:score_prompt"}, prefill
    assert _functions(decode) == {"generation.py:_read_back"}, decode
    for found in (prefill, decode):
        assert aten.index_select.default in found.recorded_ops  # the decoder ran under the detector


def _unchecked(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` with torch's sync check off while it runs."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe_bf16"])
def test_on_cuda_nothing_syncs_but_the_deliberate_reads(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the CPU tests find, checked by torch on a GPU: `set_sync_debug_mode("error")` raises on any
    sync but in the reads of `READBACKS`, which the detector still finds there."""
    for owner, name in READBACKS.values():
        monkeypatch.setattr(owner, name, _unchecked(getattr(owner, name)))
    (tmp_path / "model").mkdir()
    engine = _build(kind, "cuda", tmp_path / "model")
    # Unchecked first: what a process initialises once (cuBLAS handles, first launches) is not a pass's.
    _train(engine, "cross_entropy", nullcontext)
    for second_loss in ("importance_sampling", "gspo"):
        assert _functions(_train(engine, second_loss, cuda_syncs_raise)) <= set(READBACKS)
    prefill, decode = _sample(engine, tmp_path / "snapshot", cuda_syncs_raise)
    assert _functions(prefill) == {"generation.py:_read_back", "prompt_scores.py:score_prompt"}
    assert _functions(decode) == {"generation.py:_read_back"}
