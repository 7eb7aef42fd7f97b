"""Decode steps replayed from CUDA graphs (engine/sampler/decode_graphs.py): a replay's logits are the eager
bucketed step's bit for bit, across steps whose live rows change within and across buckets, after a
snapshot pool entry is reloaded and after the KV pool is reallocated, with fewer graphs held than buckets
met. On a GPU (skipped, visibly, elsewhere) also: a replay does not sync; sampling with graphs draws the
tokens and logprobs sampling without them draws; a reset KV cache drops the graphs. On a CPU the same
bookkeeping runs against `_EmulatedGraph`, which records a capture's aten ops with their tensors and
replays them on those tensors, as a CUDA graph replays its kernels on its addresses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.sampler.decode_graphs import DecodeGraphs
from loraplex.engine.sampler.snapshot_cache import SNAPSHOT_ID_BASE
from loraplex.engine.types import SampleRequest, SamplingParams
from loraplex.model.kv_cache import DecodeStep
from loraplex.model.lora_pool import LoRAPool
from loraplex.model.multi_lora import LoRARouting, MultiLoRALinear
from tests.engine.test_sampler import sample_all
from tests.model.host_syncs import cuda_syncs_raise

LENGTHS = (5, 17, 3, 40, 9, 2, 33, 12, 20)  # prompt lengths of the rows
# The rows of each step, each step of another bucket than the step before or of other rows in the same one:
# (4 rows, span 32) twice, (1, 32), (16, 48), (4, 32) again, (4, 48) twice.
ROW_SETS = ([0, 1, 2], [2, 4, 7, 8], [1], [0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2], [3, 6, 7, 8], [5, 6, 3])


def _engine(tmp_path_factory: pytest.TempPathFactory, device: str, cuda_graphs: str) -> LocalEngine:
    return build_local_engine(
        "tiny", tmp_path_factory.mktemp("data"), device, 1, 8, None, cuda_graphs_setting=cuda_graphs
    )


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return _engine(tmp_path_factory, "cuda", "off")


class _EmulatedGraph:
    """A CUDA graph's semantics on any device: `capture()` records every aten op with its arguments and
    results; `replay()` runs them again on the same tensors, writing each result into the tensor the
    capture returned (which later ops read), so inputs and outputs stay where they were captured."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    @contextmanager
    def capture(self) -> Iterator[None]:
        graph = self

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
                out = func(*args, **(kwargs or {}))
                graph.calls.append((func, args, kwargs or {}, out))
                return out

        with Recorder():
            yield

    def replay(self) -> None:
        for func, args, kwargs, out in self.calls:
            fresh = func(*args, **kwargs)
            for recorded, result in zip(tree_flatten(out)[0], tree_flatten(fresh)[0], strict=True):
                # A view or an in-place result already lies in the recorded tensor's storage.
                if isinstance(recorded, torch.Tensor) and not _same_storage(recorded, result):
                    recorded.copy_(result)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda's graph and stream calls DecodeGraphs makes, on the CPU: graphs are `_EmulatedGraph`s."""

    class Stream:
        def __init__(self, device: Any = None) -> None:
            del device

        def wait_stream(self, stream: Any) -> None:
            del stream

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool, stream, **_: graph.capture())


def _pools(engine: LocalEngine) -> list[LoRAPool]:
    pools = [m.snapshot_pool for m in engine.decoder.modules() if isinstance(m, MultiLoRALinear)]
    assert all(pool is not None for pool in pools)
    return pools  # type: ignore[return-value]  # checked above


def _load_entry(engine: LocalEngine, entry: int, seed: int) -> None:
    """Random rank-4 adapters into `entry` of every pool, in place (as SnapshotCache loads snapshots)."""
    generator = torch.Generator().manual_seed(seed)
    for pool in _pools(engine):
        (_, out_features, _), in_features = pool.B_POR.shape, pool.A_PRI.shape[2]
        A = 0.1 * torch.randn(4, in_features, generator=generator)
        B = 0.1 * torch.randn(out_features, 4, generator=generator)
        pool.load(entry, A, B, 2.0)


def _prefill_rows(engine: LocalEngine) -> list[int]:
    sampler, device = engine.sampler, engine.decoder.lm_head.weight.device
    rows = [sampler.cache.allocate(length + len(ROW_SETS) + 1) for length in LENGTHS]
    tokens_T = torch.arange(sum(LENGTHS), device=device) % 250
    step = sampler.cache.prefill(rows, list(LENGTHS))
    engine.decoder.forward_cached(
        tokens_T, step, LoRARouting.from_sequences(list(LENGTHS), [None] * len(rows))
    )
    return rows


def _step(
    engine: LocalEngine, rows: list[int], entries: list[int]
) -> tuple[torch.Tensor, DecodeStep, LoRARouting]:
    """The sampler's bucketed decode step of `rows`, each routed to its pool entry (-1: base only)."""
    snapshot_ids = [None if entry < 0 else SNAPSHOT_ID_BASE + entry for entry in entries]
    return engine.sampler._bucketed_step(rows, [7 * row % 250 for row in rows], snapshot_ids)


@torch.no_grad()
def _check_replays_equal_the_eager_steps(engine: LocalEngine, max_graphs: int) -> None:
    sampler = engine.sampler
    graphs = DecodeGraphs(sampler._eager_step_logits, max_graphs)
    _load_entry(engine, 0, seed=1)
    for round_ in range(2):  # the second over a KV pool allocated again: every graph dropped, or still valid
        rows = _prefill_rows(engine)
        for i, row_set in enumerate(ROW_SETS):
            if i == 6:
                _load_entry(engine, 0, seed=2 + round_)  # a snapshot replaced under a captured graph
            entries = [(r + i) % 2 - 1 for r in row_set]  # pool entry 0 or base only, changing every step
            tokens_B, step, routing = _step(engine, [rows[r] for r in row_set], entries)
            # Eager first: its k/v writes are the ones the replay writes again, so both see one cache.
            want_BV = sampler._eager_step_logits(tokens_B, step, routing).clone()
            got_BV = graphs.logits(tokens_B, step, routing)
            assert torch.equal(got_BV, want_BV), (round_, row_set)
        assert 0 < len(graphs) <= max_graphs
        for row in rows:
            sampler.cache.free(row)


def test_emulated_on_a_cpu_a_replay_equals_the_eager_step_bit_for_bit(
    emulated_cuda: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Two graphs held for the four buckets met: evicted ones are captured again.
    _check_replays_equal_the_eager_steps(_engine(tmp_path_factory, "cpu", "off"), max_graphs=2)


@pytest.mark.gpu
def test_a_replay_equals_the_eager_step_bit_for_bit(eager: LocalEngine) -> None:
    _check_replays_equal_the_eager_steps(eager, max_graphs=2)


@pytest.mark.gpu
@torch.no_grad()
def test_a_replay_of_a_captured_bucket_does_not_sync(eager: LocalEngine) -> None:
    sampler = eager.sampler
    graphs = DecodeGraphs(sampler._eager_step_logits)
    rows = _prefill_rows(eager)
    try:
        graphs.logits(*_step(eager, rows[:3], [-1] * 3))  # captured here, outside the check
        four_rows = [rows[0], rows[1], rows[2], rows[4]]  # the same bucket: 4 rows, span 32
        tokens_B, step, routing = _step(eager, four_rows, [-1] * 4)
        with cuda_syncs_raise():
            logits_BV = graphs.logits(tokens_B, step, routing)
        assert len(graphs) == 1 and logits_BV.shape[0] == 4
    finally:
        for row in rows:
            sampler.cache.free(row)


@pytest.mark.gpu
def test_sampling_with_graphs_draws_what_sampling_without_draws(
    eager: LocalEngine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    graphed = _engine(tmp_path_factory, "cuda", "auto")  # on: CUDA, one rank, a dense model
    assert graphed.sampler.graphs is not None and eager.sampler.graphs is None
    requests = {
        f"{kind}{i}": SampleRequest(
            np.arange(1, 3 + 7 * i) % 250,
            SamplingParams(
                max_tokens=6 + 3 * i, temperature=1.0 if kind == "seeded" else 0.0, seed=i, stop=()
            ),
            num_samples=1 + i % 3,
        )
        for i in range(5)
        for kind in ("seeded", "greedy")
    }
    want = sample_all(eager, requests, join_every=2)  # requests join mid-decode: batches change
    got = sample_all(graphed, requests, join_every=2)
    assert len(graphed.sampler.graphs) > 1
    for key, result in want.items():
        for ours, theirs in zip(got[key].sequences, result.sequences, strict=True):
            np.testing.assert_array_equal(ours.tokens, theirs.tokens, err_msg=key)
            np.testing.assert_array_equal(ours.logprobs, theirs.logprobs, err_msg=key)
    graphed.drop_samples()  # a failed step's reset: a new KV cache, and no graph of the old one's pools
    assert len(graphed.sampler.graphs) == 0


def test_a_capture_that_fails_leaves_sampling_eager_with_the_same_draws(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU every capture fails (there is no CUDA stream to capture on): the sampler logs it once,
    drops its graphs and decodes eagerly, drawing what a sampler without graphs draws."""
    requests = {
        f"seeded{i}": SampleRequest(np.arange(1, 4 + 5 * i) % 250, SamplingParams(max_tokens=5, seed=i))
        for i in range(3)
    }
    want = sample_all(_engine(tmp_path_factory, "cpu", "off"), requests, join_every=1)
    failing = _engine(tmp_path_factory, "cpu", "off")
    failing.sampler.graphs = DecodeGraphs(failing.sampler._eager_step_logits)
    got = sample_all(failing, requests, join_every=1)
    assert failing.sampler.graphs is None
    assert [r.message for r in caplog.records if "without CUDA graphs" in r.message] == [
        "decoding without CUDA graphs from now on (serve --cuda-graphs off skips them)"
    ]
    for key, result in want.items():
        for ours, theirs in zip(got[key].sequences, result.sequences, strict=True):
            np.testing.assert_array_equal(ours.tokens, theirs.tokens, err_msg=key)
            np.testing.assert_array_equal(ours.logprobs, theirs.logprobs, err_msg=key)
