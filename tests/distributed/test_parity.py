"""Two data-parallel engine ranks compute what one rank computes: passes, fused steps, checkpoints.

The reference is a single-rank LocalEngine on the same tiny model, given the same calls; its float64 twin
measures its rounding, and every comparison allows a multiple of that (tests/model/rounding.py). One 2-rank
engine serves the module; each test creates its slots on both engines and frees them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch.distributed as dist

from loraplex.engine.interface import Engine
from loraplex.engine.sharding import split_by_tokens
from loraplex.engine.types import (
    AdamParams,
    LoraConfig,
    PassRequest,
    PassResult,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from loraplex.errors import UserError
from tests.distributed.conftest import (
    ReferenceEngine,
    ReferenceResult,
    adapter_state,
    rl_request,
    sft_request,
)
from tests.model.rounding import (
    NOISE_MULTIPLE,
    assert_at_most,
    assert_within_rounding,
    rounding_bound,
    sums_bound,
)

# AdamW (eps 1e-12) turns the rounding of a cancelling or near-zero gradient element into an update error
# as large as lr times its relative error: a few such elements carry most of an adapter tensor's error
# norm, in `got` and `want` alike, so a tensor's error is one sample of a ratio with a longer tail than
# a forward output's. Hence twice NOISE_MULTIPLE. Measured on an AMD EPYC, 3 parity modules, 2,661 tensors
# with non-zero noise: error / |want - exact| median 0.2, 5 above 2, none above 3.
ADAMW_NOISE_MULTIPLE = 2 * NOISE_MULTIPLE
CONFIGS = [
    LoraConfig(rank=4, seed=1),
    LoraConfig(rank=8, seed=2, train_unembed=False),
    LoraConfig(rank=2, seed=3, train_attn=False),
]
PARAMS = [
    AdamParams(learning_rate=1e-3),
    AdamParams(learning_rate=5e-4, weight_decay=0.1),
    AdamParams(learning_rate=1e-3, grad_clip_norm=1.0),
]


@contextmanager
def slots_on(*engines: Engine) -> Iterator[list[int]]:
    """The three CONFIGS as slots on every engine (the same ids), freed afterwards."""
    ids = [[engine.create_slot(config) for config in CONFIGS] for engine in engines]
    assert all(i == ids[0] for i in ids)
    try:
        yield ids[0]
    finally:
        for engine in engines:
            for slot in ids[0]:
                engine.free_slot(slot)


def training_pass(slots: list[int], seed: int) -> list[PassRequest]:
    """Several requests over the three slots, long and short datums, so both ranks hold some of each."""
    a, b, c = slots
    return [
        sft_request(a, [13, 5, 21], seed),
        rl_request(b, "ppo", [9, 17], seed + 1, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        sft_request(c, [30], seed + 2),
        rl_request(a, "importance_sampling", [11, 4], seed + 3),
    ]


def assert_results_equal(got: list[PassResult | UserError], want: list[PassResult | UserError]) -> None:
    """`got` as the reference's results `want`, within rounding, with the same errors and output shapes.

    - All outputs of the pass together (each key) within rounding_bound of the reference's, whose error is
      its distance to its float64 twin's outputs;
    - a request's loss:sum, a sum of its elementwise losses, within the exact difference of their sums
      plus the rounding of summing them on each side (sums_bound: an fp32 sum of n terms may be off by
      n·U·Σ|ℓ|, so a sum that cancels to near 0 keeps the absolute error of its terms);
    - every other metric (a mean of counted tokens) within rounding_bound of the reference's.
    """
    assert len(got) == len(want)
    outputs: dict[str, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]] = {}
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, UserError):
            assert isinstance(g, UserError) and str(g) == str(w)
            continue
        assert isinstance(g, PassResult) and isinstance(w, ReferenceResult)
        x = w.exact
        assert isinstance(x, PassResult)
        assert len(g.outputs) == len(w.outputs)
        for g_out, w_out, x_out in zip(g.outputs, w.outputs, x.outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                assert g_out[key].shape == w_out[key].shape
                for values, out in zip(
                    outputs.setdefault(key, ([], [], [])), (g_out, w_out, x_out), strict=True
                ):
                    values.append(out[key].reshape(-1))
        assert g.metrics.keys() == w.metrics.keys()
        for key in w.metrics:
            error = abs(g.metrics[key] - w.metrics[key])
            if key == "loss:sum":
                bound = sums_bound(
                    *(np.concatenate([o["elementwise_loss"] for o in r.outputs]) for r in (g, w))
                )
            else:
                bound = rounding_bound(w.metrics[key], x.metrics[key])
            assert_at_most(error, bound, f"request {index} {key}")
        # The server's own statistics are recomputed from the joined logprobs (checked above, and they
        # amplify rounding differently, e.g. a KL of near-equal logprobs): the same ones, and the trained
        # tokens, which depend on the loss inputs alone, exactly.
        assert g.health.keys() == w.health.keys()
        assert g.health["train/tokens"] == w.health["train/tokens"]
    for key, (g_all, w_all, x_all) in outputs.items():
        assert_within_rounding(np.concatenate(g_all), np.concatenate(w_all), np.concatenate(x_all), key)


def assert_adapters_equal(
    got: Engine, want: ReferenceEngine, slots: list[int], multiple: float = ADAMW_NOISE_MULTIPLE
) -> None:
    """Every weight and moment tensor of `got` within rounding_bound of the reference's, in norm (with
    `multiple`).

    Not elementwise: AdamW with eps 1e-12 turns a rounding-level difference in a near-zero gradient
    element (another summation order) into a full-size update of that element, for any change of order;
    the twin's tensors carry the same effect, so their distance to the reference's measures it too.
    """
    for slot in slots:
        got_state, want_state = adapter_state(got, slot), adapter_state(want, slot)
        exact_state = adapter_state(want.exact, slot)
        assert got_state.keys() == want_state.keys()
        for name, expected in want_state.items():
            what = f"slot {slot} {name}"
            assert_within_rounding(got_state[name], expected, exact_state[name], what, multiple)


def assert_adapters_identical(got: Engine, want: Engine, slots: list[int]) -> None:
    """Every weight and moment tensor bit for bit: a loaded checkpoint is a copy, with no arithmetic."""
    for slot in slots:
        got_state, want_state = adapter_state(got, slot), adapter_state(want, slot)
        assert got_state.keys() == want_state.keys()
        for name, expected in want_state.items():
            assert np.array_equal(got_state[name], expected), f"slot {slot} {name}"


def train(engines: tuple[Engine, ...], slots: list[int], steps: int, seed: int) -> None:
    """`steps` rounds of two training passes then one fused step of all slots, on every engine."""
    for step in range(steps):
        for engine in engines:
            for k in range(2):
                results = engine.run_pass(training_pass(slots, seed + 10 * step + 5 * k))
                assert all(isinstance(r, PassResult) for r in results)
            engine.optim_step(dict(zip(slots, PARAMS, strict=True)))


def test_a_mixed_pass_on_two_ranks_returns_the_single_rank_outputs_and_metrics(ranks, reference) -> None:
    with slots_on(ranks.engine, reference) as slots:
        train((ranks.engine, reference), slots, steps=1, seed=0)  # so that every adapter's B is non-zero
        a, b, c = slots
        bad = sft_request(b, [6], seed=7)
        bad.datums[0].tokens[2] = 10_000  # outside the vocabulary: rejected by rank 0 alone
        requests = [
            sft_request(a, [5, 17, 9], seed=1),
            rl_request(
                b, "ppo", [12, 30], seed=2, config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
            ),
            bad,
            rl_request(c, "importance_sampling", [8, 3], seed=3, forward_only=True),
            sft_request(None, [14], seed=4, forward_only=True),
            sft_request(a, [11], seed=5, top_k=3),
            rl_request(c, "cispo", [7, 19, 2], seed=6),
        ]
        assert all(split_by_tokens([r for r in requests if r is not bad], 2))  # both ranks get datums
        assert_results_equal(ranks.engine.run_pass(requests), reference.run_pass(requests))
        # Both ranks' shares of the pass reach the accumulators: the step after it matches too.
        for engine in (ranks.engine, reference):
            engine.optim_step(dict(zip(slots, PARAMS, strict=True)))
        assert_adapters_equal(ranks.engine.local, reference, slots)


def test_three_fused_steps_of_three_slots_leave_the_adapters_of_a_single_rank(ranks, reference) -> None:
    with slots_on(ranks.engine, reference) as slots:
        train((ranks.engine, reference), slots, steps=3, seed=100)
        assert_adapters_equal(ranks.engine.local, reference, slots)
        # Rank 1's replica is checked through its share of a pass after the steps.
        check = training_pass(slots, seed=999)
        assert_results_equal(ranks.engine.run_pass(check), reference.run_pass(check))


def test_a_checkpoint_saved_under_two_ranks_resumes_exactly_under_one(ranks, reference, tmp_path) -> None:
    with slots_on(ranks.engine, reference) as slots:
        train((ranks.engine,), slots, steps=2, seed=200)
        for slot in slots:
            ranks.engine.save_state(slot, tmp_path / f"slot{slot}", owner_digest="owner")
            assert reference.load_state(
                tmp_path / f"slot{slot}", "owner", with_optimizer=True, slot=slot
            ) == (
                slot,
                CONFIGS[slots.index(slot)],
            )
        assert_adapters_identical(reference, ranks.engine.local, slots)
        train((ranks.engine, reference), slots, steps=1, seed=300)
        assert_adapters_equal(ranks.engine.local, reference, slots)


def load_reference_checkpoints(
    engine: Engine, reference: ReferenceEngine, slots: list[int], into: Path
) -> None:
    """Each slot of the reference saved under `into` and loaded into the same slot of `engine`, and back
    into the reference (a copy; its twin then resumes from the state `engine` resumes from)."""
    for slot in slots:
        reference.save_state(slot, into / f"slot{slot}", owner_digest="owner")
        for loader in (engine, reference):
            loader.load_state(into / f"slot{slot}", "owner", with_optimizer=True, slot=slot)


def test_a_checkpoint_saved_under_one_rank_resumes_exactly_under_two(ranks, reference, tmp_path) -> None:
    with slots_on(ranks.engine, reference) as slots:
        train((reference,), slots, steps=2, seed=400)
        load_reference_checkpoints(ranks.engine, reference, slots, tmp_path)
        train((ranks.engine, reference), slots, steps=1, seed=500)
        assert_adapters_equal(ranks.engine.local, reference, slots)
        check = training_pass(slots, seed=501)
        assert_results_equal(ranks.engine.run_pass(check), reference.run_pass(check))


def test_a_checkpoint_loaded_into_a_new_slot_reaches_every_rank(ranks, reference, tmp_path) -> None:
    with slots_on(ranks.engine, reference) as slots:
        train((reference,), slots, steps=1, seed=600)
        reference.save_state(slots[0], tmp_path / "ckpt", owner_digest="owner")
        loaded = [
            engine.load_state(tmp_path / "ckpt", "owner", with_optimizer=False)
            for engine in (ranks.engine, reference)
        ]
        assert loaded[0] == loaded[1]
        new = loaded[0][0]
        try:
            check = [sft_request(new, [9, 14, 6, 20], seed=601)]
            assert_results_equal(ranks.engine.run_pass(check), reference.run_pass(check))
        finally:
            ranks.engine.free_slot(new)
            reference.free_slot(new)


def test_each_optim_step_does_exactly_one_gradient_all_reduce(ranks, monkeypatch) -> None:
    calls: list[tuple[str, int]] = []  # (collective, elements) of every tensor collective rank 0 enters
    for name in ("all_reduce", "broadcast"):
        original = getattr(dist, name)

        def counting(tensor, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, tensor.numel()))
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, name, counting)
    with slots_on(ranks.engine) as slots:
        sizes = [ranks.engine.local.pool.get(slot).adam.grads_N.numel() for slot in slots]
        assert calls == [("broadcast", n) for n in sizes]  # each new slot: one flat copy of rank 0's
        calls.clear()
        for seed in range(3):
            ranks.engine.run_pass(training_pass(slots, seed))
        assert calls == []  # passes never reduce
        ranks.engine.optim_step(dict(zip(slots, PARAMS, strict=True)))
        assert calls == [("all_reduce", sum(sizes))]  # three slots, three passes: one flat all-reduce
        ranks.engine.run_pass(training_pass(slots, seed=3))
        ranks.engine.optim_step({slots[1]: PARAMS[1]})
        assert calls == [("all_reduce", sum(sizes)), ("all_reduce", sizes[1])]


def test_sampling_spreads_over_the_ranks_and_each_answer_is_the_single_ranks(ranks, reference) -> None:
    outcomes = []
    for engine in (ranks.engine, reference):
        for index, request in enumerate(SAMPLE_REQUESTS):
            engine.add_sample(f"r{index}", request)
        if engine is ranks.engine:  # each rank is a sampling group here, and took half the queue
            assert sorted(ranks.engine._sample_group.values()) == [0] * 4 + [1] * 4
        outcomes.append(drain_sampler(engine))
    assert_same_samples(*outcomes)


# Eight requests, greedy and seeded, of several prompt lengths and sample counts; half of them stream.
SAMPLE_REQUESTS = [
    SampleRequest(
        np.array([5, 9, 2, 44, 17, 3][: 2 + k % 5], np.int64),
        SamplingParams(max_tokens=4 + k % 3, temperature=0.0 if k % 2 else 1.0, seed=k),
        num_samples=1 + k % 2,
        streams=k % 4 < 2,
    )
    for k in range(8)
]


def drain_sampler(engine: Engine) -> dict[str, object]:
    """Step `engine`'s sampler until it has no work; every finished request's result by key. Each
    streaming request's progress joins to its samples' tokens but the last (which finishes it)."""
    finished: dict[str, object] = {}
    reported: dict[str, list[list[int]]] = {}
    while engine.has_sampling_work():
        finished.update(engine.step_sampler())
        for key, progress in engine.take_sample_progress().items():
            so_far = reported.setdefault(key, [[] for _ in progress.tokens])
            for tokens, new in zip(so_far, progress.tokens, strict=True):
                tokens += new
    for key, result in finished.items():
        assert isinstance(result, SampleResult), result
        if SAMPLE_REQUESTS[int(key[1:])].streams:
            assert reported[key] == [sequence.tokens[:-1].tolist() for sequence in result.sequences]
        else:
            assert key not in reported
    return finished


def assert_same_samples(got: dict[str, object], want: dict[str, object]) -> None:
    """The same requests finished, each with the same tokens and stop reasons (their logprobs' bounds are
    the sampler tests' concern)."""
    assert got.keys() == want.keys()
    for key, result in want.items():
        drawn = [[(s.tokens.tolist(), s.stop_reason) for s in r.sequences] for r in (got[key], result)]
        assert drawn[0] == drawn[1], key
