"""Two tenants on one server through the SDK: one floods the sampler with more requests than its decode
batch holds, the other sends one; the other's sample comes back with the flood's first batches, not
behind all of it (tenants take turns, runtime/core/sampling.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tinker import types

from tests.e2e.conftest import Server
from tests.e2e.sdk import base_model, client, create_key

BATCH = 16  # the sampler's decode batch here (--max-sampling-batch)
FLOOD = 8 * BATCH
PROMPT = types.ModelInput.from_ints([104, 101, 108, 108, 111])
PARAMS = types.SamplingParams(max_tokens=24, temperature=1.0, seed=0)


def test_one_tenants_flood_does_not_hold_back_another_tenants_sample(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--auth", "keys", "--max-sampling-batch", str(BATCH))
    model = base_model(server)
    alice = client(server, create_key(server.data_dir, "alice")).create_sampling_client(base_model=model)
    bob = client(server, create_key(server.data_dir, "bob")).create_sampling_client(base_model=model)
    done = threading.Semaphore(0)
    finished = [0]

    def count(_future: object) -> None:
        finished[0] += 1
        done.release()

    flood = [alice.sample(PROMPT, 1, PARAMS) for _ in range(FLOOD)]
    for future in flood:
        future.future().add_done_callback(count)
    flood[0].result()  # the flood is on the server and being sampled
    bob.sample(PROMPT, 1, PARAMS).result()
    finished_before_bob = finished[0]
    for _ in range(FLOOD):
        assert done.acquire(timeout=300)
    assert all(len(f.result().sequences) == 1 for f in flood)
    # First come, first served would put bob behind the whole flood; turns put him into the next batch with
    # room, which opens as the flood's first batches finish.
    assert finished_before_bob <= 3 * BATCH, (
        f"{finished_before_bob} of the flood finished before bob's sample"
    )
