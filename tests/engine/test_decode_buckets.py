"""Decode steps padded to buckets: the buckets, and that within one a step's forward runs the same aten ops
on the same shapes whatever its live rows and context lengths (what one CUDA graph per bucket needs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.sampler.decode_buckets import batch_bucket, span_bucket
from loraplex.engine.types import SampleRequest, SamplingParams
from tests.engine.test_sampler import sample_all

# (op, the shapes of its tensor arguments)
OpShapes = list[tuple[str, tuple[tuple[int, ...], ...]]]


class _ShapeRecorder(TorchDispatchMode):
    """Every aten op dispatched, with its tensor arguments' shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: OpShapes = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        self.ops.append((str(func), tuple(tuple(a.shape) for a in flat if isinstance(a, torch.Tensor))))
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 1, 8, None)


def test_rows_round_up_to_powers_of_two_then_multiples_of_eight_spans_to_quarter_doublings() -> None:
    assert [batch_bucket(n, 128) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 100, 128)] == [
        *(1, 2, 4, 4, 8, 8, 16, 16, 24, 104, 128)
    ]
    assert [batch_bucket(n, 12) for n in (9, 12)] == [12, 12]  # never past the largest batch
    # Whole blocks up to 8 of them, then four steps per doubling: 160, 192, 224, 256, 320, ...
    spans = (1, 16, 17, 33, 128, 129, 161, 257, 1025, 1088, 1089, 4096)
    assert [span_bucket(n, 4096) for n in spans] == [
        *(16, 16, 32, 48, 128, 160, 192, 320, 1280, 1280, 1280, 4096)
    ]
    assert span_bucket(3000, 3000) == 3008  # the context rounded up to a block
    # Never a quarter more blocks than the span fills; each bucket its own bucket.
    for span in range(1, 8193):
        bucket = span_bucket(span, 8192)
        assert bucket % 16 == 0 and span <= bucket < 1.25 * (-(-span // 16) * 16)
        assert span_bucket(bucket, 8192) == bucket
    with pytest.raises(ValueError):
        batch_bucket(129, 128)
    with pytest.raises(ValueError):
        span_bucket(4097, 4096)


def _decode_ops(engine: LocalEngine, num_samples: int, prompt_length: int) -> OpShapes:
    """The ops of a request's first decode step's forward and logits (`_eager_step_logits`)."""
    sampler = engine.sampler
    recorded: list[OpShapes] = []

    def recording(step_logits: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: Any) -> torch.Tensor:
            with _ShapeRecorder() as recorder:
                logits = step_logits(*args)
            recorded.append(recorder.ops)
            return logits

        return run

    sampler._eager_step_logits = recording(sampler._eager_step_logits)  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=1, stop=())
        prompt = np.arange(1, prompt_length + 1) % 200
        sample_all(engine, {"r": SampleRequest(prompt, params, num_samples=num_samples)})
    finally:
        del sampler._eager_step_logits
    return recorded[0]


def test_within_a_bucket_decode_steps_of_other_rows_and_lengths_run_the_same_ops_on_the_same_shapes(
    engine: LocalEngine,
) -> None:
    three_rows_36_positions = _decode_ops(engine, 3, 35)  # 4 rows of span 48
    four_rows_47_positions = _decode_ops(engine, 4, 46)
    assert three_rows_36_positions == four_rows_47_positions
    assert any(op.startswith("aten.index_select") for op, _ in three_rows_36_positions)  # the forward ran
    assert _decode_ops(engine, 5, 35) != three_rows_36_positions  # 8 rows: the recorder tells buckets apart
    assert _decode_ops(engine, 3, 50) != three_rows_36_positions  # span 64


def test_a_sampler_of_three_rows_decodes_three_rows_not_a_bucket_of_four(engine: LocalEngine) -> None:
    sampler = engine.sampler
    max_batch = sampler.max_batch
    sampler.max_batch = 3
    try:
        shapes = [shape for op, shape in _decode_ops(engine, 3, 5) if op.startswith("aten.embedding")]
    finally:
        sampler.max_batch = max_batch
    assert shapes == [((512, 256), (3,))]  # the embedding's weight and the step's 3 tokens
