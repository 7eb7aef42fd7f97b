"""`loraplex serve --nproc 2` through the official SDK: it trains as `--nproc 1` does, reports every rank's
bytes on /metrics, stops its ranks when it stops (or dies), and exits with a clear message when a rank
dies; runs then resume from checkpoints.

Servers are real subprocesses on free loopback ports (tests/e2e/conftest.py), always stopped.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import Server
from tests.e2e.sdk import base_model, client, logprobs
from tests.e2e.test_export import peft_logprobs, tinker_cli
from tests.e2e.test_observability import scrape_until, tiny_plan

LENGTHS = (6, 11, 17, 4)  # per datum: both ranks get some of each request


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def _datums(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    datums = []
    for n in lengths:
        tokens = rng.integers(0, 256, n + 1)
        inputs = {"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(n, np.float32)}
        datums.append(
            types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs)
        )
    return datums


def _train(run: tinker.TrainingClient, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        fb = run.forward_backward(_datums(step), "cross_entropy")
        opt = run.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def _logprobs(run: tinker.TrainingClient) -> np.ndarray:
    out = run.forward(_datums(99), "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def _children(server: Server) -> list[int]:
    """Pids of the server's child processes: its engine ranks."""
    assert server.proc is not None
    pid = server.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _is_gone(pid: int) -> bool:
    """Whether the process has exited (a zombie counts: it no longer runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _server(tmp_path: Path, name: str, *args: str) -> Server:
    """A server (not yet started) on tmp_path/name."""
    data_dir = tmp_path / name
    data_dir.mkdir(exist_ok=True)
    return Server(data_dir, list(args))


def _rank_bytes(server: Server, ranks: int, adapter: int) -> dict[tuple[int, str], float]:
    """loraplex_rank_parameter_bytes of every rank by kind, once each rank reports `adapter` bytes of
    adapters (the engine loop refreshes the gauges about once a second)."""
    key = "loraplex_rank_parameter_bytes"
    samples = scrape_until(
        server,
        lambda s: all(s.get((key, (("kind", "adapter"), ("rank", str(r))))) == adapter for r in range(ranks)),
    )
    found = {}
    for (name, pairs), v in samples.items():
        if name == key:
            labels = dict(pairs)
            found[(int(labels["rank"]), labels["kind"])] = v
    return found


def test_two_ranks_train_through_the_sdk_as_one_rank_does_and_stop_with_the_server(tmp_path) -> None:
    outcomes, held = [], []
    for nproc in ("1", "2"):
        server = _server(tmp_path, f"nproc{nproc}", "--nproc", nproc)
        try:
            server.start()
            workers = _children(server)
            assert len(workers) == int(nproc) - 1
            run = (
                client(server)
                .create_lora_training_client(base_model=base_model(server), rank=8, seed=1)
                .result()
            )
            outcomes.append((_train(run, 3), _logprobs(run)))
            plan = tiny_plan(server)
            held.append(_rank_bytes(server, int(nproc), plan.slot.weights))
        finally:
            server.stop()
        assert all(_is_gone(pid) for pid in workers)
    assert server.proc is not None and server.proc.returncode == 0  # rank 0 stopped its ranks in order
    (losses_1, logprobs_1), (losses_2, logprobs_2) = outcomes
    np.testing.assert_allclose(losses_2, losses_1, rtol=1e-5)
    np.testing.assert_allclose(logprobs_2, logprobs_1, rtol=1e-5, atol=1e-6)
    # Each rank holds the whole base and a replica of the run's slot; a step after every pass leaves the
    # undo buffer empty, so the optimizer holds the slot's gradient rows and moments alone.
    one_rank = {
        "base": plan.base,
        "adapter": plan.slot.weights,
        "optimizer": plan.slot.gradients + plan.slot.moments,
    }
    assert held[0] == {(0, kind): v for kind, v in one_rank.items()}
    assert held[1] == {(rank, kind): v for rank in (0, 1) for kind, v in one_rank.items()}


def test_a_dead_rank_stops_the_server_with_a_clear_message_and_runs_resume_after_a_restart(tmp_path) -> None:
    server = _server(tmp_path, "data", "--nproc", "2")
    try:
        server.start()
        run = (
            client(server).create_lora_training_client(base_model=base_model(server), rank=8, seed=1).result()
        )
        _train(run, 2)
        checkpoint = run.save_state("before").result().path
        expected = _logprobs(run)
        (worker,) = _children(server)
        os.kill(worker, signal.SIGKILL)
        assert server.proc is not None
        assert server.proc.wait(timeout=30) == 1
    finally:
        server.stop()
    log = (tmp_path / f"server-{server.port}.log").read_text()
    assert "engine rank 1 exited with code -9" in log and "restart" in log

    # On the same port, where the first SDK client's session heartbeats carry on.
    restarted = Server(server.data_dir, list(server.args), server.port, clients=server.clients)
    try:
        restarted.start()
        service = client(restarted)
        resumed = service.create_training_client_from_state_with_optimizer(checkpoint).result()
        np.testing.assert_allclose(_logprobs(resumed), expected, rtol=1e-6)
        # And a killed server takes its ranks with it.
        (worker,) = _children(restarted)
        restarted.close_clients()
        restarted.kill()
        deadline = time.monotonic() + 10
        while not _is_gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _is_gone(worker)
    finally:
        restarted.stop()


def _greedy(run: tinker.TrainingClient) -> list[int]:
    """Six greedy tokens of the run's current weights (through a sampler snapshot)."""
    sampler = run.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    prompt = types.ModelInput.from_ints([5, 9, 2, 44, 17])
    return list(sampler.sample(prompt, 1, params).result().sequences[0].tokens)


def test_tensor_parallel_ranks_train_sample_and_resume_on_one_rank_through_the_sdk(tmp_path) -> None:
    """`serve --nproc 2 --tp 2` trains, samples, exports and reports its split as one rank does; a rank
    killed in the middle of a pass stops it with the rank named, and the pass's future fails with that
    cause; its checkpoint then resumes on one rank of the same data dir."""
    server = _server(tmp_path, "data", "--nproc", "2", "--tp", "2")
    try:
        server.start()
        service = client(server)
        run = service.create_lora_training_client(base_model=base_model(server), rank=8, seed=1).result()
        losses = _train(run, 3)
        assert losses[-1] < losses[0]
        checkpoint = run.save_state("tp").result().path
        expected, tokens = _logprobs(run), _greedy(run)
        # The PEFT export, downloaded with the tinker CLI, gives HF peft this server's logprobs.
        export = run.save_weights_external("final").result().path
        out = tmp_path / "out"
        done = tinker_cli(server, "tml-local", "checkpoint", "download", export, "--output", str(out))
        assert done.returncode == 0, done.stderr
        adapter = out / export.removeprefix("tinker://").replace("/", "_")
        np.testing.assert_allclose(peft_logprobs(server, adapter)[0], logprobs(run), atol=1e-4)
        # Both ranks hold what the memory plan states for one rank of two (the tiny model splits evenly).
        plan = tiny_plan(server, tp=2)
        one_rank = {
            "base": plan.base,
            "adapter": plan.slot.weights,
            "optimizer": plan.slot.gradients + plan.slot.moments,
        }
        held = _rank_bytes(server, 2, plan.slot.weights)
        assert held == {(rank, kind): v for rank in (0, 1) for kind, v in one_rank.items()}
        assert plan.base <= 0.55 * tiny_plan(server).base
        # A pass long enough to be killed in (timed undisturbed first), and rank 1 killed a quarter in.
        long = _datums(7, (2000,) * 4)
        start = time.monotonic()
        run.forward_backward(long, "cross_entropy").result()
        pass_s = time.monotonic() - start
        in_flight = run.forward_backward(long, "cross_entropy")
        time.sleep(pass_s / 4)
        (worker,) = _children(server)
        os.kill(worker, signal.SIGKILL)
        assert server.proc is not None and server.proc.wait(timeout=30) == 1
    finally:
        server.stop()
    log = (tmp_path / f"server-{server.port}.log").read_text()
    assert "engine rank 1 exited with code -9" in log and "restart" in log

    one = Server(server.data_dir, ["--nproc", "1"], server.port, clients=server.clients)
    try:
        one.start()
        # The SDK, retrying while no server answered, gets the pass's failure from the restarted one.
        with pytest.raises(Exception, match="engine rank 1 exited with code -9"):
            in_flight.result(timeout=60)
        service = client(one)
        resumed = service.create_training_client_from_state_with_optimizer(checkpoint).result()
        np.testing.assert_allclose(_logprobs(resumed), expected, rtol=1e-5, atol=1e-6)
        assert _greedy(resumed) == tokens
        fresh = service.create_lora_training_client(base_model=base_model(one), rank=8, seed=1).result()
        np.testing.assert_allclose(_train(fresh, 3), losses, rtol=1e-5)
    finally:
        one.stop()
