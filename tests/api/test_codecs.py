"""Codecs against the SDK's own encoder and decoder: what the client sends decodes, what we send it reads."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types._pydantic_types.tensor_data import TensorData as TensorDataModel

from loraplex.api.tinker.codecs import (
    encode_forward_backward_output,
    encode_sample_response,
    forward_backward_command,
    parse_forward_backward,
    sample_response_json,
)
from loraplex.errors import UserError
from loraplex.runtime.core.commands import ForwardBackward, PassResult
from loraplex.runtime.core.sampling import SampledSequence, SampleResult


def decode_forward_backward(body: bytes) -> tuple[str, int, ForwardBackward]:
    """What the forward_backward route reads from a body: its run, its seq_id, then its command."""
    msg = parse_forward_backward(body)
    return msg.model_id, msg.seq_id, forward_backward_command(msg)


def _sdk_bytes(datum: types.Datum, loss_fn: str = "ppo", config: dict | None = None) -> bytes:
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn, loss_fn_config=config)
    request = types.ForwardBackwardRequest(model_id="s:train:0", seq_id=4, forward_backward_input=fb_input)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_an_sdk_request_decodes_to_the_same_tokens_inputs_and_config() -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={
            "target_tokens": np.array([6, 7, 8]),
            "advantages": np.array([0.5, -1.0, 2.0], np.float32),
        },
    )
    model_id, seq_id, command = decode_forward_backward(_sdk_bytes(datum, config={"clip_low_threshold": 0.7}))
    assert (model_id, seq_id, command.loss_fn, command.loss_fn_config) == (
        "s:train:0",
        4,
        "ppo",
        {"clip_low_threshold": 0.7},
    )
    np.testing.assert_array_equal(command.datums[0].tokens, [5, 6, 7])
    np.testing.assert_array_equal(command.datums[0].loss_fn_inputs["target_tokens"], [6, 7, 8])
    assert command.datums[0].loss_fn_inputs["advantages"].dtype == np.float32


def test_sparse_2d_weights_are_densified_with_zeros() -> None:
    weights = types.TensorData(
        data=[0.5, 2.0],
        dtype="float32",
        shape=[3, 2],
        sparse_crow_indices=[0, 1, 1, 2],
        sparse_col_indices=[1, 0],
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.zeros((3, 2), np.int64), "weights": weights},
    )
    dense = decode_forward_backward(_sdk_bytes(datum, "cross_entropy"))[2].datums[0].loss_fn_inputs["weights"]
    np.testing.assert_array_equal(dense, [[0.0, 0.5], [0.0, 0.0], [2.0, 0.0]])


def test_a_body_that_is_not_protobuf_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"not a tinker_public\.ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff\xff")


def test_outputs_of_mixed_shapes_reach_the_sdk_in_datum_order() -> None:
    result = PassResult(
        outputs=[
            {"logprobs": np.array([-1.0, -2.0], np.float32)},
            {"logprobs": np.array([[-1.0, -3.0], [-4.0, -5.0]], np.float32)},
            {"logprobs": np.array([-6.0], np.float64)},
        ],
        metrics={"loss:sum": 3.5},
    )
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(result))
    assert decoded.metrics == {"loss:sum": 3.5}
    shapes = [out["logprobs"].shape for out in decoded.loss_fn_outputs]
    assert shapes == [[2], [2, 2], [1]]
    assert decoded.loss_fn_outputs[1]["logprobs"].data == [-1.0, -3.0, -4.0, -5.0]


def test_a_sample_result_reaches_the_sdk_with_int32_tokens_float32_logprobs_and_unscored_positions_none() -> (
    None
):
    nan = np.nan
    result = SampleResult(
        sequences=[
            SampledSequence(np.array([7, 300], np.int32), np.array([-0.5, -1.25], np.float32), "length"),
            SampledSequence(np.array([9], np.int32), np.array([-2.0], np.float32), "stop"),
        ],
        prompt_logprobs=np.array([nan, -3.0, -4.5], np.float32),
        topk_prompt_ids=np.array([[-1, -1], [4, 2], [5, -1]], np.int32),
        topk_prompt_logprobs=np.array([[nan, nan], [-0.1, -2.0], [-0.7, nan]], np.float32),
    )
    decoded = deserialize_sample_response(encode_sample_response(result))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in decoded.sequences] == [
        ([7, 300], [-0.5, -1.25], "length"),
        ([9], [-2.0], "stop"),
    ]
    assert decoded.prompt_logprobs == [None, -3.0, -4.5]
    topk = [None, [(4, pytest.approx(-0.1)), (2, -2.0)], [(5, pytest.approx(-0.7))]]
    assert decoded.topk_prompt_logprobs == topk


def test_a_sample_result_without_prompt_scores_has_none_of_them_on_the_wire() -> None:
    result = SampleResult([SampledSequence(np.array([1], np.int32), np.array([-1.0], np.float32), "stop")])
    decoded = deserialize_sample_response(encode_sample_response(result))
    assert (decoded.prompt_logprobs, decoded.topk_prompt_logprobs) == (None, None)
    assert (decoded.target_prompt_logprobs, decoded.prompt_alt_tokens) == (None, None)
    assert decoded.sequences[0].topk_logprobs is None


NAN = np.nan
# Two sampled tokens with their top-3 (the second position kept only one id), prompt positions 1 and 2
# with two named ids each (-1: none) and two draws each.
OUTPUTS = SampleResult(
    sequences=[
        SampledSequence(
            np.array([4, 5], np.int32),
            np.array([-0.5, -0.25], np.float32),
            "length",
            topk_ids=np.array([[4, 2, 7], [5, -1, -1]], np.int32),
            topk_logprobs=np.array([[-0.5, -1.5, -3.0], [-0.25, NAN, NAN]], np.float32),
        )
    ],
    target_prompt_logprobs=np.array([[-2.0, NAN], [NAN, -0.75]], np.float32),
    prompt_alt_ids=np.array([[3, 3], [9, 1]], np.int32),
    prompt_alt_logprobs=np.array([[-0.5, -0.5], [-1.25, -2.5]], np.float32),
)


def test_sampled_top_k_named_ids_and_prompt_draws_reach_the_sdk_as_its_types_describe() -> None:
    decoded = deserialize_sample_response(encode_sample_response(OUTPUTS))
    assert decoded.sequences[0].topk_logprobs == [[(4, -0.5), (2, -1.5), (7, -3.0)], [(5, -0.25)]]
    target = decoded.target_prompt_logprobs
    assert (target.dtype, target.shape, target.sparse_crow_indices) == ("float32", [2, 2], None)
    assert target.tolist() == [[-2.0, 0.0], [0.0, -0.75]]  # 0.0 where the request named -1
    alt = decoded.prompt_alt_tokens
    assert (alt.tokens.dtype, alt.tokens.shape, alt.tokens.tolist()) == ("int64", [2, 2], [[3, 3], [9, 1]])
    assert (alt.logprobs.dtype, alt.logprobs.tolist()) == ("float32", [[-0.5, -0.5], [-1.25, -2.5]])


def test_named_ids_sent_sparse_come_back_sparse_listing_the_same_cells() -> None:
    sparse = SampleResult(
        OUTPUTS.sequences, target_prompt_logprobs=OUTPUTS.target_prompt_logprobs, target_prompt_is_sparse=True
    )
    target = deserialize_sample_response(encode_sample_response(sparse)).target_prompt_logprobs
    assert (target.sparse_crow_indices, target.sparse_col_indices) == ([0, 1, 2], [0, 1])
    assert target.data == [-2.0, -0.75]
    assert target.tolist() == [[-2.0, 0.0], [0.0, -0.75]]
    as_json = TensorDataModel.model_validate(sample_response_json(sparse)["target_prompt_logprobs"])
    assert (as_json.shape, as_json.sparse_crow_indices, as_json.sparse_col_indices) == (
        [2, 2],
        [0, 1, 2],
        [0, 1],
    )
    assert as_json.data == [-2.0, -0.75]


def test_the_json_form_carries_the_same_outputs() -> None:
    as_json = sample_response_json(OUTPUTS)
    assert as_json["sequences"][0]["topk_logprobs"] == [[[4, -0.5], [2, -1.5], [7, -3.0]], [[5, -0.25]]]
    target = TensorDataModel.model_validate(as_json["target_prompt_logprobs"])
    assert (target.dtype, target.shape, target.data) == ("float32", [2, 2], [-2.0, 0.0, 0.0, -0.75])
    tokens = TensorDataModel.model_validate(as_json["prompt_alt_tokens"]["tokens"])
    assert (tokens.dtype, tokens.shape, tokens.data) == ("int64", [2, 2], [3, 3, 9, 1])
    assert as_json["prompt_alt_tokens"]["logprobs"]["data"] == [-0.5, -0.5, -1.25, -2.5]
