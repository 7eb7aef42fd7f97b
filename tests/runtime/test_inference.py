"""InferenceService over the fake engine: model names, aliases, samplers, and results equal to
Runtime.sample's for the same request."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pyrage
import pytest

from loraplex.errors import UserError
from loraplex.model.tiny import ensure_tiny_model
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.aliases import AliasTable
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import SaveExternal, SaveSnapshot
from loraplex.runtime.core.sampling import SampleRequest, SamplingBackpressureError, SamplingParams
from loraplex.runtime.serving.inference import Generation, InferenceService, ModelNotFoundError
from loraplex.runtime.serving.text_codec import TextCodec
from tests.fakes import FakeEngine
from tests.runtime.conftest import create_run, held, result_of

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


# --- how much one request may queue, and cancelling what nobody waits for
def _held_service(
    service_factory, codec: TextCodec, **config
) -> tuple[Runtime, FakeEngine, InferenceService]:
    """A service whose sampling never finishes (requests stay generating), and its InferenceService."""
    engine = FakeEngine()
    engine.holds_samples = True
    service = service_factory(engine, **config)
    aliases = AliasTable(service.config.data_dir)
    inference = InferenceService(
        service.info, service.samplers, service.futures, service.sessions, service.catalog, aliases, codec
    )
    return service, engine, inference


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _settled_futures(service: Runtime, tenant: str = "local") -> list[tuple[str, str | None]]:
    """(status, error) of the tenant's futures once none is pending (fails the test after 5 s)."""
    deadline = time.monotonic() + 5.0
    while any(row.status == "pending" for row in service.store.recent_futures([tenant], 100)):
        assert time.monotonic() < deadline, "futures still pending"
        time.sleep(0.01)
    return [(row.status, row.error) for row in service.store.recent_futures([tenant], 100)]


def test_more_samples_than_the_queue_holds_are_refused_whole_before_anything_is_queued(
    service_factory, codec: TextCodec
) -> None:
    service, engine, inference = _held_service(service_factory, codec, max_queued_samples=4)
    generation = Generation(model="fake/bigram", prompts=[PROMPT] * 3, params=PARAMS, n=2)
    with pytest.raises(UserError) as refused:
        asyncio.run(inference.complete("local", generation))
    assert str(refused.value) == (
        "n is 2: 3 prompts x 2 = 6 samples, over the 4 this server queues at once (--max-queued-samples); "
        "send fewer prompts or a smaller n"
    )
    scored = Generation(model="fake/bigram", prompts=[PROMPT], params=PARAMS, n=3, top_logprobs=1)
    twice = r"n is 3: 1 prompts x 3 x 2 \(top logprobs score each choice once more\)"
    with pytest.raises(UserError, match=twice):
        asyncio.run(inference.complete("local", scored))
    assert (service.state.samples.queued_samples, engine.sample_queue) == (0, [])
    assert service.store.recent_futures(["local"], 10) == []


def test_a_request_that_does_not_fit_the_queue_now_is_429_with_none_of_its_prompts_queued(
    service_factory, codec: TextCodec
) -> None:
    service, engine, inference = _held_service(service_factory, codec, max_queued_samples=4)
    session = service.sessions.create("local", {})
    sampler = service.samplers.create_sampler("local", session, 0, None, "fake/bigram")
    service.samplers.sample("local", sampler, 0, SampleRequest(np.array(PROMPT), PARAMS, num_samples=3))
    generation = Generation(model="fake/bigram", prompts=[PROMPT, PROMPT], params=PARAMS)
    with pytest.raises(SamplingBackpressureError, match="3 samples are queued"):
        asyncio.run(inference.complete("local", generation))
    assert service.state.samples.queued_samples == 3
    assert len(service.store.recent_futures(["local"], 10)) == len(engine.sample_queue) == 1  # Tinker's


def test_a_cancelled_generation_leaves_the_engine_and_its_futures_fail_as_cancelled(
    service_factory, codec: TextCodec
) -> None:
    service, engine, inference = _held_service(service_factory, codec)
    generation = Generation(model="fake/bigram", prompts=[PROMPT, PROMPT[:2]], params=PARAMS, n=2)

    async def cancel_while_generating() -> None:
        task = asyncio.ensure_future(inference.complete("local", generation))
        await _until(lambda: len(engine.sample_queue) == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: engine.sample_queue == [], timeout_s=1.0)

    asyncio.run(cancel_while_generating())
    assert _settled_futures(service) == [("failed", "cancelled: the client went away")] * 2
    assert service.state.samples.queued_samples == 0


def test_a_prompt_that_fails_cancels_the_rest_of_its_request(service_factory, codec: TextCodec) -> None:
    service, engine, inference = _held_service(service_factory, codec)
    generation = Generation(model="fake/bigram", prompts=[PROMPT, [99]], params=PARAMS)  # 99: no such token

    async def fail_one() -> None:
        with pytest.raises(UserError, match="token ids in"):
            await inference.complete("local", generation)
        await _until(lambda: engine.sample_queue == [], timeout_s=1.0)

    asyncio.run(fail_one())
    assert _settled_futures(service) == [("failed", "cancelled: another part of the same request failed")]
    assert service.state.samples.queued_samples == 0


def test_a_request_cancelled_before_the_engine_loop_takes_it_never_reaches_the_engine(
    service_factory,
) -> None:
    added: list[str] = []

    class Logged(FakeEngine):
        def add_sample(self, key: str, request: SampleRequest) -> None:
            added.append(key)
            super().add_sample(key, request)

    service = service_factory(Logged())
    session = service.sessions.create("local", {})
    sampler = service.samplers.create_sampler("local", session, 0, None, "fake/bigram")
    with held(service):  # the engine loop waits for the lock: the request stays in the queue
        record = service.samplers.sample("local", sampler, 0, SampleRequest(np.array(PROMPT), PARAMS))
        service.samplers.cancel([record.id], "the client went away")
    done = result_of(service, record)
    assert (done.status, done.error, done.category) == ("failed", "cancelled: the client went away", "user")
    assert added == [] and service.state.samples.queued_samples == 0


def test_an_encrypted_export_as_the_model_is_refused_saying_the_server_cannot_read_it(
    service: Runtime, inference: InferenceService
) -> None:
    run = create_run(service)
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    command = SaveExternal("sealed", age_recipients=(recipient,))
    path = result_of(service, service.training.submit("local", run, 1, command)).result["path"]
    with pytest.raises(UserError, match="is encrypted to its age recipients, so this server cannot read"):
        _complete(inference, path)
