"""InferenceService over the fake engine: model names, aliases, samplers, and results equal to
Runtime.sample's for the same request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from loraplex.errors import UserError
from loraplex.model.tiny import ensure_tiny_model
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.aliases import AliasTable
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import SaveSnapshot
from loraplex.runtime.core.sampling import SampleRequest, SamplingParams
from loraplex.runtime.serving.inference import Generation, InferenceService, ModelNotFoundError
from loraplex.runtime.serving.text_codec import TextCodec
from tests.runtime.conftest import create_run, result_of

PROMPT = [3, 17, 9, 41]  # ids the fake engine's 64-token vocabulary has
PARAMS = SamplingParams(max_tokens=5, temperature=1.0, seed=4)


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    loaded = TextCodec.load(str(ensure_tiny_model(tmp_path_factory.mktemp("data"))))
    assert loaded is not None
    return loaded


@pytest.fixture
def service(service_factory) -> Runtime:
    return service_factory()


@pytest.fixture
def inference(service: Runtime, codec: TextCodec, tmp_path: Path) -> InferenceService:
    return InferenceService(
        service.info,
        service.samplers,
        service.futures,
        service.sessions,
        service.catalog,
        AliasTable(service.store),
        codec,
    )


def _snapshot(service: Runtime, tenant: str = "local", name: str = "snap") -> str:
    run = create_run(service, tenant)
    return result_of(service, service.training.submit(tenant, run, 1, SaveSnapshot(name)), tenant).result[
        "path"
    ]


def _complete(inference: InferenceService, model: str, tenant: str = "local", **fields) -> list:
    generation = Generation(model=model, prompts=[PROMPT], params=PARAMS, **fields)
    return asyncio.run(inference.complete(tenant, generation))


def test_a_completion_returns_what_training_service_sample_returns_for_the_same_request(
    service: Runtime, inference: InferenceService
) -> None:
    (completion,) = _complete(inference, "fake/bigram", n=2)
    session = service.sessions.create("local", {})
    sampler = service.samplers.create_sampler("local", session, 0, None, "fake/bigram")
    request = SampleRequest(np.array(PROMPT), PARAMS, num_samples=2)
    expected = result_of(service, service.samplers.sample("local", sampler, 0, request)).result.sequences
    assert [[t.token_id for t in c.tokens] for c in completion.choices] == [
        s.tokens.tolist() for s in expected
    ]
    assert [[t.logprob for t in c.tokens] for c in completion.choices] == [
        s.logprobs.tolist() for s in expected
    ]


def test_max_tokens_0_scores_the_prompt_and_samples_nothing(inference: InferenceService) -> None:
    (completion,) = _complete(inference, "fake/bigram", is_sampled=False, echo=True, scores_prompt=True)
    assert [(c.text, c.tokens, c.finish_reason) for c in completion.choices] == [("", (), "length")]
    assert completion.num_prompt_tokens == len(completion.prompt) == len(PROMPT)
    assert completion.prompt[0].logprob is None and all(t.logprob < 0 for t in completion.prompt[1:])


def test_model_names_resolve_to_the_base_model_own_checkpoints_and_own_aliases(
    service: Runtime, inference: InferenceService
) -> None:
    path = _snapshot(service)
    asyncio.run(inference.set_alias("local", "mine", path))
    assert [asyncio.run(inference.resolve("local", name)) for name in ("fake/bigram", path, "mine")] == [
        None,
        path,
        path,
    ]
    for tenant, name in [("local", "gpt-4o"), ("local", "tinker://bad"), ("other", path), ("other", "mine")]:
        with pytest.raises(ModelNotFoundError, match="does not exist or you do not have access"):
            asyncio.run(inference.resolve(tenant, name))


def test_an_alias_must_name_a_checkpoint_the_tenant_owns(
    service: Runtime, inference: InferenceService
) -> None:
    path = _snapshot(service, "other")
    with pytest.raises(ModelNotFoundError):
        asyncio.run(inference.set_alias("local", "theirs", path))
    with pytest.raises(UserError, match="tinker:// checkpoint path"):
        asyncio.run(inference.set_alias("local", "base", "fake/bigram"))
    with pytest.raises(UserError, match="base model's name"):
        asyncio.run(inference.set_alias("local", "fake/bigram", path))
    assert inference.aliases.of("local") == {}


def test_a_sampler_that_retention_removed_is_made_again_on_the_next_request(
    service: Runtime, inference: InferenceService
) -> None:
    path = _snapshot(service)
    first = _complete(inference, path)
    (sampler,) = inference._samplers.values()
    row = service.store.get_sampler(sampler)
    assert row is not None and service.store.delete_unused_sampler(sampler, row.last_used_at)
    assert _complete(inference, path)[0].choices == first[0].choices  # seeded: the same sample again
    assert list(inference._samplers.values()) != [sampler]


def test_a_deleted_checkpoint_is_an_unknown_model(service: Runtime, inference: InferenceService) -> None:
    path = _snapshot(service)
    _complete(inference, path)
    service.catalog.delete_checkpoint("local", CheckpointPath.parse(path))
    with pytest.raises(ModelNotFoundError):
        _complete(inference, path)


def test_models_are_the_base_model_the_tenants_sampler_checkpoints_and_its_aliases(
    service: Runtime, inference: InferenceService
) -> None:
    path = _snapshot(service)
    _snapshot(service, "other", "theirs")
    asyncio.run(inference.set_alias("local", "mine", path))
    cards = [(c.model_id, c.owned_by, c.root, c.parent) for c in asyncio.run(inference.models("local"))]
    assert cards == [
        ("fake/bigram", "loraplex", "fake/bigram", None),
        (path, "local", path, "fake/bigram"),
        ("mine", "local", path, "fake/bigram"),
    ]


def test_another_tenants_published_sampler_checkpoint_is_listed_and_served_until_unpublished(
    service: Runtime, inference: InferenceService
) -> None:
    theirs = _snapshot(service, "other", "shared")
    with pytest.raises(ModelNotFoundError):
        _complete(inference, theirs)
    service.catalog.set_public("other", CheckpointPath.parse(theirs), True)
    cards = [(c.model_id, c.owned_by) for c in asyncio.run(inference.models("local"))]
    assert (theirs, "published") in cards
    assert _complete(inference, theirs) == _complete(inference, theirs, tenant="other")
    service.catalog.set_public("other", CheckpointPath.parse(theirs), False)
    assert theirs not in [c.model_id for c in asyncio.run(inference.models("local"))]
    with pytest.raises(ModelNotFoundError):
        _complete(inference, theirs)
