"""A client on the server's machine loads the served model's tokenizer by its name, without the Hub."""

from __future__ import annotations

import subprocess
import sys

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
