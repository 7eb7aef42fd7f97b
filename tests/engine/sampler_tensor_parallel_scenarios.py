"""What every rank of tests/engine/test_sampler_tensor_parallel.py runs: rank 0 in the test process, rank 1
as `python -m tests.engine.sampler_tensor_parallel_scenarios MODEL_DIR ...` (tests/model/two_ranks.py).
With `SINGLE` the same functions give the single-rank reference, and in float64 its twin.

A scenario loads a decoder (this rank's part of it), puts a Sampler over it and makes the Sampler calls the
engine makes on every rank, in one order: requests of the base model and of two snapshots of different
LoRA ranks (greedy with top logprobs, seeded draws at temperature 1 with and without top-k / top-p, prompt
logprobs with top-k prompt logprobs over several chunks), one of them added after the first step so that
its prefill shares a step with the others' decodes, then steps until every request has finished.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from loraplex.engine.sampler.generation import Sampler
from loraplex.engine.slots import lora_names
from loraplex.engine.snapshots import write_snapshot
from loraplex.engine.types import LoraConfig, SampleRequest, SampleResult, SamplingParams
from loraplex.errors import UserError
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.multi_lora import init_slot_weights
from loraplex.model.tensor_parallel import TensorParallel
from tests.model.two_ranks import rank_main

# Snapshot name -> its adapter; seeded like a slot of that config, B random (a fresh slot's is zero).
SNAPSHOTS = {
    "rank4": (LoraConfig(rank=4, seed=1), {"attn", "mlp", "unembed"}),
    "rank8": (LoraConfig(rank=8, seed=2, train_mlp=False), {"attn", "unembed"}),
}
MAX_TOKENS = 6
CHUNK = 4  # prompt positions per lm_head chunk: the long prompt's scores take several chunks
SHORT = np.array([5, 17, 99, 42], dtype=np.int64)
LONG = np.array([3, 60, 11, 90, 7, 33, 120, 1, 64, 28, 9], dtype=np.int64)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=())
JOINS_LATE = "prompt scores rank8"  # added after the first step

Run = tuple[dict[str, SampleResult], int]  # run_sampler's: results by key, KV cache bytes per token


def snapshot_dirs(model_dir: Path) -> dict[str, Path]:
    """Where the snapshots of `model_dir`'s model lie (beside it, so every rank finds them)."""
    return {name: model_dir.parent / f"{model_dir.name}-{name}" for name in SNAPSHOTS}


def write_snapshots(model_dir: Path) -> None:
    """Write the snapshots of SNAPSHOTS for the model in `model_dir`, from a single-rank decoder's slots."""
    targets = load_decoder(model_dir).lora_targets()
    generator = torch.Generator().manual_seed(4)
    for name, directory in snapshot_dirs(model_dir).items():
        config, groups = SNAPSHOTS[name]
        weights = {}
        for path, (A, B) in init_slot_weights(targets, config.rank, config.seed, groups).items():
            name_A, name_B = lora_names(path)
            weights[name_A], weights[name_B] = A, 0.1 * torch.randn(B.shape, generator=generator)
        write_snapshot(weights, config, directory, model_dir.name)


def requests(model_dir: Path) -> dict[str, SampleRequest]:
    """The scenario's requests, by key, in the order they are added."""
    snapshots = snapshot_dirs(model_dir)
    truncated = SamplingParams(MAX_TOKENS, temperature=1.0, top_k=20, top_p=0.9, seed=11, stop=())
    untruncated = SamplingParams(MAX_TOKENS, temperature=1.0, seed=12, stop=())
    return {
        "greedy base": SampleRequest(SHORT, GREEDY, topk_sample_logprobs=3),
        "greedy rank4": SampleRequest(LONG, GREEDY, snapshot=snapshots["rank4"]),
        "top-k top-p rank8": SampleRequest(
            SHORT, truncated, num_samples=2, topk_sample_logprobs=4, snapshot=snapshots["rank8"]
        ),
        "untruncated rank4": SampleRequest(LONG[:6], untruncated, num_samples=2, snapshot=snapshots["rank4"]),
        JOINS_LATE: SampleRequest(
            LONG,
            SamplingParams(1, temperature=0.0, stop=()),
            prompt_logprobs=True,
            topk_prompt_logprobs=3,
            snapshot=snapshots["rank8"],
        ),
    }


def run_sampler(model_dir: Path, tp: TensorParallel, dtype: torch.dtype = torch.float32) -> Run:
    """Every request's result on this rank, and its KV cache's bytes per token; every rank of `tp` must
    run it."""
    decoder = load_decoder(model_dir, "cpu", dtype, tp)
    sampler = Sampler(
        decoder,
        model_dir,
        max_context_length=32,
        max_batch=8,
        snapshot_capacity=2,
        max_rank=max(config.rank for config, _ in SNAPSHOTS.values()),
        chunk_size=CHUNK,
    )
    pending = requests(model_dir)
    late = pending.pop(JOINS_LATE)
    for key, request in pending.items():
        sampler.add(key, request)
    results: dict[str, SampleResult] = {}
    steps = 0
    while sampler.has_work():
        for key, result in sampler.step():
            assert not isinstance(result, UserError), result
            results[key] = result
        steps += 1
        if steps == 1:
            sampler.add(JOINS_LATE, late)
    return results, sampler.cache.bytes_per_token


def run_all(model_dirs: list[Path], tp: TensorParallel) -> dict[str, list[Run]]:
    """Per model, in one order on every rank: every rank's `run_sampler` (gathered to every rank)."""
    runs = {}
    for model_dir in model_dirs:
        per_rank: list = [None] * tp.size
        dist.all_gather_object(per_rank, run_sampler(model_dir, tp), group=tp.group)
        runs[model_dir.name] = per_rank
    return runs


if __name__ == "__main__":
    rank_main(run_all)
