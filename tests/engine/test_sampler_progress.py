"""A streaming request's progress (Engine.take_sample_progress): each step reports exactly the tokens its
samples drew since the last report, with their logprobs, so that the reports joined are the first tokens
of the finished result; the finishing step's tokens come with the result alone; a request that does not
stream is never reported, and streaming changes no sampled token."""

from __future__ import annotations

from dataclasses import replace
from itertools import chain

import numpy as np
import pytest

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import SampleRequest, SampleResult, SamplingParams
from loraplex.errors import UserError

PROMPT = np.array([5, 6, 7, 8], dtype=np.int64)
PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop=())  # nothing stops it early


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 2, 8, None)


def test_each_step_reports_the_tokens_drawn_since_the_last_and_the_result_holds_them_all(
    engine: LocalEngine,
) -> None:
    engine.add_sample("quiet", SampleRequest(PROMPT, PARAMS, num_samples=2))
    engine.add_sample("streamed", SampleRequest(PROMPT, PARAMS, num_samples=2, streams=True))
    reports: list[list[list[int]]] = []
    logprobs: list[list[list[float]]] = []
    results: dict[str, SampleResult] = {}
    while engine.has_sampling_work():
        for key, result in engine.step_sampler():
            assert not isinstance(result, UserError), result
            results[key] = result
        progress = engine.take_sample_progress()
        assert set(progress) <= {"streamed"}  # the quiet request is never reported
        if "streamed" in progress:
            reports.append(progress["streamed"].tokens)
            logprobs.append(progress["streamed"].logprobs)
    assert engine.take_sample_progress() == {}
    # The first step prefills (drawing each sample's first token) and decodes once; every later step draws
    # one more. The step that draws the last token finishes the request, which is then in no report.
    assert [[len(tokens) for tokens in report] for report in reports] == [[2, 2]] + [[1, 1]] * 9
    for sample, sequence in enumerate(results["streamed"].sequences):
        assert (
            list(chain.from_iterable(report[sample] for report in reports)) == sequence.tokens[:-1].tolist()
        )
        assert (
            list(chain.from_iterable(report[sample] for report in logprobs))
            == sequence.logprobs[:-1].tolist()
        )
    # Streaming is only a report: the same seed draws the same tokens either way.
    for streamed, quiet in zip(results["streamed"].sequences, results["quiet"].sequences, strict=True):
        assert streamed.tokens.tolist() == quiet.tokens.tolist()


def test_a_cancelled_streaming_request_is_reported_no_more(engine: LocalEngine) -> None:
    engine.add_sample("gone", SampleRequest(PROMPT, replace(PARAMS, seed=2), streams=True))
    engine.step_sampler()
    assert list(engine.take_sample_progress()) == ["gone"]
    engine.step_sampler()
    assert engine.cancel_sample("gone") is True
    assert engine.take_sample_progress() == {}
    assert not engine.has_sampling_work()
