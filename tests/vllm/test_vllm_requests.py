"""The vLLM sampler's pieces without vLLM: a Tinker request as a /v1/completions body, vLLM's answer as a
SampleResult, the refusals, and a server's snapshot LRU against a scripted HTTP server."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from loraplex.config import ServerConfig
from loraplex.engine.snapshots import WEIGHTS_FILE
from loraplex.engine.types import SampleRequest, SamplingParams
from loraplex.errors import FieldError, ServerError, UnavailableError, UserError
from loraplex.runtime.vllm.base_check import (
    MAX_MEAN_LOGPROB_GAP,
    PROMPT_TOKENS,
    base_model_mismatch,
    check_body,
    check_prompt,
    logprob_gap,
    served_logprobs,
)
from loraplex.runtime.vllm.process import VllmProcess, lora_server
from loraplex.runtime.vllm.requests import completion_body, refuse_unsupported, sample_result, vllm_seed
from loraplex.runtime.vllm.sampler import ROWS_PER_SERVER, VllmSampler
from loraplex.runtime.vllm.server import VllmServer, adapter_name
from loraplex.runtime.vllm.staging import SnapshotStaging
from tests.fakes import FakeEngine


def _request(**fields) -> SampleRequest:
    params = fields.pop("params", SamplingParams(max_tokens=4))
    return SampleRequest(np.array([5, 6, 7]), params, **fields)


def test_a_request_becomes_a_body_of_token_ids_with_tinkers_stops_and_seed() -> None:
    params = SamplingParams(
        max_tokens=4, temperature=0.7, top_k=20, top_p=0.9, seed=2**64 - 1, stop=("ab", 9)
    )
    body = completion_body(_request(params=params, num_samples=3, topk_sample_logprobs=2), "lp-x", 4)
    assert body["prompt"] == [5, 6, 7] and body["model"] == "lp-x" and body["n"] == 3
    assert (body["temperature"], body["top_k"], body["top_p"], body["max_tokens"]) == (0.7, 20, 0.9, 4)
    assert body["seed"] == 2**63 - 1  # vLLM reads -1 (the bits of 2**64 - 1) as no seed
    assert [vllm_seed(s) for s in (0, 2**63 - 1, 2**63, 2**64 - 2)] == [0, 2**63 - 1, -(2**63), -2]
    assert (body["stop"], body["stop_token_ids"], body["ignore_eos"]) == (["ab"], [9], False)
    assert body["logprobs"] == 2 and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["include_stop_str_in_output"]  # Tinker keeps the tokens that complete a stop string


def test_stop_none_leaves_eos_to_vllm_and_an_empty_stop_only_max_tokens() -> None:
    assert "stop" not in completion_body(_request(), "m", 4) and "ignore_eos" not in completion_body(
        _request(), "m", 4
    )
    body = completion_body(_request(params=SamplingParams(max_tokens=4, stop=())), "m", 4)
    assert body["ignore_eos"] and body["stop"] == [] and body["stop_token_ids"] == []


def _choice(index: int, tokens: list[int], logprobs: list[float | None], top=None, finish="length") -> dict:
    scored = {"token_logprobs": logprobs, "tokens": [f"token_id:{t}" for t in tokens]}
    if top is not None:
        scored["top_logprobs"] = top
    return {"index": index, "token_ids": tokens, "logprobs": scored, "finish_reason": finish}


def test_an_answer_becomes_samples_in_index_order_with_topk_likeliest_first() -> None:
    top = [{"token_id:3": -0.5, "token_id:4": -1.5, "token_id:8": None}]  # None: -inf, left out by top-k
    answer = {"choices": [_choice(1, [4], [-1.5], top, "stop"), _choice(0, [3], [-0.5], top)]}
    result = sample_result(answer, _request(num_samples=2, topk_sample_logprobs=3))
    first, second = result.sequences
    assert (first.tokens.tolist(), first.stop_reason, second.stop_reason) == ([3], "length", "stop")
    assert first.topk_ids is not None and first.topk_logprobs is not None
    assert first.topk_ids.tolist() == [[3, 4, -1]]
    assert first.topk_logprobs[0, :2].tolist() == [-0.5, -1.5] and math.isnan(first.topk_logprobs[0, 2])


def test_a_greedy_request_asks_vllm_once_and_repeats_the_sample() -> None:
    request = _request(params=SamplingParams(max_tokens=2, temperature=0.0), num_samples=3)
    assert completion_body(request, "m", 2)["n"] == 1  # vLLM refuses n > 1 when greedy
    result = sample_result({"choices": [_choice(0, [1, 2], [-0.1, -0.2])]}, request)
    assert [s.tokens.tolist() for s in result.sequences] == [[1, 2]] * 3
    assert result.sequences[1] is not result.sequences[0]  # each its own arrays


def test_an_answer_that_does_not_fit_the_request_is_a_server_error() -> None:
    with pytest.raises(ServerError, match="answered 1 samples where 2 were asked"):
        sample_result({"choices": [_choice(0, [1], [-0.1])]}, _request(num_samples=2))
    with pytest.raises(ServerError, match="2 tokens with 1 logprobs"):
        sample_result({"choices": [_choice(0, [1, 2], [-0.1])]}, _request())


def test_fields_vllm_cannot_answer_exactly_are_refused_naming_the_backend() -> None:
    with pytest.raises(FieldError, match="prompt_alt_tokens_k is not served by the vLLM sampler"):
        refuse_unsupported(_request(prompt_alt_tokens_k=2), 20)
    with pytest.raises(FieldError, match="target_prompt_logprobs is not served by the vLLM sampler"):
        refuse_unsupported(_request(target_prompt_ids=np.zeros((2, 1), np.int64)), 20)
    with pytest.raises(FieldError, match="topk_sample_logprobs 21 is over the 20"):
        refuse_unsupported(_request(topk_sample_logprobs=21), 20)
    refuse_unsupported(_request(topk_sample_logprobs=20, prompt_logprobs=True, topk_prompt_logprobs=50), 20)


def _snapshot(directory: Path, content: bytes = b"weights") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / WEIGHTS_FILE).write_bytes(content)
    return directory


def test_a_snapshot_rewritten_in_place_gets_a_new_adapter_name(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path / "s")
    first = adapter_name(snapshot)
    assert adapter_name(snapshot) == first
    (snapshot / WEIGHTS_FILE).unlink()
    _snapshot(snapshot, b"other weights")
    assert adapter_name(snapshot) != first


class _ScriptedVllm:
    """The adapter routes of a vLLM server, as httpx's MockTransport handler."""

    def __init__(self, loaded: set[str] | None = None) -> None:
        self.loaded = loaded or set()
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append((request.url.path, body.get("lora_name", "")))
        if request.url.path == "/v1/load_lora_adapter":
            if body["lora_name"] in self.loaded:
                return httpx.Response(
                    400,
                    json={
                        "error": {
                            "message": f"The lora adapter '{body['lora_name']}' has already been loaded."
                        }
                    },
                )
            self.loaded.add(body["lora_name"])
            return httpx.Response(200, text="Success")
        if request.url.path == "/v1/unload_lora_adapter":
            self.loaded.discard(body["lora_name"])
            return httpx.Response(200, text="Success")
        if request.url.path == "/v1/completions":
            return httpx.Response(500, json={"error": {"message": "EngineCore encountered an issue"}})
        return httpx.Response(400, json={"error": {"message": "bad"}})


def _server(vllm: _ScriptedVllm, max_loras: int) -> VllmServer:
    server = VllmServer(0, "http://vllm", None, max_loras, timeout_s=5, start_timeout_s=5)
    server.client = httpx.AsyncClient(transport=httpx.MockTransport(vllm))
    return server


def test_loads_past_max_loras_unload_the_least_recently_used_idle_snapshot(tmp_path: Path) -> None:
    a, b, c = (_snapshot(tmp_path / name) for name in "abc")
    vllm = _ScriptedVllm()
    server = _server(vllm, max_loras=2)

    async def scenario() -> None:
        for snapshot in (a, b, a):  # a is used last: b is the least recent
            server.release_adapter(await server.use_adapter(snapshot))
        held = await server.use_adapter(c)
        assert vllm.loaded == {adapter_name(a), adapter_name(c)}
        in_use = await server.use_adapter(a)  # now a and c are in use: nothing idle to unload
        server.release_adapter(await server.use_adapter(b))
        assert vllm.loaded == {adapter_name(a), adapter_name(b), adapter_name(c)}
        for name in (held, in_use):
            server.release_adapter(name)

    asyncio.run(scenario())
    loads = [name for path, name in vllm.calls if path == "/v1/load_lora_adapter"]
    assert loads == [adapter_name(s) for s in (a, b, c, b)]


def test_a_load_answered_already_loaded_counts_as_loaded_and_a_deleted_snapshot_is_unloaded(
    tmp_path: Path,
) -> None:
    a = _snapshot(tmp_path / "a")
    vllm = _ScriptedVllm(loaded={adapter_name(a)})  # loaded before this server started (a restart of ours)
    server = _server(vllm, max_loras=4)

    async def scenario() -> None:
        server.release_adapter(await server.use_adapter(a))
        assert list(server.adapters) == [adapter_name(a)]
        await server.forget(a)

    asyncio.run(scenario())
    assert vllm.loaded == set() and not server.adapters


def test_a_server_failing_inside_is_unavailable_and_a_refusal_is_the_users(tmp_path: Path) -> None:
    server = _server(_ScriptedVllm(), max_loras=1)
    with pytest.raises(UnavailableError, match="failed: EngineCore encountered an issue"):
        asyncio.run(server.complete({"model": "m"}))
    with pytest.raises(UserError, match=r"refused the request \(400\): bad"):
        asyncio.run(server._post("/v1/other", {}))


@pytest.fixture
def from_config(tmp_path: Path) -> Iterator[Callable[..., VllmSampler]]:
    """from_config(**fields) -> the vLLM sampler a server of those fields builds (not started); each one
    closed after the test (its event loop with it)."""
    built: list[VllmSampler] = []

    def build(**fields: object) -> VllmSampler:
        config = ServerConfig(data_dir=tmp_path, sampler="vllm", **fields)
        built.append(VllmSampler.from_config(config, FakeEngine(), wake=lambda: None))
        return built[-1]

    yield build
    for sampler in built:
        sampler.close()


def test_vllm_devices_start_one_tensor_parallel_server_per_group(tmp_path: Path, from_config) -> None:
    sampler = from_config(vllm_python=Path(sys.executable), vllm_devices="0,1;2,3", vllm_args="--seed 3")
    processes = [server.process for server in sampler._servers]
    assert [p.environment["CUDA_VISIBLE_DEVICES"] for p in processes if p] == ["0,1", "2,3"]
    for index, process in enumerate(processes):
        assert process is not None and process.log_path == tmp_path / "logs" / f"vllm-{index}.log"
        arguments = " ".join(process.arguments)
        assert "--tensor-parallel-size 2" in arguments and arguments.endswith("--seed 3")
        assert "--served-model-name fake/bigram" in arguments and "--max-lora-rank 64" in arguments
        assert process.environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


def test_on_a_cpu_vllm_gets_fp32_a_bounded_kv_cache_and_no_worker_process_unless_the_operator_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def start(on_cpu: bool) -> VllmProcess:
        return lora_server(Path(sys.executable), tmp_path, "m", 4096, 8, 2, 20, on_cpu, tmp_path / "log")

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    on_cpu = start(on_cpu=True)
    assert on_cpu.environment == {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    assert " ".join(on_cpu.arguments).endswith("--dtype float32")
    on_gpu = start(on_cpu=False)
    assert on_gpu.environment == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    assert "--dtype" not in on_gpu.arguments
    # What the operator set is inherited by the process, not overridden.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert start(on_cpu=True).environment == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "needs either --vllm-url"),
        ({"vllm_url": "http://a:8000", "vllm_python": Path(sys.executable)}, "needs either --vllm-url"),
        ({"vllm_url": "http://a:8000", "vllm_devices": "0"}, "not those of --vllm-url"),
        ({"vllm_url": " , "}, "names no server"),
        ({"vllm_python": Path(sys.executable), "vllm_devices": "0;0"}, "each device in one group"),
        ({"vllm_python": Path("/nonexistent/python")}, "is not an executable python"),
    ],
)
def test_a_vllm_sampler_misconfigured_is_refused_at_start_saying_how(from_config, fields, message) -> None:
    with pytest.raises(UserError, match=message):
        from_config(**fields)


def test_servers_given_by_url_are_spread_over_in_order(from_config) -> None:
    sampler = from_config(vllm_url="http://a:8000/, http://b:8000")
    assert [server.url for server in sampler._servers] == ["http://a:8000", "http://b:8000"]
    assert sampler.sampling_rows() == 2 * ROWS_PER_SERVER


def test_staged_snapshots_are_copied_once_loaded_by_the_servers_path_and_dropped_with_their_snapshot(
    tmp_path: Path,
) -> None:
    """--vllm-snapshot-dir LOCAL:REMOTE, for vLLM servers that cannot see the data dir: the load names the
    copy as the servers see it, and retention's deletion of the snapshot deletes its copy."""
    a = _snapshot(tmp_path / "data" / "a")
    staging = SnapshotStaging(f"{tmp_path / 'staged'}:/mnt/loraplex")
    vllm = _ScriptedVllm()
    server = _server(vllm, max_loras=4)
    server.staging = staging
    paths: list[str] = []
    original = vllm.__call__

    def recording(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter":
            paths.append(json.loads(request.content)["lora_path"])
        return original(request)

    server.client = httpx.AsyncClient(transport=httpx.MockTransport(recording))
    name = adapter_name(a)

    async def scenario() -> None:
        server.release_adapter(await server.use_adapter(a))
        assert staging.path_for(a, name) == f"/mnt/loraplex/{name}"  # already there: not copied again

    asyncio.run(scenario())
    assert paths == [f"/mnt/loraplex/{name}"]
    assert (tmp_path / "staged" / name / WEIGHTS_FILE).read_bytes() == b"weights"
    assert [p.name for p in (tmp_path / "staged").iterdir()] == [name]  # no partial copy left
    staging.drop(a)
    assert not (tmp_path / "staged" / name).exists()
    assert SnapshotStaging().path_for(a, name) == str(a.resolve())  # without staging: the data dir's path


# ---- the base-model check


def test_the_base_model_check_scores_a_fixed_prompt_and_refuses_logprobs_past_rounding() -> None:
    prompt = check_prompt(vocab_size=512)
    assert prompt == check_prompt(512) and len(set(prompt)) == PROMPT_TOKENS and max(prompt) < 512
    qwen3 = check_prompt(vocab_size=151_936)  # its tokenizer has 151,669 ids: the prompt stays far below
    assert len(set(qwen3)) == PROMPT_TOKENS and max(qwen3) < 10_000
    body = check_body("lp-base", prompt)
    assert (body["model"], body["prompt"], body["prompt_logprobs"], body["max_tokens"]) == (
        "lp-base",
        prompt,
        0,
        1,
    )
    # vLLM's answer: no logprob for the first token, then a dict keyed by the id (as a string) per token.
    engine_logprobs = -np.linspace(1.0, 8.0, PROMPT_TOKENS - 1)
    scored = zip(prompt[1:], engine_logprobs, strict=True)
    positions = [None] + [{str(token): {"logprob": lp, "rank": 3}} for token, lp in scored]
    served = served_logprobs({"choices": [{"prompt_logprobs": positions}]}, prompt)
    assert served.tolist() == engine_logprobs.tolist()

    assert logprob_gap(engine_logprobs, served + 0.2) == pytest.approx(0.2)
    assert base_model_mismatch(0.2) is None  # rounding's order in bf16
    why = base_model_mismatch(logprob_gap(engine_logprobs, served - 1.5))
    assert why is not None and "differ from the engine's by 1.5 nats on average" in why
    assert f"a fixed {PROMPT_TOKENS}-token prompt" in why and f"at most {MAX_MEAN_LOGPROB_GAP:g}" in why
