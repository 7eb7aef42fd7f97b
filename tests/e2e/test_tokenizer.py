"""A client on the server's machine loads the served model's tokenizer by its name, without the Hub."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

CLIENT = """
import sys, tinker
with tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-local") as service:
    tokenizer = service.create_sampling_client(base_model="loraplex/tiny").result().get_tokenizer()
    print(tokenizer.decode(tokenizer.encode("hello loraplex")))
"""


def test_a_sampling_clients_get_tokenizer_works_offline_on_the_servers_machine(module_server) -> None:
    env = {**module_server.env, "HF_HUB_OFFLINE": "1"}  # the Hub is unreachable: only the cache answers
    client = subprocess.run(
        [sys.executable, "-c", CLIENT, module_server.base_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert client.returncode == 0, client.stderr[-2000:]
    assert client.stdout.strip().endswith("hello loraplex")


def test_serving_under_an_operators_model_name_files_nothing_into_the_hugging_face_cache(
    start_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Filing a tokenizer-only snapshot there would shadow the real repository: an offline load of its
    # weights would find refs/main naming a snapshot without them.
    hub_cache = tmp_path / "hf-home" / "hub"  # under the server's own HF_HOME (conftest.py Server.env)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))  # and there even if the test's environment set one
    server = start_server("--model-name", "someorg/somemodel")
    models = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer tml-local"}).json()
    assert models["data"][0]["id"] == "someorg/somemodel"
    assert not (hub_cache / "models--someorg--somemodel").exists()
