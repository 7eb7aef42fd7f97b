"""Two engine ranks on the tiny model: rank 0 in the test process, rank 1 a real `loraplex engine-worker`
child (gloo on CPU, one thread each); a single-rank LocalEngine on the same model is the reference, and
its float64 twin measures the reference's rounding error (`ReferenceEngine`).

`start_ranks` always closes the engine and kills the child, whatever the test did to it.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from loraplex.engine.checkpoints import OPTIMIZER_FILE, WEIGHTS_FILE
from loraplex.engine.distributed.coordinator import DistributedEngine, start_coordinator
from loraplex.engine.distributed.group import RankEnv, RankTimeouts
from loraplex.engine.distributed.launch import LocalRanks
from loraplex.engine.interface import Engine, EngineInfo
from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import AdamParams, DatumInput, LoraConfig, PassRequest, PassResult, PreparedStep
from loraplex.errors import UserError
from loraplex.model.decoder import Decoder
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.tensor_parallel import SINGLE, TensorParallel
from tests.model.float64 import float64_experts

MAX_SLOTS, MAX_RANK = 4, 16
VOCAB = 512  # the tiny model's
_START_TIMEOUT_S = 120.0  # a loaded host can take many seconds to start a rank's Python and torch


def build_engine(
    data_dir: Path, device: str = "cpu", model: str = "tiny", tp: TensorParallel = SINGLE
) -> LocalEngine:
    """An engine on `model` (the tiny model by default), configured as the ranks are: a single-rank one,
    or with `tp` one rank's part of a tensor-parallel group."""
    return build_local_engine(model, data_dir, device, MAX_SLOTS, MAX_RANK, None, None, tp)


@dataclass
class ReferenceResult(PassResult):
    """The reference's result of one request, with its float64 twin's result of the same request."""

    exact: PassResult | UserError | None = None


class ReferenceEngine(LocalEngine):
    """The single-rank reference, with `exact`: its float64 twin, given every slot, pass, step, undo and
    load.

    A comparison against the reference reads this host's rounding error of it as its distance to the
    twin (tests/model/rounding.py). The twin holds the base model in float64 (but for the fp32 islands
    tests/model/float64.py lists); its adapters, their gradients and AdamW stay fp32 (the slot pool and the
    LoRA layers accept fp32 tensors only), computed from float64 activations. Its rounding is therefore
    independent of the reference's, and its distance to the reference at least the reference's own error:
    the base model's rounding, plus both engines' rounding in the adapters, their gradient sums and the
    optimizer.
    """

    def __init__(self, decoder: Decoder, info: EngineInfo, max_slots: int, exact: LocalEngine) -> None:
        super().__init__(decoder, info, max_slots)
        self.exact = exact
        self._exact_step: PreparedStep | None = None  # the twin's step, prepared with the reference's

    def create_slot(self, config: LoraConfig) -> int:
        slot = super().create_slot(config)
        assert self.exact.create_slot(config) == slot
        return slot

    def free_slot(self, slot: int) -> None:
        super().free_slot(slot)
        self.exact.free_slot(slot)

    def run_pass(self, requests: list[PassRequest], keep_undo: bool = False) -> list[PassResult | UserError]:
        """The reference's results, each a ReferenceResult carrying the twin's."""
        results = super().run_pass(requests, keep_undo)
        with float64_experts():
            exact = self.exact.run_pass(requests, keep_undo)
        return [
            ReferenceResult(r.outputs, r.metrics, r.health, exact=x) if isinstance(r, PassResult) else r
            for r, x in zip(results, exact, strict=True)
        ]

    def prepare_step(self, steps: dict[int, AdamParams]) -> PreparedStep:
        prepared = super().prepare_step(steps)
        self._exact_step = self.exact.prepare_step(steps)
        return prepared

    def apply_step(self, prepared: PreparedStep) -> None:
        super().apply_step(prepared)
        self.exact.apply_step(self._exact_step)

    def abort_step(self, prepared: PreparedStep) -> None:
        super().abort_step(prepared)
        self.exact.abort_step(self._exact_step)

    def undo_last(self) -> None:
        super().undo_last()
        self.exact.undo_last()

    def load_state(
        self, directory: Path, owner_digest: str, with_optimizer: bool, slot: int | None = None
    ) -> tuple[int, LoraConfig]:
        """Load into the reference and the twin alike: both resume from the same fp32 state."""
        loaded = super().load_state(directory, owner_digest, with_optimizer, slot)
        assert self.exact.load_state(directory, owner_digest, with_optimizer, slot) == loaded
        return loaded


def build_reference(data_dir: Path, model: str = "tiny") -> ReferenceEngine:
    """A single-rank reference engine on `model` (CPU, fp32, configured as the ranks are) and its twin."""
    engine = build_engine(data_dir, "cpu", model)
    exact_decoder = load_decoder(Path(engine.info.tokenizer_dir), torch.device("cpu"), torch.float64)
    exact = LocalEngine(exact_decoder, engine.info, MAX_SLOTS)
    return ReferenceEngine(engine.decoder, engine.info, MAX_SLOTS, exact)


@dataclass
class Ranks:
    """A running 2-rank engine, its child process and the failures it reported."""

    engine: DistributedEngine
    local_ranks: LocalRanks
    failures: list[str] = field(default_factory=list)


@contextmanager
def start_ranks(
    data_dir: Path,
    timeout_s: float = 60.0,
    is_watched: bool = True,
    model: str = "tiny",
    world_size: int = 2,
    tp: int = 1,
) -> Iterator[Ranks]:
    """Rank 0 here and ranks 1.. as children, in tensor-parallel groups of `tp`; is_watched=False hides the
    children from rank 0, as ranks on another machine would be, so only collectives can reveal a failure."""
    env = RankEnv.on_this_machine(world_size)
    command = [
        sys.executable,
        "-m",
        "loraplex.cli",
        "engine-worker",
        "--data-dir",
        str(data_dir),
        "--model",
        model,
    ]
    command += ["--device", "cpu", "--max-slots", str(MAX_SLOTS), "--max-rank", str(MAX_RANK)]
    # Start-up has its own, long timeout: a loaded host may take seconds to start the child.
    command += ["--rank-timeout-s", str(timeout_s), "--rank-start-timeout-s", str(_START_TIMEOUT_S)]
    command += ["--tp", str(tp)]
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        local_ranks = LocalRanks.spawn(command, env)
    failures: list[str] = []
    try:
        engine = start_coordinator(
            env,
            lambda device, tp_group: build_engine(data_dir, device, model, tp_group),
            "cpu",
            RankTimeouts(collective_s=timeout_s, start_s=_START_TIMEOUT_S),
            tp,
            failures.append,
            local_ranks if is_watched else None,
        )
        try:
            yield Ranks(engine, local_ranks, failures)
        finally:
            engine.close()
    finally:
        local_ranks.stop(0.0)
        torch.set_num_threads(threads)


# --- a module's two ranks and its single-rank reference (each module starts its own)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ranks")


@pytest.fixture(scope="module")
def ranks(data_dir: Path) -> Iterator[Ranks]:
    with start_ranks(data_dir) as running:
        yield running


@pytest.fixture(scope="module")
def reference(data_dir: Path) -> ReferenceEngine:
    return build_reference(data_dir)


# --- requests: random tokens of given lengths, seeded
def _tokens(rng: np.random.Generator, length: int) -> np.ndarray:
    return rng.integers(0, VOCAB, length, dtype=np.int64)


def sft_request(
    slot: int | None, lengths: list[int], seed: int, forward_only: bool = False, top_k: int | None = None
) -> PassRequest:
    """cross_entropy over random datums; top_k gives (N, K) targets and weights."""
    rng = np.random.default_rng(seed)
    datums = []
    for n in lengths:
        shape = (n,) if top_k is None else (n, top_k)
        targets = rng.integers(0, VOCAB, shape, dtype=np.int64)
        weights = rng.uniform(0.0, 1.0, shape).astype(np.float32)
        datums.append(DatumInput(_tokens(rng, n), {"target_tokens": targets, "weights": weights}))
    return PassRequest(slot, "cross_entropy", {}, datums, forward_only)


def rl_request(
    slot: int | None,
    loss_fn: str,
    lengths: list[int],
    seed: int,
    config: dict[str, float] | None = None,
    forward_only: bool = False,
) -> PassRequest:
    """An RL loss over random datums with sampler logprobs near the model's, so some ratios clip."""
    rng = np.random.default_rng(seed)
    datums = []
    for n in lengths:
        inputs = {
            "target_tokens": _tokens(rng, n),
            "logprobs": rng.uniform(-7.0, -5.5, n).astype(np.float32),
            "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
        }
        datums.append(DatumInput(_tokens(rng, n), inputs))
    return PassRequest(slot, loss_fn, config or {}, datums, forward_only)


def adapter_state(engine: Engine, slot: int) -> dict[str, np.ndarray]:
    """A slot's weights and AdamW moments, whole, as numpy copies keyed by name ("exp_avg.<name>" for a
    moment): a LocalEngine's read from its slot pool, another engine's from a checkpoint it writes (a
    DistributedEngine's ranks gather their parts of the slot for it)."""
    if not isinstance(engine, LocalEngine):
        with tempfile.TemporaryDirectory() as tmp:
            engine.save_state(slot, Path(tmp) / "state", owner_digest="test")
            files = [Path(tmp) / "state" / name for name in (WEIGHTS_FILE, OPTIMIZER_FILE)]
            return {
                name: t.numpy() for file in files for name, t in safetensors.torch.load_file(file).items()
            }
    record = engine.pool.get(slot)
    state = record.optimizer_state()
    tensors = {**record.weights, **{f"exp_avg.{k}": v for k, v in state.exp_avg.items()}}
    tensors |= {f"exp_avg_sq.{k}": v for k, v in state.exp_avg_sq.items()}
    return {name: t.detach().cpu().numpy().copy() for name, t in tensors.items()}
