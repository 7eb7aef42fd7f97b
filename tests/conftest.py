"""Fixtures every test package shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def postgres_url_prefix() -> Iterator[str]:
    """One throwaway PostgreSQL cluster for the session (Debian's server, installed by .ci/run if absent)."""
    from tests.e2e.postgres import postgres_available, postgres_cluster

    if not postgres_available():
        pytest.fail("PostgreSQL is not installed: .ci/run installs Debian's postgresql package")
    with postgres_cluster() as prefix:
        yield prefix


def pytest_configure(config: pytest.Config) -> None:
    """Tests run with deterministic kernels, as `serve --deterministic` does (servers started by tests pass
    it): a test that compares two runs bit for bit must hold on a GPU too."""
    from loraplex.engine.determinism import use_deterministic_kernels

    use_deterministic_kernels()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the `gpu` tests, visibly, on a machine without CUDA (bench/gpu_check.sh runs them on one)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run bench/gpu_check.sh on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
