"""JSON rendered in pieces is byte for byte what Starlette's JSONResponse sends, for any value and for the
lazy forms of large results; and no single json.dumps call runs over a large share of a result."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from starlette.responses import JSONResponse

from loraplex.api.tinker import json_render
from loraplex.api.tinker.codecs import forward_backward_output_json, sample_response_json
from loraplex.api.tinker.json_render import render_json
from loraplex.runtime.core.commands import PassResult
from loraplex.runtime.core.sampling import SampledSequence, SampleResult

VALUES = [
    {},
    [],
    {"a": [1, 2.5, None, True, "é\u2028\"'"], "b": {"c": []}},
    list(range(20_000)),
    [[i, float(i) / 3] for i in range(9000)],
    {"rows": [{"data": list(range(5000)), "name": "x"} for _ in range(4)], "n": 1},
    [1, 2, list(range(10_000)), {"k": list(range(10_000))}],  # the first item is small, a later one not
    (1, (2, 3), [4]),
    {1: "int key", "2": list(range(10_000))},
]


@pytest.mark.parametrize("value", VALUES, ids=[f"value{i}" for i in range(len(VALUES))])
def test_rendering_in_pieces_sends_what_json_response_sends(value: Any) -> None:
    assert render_json(value) == JSONResponse(value).body


def test_nan_is_refused_as_json_response_refuses_it() -> None:
    for value in ([math.nan], {"x": [*range(9000), math.inf]}):
        with pytest.raises(ValueError):
            JSONResponse(value)
        with pytest.raises(ValueError):
            render_json(value)


def _results() -> tuple[PassResult, SampleResult]:
    rng = np.random.default_rng(3)
    logprobs = rng.random(40_000).astype(np.float32)
    logprobs[::7] = np.nan
    passed = PassResult(
        outputs=[
            {"logprobs": logprobs, "elementwise_loss": rng.random(40_000).astype(np.float32)},
            {
                "logprobs": rng.random((300, 4)).astype(np.float32),
                "elementwise_loss": np.zeros(300, np.float32),
            },
        ],
        metrics={"loss:sum": 1.25, "grad_norm": math.inf},
    )
    ids = rng.integers(0, 50, (3000, 8)).astype(np.int32)
    ids[::5, 3:] = -1
    ids[::11] = -1  # positions scored not at all
    topk = rng.random((3000, 8)).astype(np.float32)
    targets = np.where(rng.random((2999, 3)) < 0.5, np.nan, rng.random((2999, 3))).astype(np.float32)
    sequence = SampledSequence(
        np.arange(20_000, dtype=np.int32), rng.random(20_000).astype(np.float32), "stop", ids[:20], topk[:20]
    )
    sampled = SampleResult(
        [sequence, SampledSequence(np.zeros(0, np.int32), np.zeros(0, np.float32), "length")],
        prompt_logprobs=np.where(rng.random(3000) < 0.1, np.nan, rng.random(3000)).astype(np.float32),
        topk_prompt_ids=ids,
        topk_prompt_logprobs=topk,
        target_prompt_logprobs=targets,
        target_prompt_is_sparse=True,
        prompt_alt_ids=ids[1:, :2],
        prompt_alt_logprobs=topk[1:, :2],
    )
    return passed, sampled


def test_the_lazy_forms_of_large_results_render_to_the_bytes_of_their_plain_forms() -> None:
    passed, sampled = _results()
    dense_targets = SampleResult(**{**vars(sampled), "target_prompt_is_sparse": False})
    for to_json, result in (
        (forward_backward_output_json, passed),
        (sample_response_json, sampled),
        (sample_response_json, dense_targets),
    ):
        assert render_json(to_json(result, is_lazy=True)) == JSONResponse(to_json(result)).body


def test_no_json_dumps_call_renders_more_than_a_piece_of_a_large_result(monkeypatch) -> None:
    sizes: list[int] = []
    dumps = json.dumps

    def counted(value: Any, **kwargs: Any) -> str:
        sizes.append(_leaves(value))
        return dumps(value, **kwargs)

    monkeypatch.setattr(json_render.json, "dumps", counted)
    passed, sampled = _results()
    for to_json, result in ((forward_backward_output_json, passed), (sample_response_json, sampled)):
        render_json(to_json(result, is_lazy=True))
    assert sum(sizes) > 100_000 and max(sizes) <= 1 << 14  # codecs.py's pieces of 16Ki values


def _leaves(value: Any) -> int:
    if isinstance(value, dict):
        return sum(_leaves(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_leaves(item) for item in value)
    return 1
