"""`--deterministic`: the switch reaches torch in every engine process, and a training run with RL losses
and sampling repeats bit for bit. On the CPU the repeat holds anyway; the `gpu` case is the one that
proves it where atomics and split-K reductions could differ (bench/gpu_check.sh runs it)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loraplex.engine.determinism import use_deterministic_kernels
from loraplex.engine.local import build_local_engine
from loraplex.engine.sampler.sampling import _cumulative_probs
from loraplex.engine.types import (
    AdamParams,
    DatumInput,
    LoraConfig,
    PassRequest,
    SampleRequest,
    SamplingParams,
)
from tests.engine.test_sampler import sample_one, tokens_of


def test_the_flag_turns_on_torchs_deterministic_algorithms_and_fixes_the_cublas_workspace() -> None:
    # Imported here: bench/gpu_check.sh collects this module where only the engine's packages are installed.
    from loraplex.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["serve", "--deterministic"])).deterministic
    assert not config_from_args(build_parser().parse_args(["serve"])).deterministic
    use_deterministic_kernels()  # tests/conftest.py already did, as every serve --deterministic rank does
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")


def test_a_deterministic_server_starts_without_the_compiler_and_compiles_deterministically() -> None:
    """Importing the server and the engine and turning the switch on leave torch._dynamo and inductor
    unimported (they cost every server and rank about 2 s of start-up, and compile nothing unless
    `--compile` is on); the first compile then gets inductor's deterministic flag."""
    script = (
        "import sys, torch\n"
        "import loraplex.api.app, loraplex.cli, loraplex.engine.local, loraplex.engine.distributed.launch\n"
        "from loraplex.engine.determinism import use_deterministic_kernels\n"
        "use_deterministic_kernels()\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor')))\n"
        "assert not loaded, loaded\n"
        "from loraplex.model.elementwise import fused\n"
        "fused()\n"
        "import torch._inductor.config\n"
        "assert torch._inductor.config.deterministic\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_cumulative_probabilities_are_exact_sums_in_fixed_point() -> None:
    """Each prefix sum is the exact sum of the probabilities rounded to multiples of 2⁻⁶², so it lies within
    k·2⁻⁶³ of the exact prefix sum (plus float64's rounding of the result): no summation order enters."""
    generator = torch.Generator().manual_seed(0)
    probs_BV = torch.softmax(3 * torch.randn(3, 5000, generator=generator, dtype=torch.float64), -1)
    got_BV = _cumulative_probs(probs_BV)
    for row, got in zip(probs_BV.tolist(), got_BV.tolist(), strict=True):
        for k in (1, 17, 2500, 5000):
            exact = math.fsum(row[:k])
            assert abs(got[k - 1] - exact) <= k * 2.0**-63 + 2.0**-53 * exact
    # Reversing the vocabulary and summing back from the end gives the same total, bit for bit.
    assert torch.equal(got_BV[:, -1], _cumulative_probs(probs_BV.flip(-1))[:, -1])


def _rl_datum(length: int, seed: int) -> DatumInput:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, length + 1)
    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": rng.uniform(-6.0, -1.0, length).astype(np.float32),
        "advantages": rng.normal(size=length).astype(np.float32),
    }
    return DatumInput(tokens[:-1], inputs)


def _train_and_sample(device: str, data_dir: Path) -> list[np.ndarray]:
    """Two slots trained with gspo (an index_add over sequences) and importance sampling (a gather and a
    scatter_add_ in the logprob backward) over packed datums, two AdamW steps, then a seeded sample of each;
    every logprob, loss, weight and token that came out."""
    engine = build_local_engine("tiny", data_dir, device, 2, 8, None)
    slots = [engine.create_slot(LoraConfig(rank=8, seed=seed)) for seed in (1, 2)]
    outputs: list[np.ndarray] = []
    for step in range(2):
        requests = [
            PassRequest(slot, loss, {}, [_rl_datum(n, 10 * step + n) for n in (7, 30, 64)], False)
            for slot, loss in zip(slots, ("gspo", "importance_sampling"), strict=True)
        ]
        for result in engine.run_pass(requests):
            outputs += [value for out in result.outputs for value in out.values()]  # type: ignore[union-attr]
        engine.optim_step({slot: AdamParams(learning_rate=1e-2) for slot in slots})
    for slot in slots:
        outputs += [t.detach().cpu().float().numpy() for t in engine.pool.get(slot).weights.values()]
        engine.save_snapshot(slot, data_dir / f"snapshot-{slot}")
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, stop=())
        snapshot = data_dir / f"snapshot-{slot}"
        result = sample_one(engine, SampleRequest(tokens_of(b"hello world"), params, 2, snapshot=snapshot))
        outputs += [array for sequence in result.sequences for array in (sequence.tokens, sequence.logprobs)]
    return outputs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_training_with_rl_losses_and_sampling_repeat_bit_for_bit(device: str, tmp_path: Path) -> None:
    use_deterministic_kernels()
    first = _train_and_sample(device, tmp_path / "first")
    second = _train_and_sample(device, tmp_path / "second")
    assert len(first) == len(second) > 0
    for a, b in zip(first, second, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
