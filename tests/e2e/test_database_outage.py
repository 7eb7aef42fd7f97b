"""A PostgreSQL outage in the middle of training, through the SDK against a real server: the step sent
while the database is down waits, healthz answers 503 with the reason and then 200 again, and the run's
losses afterwards are those of a run that never saw an outage (nothing lost, nothing counted twice)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.e2e.conftest import Server
from tests.e2e.postgres import create_database, postgres_available, running_cluster
from tests.e2e.sdk import client, new_run, sft_steps
from tests.e2e.test_observability import scrape, value

STEPS_BEFORE, STEPS_AFTER = 2, 3


def _wait_for_health(server: Server, status: int, within_s: float) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        answer = httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10)
        if answer.status_code == status:
            return answer
        time.sleep(0.2)
    pytest.fail(f"healthz did not answer {status} within {within_s} s")


def test_training_waits_out_a_database_outage_and_goes_on_as_if_none_happened(
    start_server: Callable[..., Server],
) -> None:
    if not postgres_available():
        pytest.fail("PostgreSQL is not installed: .ci/run installs Debian's postgresql package")
    with running_cluster() as cluster:
        url = create_database(cluster.url_prefix, "outage")
        server = start_server("--database-url", url, "--database-outage-s", "60")
        service = client(server)
        steps = STEPS_BEFORE + 1 + STEPS_AFTER
        uninterrupted = sft_steps(new_run(service, server, seed=5), steps)

        run = new_run(service, server, seed=5)
        losses = sft_steps(run, STEPS_BEFORE)
        cluster.stop()
        down = _wait_for_health(server, 503, within_s=15)  # the watch probes every 2 s
        assert down.json()["status"] == "unavailable" and "database unreachable" in down.json()["reason"]
        assert down.headers["retry-after"]
        # A step sent now waits for the database instead of failing.
        during: list[float] = []
        step = threading.Thread(target=lambda: during.extend(sft_steps(run, 1)))
        step.start()
        time.sleep(3)
        assert step.is_alive()
        cluster.start()
        step.join(timeout=90)
        assert not step.is_alive() and len(during) == 1
        _wait_for_health(server, 200, within_s=15)
        losses += during + sft_steps(run, STEPS_AFTER)
        assert losses == uninterrupted  # the same computation, bit for bit: no step lost or repeated
        # The SDK resends a 500 silently: the server's own count shows none was sent.
        samples = scrape(server)
        assert value(samples, "loraplex_database_up") == 1
        assert not [
            labels
            for (name, labels), count in samples.items()
            if name == "loraplex_errors_total" and ("category", "server") in labels and count > 0
        ]
        server.stop()  # while its database still runs: stopping finishes the clients' sessions there
