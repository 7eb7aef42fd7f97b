"""Fuzzing every route of a server over the real tiny engine: valid request envelopes with mutated fields
(a fixed seed and a bounded budget), and schemathesis over /openapi.json. Malformed input may get any 4xx,
never a 5xx, and no future it creates fails as a server error."""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import schemathesis
import zstandard
from fastapi.testclient import TestClient
from hypothesis import Phase, given, settings, strategies
from schemathesis import GenerationMode
from tinker.proto import tinker_public_pb2 as pb

from loraplex.api.app import create_app
from loraplex.cli import sampling_limits
from loraplex.config import ServerConfig
from loraplex.engine.local import build_local_engine
from loraplex.engine.types import LoraConfig
from loraplex.errors import UserError
from loraplex.runtime.assembly import Runtime
from tests.fakes import FakeEngine

SEED = 1405
BUDGET_S = 30.0
MAX_CASES = 4000
KEY = {"X-API-Key": "tml-local"}
# Small token limits keep every pass a valid mutation may start cheap on a CPU.
LIMITS = {
    "max_tokens_per_datum": 64,
    "max_tokens_per_request": 256,
    "max_target_width": 8,
    "max_json_body_mib": 1,
    "max_sample_kv_mib": 16,
    "max_rank": 8,
}

INTS = [0, 1, -1, 2, 7, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
FLOATS = [0.0, -0.0, 1.5, 1e308, -1e308, math.nan, math.inf, -math.inf, 5e-324]
STRINGS = ["", "x", "\ud800", "\x00", "é" * 300, "x" * 70_000, "../../etc/passwd", "tinker://a/weights/b"]
OTHERS = [None, True, False, [], [1, 2], {}, {"a": None}, [[[[[]]]]]]
SPECIALS = INTS + FLOATS + STRINGS + OTHERS


@dataclass
class Fixtures:
    """A served app and the valid names its envelopes use."""

    http: TestClient
    session: str
    run: str
    sampler: str
    checkpoint: str
    next_seq: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixtures]:
    data_dir = tmp_path_factory.mktemp("fuzz")
    config = ServerConfig(data_dir=data_dir, long_poll_s=0.05, **LIMITS)
    engine = build_local_engine("tiny", data_dir, "cpu", 2, config.max_rank, None)
    engine.sampler.limits = sampling_limits(config)
    app = create_app(Runtime.open(engine, config))
    with TestClient(app, raise_server_exceptions=False) as http:
        session = http.post("/api/v1/create_session", json={}, headers=KEY).json()["session_id"]
        body = {
            "session_id": session,
            "model_seq_id": 0,
            "base_model": "loraplex/tiny",
            "lora_config": {"rank": 4},
        }
        run = _settled(http, http.post("/api/v1/create_model", json=body, headers=KEY).json())["model_id"]
        save = {"model_id": run, "seq_id": 1, "path": "fuzz"}
        checkpoint = _settled(http, http.post("/api/v1/save_weights", json=save, headers=KEY).json())["path"]
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "loraplex/tiny"}
        sampler = http.post("/api/v1/create_sampling_session", json=body, headers=KEY).json()
        yield Fixtures(http, session, run, sampler["sampling_session_id"], checkpoint, next_seq=2)


def _settled(http: TestClient, future: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}, headers=KEY)
        if result.json().get("type") != "try_again":
            return result.json()
    raise TimeoutError(future)


# --- JSON envelopes and their mutations


def _json_routes(f: Fixtures) -> list[tuple[str, str, Any]]:
    """(method, path, body) of every JSON route, each valid for this server's fixtures."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    sampling = {"max_tokens": 3, "seed": 1, "stop": ["\n"], "temperature": 0.7, "top_k": -1, "top_p": 1.0}
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0}
    meta = {"k": "v"}
    return [
        ("POST", "/api/v1/client/config", {"sdk_version": "0.38.0"}),
        ("POST", "/api/v1/client/dynamic_config", {"sdk_version": "0.38.0"}),
        ("POST", "/api/v1/create_session", {"tags": [], "user_metadata": meta, "sdk_version": "0.38.0"}),
        ("POST", "/api/v1/session_heartbeat", {"session_id": f.session, "type": "session_heartbeat"}),
        ("POST", "/api/v1/telemetry", {"events": [], "platform": "Linux", "session_id": f.session}),
        (
            "POST",
            "/api/v1/create_model",
            {
                "session_id": f.session,
                "model_seq_id": 7,
                "base_model": "loraplex/tiny",
                "user_metadata": meta,
                "lora_config": {"rank": 2, "seed": 3, "train_unembed": False},
                "optimizer_config": {"type": "adamw"},
            },
        ),
        ("POST", "/api/v1/get_info", {"model_id": f.run, "type": "get_info"}),
        ("POST", "/api/v1/optim_step", {"model_id": f.run, "seq_id": "SEQ", "adam_params": adam}),
        (
            "POST",
            "/api/v1/save_weights",
            {"model_id": f.run, "seq_id": "SEQ", "path": "s", "user_metadata": meta},
        ),
        (
            "POST",
            "/api/v1/save_weights_for_sampler",
            {"model_id": f.run, "seq_id": "SEQ", "sampling_session_seq_id": 3, "kind": "snapshot"},
        ),
        ("POST", "/api/v1/save_weights_external", {"model_id": f.run, "seq_id": "SEQ", "path": "e"}),
        ("POST", "/api/v1/load_weights", {"model_id": f.run, "seq_id": "SEQ", "path": f.checkpoint}),
        (
            "POST",
            "/api/v1/load_weights",
            {"session_id": f.session, "model_seq_id": 9, "path": f.checkpoint, "optimizer": True},
        ),
        ("POST", "/api/v1/retrieve_future", {"request_id": "req-0"}),
        (
            "POST",
            "/api/v1/create_sampling_session",
            {"session_id": f.session, "sampling_session_seq_id": 5, "model_path": f.checkpoint},
        ),
        (
            "POST",
            "/api/v1/asample",
            {
                "sampling_session_id": f.sampler,
                "seq_id": 0,
                "num_samples": 2,
                "prompt": prompt,
                "sampling_params": sampling,
                "prompt_logprobs": True,
                "topk_prompt_logprobs": 2,
            },
        ),
        ("POST", "/api/v1/weights_info", {"tinker_path": f.checkpoint}),
        ("POST", f"/api/v1/sessions/{f.session}/finish", {"reason": {"type": "success"}}),
        ("GET", f"/api/v1/samplers/{f.sampler}", None),
        ("GET", "/api/v1/training_runs?limit=5&offset=0", None),
        ("GET", f"/api/v1/training_runs/{f.run}", None),
        ("GET", f"/api/v1/training_runs/{f.run}/checkpoints", None),
        ("GET", "/api/v1/checkpoints?limit=5&offset=0", None),
        ("DELETE", f"/api/v1/training_runs/{f.run}/checkpoints/weights/nope", None),
        ("GET", "/api/v1/healthz", None),
        ("GET", "/api/v1/get_server_capabilities", None),
    ]


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every location in a JSON value, the root included."""
    found = [at]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*at, index))
    return found


def _mutate_json(rng: random.Random, body: Any) -> Any:
    """One to three edits: a value replaced by a special one, a key dropped, an unknown key added."""
    for _ in range(rng.randint(1, 3)):
        at = rng.choice(_paths(body))
        parent = body
        for step in at[:-1]:
            parent = parent[step]
        action = rng.random()
        if not at:
            body = _special(rng) if action < 0.5 else body
        elif action < 0.7:
            parent[at[-1]] = _special(rng)
        elif isinstance(parent, dict):
            del parent[at[-1]]
        if action > 0.85 and isinstance(body, dict):
            body[rng.choice(["type", "extra", "seq_id", "model_id"])] = _special(rng)
    return body


def _special(rng: random.Random) -> Any:
    """A special value of its own (a later edit must not change the shared one)."""
    return copy.deepcopy(rng.choice(SPECIALS))


def _mutate_path(rng: random.Random, path: str) -> str:
    """A path segment or query value replaced by a special string or integer."""
    route, _, query = path.partition("?")
    parts = route.split("/")
    short = [value for value in SPECIALS if len(str(value)) < 1000]
    if query and rng.random() < 0.5:
        value = quote(str(rng.choice(short)), errors="surrogatepass")
        return f"{route}?{rng.choice(['limit', 'offset'])}={value}"
    index = rng.randrange(3, len(parts))
    parts[index] = quote(str(rng.choice(short)), safe="", errors="surrogatepass")
    return "/".join(parts) + (f"?{query}" if query else "")


# --- protobuf envelopes and their mutations


def _forward_msg(rng: random.Random, f: Fixtures, seq_id: int) -> pb.ForwardBackwardRequest:
    """A valid request: cross_entropy on 1-D or sparse (N, 2) targets, or importance_sampling."""
    tokens = np.array([5, 6, 7, 8], "<i4")
    loss_fn = rng.choice(["cross_entropy", "cross_entropy", "importance_sampling"])
    msg = pb.ForwardBackwardRequest(
        model_id=f.run, seq_id=seq_id, loss_fn=loss_fn, forward_only=rng.random() < 0.5
    )
    for _ in range(rng.randint(1, 3)):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = tokens.tobytes()
        inputs = datum.loss_fn_inputs
        if rng.random() < 0.3 and loss_fn == "cross_entropy":
            targets = inputs["target_tokens"]
            targets.dtype, targets.shape[:] = pb.DTYPE_INT64, [4, 2]
            targets.sparse_csr.values = np.array([6, 9, 7, 8, 9], "<i8").tobytes()
            targets.sparse_csr.crow_indices = np.array([0, 2, 3, 4, 5], "<i8").tobytes()
            targets.sparse_csr.col_indices = np.array([0, 1, 0, 0, 1], "<i8").tobytes()
            weights = inputs["weights"]
            weights.dtype, weights.shape[:] = pb.DTYPE_FLOAT32, [4, 2]
            weights.dense = np.full((4, 2), 0.5, "<f4").tobytes()
        else:
            inputs["target_tokens"].CopyFrom(_dense(np.array([6, 7, 8, 9], "<i8"), pb.DTYPE_INT64))
            inputs["weights"].CopyFrom(_dense(np.ones(4, "<f4"), pb.DTYPE_FLOAT32))
        if loss_fn == "importance_sampling":
            inputs["logprobs"].CopyFrom(_dense(np.full(4, -1.0, "<f4"), pb.DTYPE_FLOAT32))
            inputs["advantages"].CopyFrom(_dense(np.array([1, -1, 0.5, 0], "<f4"), pb.DTYPE_FLOAT32))
    return msg


def _dense(values: np.ndarray, dtype: int) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=list(values.shape), dense=values.tobytes())


SHAPES = [[], [-1], [4, 10**12], [10**12, 1], [2**62, 4], [4, 2, 2], [0], [4, 0], [5], [4, 3], [4, 9]]
BAD_INDICES = [[], [0], [1, 0], [0, 5, 3, 2, 1], [-3, 0, 1, 2, 3], [0, 1, 2, 3, 2**62], [0, 0, 0, 0, 99]]


def _mutate_forward(rng: random.Random, msg: pb.ForwardBackwardRequest) -> None:
    for _ in range(rng.randint(1, 3)):
        datum = rng.choice(msg.data) if msg.data else msg.data.add()
        tensor = datum.loss_fn_inputs[rng.choice(list(datum.loss_fn_inputs) or ["target_tokens"])]
        choice = rng.randrange(12)
        if choice == 0:
            tensor.shape[:] = rng.choice(SHAPES)
        elif choice == 1:
            tensor.dtype = rng.choice([-1, 0, 1, 2, 3, 4, 99])
        elif choice == 2:
            tensor.dense = tensor.dense[: rng.randint(0, len(tensor.dense))] + bytes(rng.randint(0, 3))
        elif choice == 3:
            field = rng.choice(["values", "crow_indices", "col_indices"])
            raw = np.array(rng.choice(BAD_INDICES), "<i8").tobytes()
            setattr(tensor.sparse_csr, field, raw[: len(raw) - rng.choice([0, 0, 3])])
        elif choice == 4:
            chunk = datum.model_input[0] if datum.model_input else datum.model_input.add()
            chunk.encoded_text.tokens = rng.choice(
                [b"\x01\x02\x03", b"", np.array([5, 2**31 - 1, -5], "<i4").tobytes()]
            )
        elif choice == 5:
            datum.model_input.add().image.data = b"\x89PNG"
        elif choice == 6:
            msg.loss_fn = rng.choice(["ppo", "cispo", "dro", "gspo", "", "nope", "cross_entropy"])
        elif choice == 7:
            key = rng.choice(["clip_low_threshold", "clip_high_threshold", "beta", "nope"])
            number = rng.choice(FLOATS)
            msg.loss_fn_config[key] = number
            msg.loss_fn_config_v2[key].number = number
        elif choice == 8:
            msg.loss_fn_config_v2["x"].text = "t"
        elif choice == 9:
            msg.seq_id = rng.choice([0, -1, 2**31 - 1, -(2**31)])
        elif choice == 10:
            del msg.data[:]
        else:
            for _ in range(40):
                msg.data.add().CopyFrom(datum)


def _forward_body(rng: random.Random, msg: pb.ForwardBackwardRequest) -> tuple[bytes, dict[str, str]]:
    """The body bytes, mangled now and then, and its headers (zstd, or a Content-Encoding we refuse)."""
    body = msg.SerializeToString()
    headers = {**KEY, "Content-Type": "application/x-protobuf"}
    roll = rng.random()
    if roll < 0.1 and body:
        index = rng.randrange(len(body))
        body = body[:index] + bytes([rng.randrange(256)]) + body[index + 1 :]
    elif roll < 0.15:
        body = body[: rng.randrange(len(body) + 1)]
    elif roll < 0.25:
        body = zstandard.ZstdCompressor(write_content_size=rng.random() < 0.5).compress(
            body if rng.random() < 0.7 else bytes(3 * 2**20)  # the second: a bomb
        )
        headers["Content-Encoding"] = rng.choice(["zstd", "zstd", "gzip"])
    return body, headers


# --- the fuzzer


@dataclass
class Finding:
    """A request answered with a 5xx, or whose future failed as a server error."""

    method: str
    path: str
    body: bytes
    status: int
    detail: str

    def __str__(self) -> str:
        return f"{self.method} {self.path} -> {self.status} {self.detail[:300]}\n  body: {self.body[:600]!r}"


def _cases(rng: random.Random, f: Fixtures) -> Iterator[tuple[str, str, bytes, dict[str, str], bool]]:
    """(method, path, body, headers, uses the run's next seq_id) of mutated requests, forever."""
    routes = _json_routes(f)
    while True:
        if rng.random() < 0.3:
            msg = _forward_msg(rng, f, f.next_seq)
            if rng.random() < 0.85:
                _mutate_forward(rng, msg)
            body, headers = _forward_body(rng, msg)
            path = rng.choice(["/api/v1/forward_backward", "/api/v1/forward"])
            yield "POST", path, body, headers, msg.seq_id == f.next_seq
            continue
        method, path, template = rng.choice(routes)
        if template is None or rng.random() < 0.15:
            yield method, _mutate_path(rng, path), b"", KEY, False
            continue
        body = json.loads(json.dumps(template).replace('"SEQ"', str(f.next_seq)))
        body = _mutate_json(rng, body)
        text = json.dumps(body, allow_nan=True)
        if rng.random() < 0.05:
            text = text[: rng.randrange(len(text) + 1)]
        headers = {**KEY, "Content-Type": rng.choice(["application/json"] * 9 + ["text/plain"])}
        uses_seq = isinstance(body, dict) and body.get("seq_id") == f.next_seq and "model_id" in body
        yield method, path, text.encode("utf-8", "surrogatepass"), headers, uses_seq


def test_no_mutated_request_to_any_route_gets_a_5xx_or_fails_as_a_server_error(served: Fixtures) -> None:
    rng = random.Random(SEED)
    http, findings, futures = served.http, [], []
    deadline = time.monotonic() + BUDGET_S
    cases = _cases(rng, served)
    for _ in range(MAX_CASES):
        if time.monotonic() > deadline:
            break
        method, path, body, headers, uses_seq = next(cases)
        reply = http.request(method, path, content=body, headers=headers)
        answer = _json_or_text(reply)
        if reply.status_code >= 500:
            findings.append(Finding(method, path, body, reply.status_code, str(answer)))
        elif isinstance(answer, dict) and "request_id" in answer:
            futures.append((method, path, body, answer["request_id"]))
            served.next_seq += uses_seq
    findings += _server_failures(http, futures)
    assert [str(f) for f in findings] == []
    assert http.get("/api/v1/healthz").json()["status"] == "ok"


def _json_or_text(reply: Any) -> Any:
    try:
        return reply.json()
    except ValueError:
        return reply.text


def _server_failures(http: TestClient, futures: list[tuple[str, str, bytes, str]]) -> list[Finding]:
    """Futures that failed as server errors, among those that settle within a few seconds."""
    found, deadline = [], time.monotonic() + 10.0
    for method, path, body, request_id in futures:
        if time.monotonic() > deadline:
            break
        result = http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=KEY).json()
        if result.get("category") == "server":
            found.append(Finding(method, path, body, 200, f"server failure: {result.get('error')}"))
    return found


# --- schemathesis over the OpenAPI schema


@pytest.fixture(scope="module")
def openapi(served: Fixtures) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict({"seed": SEED, "headers": KEY})
    return schemathesis.openapi.from_asgi("/openapi.json", served.http.app, config=config)


def test_schemathesis_finds_no_5xx_on_any_operation(openapi: schemathesis.BaseSchema) -> None:
    findings: list[str] = []

    @settings(max_examples=16, derandomize=True, database=None, deadline=None, phases=[Phase.generate])
    @given(data=strategies.data())
    def call(data: strategies.DataObject, operation: schemathesis.APIOperation) -> None:
        # Valid and invalid inputs both (an operation without parameters has no invalid ones).
        modes = [operation.as_strategy(generation_mode=mode) for mode in GenerationMode]
        case = data.draw(strategies.one_of(modes))
        response = case.call(headers=KEY)
        if response.status_code >= 500:
            findings.append(f"{case.method} {case.formatted_path} {case.body!r}: {response.text[:300]}")

    for operation in openapi.get_all_operations():
        call(operation=operation.ok())
    assert findings == []


# --- what the fuzzer found, kept as tests


class _RefusingEngine(FakeEngine):
    """An engine that refuses every new adapter (as one refuses a checkpoint of another base model)."""

    def create_slot(self, config: LoraConfig) -> int:
        raise UserError("this engine refuses the adapter")


def test_a_create_model_resent_after_its_creation_failed_answers_its_first_future(tmp_path: Path) -> None:
    # Found by the fuzzer (seed 13): the resend reached runtime/control/service.py create_run, which
    # inserted a second future row for (run, seq_id 0) and failed on its UNIQUE constraint (a 500).
    config = ServerConfig(data_dir=tmp_path, long_poll_s=0.5)
    with TestClient(create_app(Runtime.open(_RefusingEngine(), config))) as http:
        session = http.post("/api/v1/create_session", json={}, headers=KEY).json()["session_id"]
        body = {
            "session_id": session,
            "model_seq_id": 7,
            "base_model": "fake/bigram",
            "lora_config": {"rank": 4},
        }
        first = http.post("/api/v1/create_model", json=body, headers=KEY).json()
        assert _settled(http, first) == {"error": "this engine refuses the adapter", "category": "user"}
        resent = http.post("/api/v1/create_model", json=body, headers=KEY)
        assert (resent.status_code, resent.json()) == (200, first)
