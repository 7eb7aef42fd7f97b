"""The sampler's snapshot pool: a decode step runs the same aten ops for 1 and for 16 distinct snapshots,
draws the tokens the segmented path draws (mixed ranks, base-only rows), and a pool smaller than the
snapshots in use evicts and reloads them without changing a token."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import LoraConfig, SampleRequest, SampleResult, SamplingParams
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.multi_lora import MultiLoRALinear
from tests.engine.conftest import randomize_lora_b
from tests.engine.test_sampler import sample_all
from tests.model.host_syncs import host_syncs

NUM_SNAPSHOTS = 16
PROMPT = np.array([5, 17, 99, 42], dtype=np.int64)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=())
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop=())


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine(
        "tiny", tmp_path_factory.mktemp("data"), "cpu", 1, 8, None, max_sampling_snapshots=NUM_SNAPSHOTS
    )


@pytest.fixture(scope="module")
def snapshots(engine: LocalEngine, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Snapshots of ranks 2, 4 and 8 (the pool's), every third without MLP adapters, random B loud enough
    to change tokens."""
    directory = tmp_path_factory.mktemp("snapshots")
    generator = torch.Generator().manual_seed(0)
    paths = []
    for i in range(NUM_SNAPSHOTS):
        slot = engine.create_slot(LoraConfig(rank=(2, 4, 8)[i % 3], seed=i, train_mlp=i % 3 != 1))
        randomize_lora_b(engine.pool.get(slot).weights, 0.5, generator)
        paths.append(directory / f"s{i}")
        engine.save_snapshot(slot, paths[-1])
        engine.free_slot(slot)
    return paths


@contextmanager
def segmented(engine: LocalEngine) -> Iterator[None]:
    """Take the pools off the layers: the decode step then routes by segments, as before the pool."""
    layers = [m for m in engine.decoder.modules() if isinstance(m, MultiLoRALinear)]
    pools = [layer.snapshot_pool for layer in layers]
    for layer in layers:
        layer.snapshot_pool = None
    try:
        yield
    finally:
        for layer, pool in zip(layers, pools, strict=True):
            layer.snapshot_pool = pool


def decode_step_ops(engine: LocalEngine, snapshots: list[Path]) -> Counter[str]:
    """The aten ops of one decode step of one sequence per snapshot (all admitted the step before)."""
    for i, snapshot in enumerate(snapshots):
        engine.add_sample(f"r{i}", SampleRequest(PROMPT, GREEDY, snapshot=snapshot))
    engine.step_sampler()  # admission, prefill and the first decode step
    with host_syncs() as found:
        assert engine.step_sampler() == []
    while engine.has_sampling_work():
        engine.step_sampler()
    return Counter(map(str, found.recorded_ops))


def test_a_decode_step_runs_the_same_aten_ops_for_one_and_for_sixteen_snapshots(engine, snapshots) -> None:
    one = decode_step_ops(engine, [snapshots[0]] * NUM_SNAPSHOTS)
    sixteen = decode_step_ops(engine, snapshots)
    assert sixteen == one
    with segmented(engine):  # the measure can tell: by segments, the ops grow with the snapshots
        assert sum(decode_step_ops(engine, snapshots).values()) > sum(
            decode_step_ops(engine, [snapshots[0]] * NUM_SNAPSHOTS).values()
        )


def mixed_requests(snapshots: list[Path]) -> dict[str, SampleRequest]:
    """Seeded and greedy requests of five snapshots (ranks 2, 4 and 8, with and without MLP adapters)
    and of the base model, two samples each."""
    requests = {}
    for i, snapshot in enumerate([None, *snapshots[:5]]):
        for name, params in (("seeded", SEEDED), ("greedy", GREEDY)):
            requests[f"{name}{i}"] = SampleRequest(
                PROMPT[: 2 + i % 3], params, num_samples=2, snapshot=snapshot
            )
    return requests


def tokens(results: dict[str, SampleResult]) -> dict[str, list[list[int]]]:
    return {key: [s.tokens.tolist() for s in result.sequences] for key, result in sorted(results.items())}


def test_the_pool_draws_the_tokens_the_segments_draw(engine, snapshots) -> None:
    requests = mixed_requests(snapshots)
    pooled = sample_all(engine, requests, join_every=2)  # requests join mid-decode: mixed batches
    with segmented(engine):
        by_segments = sample_all(engine, requests, join_every=2)
    assert tokens(pooled) == tokens(by_segments)
    base = tokens(pooled)["greedy0"]
    assert any(tokens(pooled)[f"greedy{i}"] != base for i in range(1, 6))  # the snapshots do change tokens


def test_more_snapshots_than_the_pool_evict_and_reload_with_the_same_tokens(engine, snapshots) -> None:
    # A decoder of its own: snapshot ids of two samplers on one decoder would collide.
    small = LocalEngine(load_decoder(Path(engine.info.tokenizer_dir)), engine.info, 1, snapshot_capacity=2)
    requests = mixed_requests(snapshots)
    expected = tokens(sample_all(engine, requests))
    assert tokens(sample_all(small, requests)) == expected  # five snapshots take turns in two entries
    assert small.sampler.snapshots.loads == 5
    assert tokens(sample_all(small, requests, join_every=1)) == expected  # the evicted ones reloaded
    assert small.sampler.snapshots.loads > 5
