"""Sample results survive the futures table: every output, as stored and read back, and text stored before
an output existed reads as a result without it."""

from __future__ import annotations

import json

import numpy as np

from loraplex.runtime.control.store.results import decode_result, encode_result
from loraplex.runtime.core.sampling import SampledSequence, SampleResult


def test_every_sample_output_reads_back_exactly_as_stored() -> None:
    result = SampleResult(
        sequences=[
            SampledSequence(
                np.array([4, 5], np.int32),
                np.array([-0.5, -0.25], np.float32),
                "length",
                np.array([[4, 2], [5, -1]], np.int32),
                np.array([[-0.5, -1.5], [-0.25, np.nan]], np.float32),
            ),
            SampledSequence(np.array([9], np.int32), np.array([-1.0], np.float32), "stop"),
        ],
        prompt_logprobs=np.array([np.nan, -1.0, -2.0], np.float32),
        target_prompt_logprobs=np.array([[-2.0, np.nan], [np.nan, -0.75]], np.float32),
        target_prompt_is_sparse=True,
        prompt_alt_ids=np.array([[3, 3], [9, 1]], np.int32),
        prompt_alt_logprobs=np.array([[-0.5, -0.5], [-1.25, -2.5]], np.float32),
    )
    decoded = decode_result(encode_result(result))
    assert isinstance(decoded, SampleResult)
    first, second = decoded.sequences
    np.testing.assert_array_equal(first.topk_ids, result.sequences[0].topk_ids)
    np.testing.assert_array_equal(first.topk_logprobs, result.sequences[0].topk_logprobs)
    assert (second.topk_ids, second.topk_logprobs) == (None, None)
    np.testing.assert_array_equal(decoded.target_prompt_logprobs, result.target_prompt_logprobs)
    assert decoded.target_prompt_is_sparse
    np.testing.assert_array_equal(decoded.prompt_alt_ids, result.prompt_alt_ids)
    np.testing.assert_array_equal(decoded.prompt_alt_logprobs, result.prompt_alt_logprobs)
    assert decoded.prompt_alt_ids.dtype == np.int32


def test_a_result_stored_before_the_new_outputs_reads_without_them() -> None:
    plain = SampleResult([SampledSequence(np.array([1]), np.array([-1.0]), "stop")])
    stored = json.loads(encode_result(plain))
    body = stored["sample_result"]
    for name in (
        "target_prompt_logprobs",
        "target_prompt_is_sparse",
        "prompt_alt_ids",
        "prompt_alt_logprobs",
    ):
        del body[name]
    for name in ("topk_ids", "topk_logprobs"):
        del body["sequences"][0][name]
    decoded = decode_result(json.dumps(stored))
    assert isinstance(decoded, SampleResult) and decoded.sequences[0].tokens.tolist() == [1]
    assert decoded.target_prompt_logprobs is None and not decoded.target_prompt_is_sparse
    assert decoded.prompt_alt_ids is None and decoded.sequences[0].topk_ids is None
