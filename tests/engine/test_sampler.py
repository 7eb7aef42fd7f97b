"""The sampler: greedy equals transformers, logprobs equal scoring, seeds reproduce, stops are exact,
and a request's tokens never depend on the snapshots and requests sharing its decode steps."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, Qwen3Config

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.sampler.generation import _Sequence
from loraplex.engine.sampler.sampling import draw_token_reference, draw_tokens
from loraplex.engine.sampler.stops import IncrementalDetokenizer, StopChecker
from loraplex.engine.types import (
    AdamParams,
    DatumInput,
    LoraConfig,
    PassRequest,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from loraplex.errors import NotFoundError, UserError
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.packing import PackedSequences
from tests.engine.conftest import randomize_lora_b
from tests.model.rounding import U, assert_within_rounding
from tests.model.test_decoder_parity import save_random_hf_model

EOS = 258  # the tiny model's <|im_end|>
XYZ = list(b"xyz")  # run "xyz" learns to repeat these bytes
AB_EOS = [*b"ab", EOS]  # run "ab" learns "ab<|im_end|>" over and over
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, stop=())


def tokens_of(text: bytes) -> np.ndarray:
    """Tiny-tokenizer ids of a byte string: byte b is token b."""
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def sample_all(
    engine: LocalEngine, requests: dict[str, SampleRequest], join_every: int = 0
) -> dict[str, SampleResult]:
    """Run requests to completion; join_every = n adds one request every n steps (continuous batching)."""
    pending = list(requests.items())
    results: dict[str, SampleResult] = {}
    step = 0
    while pending or engine.has_sampling_work():
        while pending and (join_every == 0 or step % join_every == 0):
            engine.add_sample(*pending.pop(0))
            if join_every:
                break
        for key, result in engine.step_sampler():
            assert not isinstance(result, UserError), result
            results[key] = result
        step += 1
    return results


def sample_one(engine: LocalEngine, request: SampleRequest) -> SampleResult:
    return sample_all(engine, {"only": request})["only"]


def train(engine: LocalEngine, slot: int, pattern: list[int], steps: int) -> None:
    """Next-token cross-entropy on the pattern repeated, AdamW after each pass."""
    text = np.array(pattern * 20, dtype=np.int64)
    datum = DatumInput(text[:-1], {"target_tokens": text[1:], "weights": np.ones(len(text) - 1, np.float32)})
    for _ in range(steps):
        engine.run_pass([PassRequest(slot, "cross_entropy", {}, [datum], forward_only=False)])
        engine.optim_step({slot: AdamParams(learning_rate=5e-3)})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 4, 8, None)


def float64_twin(engine: LocalEngine) -> LocalEngine:
    """The engine's model in float64 behind its own sampler (logprobs still normalised in fp32, as the
    sampler does): what a comparison's expected side computes, exact to fp32 rounding."""
    decoder = load_decoder(Path(engine.info.tokenizer_dir), "cpu", torch.float64)
    return LocalEngine(decoder, engine.info, engine.max_slots)


@pytest.fixture(scope="module")
def twin(engine: LocalEngine) -> LocalEngine:
    return float64_twin(engine)


def same_tokens(results: Iterable[SampleResult]) -> list[list[int]]:
    """Each result's sequences' tokens, asserted equal across results (a twin drew what the engine drew)."""
    tokens = [[s.tokens.tolist() for s in result.sequences] for result in results]
    assert all(t == tokens[0] for t in tokens), tokens
    return tokens[0]


@pytest.fixture(scope="module")
def snapshots(engine: LocalEngine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs, each saved after 6 and after 15 training steps (when it has learnt its pattern)."""
    directory = tmp_path_factory.mktemp("snapshots")
    found = {}
    for name, pattern, config in (
        ("xyz", XYZ, LoraConfig(rank=4, seed=1)),
        ("ab", AB_EOS, LoraConfig(rank=8, seed=2, train_unembed=False)),
    ):
        slot = engine.create_slot(config)
        for steps, total in ((6, 6), (9, 15)):
            train(engine, slot, pattern, steps)
            found[f"{name}@{total}"] = directory / f"{name}-{total}"
            engine.save_snapshot(slot, found[f"{name}@{total}"])
        engine.free_slot(slot)
    return found


# ---- parity with transformers


@pytest.fixture(scope="module")
def random_qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalEngine, Path]:
    """A random Qwen3 loud enough that greedy text varies, served by a LocalEngine."""
    directory = tmp_path_factory.mktemp("qwen3")
    shapes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    save_random_hf_model(Qwen3Config(**shapes, num_attention_heads=4, num_key_value_heads=2), directory)
    return build_local_engine(str(directory), directory, "cpu", 2, 8, None), directory


def transformers_greedy(model: torch.nn.Module, prompt: np.ndarray, max_tokens: int) -> list[int]:
    output = model.generate(
        torch.from_numpy(prompt)[None], max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
    )
    return output[0, len(prompt) :].tolist()


PROMPTS = {"short": np.array([5, 17, 99]), "long": np.arange(3, 40, 3), "one": np.array([64])}


def test_greedy_equals_transformers_generate_for_the_base_model(random_qwen3) -> None:
    engine, directory = random_qwen3
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    results = sample_all(engine, {key: SampleRequest(prompt, GREEDY) for key, prompt in PROMPTS.items()})
    for key, prompt in PROMPTS.items():
        assert results[key].sequences[0].tokens.tolist() == transformers_greedy(hf_model, prompt, 12)
        assert results[key].sequences[0].stop_reason == "length"
    assert len({tuple(result.sequences[0].tokens) for result in results.values()}) == len(PROMPTS)


def test_greedy_equals_transformers_generate_for_a_peft_adapter(random_qwen3, tmp_path: Path) -> None:
    from peft import PeftModel

    engine, directory = random_qwen3
    slot = engine.create_slot(LoraConfig(rank=4, seed=3))
    randomize_lora_b(engine.pool.get(slot).weights, 0.1, torch.Generator().manual_seed(0))
    engine.save_snapshot(slot, tmp_path / "snap")
    engine.free_slot(slot)
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "snap").eval()

    requests = {
        key: SampleRequest(prompt, GREEDY, snapshot=tmp_path / "snap") for key, prompt in PROMPTS.items()
    }
    results = sample_all(engine, {**requests, "base": SampleRequest(PROMPTS["long"], GREEDY)})
    for key, prompt in PROMPTS.items():
        assert results[key].sequences[0].tokens.tolist() == transformers_greedy(peft_model, prompt, 12)
    assert results["base"].sequences[0].tokens.tolist() != results["long"].sequences[0].tokens.tolist()


# ---- logprobs


def test_sampled_logprobs_at_temperature_one_equal_compute_logprobs(engine, twin, snapshots) -> None:
    for snapshot in (None, snapshots["xyz@15"]):
        prompt = tokens_of(b"xyz")
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, stop=())
        sampled = sample_one(engine, SampleRequest(prompt, params, snapshot=snapshot)).sequences[0]
        # compute_logprobs, exactly as the SDK sends it.
        scoring = SampleRequest(
            np.concatenate([prompt, sampled.tokens]),
            SamplingParams(max_tokens=1, temperature=1.0),
            prompt_logprobs=True,
            snapshot=snapshot,
        )
        scored, exact = sample_one(engine, scoring), sample_one(twin, scoring)
        assert math.isnan(scored.prompt_logprobs[0])
        n = len(prompt)
        assert_within_rounding(
            sampled.logprobs, scored.prompt_logprobs[n:], exact.prompt_logprobs[n:], "logprobs"
        )


def test_prompt_logprobs_equal_the_training_forward_and_topk_is_the_full_distribution(engine, twin) -> None:
    prompt = tokens_of(b"the quick brown fox")
    engine.sampler.chunk_size = 4  # several chunks over one prompt
    try:
        result = sample_one(
            engine, SampleRequest(prompt, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=3)
        )
    finally:
        engine.sampler.chunk_size = 1024
    datum = DatumInput(prompt[:-1], {"target_tokens": prompt[1:]})
    forward, exact = (
        e.run_pass([PassRequest(None, "cross_entropy", {}, [datum], forward_only=True)])[0]
        for e in (engine, twin)
    )
    want, want_exact = (r.outputs[0]["logprobs"] for r in (forward, exact))
    assert_within_rounding(result.prompt_logprobs[1:], want, want_exact, "prompt logprobs")

    with torch.no_grad():
        packing = PackedSequences.from_lengths([len(prompt)])
        full, full_exact = (
            torch.log_softmax(e.decoder.logits(torch.from_numpy(prompt), packing), -1) for e in (engine, twin)
        )
    values, ids = full[:-1].topk(3, dim=-1)
    assert (result.topk_prompt_ids[0] == -1).all() and np.isnan(result.topk_prompt_logprobs[0]).all()
    assert result.topk_prompt_ids[1:].tolist() == ids.tolist()
    exact_values = full_exact[:-1].gather(-1, ids)
    assert_within_rounding(result.topk_prompt_logprobs[1:], values, exact_values, "top-k logprobs")


def test_prompt_logprobs_last_n_leaves_earlier_positions_nan(engine, twin) -> None:
    prompt = tokens_of(b"abcdefgh")
    request = SampleRequest(prompt, GREEDY, prompt_logprobs=True)
    everything, exact = sample_one(engine, request), sample_one(twin, request)
    last_3 = sample_one(engine, SampleRequest(prompt, GREEDY, prompt_logprobs=True, prompt_logprobs_last_n=3))
    assert np.isnan(last_3.prompt_logprobs[:5]).all()
    assert_within_rounding(
        last_3.prompt_logprobs[5:], everything.prompt_logprobs[5:], exact.prompt_logprobs[5:], "logprobs"
    )


# ---- seeds


def test_same_seed_same_tokens_different_seeds_and_samples_differ(engine) -> None:
    prompt = tokens_of(b"hello")

    def sample(seed: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, stop=())
        result = sample_one(engine, SampleRequest(prompt, params, num_samples=3))
        return [sequence.tokens.tolist() for sequence in result.sequences]

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first
    assert len({tuple(tokens) for tokens in first}) == 3


def test_samples_sharing_one_prefill_decode_like_a_request_of_one(engine, twin, snapshots) -> None:
    request = SampleRequest(tokens_of(b"yz"), GREEDY, snapshot=snapshots["ab@6"])
    single, exact = sample_one(engine, request), sample_one(twin, request)
    same_tokens([single, exact])
    shared = sample_one(
        engine, SampleRequest(tokens_of(b"yz"), GREEDY, num_samples=3, snapshot=snapshots["ab@6"])
    )
    for sequence in shared.sequences:
        assert sequence.tokens.tolist() == single.sequences[0].tokens.tolist()
        want, want_exact = single.sequences[0].logprobs, exact.sequences[0].logprobs
        assert_within_rounding(sequence.logprobs, want, want_exact, "logprobs")


# ---- stops


@pytest.fixture(scope="module")
def tokenizer(engine) -> Tokenizer:
    return engine.sampler.tokenizer


def stops_at(checker: StopChecker, tokens: Iterable[int]) -> int | None:
    """Index of the token on which the checker first says stop."""
    return next((i for i, token in enumerate(tokens) if checker.is_stop(token)), None)


def test_a_stop_string_is_found_on_the_token_that_completes_it(tokenizer) -> None:
    text = b"ab zxy! zxy"
    assert stops_at(StopChecker([], ["zxy"], tokenizer), text) == 5  # "zxy" spans tokens 3, 4, 5
    assert stops_at(StopChecker([], ["!", "y! "], tokenizer), text) == 6
    assert stops_at(StopChecker([], ["zz"], tokenizer), text) is None
    # "é" is two byte tokens: the string completes on its second byte, not on the first.
    assert stops_at(StopChecker([], ["aé"], tokenizer), "xaé".encode()) == 3
    assert stops_at(StopChecker([], ["<|im_end|>"], tokenizer), [*b"ok", EOS]) == 2  # special tokens as text
    assert stops_at(StopChecker([ord("b")], [], tokenizer), text) == 1


def test_incremental_text_equals_decoding_everything(tokenizer) -> None:
    tokens = [*"naïve 世界 🎉 ok".encode(), EOS, 300, *b"end"]  # 300: an id the tokenizer has no text for
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token) for token in tokens]
    assert "".join(pieces) == tokenizer.decode(tokens, skip_special_tokens=False)


def test_stop_strings_and_stop_tokens_end_to_end(engine, snapshots) -> None:
    request = SampleRequest(tokens_of(b"xyzx"), SamplingParams(max_tokens=20, temperature=0.0, stop=()))
    request.snapshot = snapshots["xyz@15"]
    free = sample_one(engine, request).sequences[0].tokens.tolist()
    assert bytes(free).startswith(b"yzxyzx")

    request.params = SamplingParams(max_tokens=20, temperature=0.0, stop=("zxy",))
    stopped = sample_one(engine, request).sequences[0]
    end = bytes(free).find(b"zxy") + 3
    assert stopped.tokens.tolist() == free[:end] and stopped.stop_reason == "stop"

    request.params = SamplingParams(max_tokens=20, temperature=0.0, stop=(ord("x"),))
    stopped = sample_one(engine, request).sequences[0]
    assert stopped.tokens.tolist() == free[: free.index(ord("x")) + 1] and stopped.stop_reason == "stop"


@pytest.mark.parametrize(
    ("stop", "expected_length", "reason"),
    [(None, 1, "stop"), (("q",), 1, "stop"), ((ord("q"),), 1, "stop"), ((), 12, "length")],
    ids=["none_stops_at_eos", "stop_strings_keep_eos", "stop_ids_keep_eos", "empty_list_runs_past_eos"],
)
def test_eos_stops_unless_the_stop_list_is_empty(engine, snapshots, stop, expected_length, reason) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=stop)
    request = SampleRequest(tokens_of(b"ab"), params, snapshot=snapshots["ab@15"])
    sequence = sample_one(engine, request).sequences[0]
    assert sequence.tokens[0] == EOS  # the run learnt "ab" -> <|im_end|>
    assert len(sequence.tokens) == expected_length and sequence.stop_reason == reason


# ---- batching across snapshots


def test_a_mixed_batch_of_four_snapshots_and_base_gives_each_request_its_tokens_alone(
    engine, twin, snapshots
) -> None:
    requests = {}
    for i, snapshot in enumerate([None, *snapshots.values()]):
        prompt = tokens_of(b"xyzab"[: 2 + i])
        requests[f"greedy{i}"] = SampleRequest(prompt, GREEDY, snapshot=snapshot)
        seeded = SamplingParams(max_tokens=9 + i, temperature=1.0, seed=i, stop=None)
        requests[f"seeded{i}"] = SampleRequest(prompt, seeded, num_samples=2, snapshot=snapshot)
    alone = {key: sample_one(engine, request) for key, request in requests.items()}
    exact = {key: sample_one(twin, request) for key, request in requests.items()}
    for key in alone:
        same_tokens([alone[key], exact[key]])
    for join_every in (0, 2):  # all at once, then joining while others decode
        together = sample_all(engine, requests, join_every)
        for key, result in alone.items():
            for ours, theirs, exactly in zip(
                together[key].sequences, result.sequences, exact[key].sequences, strict=True
            ):
                assert ours.tokens.tolist() == theirs.tokens.tolist(), key
                assert_within_rounding(ours.logprobs, theirs.logprobs, exactly.logprobs, key)
    assert len({tuple(alone[f"greedy{i}"].sequences[0].tokens.tolist()) for i in range(5)}) == 5


def test_an_older_snapshot_keeps_sampling_the_old_model_after_more_training(engine, tmp_path: Path) -> None:
    slot = engine.create_slot(LoraConfig(rank=4, seed=5))
    request = SampleRequest(tokens_of(b"xy"), SamplingParams(max_tokens=8, seed=3, stop=()), num_samples=2)
    train(engine, slot, XYZ, 3)
    engine.save_snapshot(slot, tmp_path / "old")
    request.snapshot = tmp_path / "old"
    before = sample_one(engine, request)
    train(engine, slot, XYZ, 3)
    engine.save_snapshot(slot, tmp_path / "new")
    engine.free_slot(slot)

    after = sample_one(engine, request)
    request.snapshot = tmp_path / "new"
    newer = sample_one(engine, request)
    for old, again, new in zip(before.sequences, after.sequences, newer.sequences, strict=True):
        assert again.tokens.tolist() == old.tokens.tolist()
        np.testing.assert_array_equal(again.logprobs, old.logprobs)
        assert np.abs(new.logprobs - old.logprobs).max() > 1e-3


def test_evicted_snapshots_reload_from_disk_with_identical_results(engine, snapshots) -> None:
    # A decoder of its own: snapshot ids of two engines on one decoder would collide.
    decoder = load_decoder(engine.info.tokenizer_dir)
    small = LocalEngine(decoder, engine.info, max_slots=1, snapshot_capacity=1)
    requests = {
        name: SampleRequest(tokens_of(b"xa"), SamplingParams(max_tokens=6, seed=1, stop=()), snapshot=path)
        for name, path in snapshots.items()
    }
    first = {name: sample_one(small, request) for name, request in requests.items()}
    again = {name: sample_one(small, request) for name, request in requests.items()}
    concurrent = sample_all(small, requests)  # each waits for the one snapshot place to be released
    assert small.sampler.snapshots.loads == 3 * len(requests)
    assert len(small.sampler.snapshots.resident_ids) == 1
    for name in requests:
        expected = first[name].sequences[0]
        for results in (again, concurrent):
            assert results[name].sequences[0].tokens.tolist() == expected.tokens.tolist()
            np.testing.assert_array_equal(results[name].sequences[0].logprobs, expected.logprobs)


# ---- requests that fail


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt": np.array([1, 600])}, "prompt has token id 600"),
        ({"prompt": np.zeros(4096, dtype=np.int64)}, "prompt has 4096 tokens"),
        ({"num_samples": 0}, "num_samples"),
        ({"params": SamplingParams(temperature=-1.0)}, "temperature"),
        ({"params": SamplingParams(top_k=0)}, "top_k"),
        ({"params": SamplingParams(top_p=0.0)}, "top_p"),
        ({"params": SamplingParams(max_tokens=4095)}, "max_tokens"),
        ({"params": SamplingParams(seed=-1)}, "seed"),
        ({"params": SamplingParams(stop=("",))}, "empty stop string"),
        ({"params": SamplingParams(stop=(512,))}, "stop has token id 512"),
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
    ],
)
def test_invalid_requests_name_the_field(engine, change: dict, field: str) -> None:
    request = SampleRequest(**{"prompt": np.array([1, 2, 3]), **change})
    with pytest.raises(UserError, match=field):
        engine.validate_sample_request(request)
    assert not engine.has_sampling_work()


def test_a_snapshot_that_cannot_load_fails_only_its_own_request(engine, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="missing"):
        engine.validate_sample_request(SampleRequest(np.array([1]), snapshot=tmp_path / "missing"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{}")
    engine.add_sample("broken", SampleRequest(np.array([1]), GREEDY, snapshot=tmp_path / "broken"))
    engine.add_sample("fine", SampleRequest(np.array([1]), GREEDY))
    outcomes = {}
    while engine.has_sampling_work():
        outcomes.update(engine.step_sampler())
    assert isinstance(outcomes["broken"], UserError) and "broken" in str(outcomes["broken"])
    assert len(outcomes["fine"].sequences[0].tokens) == GREEDY.max_tokens


def test_a_failed_step_drops_every_request_and_the_next_ones_run(engine, snapshots, monkeypatch) -> None:
    request = SampleRequest(tokens_of(b"xy"), GREEDY, snapshot=snapshots["xyz@6"])
    expected = sample_one(engine, request).sequences[0].tokens.tolist()
    engine.add_sample("first", request)
    engine.step_sampler()
    engine.add_sample("second", request)

    def broken(*args: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.decoder, "forward_cached", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step_sampler()
    monkeypatch.undo()
    assert not engine.has_sampling_work() and engine.sampler.cache.num_live_rows == 0
    assert sample_one(engine, request).sequences[0].tokens.tolist() == expected


def test_the_prefill_budget_admits_at_least_one_request_per_step(engine) -> None:
    for key in "abc":
        engine.add_sample(
            key, SampleRequest(tokens_of(b"0123456789"), SamplingParams(max_tokens=3, temperature=0))
        )
    assert engine.sampler.cache.num_live_rows == 0
    engine.step_sampler(max_prefill_tokens=15)  # 10 + 10 > 15: only "a" is admitted
    assert engine.sampler.cache.num_live_rows == 1
    engine.step_sampler(max_prefill_tokens=20)
    assert engine.sampler.cache.num_live_rows == 2  # "a" finished (3 tokens), "b" and "c" joined
    while engine.has_sampling_work():
        engine.step_sampler()


# ---- drawing tokens


@pytest.mark.parametrize("max_tokens", [5, 150])
def test_a_samples_uniforms_are_its_generators_stream_though_drawn_ahead(max_tokens: int) -> None:
    """Drawn up to 64 at a time, and never past the sample's max_tokens, the uniforms are the float64s one
    torch.rand(1) per draw gives: a seed samples the same tokens however many are drawn ahead."""
    generator = torch.Generator().manual_seed(11)
    sequence = _Sequence(0, SamplingParams(), max_tokens, generator, None)  # type: ignore[arg-type]
    one_by_one = torch.Generator().manual_seed(11)
    for _ in range(max_tokens):
        assert sequence.next_uniform() == torch.rand(1, generator=one_by_one, dtype=torch.float64).item()
        sequence.tokens.append(0)
    assert sequence.uniforms_ahead == []
    # Nothing drawn past max_tokens: the generator is where max_tokens single draws leave it.
    assert torch.equal(sequence.generator.get_state(), one_by_one.get_state())


def test_draw_tokens_equals_the_per_row_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 50, generator=generator)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.8),
        SamplingParams(temperature=2.0, top_k=1),
    ]
    got, want, exact = [], [], []
    for _ in range(20):
        uniforms = torch.rand(6, generator=generator, dtype=torch.float64)
        tokens, logprobs = draw_tokens(logits, params, uniforms)
        for b in range(6):
            token, logprob = draw_token_reference(logits[b], params[b], float(uniforms[b]))
            assert int(tokens[b]) == token
            got.append(float(logprobs[b]))
            want.append(logprob)
            exact.append(draw_logprob_exact(logits[b], params[b], token))
    assert_within_rounding(np.array(got), np.array(want), np.array(exact), "logprobs")


def draw_logprob_exact(logits_V: torch.Tensor, params: SamplingParams, token: int) -> float:
    """The logprob of `token` under the distribution `params` draws from (sampling.py's docstring), in
    float64: tempered log_softmax; the top_k likeliest; the shortest prefix of them, likeliest first, whose
    renormalised mass reaches top_p; renormalised over what is kept. Greedy: the temperature-1 logprob."""
    lp_V = torch.log_softmax(logits_V.double() / (params.temperature or 1.0), -1)
    if params.temperature == 0:
        return float(lp_V[token])
    order = torch.argsort(-lp_V, stable=True)[: params.top_k if params.top_k > 0 else len(lp_V)]
    mass = lp_V[order].exp() / lp_V[order].exp().sum()
    kept = order[: int((mass.cumsum(0) < params.top_p).sum()) + 1]
    assert token in kept.tolist()
    return float(torch.log_softmax(lp_V[kept], -1)[kept.tolist().index(token)])


def test_truncated_draws_report_the_renormalised_probability() -> None:
    """Golden: probabilities 0.5, 0.3, 0.15, 0.05; top_p 0.7 keeps the first two, renormalised 5/8, 3/8."""
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    # fp32 logits (each rounded, U), a log_softmax over four and one over the kept (a few exp, log and
    # sums each, every one rounding by U or an ulp): under 16 roundings of the logits' scale, so 32U of it.
    tolerance = 32 * U * float(logits.abs().max())
    params = [SamplingParams(top_p=0.7)]
    token, logprob = draw_tokens(logits, params, torch.tensor([0.7]))
    assert int(token) == 1 and abs(float(logprob) - math.log(3 / 8)) < tolerance
    token, logprob = draw_tokens(logits, [SamplingParams(top_k=3)], torch.tensor([0.99]))
    assert int(token) == 2 and abs(float(logprob) - math.log(0.15 / 0.95)) < tolerance
    token, logprob = draw_tokens(logits, [SamplingParams(temperature=0.0)], torch.tensor([0.99]))
    assert int(token) == 0 and abs(float(logprob) - math.log(0.5)) < tolerance
