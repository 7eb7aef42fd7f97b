"""`serve --sampler vllm` against a real vLLM server (the CPU build, started by loraplex), driven by the
official SDK, with the built-in sampler in this process as the reference: greedy samples token for token,
logprobs within 1e-4, seeds, stops, no stale adapter, the snapshot LRU, and a vLLM server killed or
stalled mid-sample."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tinker
import torch
from safetensors.torch import load_file, save_file
from tinker import types

from loraplex.engine.types import SampleRequest, SamplingParams
from loraplex.runtime.vllm.base_check import MAX_MEAN_LOGPROB_GAP
from loraplex.runtime.vllm.server import adapter_name
from tests.cookbook.conftest import Cookbook, metric
from tests.e2e.conftest import Server, _servers
from tests.e2e.sdk import client, sft_datum
from tests.vllm.conftest import Reference, ids, wait_until_sampler_up

# 16 prompts of plain text (the tiny model's tokenizer is byte-level): greedy continuations of 16 tokens.
WORDS = (
    "apple river stone cloud tiger piano lemon forest rocket candle mirror garden violin castle ocean pencil"
)
PROMPTS = [list(f"{word} is the {i}th word of".encode()) for i, word in enumerate(WORDS.split(" "))]
GREEDY_TOKENS = 16
# A greedy step is compared only where its top two logprobs are this far apart: vLLM's fp32 kernels and
# ours sum in other orders, and a sum of n fp32 terms may move by up to n·u of its terms' magnitude (u =
# 2**-24; n ≤ 768, the tiny model's widest reduction: ~5e-5 per product, a few of them per layer over 4
# layers), so a closer pair may swap; 1e-3 stands above that bound.
TIE_MARGIN = 1e-3
LOGPROB_ATOL = 1e-4
TEXT = list(b"the cat sat on the mat. the cat sat on the mat. ")


@pytest.fixture(scope="module")
def server(start_vllm_server) -> Server:
    return start_vllm_server("--vllm-max-loras", "2", "--vllm-timeout-s", "10")


@pytest.fixture(scope="module")
def reference(server: Server) -> Reference:
    return Reference(server.data_dir)


@pytest.fixture(scope="module")
def service(server: Server) -> tinker.ServiceClient:
    return client(server)


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient) -> dict[str, str]:
    """Snapshots of two runs (tinker paths): `a` after 4 steps on TEXT, `a_more` after 8 more, `b` after 4
    steps on other text."""
    paths = {}
    run_a = service.create_lora_training_client(base_model="loraplex/tiny", rank=8, seed=1).result()
    run_b = service.create_lora_training_client(base_model="loraplex/tiny", rank=16, seed=2).result()
    for name, run, text, steps in (
        ("a", run_a, TEXT, 4),
        ("b", run_b, list(b"0123456789" * 4), 4),
        ("a_more", run_a, TEXT, 8),
    ):
        for _ in range(steps):
            run.forward_backward([sft_datum(text)], "cross_entropy").result()
            run.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        paths[name] = run.save_weights_for_sampler(name).result().path
    return paths


def _sampler(service: tinker.ServiceClient, path: str | None) -> tinker.SamplingClient:
    if path is None:
        return service.create_sampling_client(base_model="loraplex/tiny").result()
    return service.create_sampling_client(model_path=path).result()


def _greedy_reference(
    reference: Reference, prompt: list[int], snapshot
) -> tuple[list[int], np.ndarray, bool]:
    """The built-in sampler's greedy tokens and logprobs, and whether no step is near a tie."""
    request = SampleRequest(
        np.asarray(prompt),
        SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, stop=()),
        topk_sample_logprobs=2,
        snapshot=snapshot,
    )
    (sequence,) = reference.sample(request).sequences
    assert sequence.topk_logprobs is not None
    gaps = sequence.topk_logprobs[:, 0] - sequence.topk_logprobs[:, 1]
    return ids(sequence.tokens), sequence.logprobs, bool(np.all(gaps > TIE_MARGIN))


@pytest.mark.parametrize("which", [None, "a", "b"])
def test_greedy_samples_equal_the_builtin_samplers_token_for_token(
    which, service, trained, reference
) -> None:
    path = None if which is None else trained[which]
    snapshot = None if path is None else reference.snapshot(path)
    sampler = _sampler(service, path)
    params = types.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, stop=[])
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, params) for p in PROMPTS]
    compared = 0
    for prompt, future in zip(PROMPTS, futures, strict=True):
        first, second = future.result().sequences
        assert first.tokens == second.tokens  # greedy: every sample is the one
        tokens, logprobs, untied = _greedy_reference(reference, prompt, snapshot)
        np.testing.assert_allclose(
            first.logprobs[: len(tokens)], logprobs[: len(first.tokens)], atol=LOGPROB_ATOL
        )
        if untied:
            assert list(first.tokens) == tokens, prompt
            assert first.stop_reason == "length"
            compared += 1
    assert compared >= len(PROMPTS) // 2, f"only {compared} prompts free of near-ties"


def test_sampled_token_logprobs_agree_with_the_models_within_1e_4(service, trained, reference) -> None:
    """At temperature 1 a sampled token's logprob is the model's own: scoring vLLM's samples with the
    built-in sampler (prompt logprobs of prompt + sample) gives the same numbers."""
    path = trained["b"]
    sampler = _sampler(service, path)
    prompt = PROMPTS[3]
    out = sampler.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=12, seed=5, stop=[])
    ).result()
    for sequence in out.sequences:
        whole = np.asarray(prompt + list(sequence.tokens))
        scored = reference.sample(
            SampleRequest(
                whole, SamplingParams(max_tokens=1), prompt_logprobs=True, snapshot=reference.snapshot(path)
            )
        )
        assert scored.prompt_logprobs is not None
        np.testing.assert_allclose(
            sequence.logprobs, scored.prompt_logprobs[len(prompt) :], atol=LOGPROB_ATOL
        )


def test_prompt_logprobs_and_their_top_k_equal_the_builtin_samplers(service, trained, reference) -> None:
    path = trained["a"]
    prompt = PROMPTS[0]
    out = (
        _sampler(service, path)
        .sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=3, seed=1),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=3,
        )
        .result()
    )
    expected = reference.sample(
        SampleRequest(
            np.asarray(prompt),
            SamplingParams(max_tokens=1),
            prompt_logprobs=True,
            topk_prompt_logprobs=3,
            snapshot=reference.snapshot(path),
        )
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], expected.prompt_logprobs[1:], atol=LOGPROB_ATOL)
    assert out.topk_prompt_logprobs is not None and expected.topk_prompt_ids is not None
    for position, top in enumerate(out.topk_prompt_logprobs[1:], start=1):
        assert [t for t, _ in top] == ids(expected.topk_prompt_ids[position])
    # compute_logprobs, the SDK's scoring call, is the same scores
    scored = _sampler(service, path).compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    np.testing.assert_allclose(scored[1:], expected.prompt_logprobs[1:], atol=LOGPROB_ATOL)


def test_a_seed_reproduces_its_samples_and_another_seed_differs(service, trained) -> None:
    sampler = _sampler(service, trained["a"])
    prompt = types.ModelInput.from_ints(PROMPTS[5])

    def draw(seed: int) -> list[list[int]]:
        params = types.SamplingParams(max_tokens=10, seed=seed, temperature=1.0, stop=[])
        return [list(s.tokens) for s in sampler.sample(prompt, 3, params).result().sequences]

    first = draw(7)
    assert draw(7) == first
    assert len({tuple(s) for s in first}) > 1  # the samples of one request differ from each other
    assert draw(8) != first
    assert draw(2**64 - 1) == draw(2**64 - 1) != draw(2**64 - 2)  # the top of Tinker's range, as int64s


def test_stop_ids_and_stop_strings_stop_where_the_builtin_sampler_stops(service, trained, reference) -> None:
    path = trained["a"]
    sampler = _sampler(service, path)
    prompt = list(b"the cat sat on the")
    tokens, _, _ = _greedy_reference(reference, prompt, reference.snapshot(path))
    stop_id = tokens[4]
    cut = tokens.index(stop_id) + 1  # the first time it is drawn

    by_id = sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        types.SamplingParams(max_tokens=16, temperature=0.0, stop=[stop_id]),
    ).result()
    assert list(by_id.sequences[0].tokens) == tokens[:cut]
    assert by_id.sequences[0].stop_reason == "stop"

    text = bytes(tokens).decode("ascii")
    stop_string = text[2:5]
    by_string = sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        types.SamplingParams(max_tokens=16, temperature=0.0, stop=[stop_string]),
    ).result()
    expected = reference.sample(
        SampleRequest(
            np.asarray(prompt),
            SamplingParams(max_tokens=16, temperature=0.0, stop=(stop_string,)),
            snapshot=reference.snapshot(path),
        )
    )
    assert list(by_string.sequences[0].tokens) == ids(expected.sequences[0].tokens)
    assert bytes(by_string.sequences[0].tokens).decode().endswith(stop_string)
    assert by_string.sequences[0].stop_reason == "stop"


def test_a_snapshot_saved_after_more_training_samples_its_own_weights(service, trained, reference) -> None:
    """No stale adapter: the later snapshot of the same run, loaded beside the earlier one, gives its own
    greedy samples (those of the built-in sampler on it), which differ from the earlier snapshot's."""
    params = types.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, stop=[])
    prompt = list(b"the cat")
    samples = {}
    for name in ("a", "a_more", "a"):
        sequence = (
            _sampler(service, trained[name])
            .sample(types.ModelInput.from_ints(prompt), 1, params)
            .result()
            .sequences[0]
        )
        samples.setdefault(name, list(sequence.tokens))
        assert list(sequence.tokens) == samples[name]
        tokens, _, untied = _greedy_reference(reference, prompt, reference.snapshot(trained[name]))
        if untied:
            assert list(sequence.tokens) == tokens
    assert samples["a"] != samples["a_more"]


def test_snapshots_past_max_loras_evict_the_least_recently_used(server, service, trained) -> None:
    """--vllm-max-loras 2: three snapshots sampled in turn keep at most two loaded in vLLM, and each still
    samples its own weights after being evicted and loaded again."""
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints(PROMPTS[1])
    first = {}
    for name in ("a", "b", "a_more", "a", "b"):
        tokens = list(_sampler(service, trained[name]).sample(prompt, 1, params).result().sequences[0].tokens)
        assert first.setdefault(name, tokens) == tokens
        (vllm,) = httpx.get(f"{server.base_url}/api/v1/healthz").json()["sampler"]["servers"]
        assert vllm["adapters"] <= 2
        loaded = [m["id"] for m in httpx.get(f"{vllm['url']}/v1/models").json()["data"] if m.get("parent")]
        assert len(loaded) <= 2, loaded


def test_a_snapshot_is_loaded_into_vllm_as_it_is_saved_before_any_request(server, service, reference) -> None:
    """An RL loop samples each step's snapshot at once: the vLLM sampler loads it when it is saved."""
    run = service.create_lora_training_client(base_model="loraplex/tiny", rank=4, seed=9).result()
    path = run.save_weights_for_sampler("ahead").result().path
    name = adapter_name(reference.snapshot(path))
    (vllm,) = httpx.get(f"{server.base_url}/api/v1/healthz").json()["sampler"]["servers"]
    deadline = time.monotonic() + 30
    while name not in (loaded := [m["id"] for m in httpx.get(f"{vllm['url']}/v1/models").json()["data"]]):
        assert time.monotonic() < deadline, loaded
        time.sleep(0.2)


def test_what_vllm_cannot_answer_exactly_is_refused_naming_the_backend(service, trained) -> None:
    sampler = _sampler(service, trained["a"])
    with pytest.raises(
        tinker.BadRequestError, match=r"prompt_alt_tokens_k is not served by the vLLM sampler"
    ):
        sampler.sample(
            types.ModelInput.from_ints(PROMPTS[0]),
            1,
            types.SamplingParams(max_tokens=2),
            prompt_alt_tokens_k=2,
        ).result()


def test_the_openai_endpoints_sample_on_vllm_and_a_stream_joins_to_the_same_text(server, trained, reference):
    ai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-local", max_retries=0)
    path, prompt = trained["a"], "the cat sat on the"
    whole = ai.completions.create(model=path, prompt=prompt, max_tokens=12, temperature=0, stop=None)
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    stream = ai.completions.create(model=path, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(pieces) == whole.choices[0].text
    assert len([piece for piece in pieces if piece]) > 1  # vLLM's stream, forwarded as it comes
    chat = ai.chat.completions.create(
        model=path, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=6, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    # lm-evaluation-harness's scoring call: the prompt's logprobs, as the built-in sampler computes them
    scored = ai.completions.create(model=path, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert scored.choices[0].logprobs is not None
    expected = reference.sample(
        SampleRequest(
            np.asarray(list(prompt.encode())),
            SamplingParams(max_tokens=1),
            prompt_logprobs=True,
            snapshot=reference.snapshot(path),
        )
    )
    assert expected.prompt_logprobs is not None
    got = scored.choices[0].logprobs.token_logprobs
    np.testing.assert_allclose(got[1:], expected.prompt_logprobs[1:], atol=LOGPROB_ATOL)


RL_STEPS = 12  # as tests/cookbook/test_rl.py: learning takes off within them


def test_the_cookbooks_synchronous_rl_loop_runs_end_to_end_on_vllm(server, tmp_path) -> None:
    """tinker-cookbook's `rl.train.main` (tests/cookbook/ascii_rl.py), unmodified, sampling on vLLM: each
    step samples the snapshot saved after the last optimizer step. The reward rises (vLLM samples the new
    weights, not a stale adapter) and the cookbook's sample-vs-train KL is at fp32 rounding (vLLM's
    logprobs are the learner's)."""
    log_path = tmp_path / "run"
    Cookbook(server).run(
        "tests.cookbook.ascii_rl", f"log_path={log_path}", f"steps={RL_STEPS}", timeout_s=900
    )
    reward = metric(log_path, "env/all/reward/total")
    assert sorted(reward) == list(range(RL_STEPS))
    first, last = (reward[0] + reward[1]) / 2, (reward[RL_STEPS - 2] + reward[RL_STEPS - 1]) / 2
    assert last >= first + 0.4, reward
    kl = metric(log_path, "optim/kl_sample_train_v1")
    assert max(abs(v) for v in kl.values()) < 1e-3, kl


def _vllm_pid(server: Server) -> int:
    (vllm,) = httpx.get(f"{server.base_url}/api/v1/healthz").json()["sampler"]["servers"]
    port = vllm["url"].rsplit(":", 1)[1]
    found = subprocess.run(
        ["pgrep", "-f", f"vllm.entrypoints.openai.api_server.*--port {port}"], capture_output=True, text=True
    )
    (pid,) = [int(p) for p in found.stdout.split()]
    return pid


def _asample(http: httpx.Client, sampler_id: str, seq_id: int, max_tokens: int) -> dict:
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": seq_id,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPTS[0]}]},
        "sampling_params": {
            "max_tokens": max_tokens,
            "seed": 1,
            "temperature": 1.0,
            "top_k": -1,
            "top_p": 1.0,
            "stop": [],
        },
    }
    return http.post("/asample", json=body).json()


def _settle(http: httpx.Client, future: dict, timeout_s: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = http.post("/retrieve_future", json={"request_id": future["request_id"]})
        if answer.status_code != 200 or answer.json().get("type") != "try_again":
            return answer
    raise TimeoutError(future)


def _another_base_model(tiny_dir: Path, directory: Path) -> Path:
    """The tiny model's architecture and tokenizer with other random weights, each tensor drawn at its own
    scale (a checkpoint nobody trains on this server; norms kept)."""
    shutil.copytree(tiny_dir, directory)
    weights = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    other = {
        name: t if t.ndim == 1 else t.std() * torch.randn(t.shape, generator=generator)
        for name, t in weights.items()
    }
    save_file(other, directory / "model.safetensors")
    return directory


def test_vllm_url_servers_of_the_engines_base_model_sample_and_one_of_another_model_is_refused(
    server, reference, tmp_path
) -> None:
    """`--vllm-url` at a running vLLM server (the module's): a second loraplex serving the same base model
    samples on it greedily as the built-in sampler does; a third, serving a model of the same architecture
    with other weights, leaves it down, saying that it serves another base model (base_check.py)."""
    (vllm,) = httpx.get(f"{server.base_url}/api/v1/healthz").json()["sampler"]["servers"]
    other_model = _another_base_model(server.data_dir / "models" / "tiny", tmp_path / "other-model")
    (tmp_path / "same").mkdir()
    (tmp_path / "other").mkdir()
    with _servers(tmp_path / "same") as start:
        same = start("--sampler", "vllm", "--vllm-url", vllm["url"])
        wait_until_sampler_up(same)
        sampler = client(same).create_sampling_client(base_model="loraplex/tiny").result()
        params = types.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, stop=[])
        futures = [sampler.sample(types.ModelInput.from_ints(p), 1, params) for p in PROMPTS[:4]]
        for prompt, future in zip(PROMPTS, futures, strict=False):
            (sample,) = future.result().sequences
            tokens, logprobs, untied = _greedy_reference(reference, prompt, None)
            assert ids(sample.tokens) == tokens or not untied, prompt
            np.testing.assert_allclose(sample.logprobs[:1], logprobs[:1], atol=LOGPROB_ATOL)

    with _servers(tmp_path / "other") as start:
        other = start("--model", str(other_model), "--sampler", "vllm", "--vllm-url", vllm["url"])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            (refused,) = httpx.get(f"{other.base_url}/api/v1/healthz").json()["sampler"]["servers"]
            if refused["failure"]:
                break
            time.sleep(0.5)
        assert not refused["up"], refused
        assert "it serves another base model than the engine's" in refused["failure"], refused
        gap = float(refused["failure"].split("differ from the engine's by ")[1].split(" nats")[0])
        print(f"another random tiny model: logprobs {gap} nats apart on average")
        assert gap > MAX_MEAN_LOGPROB_GAP


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_vllm_server_that_dies_or_stalls_mid_sample_fails_it_retryably_then_comes_back(
    fault, server, service
) -> None:
    """kill -9 (or SIGSTOP, past --vllm-timeout-s) of the vLLM server while it samples: the request's
    future answers 410, the server is restarted, healthz and /metrics show it, and the next sample, through
    the SDK, succeeds. An SDK sample in flight at the fault sees what an RL loop sees: nothing but a delay
    (the SDK sends a sample whose future failed retryably again)."""
    http = httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": "tml-local"}, timeout=30)
    session = http.post("/create_session", json={}).json()["session_id"]
    sampler_id = http.post(
        "/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 0, "base_model": "loraplex/tiny"},
    ).json()["sampling_session_id"]
    downs_before = httpx.get(f"{server.base_url}/api/v1/healthz").json()["sampler"]["servers"][0]["restarts"]
    pid = _vllm_pid(server)
    sdk_sampler = _sampler(service, None)
    sdk_params = types.SamplingParams(max_tokens=1000, seed=3, stop=[])
    with ThreadPoolExecutor(1) as pool:
        sdk_pending = pool.submit(
            lambda: sdk_sampler.sample(types.ModelInput.from_ints(PROMPTS[2]), 1, sdk_params).result(
                timeout=600
            )
        )
        future = _asample(http, sampler_id, 0, max_tokens=3000)  # long enough to be in flight for seconds
        time.sleep(1.0)
        os.killpg(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        try:
            answer = _settle(http, future)
        finally:
            if fault == "stalled":
                os.killpg(pid, signal.SIGCONT)  # loraplex has killed it by now; harmless if it has
        assert answer.status_code == 410, answer.text
        assert "went down" in answer.json()["error"] or "could not be reached" in answer.json()["error"]

        health = wait_until_sampler_up(server, downs=downs_before + 1)
        (vllm,) = health["sampler"]["servers"]
        assert vllm["restarts"] == downs_before + 1
        assert ("exited" if fault == "killed" else "has not answered") in vllm["failure"]
        metrics = httpx.get(f"{server.base_url}/metrics", headers={"X-API-Key": "tml-local"}).text
        assert f'loraplex_sampler_server_down_total{{server="0"}} {downs_before + 1}.0' in metrics
        assert 'loraplex_sampler_server_up{server="0"} 1.0' in metrics
        assert len(sdk_pending.result().sequences[0].tokens) == 1000

    out = sdk_sampler.sample(
        types.ModelInput.from_ints(PROMPTS[0]), 2, types.SamplingParams(max_tokens=5, stop=[])
    ).result()
    assert [len(s.tokens) for s in out.sequences] == [5, 5]
