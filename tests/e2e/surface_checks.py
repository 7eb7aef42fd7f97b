"""The checks of tests/e2e/test_sdk_surface.py, one per method of the SDK's clients: each calls its method
once, as `Call` says (the method itself or its `_async` twin), on the objects of a `World`, and checks a
value that comes from elsewhere (another call, the files on disk). A not-supported method's check only
calls it: the test matches the error to docs/SDK_SURFACE.md.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.lib.queue_state_logger import QueueState

from tests.e2e.conftest import Server
from tests.e2e.sdk import PHRASE, logprobs, sft_datum
from tests.e2e.sdk import client as sdk_client

KEY = "tml-local"
PROMPT = types.ModelInput.from_ints(PHRASE)
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@dataclass
class World:
    """A session with a run trained one step, its checkpoints, a sampler, and clients of every kind."""

    server: Server
    service: tinker.ServiceClient  # display_name "sdk surface", user_metadata {"suite": "sdk"}
    model: str
    run: tinker.TrainingClient
    state_path: str  # the run's weights after its step
    state_logprobs: np.ndarray  # PHRASE's logprobs with those weights
    sampler_path: str  # the same weights, for sampling
    sampler: tinker.SamplingClient
    export_path: str  # the same weights, exported
    rest: tinker.RestClient
    admin: tinker.AdminClient

    @property
    def session_id(self) -> str:
        return self.run.model_id.split(":")[0]

    def new_run(self) -> tinker.TrainingClient:
        return self.service.create_lora_training_client(self.model, rank=8, seed=4).result()

    def checkpoint(self, name: str) -> str:
        """A new training checkpoint of the run."""
        return self.run.save_state(name).result().path

    def listed(self, path: str) -> types.Checkpoint | None:
        """The checkpoint as its run's list shows it (None: not listed)."""
        run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id
        found = [c for c in self.rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path]
        return found[0] if found else None

    def checkpoints_on_disk(self) -> tuple[int, int]:
        """How many checkpoint directories the data dir holds, and the bytes of their files."""
        root = self.server.data_dir / "checkpoints"
        directories = [d for d in root.glob("*/*/*") if d.is_dir() and not d.name.startswith(".")]
        return len(directories), sum(
            f.stat().st_size for d in directories for f in d.rglob("*") if f.is_file()
        )


@dataclass(frozen=True)
class Call:
    """Calls a method as a row's variant: the method (resolving the future it returns), or its `_async`."""

    is_async: bool

    @property
    def tag(self) -> str:
        """Keeps apart the names of what the two variants make."""
        return "async" if self.is_async else "sync"

    def __call__(self, obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated and experimental methods say so
            if self.is_async:
                value = asyncio.run(getattr(obj, f"{name}_async")(*args, **kwargs))
            else:
                value = getattr(obj, name)(*args, **kwargs)
            # Some `_async` twins, like every plain method that submits work, give a future.
            return value.result() if isinstance(value, tinker.APIFuture) else value


Check = Callable[[World, Call], None]


def handle_fields(handle: str) -> dict[str, Any]:
    """What a sampler handle carries (base64 JSON): its session and sampler ids among them."""
    return json.loads(base64.urlsafe_b64decode(handle))


def neg_ll(logprobs: Any, weights: Any) -> Any:
    """A custom loss for create_custom_loss (per datum, traced): the weighted negative log-likelihood, which
    cross_entropy also computes."""
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def neg_ll_of_batch(data: list[types.Datum], logprobs: list[Any]) -> Any:
    """The same loss as a plain function over the batch (forward_backward_custom's other form)."""
    loss = sum(
        -(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True)
    )
    return loss, {"custom/neg_ll:sum": loss.item()}


def _samples(sampler: tinker.SamplingClient, w: World) -> None:
    out = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=3, seed=1, stop=[])).result()
    assert sampler.get_base_model() == w.model
    assert [(len(s.tokens), s.stop_reason) for s in out.sequences] == [(3, "length")] * 2


def _has_the_saved_weights(w: World, run: tinker.TrainingClient) -> None:
    np.testing.assert_allclose(logprobs(run), w.state_logprobs, atol=1e-5)


# --- ServiceClient
def close(w: World, call: Call) -> None:
    service = tinker.ServiceClient(**_reach(w))
    session_id = service.create_lora_training_client(w.model, rank=4).result().model_id.split(":")[0]
    call(service, "close", "errored")
    finished = types.SessionSearchRequest(session_id=session_id, statuses=[{"type": "client_finished"}])
    (summary,) = Call(is_async=False)(w.rest, "search_sessions", finished).sessions
    assert summary.status.reason.type == "errored"  # type: ignore[union-attr]


def create_custom_loss(w: World, call: Call) -> None:
    handle = call(w.service, "create_custom_loss", neg_ll, {"logprobs": 1, "weights": 1})
    run = w.new_run()
    out = run.forward_backward_custom([sft_datum()], handle).result()
    assert handle.name == "neg_ll"
    assert out.metrics["custom/neg_ll:sum"] == pytest.approx(-logprobs(run).sum(), rel=1e-4)


def create_lora_training_client(w: World, call: Call) -> None:
    run = call(w.service, "create_lora_training_client", w.model, rank=4, seed=1)
    assert run.model_id.startswith(f"{w.session_id}:train:") and run.get_info().lora_rank == 4


def create_rest_client(w: World, call: Call) -> None:
    rest = call(w.service, "create_rest_client")
    assert w.session_id in rest.list_sessions().result().sessions


def service_create_sampling_client(w: World, call: Call) -> None:
    _samples(call(w.service, "create_sampling_client", w.sampler_path), w)


def _creates_from_state(name: str) -> Check:
    def check(w: World, call: Call) -> None:
        _has_the_saved_weights(w, call(w.service, name, w.state_path))

    return check


def service_console_url(w: World, call: Call) -> None:
    assert call(w.service, "get_console_url").startswith("https://tinker.thinkingmachines.ai/sessions")


def _capabilities(client: Callable[[World], Any]) -> Check:
    def check(w: World, call: Call) -> None:
        models = call(client(w), "get_server_capabilities").supported_models
        assert [m.model_name for m in models] == [w.model]

    return check


def _no_telemetry(client: Callable[[World], Any]) -> Check:
    def check(w: World, call: Call) -> None:
        assert call(client(w), "get_telemetry") is None  # the tests turn it off (TINKER_TELEMETRY=0)

    return check


# --- TrainingClient
def training_create_sampling_client(w: World, call: Call) -> None:
    _samples(call(w.run, "create_sampling_client", w.sampler_path), w)


def forward(w: World, call: Call) -> None:
    out = call(w.run, "forward", [sft_datum()], "cross_entropy")
    lps = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert out.metrics["loss:sum"] == pytest.approx(-lps.sum(), rel=1e-5) and len(lps) == len(PHRASE) - 1


def forward_backward(w: World, call: Call) -> None:
    run = w.new_run()
    out = call(run, "forward_backward", [sft_datum()], "cross_entropy")
    assert out.metrics["loss:sum"] == pytest.approx(-logprobs(run).sum(), rel=1e-5)


def forward_backward_custom(w: World, call: Call) -> None:
    run = w.new_run()
    out = call(run, "forward_backward_custom", [sft_datum()], neg_ll_of_batch)
    assert out.metrics["custom/neg_ll:sum"] == pytest.approx(-logprobs(run).sum(), rel=1e-4)


def training_console_url(w: World, call: Call) -> None:
    url = call(w.run, "get_console_url")
    assert url == f"https://tinker.thinkingmachines.ai/training_runs/{w.run.model_id}"


def get_info(w: World, call: Call) -> None:
    info = call(w.run, "get_info")
    assert (info.model_id, info.model_data.model_name, info.lora_rank) == (w.run.model_id, w.model, 8)


def training_get_tokenizer(w: World, call: Call) -> None:
    tokenizer = call(w.run, "get_tokenizer")
    assert tokenizer.decode(tokenizer.encode("hello loraplex")).endswith("hello loraplex")


def _loads(name: str) -> Check:
    def check(w: World, call: Call) -> None:
        run = w.new_run()
        assert call(run, name, w.state_path).path == w.state_path
        _has_the_saved_weights(w, run)

    return check


def optim_step(w: World, call: Call) -> None:
    run = w.new_run()
    before = logprobs(run).sum()
    run.forward_backward([sft_datum()], "cross_entropy").result()
    out = call(run, "optim_step", types.AdamParams(learning_rate=1e-2))
    assert out.metrics["learning_rate"] == pytest.approx(1e-2) and logprobs(run).sum() > before


def _saves(name: str, kind: str) -> Check:
    def check(w: World, call: Call) -> None:
        path = call(w.run, name, f"{name}-{call.tag}").path
        assert path == f"tinker://{w.run.model_id}/{kind}/{name}-{call.tag}"
        assert w.listed(path).size_bytes > 0  # type: ignore[union-attr]

    return check


def save_weights_and_get_sampling_client(w: World, call: Call) -> None:
    _samples(call(w.run, "save_weights_and_get_sampling_client"), w)


# --- SamplingClient
def compute_logprobs(w: World, call: Call) -> None:
    values = call(w.sampler, "compute_logprobs", PROMPT)
    assert values[0] is None
    np.testing.assert_allclose(values[1:], w.state_logprobs, atol=1e-3)


def sampling_create(w: World, call: Call) -> None:
    _samples(call(tinker.SamplingClient, "create", w.service.holder, model_path=w.sampler_path), w)


def from_sampler_handle(w: World, call: Call) -> None:
    handle = w.sampler.get_sampler_handle()
    _samples(call(tinker.SamplingClient, "from_sampler_handle", handle, api_key=KEY), w)


def get_base_model(w: World, call: Call) -> None:
    assert call(w.sampler, "get_base_model") == w.model


def get_sampler_handle(w: World, call: Call) -> None:
    assert handle_fields(call(w.sampler, "get_sampler_handle"))["session_id"] == w.session_id


def sampling_get_tokenizer(w: World, call: Call) -> None:
    """In a process of its own, whose Hugging Face cache is the server's: found there, offline."""
    code = (
        "import sys, tinker\n"
        "client = tinker.SamplingClient.from_sampler_handle(sys.argv[1], api_key='tml-local')\n"
        "tokenizer = client.get_tokenizer()\n"
        "print(tokenizer.decode(tokenizer.encode('hello loraplex')))"
    )
    env = {**w.server.env, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    handle = w.sampler.get_sampler_handle()
    done = subprocess.run([sys.executable, "-c", code, handle], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("hello loraplex")


def on_queue_state_change(w: World, call: Call) -> None:
    assert call(w.sampler, "on_queue_state_change", QueueState.ACTIVE, None) is None


def sample(w: World, call: Call) -> None:
    out = call(w.sampler, "sample", PROMPT, 2, types.SamplingParams(max_tokens=2, seed=1, stop=[]))
    assert [(len(s.tokens), s.stop_reason) for s in out.sequences] == [(2, "length")] * 2


# --- RestClient and AdminClient
def _deletes(name: str, arguments: Callable[[str], tuple[str, ...]]) -> Check:
    def check(w: World, call: Call) -> None:
        path = w.checkpoint(f"doomed-{name}-{call.tag}")
        call(w.rest, name, *arguments(path))
        assert w.listed(path) is None

    return check


def export_session_trace(w: World, call: Call) -> None:
    answer = httpx.get(call(w.rest, "export_session_trace", w.session_id))  # no API key: the URL is one
    events = answer.json()["traceEvents"]
    session = w.rest.get_session(w.session_id).result()
    processes = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert processes == session.training_run_ids + session.sampler_ids
    first_run = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert first_run[:3] == ["CreateModel", "ForwardBackward", "OptimStep"]


def _storage_usage(client: Callable[[World], Any]) -> Check:
    def check(w: World, call: Call) -> None:
        (row,) = call(client(w), "get_current_checkpoint_storage_usage").data
        assert (row.checkpoint_count, row.size_bytes) == w.checkpoints_on_disk()
        assert row.user_name == "local" and row.estimated_monthly_cost_usd is None

    return check


def get_external_weights_urls(w: World, call: Call) -> None:
    urls = call(w.rest, "get_external_weights_urls", w.export_path).urls
    assert sorted(urls) == ADAPTER_FILES
    assert httpx.get(urls["adapter_config.json"]).json()["r"] == 8


def get_sampler(w: World, call: Call) -> None:
    answer = call(w.rest, "get_sampler", handle_fields(w.sampler.get_sampler_handle())["sampling_session_id"])
    assert (answer.base_model, answer.model_path) == (w.model, w.sampler_path)


def get_session(w: World, call: Call) -> None:
    session = call(w.rest, "get_session", w.session_id)
    assert w.run.model_id in session.training_run_ids and session.user_metadata == {"suite": "sdk"}


def get_training_run(w: World, call: Call) -> None:
    run = call(w.rest, "get_training_run", w.run.model_id)
    assert (run.training_run_id, run.base_model, run.lora_rank) == (w.run.model_id, w.model, 8)


def get_training_run_by_tinker_path(w: World, call: Call) -> None:
    assert call(w.rest, "get_training_run_by_tinker_path", w.state_path).training_run_id == w.run.model_id


def get_weights_info_by_tinker_path(w: World, call: Call) -> None:
    info = call(w.rest, "get_weights_info_by_tinker_path", w.state_path)
    assert (info.base_model, info.lora_rank) == (w.model, 8)


def list_checkpoints(w: World, call: Call) -> None:
    listed = call(w.rest, "list_checkpoints", w.run.model_id).checkpoints
    assert {w.state_path, w.sampler_path, w.export_path} <= {c.tinker_path for c in listed}


def list_sessions(w: World, call: Call) -> None:
    assert w.session_id in call(w.rest, "list_sessions", limit=1000).sessions


def list_training_runs(w: World, call: Call) -> None:
    runs = call(w.rest, "list_training_runs", limit=1000).training_runs
    assert w.run.model_id in [r.training_run_id for r in runs]


def list_user_checkpoints(w: World, call: Call) -> None:
    listed = call(w.rest, "list_user_checkpoints", limit=1000).checkpoints
    assert (len(listed), sum(c.size_bytes for c in listed)) == w.checkpoints_on_disk()


def _sets_public(name: str, public: bool) -> Check:
    def check(w: World, call: Call) -> None:
        path = w.checkpoint(f"{name}-{call.tag}")
        w.rest.publish_checkpoint_from_tinker_path(path).result()
        call(w.rest, name, path)
        assert w.listed(path).public is public  # type: ignore[union-attr]

    return check


def search_sessions(w: World, call: Call) -> None:
    found = call(w.rest, "search_sessions", types.SessionSearchRequest(display_name="SURFACE sdk"))
    (summary,) = found.sessions
    session = w.rest.get_session(w.session_id).result()
    held = [c for run in session.training_run_ids for c in w.rest.list_checkpoints(run).result().checkpoints]
    assert (summary.session_id, summary.display_name, summary.status.type) == (  # type: ignore[union-attr]
        w.session_id,
        "sdk surface",
        "active",
    )
    assert (summary.checkpoints_count, summary.checkpoint_storage_bytes) == (
        len(held),
        sum(c.size_bytes for c in held),
    )
    assert found.next_cursor is None


def set_checkpoint_ttl_from_tinker_path(w: World, call: Call) -> None:
    path = w.checkpoint(f"ttl-{call.tag}")
    call(w.rest, "set_checkpoint_ttl_from_tinker_path", path, 7200)
    checkpoint = w.listed(path)
    assert checkpoint is not None and checkpoint.expires_at is not None
    assert 7100 < (checkpoint.expires_at - checkpoint.time).total_seconds() < 7300


def _reach(w: World) -> dict[str, str]:
    """How a new client reaches the world's server."""
    return {"base_url": w.server.base_url, "api_key": KEY}


_BILLING_WINDOW = ("2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z")

# A not-supported method's check (a lambda here) only calls it.
CLIENT_CHECKS: dict[str, Check] = {
    "ServiceClient.close": close,
    "ServiceClient.copy_weights": lambda w, call: call(
        sdk_client(w.server, KEY, project_id="archive"), "copy_weights", w.state_path
    ),
    "ServiceClient.create_custom_loss": create_custom_loss,
    "ServiceClient.create_lora_training_client": create_lora_training_client,
    "ServiceClient.create_rest_client": create_rest_client,
    "ServiceClient.create_sampling_client": service_create_sampling_client,
    "ServiceClient.create_training_client_from_state": _creates_from_state(
        "create_training_client_from_state"
    ),
    "ServiceClient.create_training_client_from_state_with_optimizer": _creates_from_state(
        "create_training_client_from_state_with_optimizer"
    ),
    "ServiceClient.get_console_url": service_console_url,
    "ServiceClient.get_server_capabilities": _capabilities(lambda w: w.service),
    "ServiceClient.get_telemetry": _no_telemetry(lambda w: w.service),
    "TrainingClient.create_sampling_client": training_create_sampling_client,
    "TrainingClient.forward": forward,
    "TrainingClient.forward_backward": forward_backward,
    "TrainingClient.forward_backward_custom": forward_backward_custom,
    "TrainingClient.get_console_url": training_console_url,
    "TrainingClient.get_info": get_info,
    "TrainingClient.get_telemetry": _no_telemetry(lambda w: w.run),
    "TrainingClient.get_tokenizer": training_get_tokenizer,
    "TrainingClient.load_state": _loads("load_state"),
    "TrainingClient.load_state_with_optimizer": _loads("load_state_with_optimizer"),
    "TrainingClient.optim_step": optim_step,
    "TrainingClient.save_state": _saves("save_state", "weights"),
    "TrainingClient.save_weights_and_get_sampling_client": save_weights_and_get_sampling_client,
    "TrainingClient.save_weights_external": _saves("save_weights_external", "external_weights"),
    "TrainingClient.save_weights_for_sampler": _saves("save_weights_for_sampler", "sampler_weights"),
    "SamplingClient.compute_logprobs": compute_logprobs,
    "SamplingClient.create": sampling_create,
    "SamplingClient.from_sampler_handle": from_sampler_handle,
    "SamplingClient.get_base_model": get_base_model,
    "SamplingClient.get_sampler_handle": get_sampler_handle,
    "SamplingClient.get_telemetry": _no_telemetry(lambda w: w.sampler),
    "SamplingClient.get_tokenizer": sampling_get_tokenizer,
    "SamplingClient.on_queue_state_change": on_queue_state_change,
    "SamplingClient.sample": sample,
    "RestClient.assign_session_project": lambda w, call: call(
        w.rest, "assign_session_project", w.session_id, "archive"
    ),
    "RestClient.copy_weights": lambda w, call: call(w.rest, "copy_weights", w.state_path, "archive"),
    "RestClient.delete_checkpoint": _deletes(
        "delete_checkpoint", lambda path: tuple(path.removeprefix("tinker://").split("/", 1))
    ),
    "RestClient.delete_checkpoint_from_tinker_path": _deletes(
        "delete_checkpoint_from_tinker_path", lambda p: (p,)
    ),
    "RestClient.export_session_trace": export_session_trace,
    "RestClient.get_audit_log": lambda w, call: call(w.rest, "get_audit_log"),
    "RestClient.get_billing_usage": lambda w, call: call(w.rest, "get_billing_usage", *_BILLING_WINDOW),
    "RestClient.get_current_checkpoint_storage_usage": _storage_usage(lambda w: w.rest),
    "RestClient.get_external_weights_urls": get_external_weights_urls,
    "RestClient.get_sampler": get_sampler,
    "RestClient.get_server_capabilities": _capabilities(lambda w: w.rest),
    "RestClient.get_session": get_session,
    "RestClient.get_telemetry": _no_telemetry(lambda w: w.rest),
    "RestClient.get_training_run": get_training_run,
    "RestClient.get_training_run_by_tinker_path": get_training_run_by_tinker_path,
    "RestClient.get_weights_info_by_tinker_path": get_weights_info_by_tinker_path,
    "RestClient.list_checkpoints": list_checkpoints,
    "RestClient.list_sessions": list_sessions,
    "RestClient.list_training_runs": list_training_runs,
    "RestClient.list_user_checkpoints": list_user_checkpoints,
    "RestClient.publish_checkpoint_from_tinker_path": _sets_public(
        "publish_checkpoint_from_tinker_path", True
    ),
    "RestClient.search_sessions": search_sessions,
    "RestClient.set_checkpoint_ttl_from_tinker_path": set_checkpoint_ttl_from_tinker_path,
    "RestClient.unpublish_checkpoint_from_tinker_path": _sets_public(
        "unpublish_checkpoint_from_tinker_path", False
    ),
    "RestClient.whoami": lambda w, call: call(w.rest, "whoami"),
    "AdminClient.get_audit_log": lambda w, call: call(w.admin, "get_audit_log"),
    "AdminClient.get_billing_usage": lambda w, call: call(w.admin, "get_billing_usage", *_BILLING_WINDOW),
    "AdminClient.get_current_checkpoint_storage_usage": _storage_usage(lambda w: w.admin),
    "AdminClient.get_telemetry": _no_telemetry(lambda w: w.admin),
}
