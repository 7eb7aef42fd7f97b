"""save_weights_external and its download: the real `tinker checkpoint download` CLI fetches the export from
URLs this server signs and serves; the files load in HF peft and give the server's own logprobs. Exports
encrypted to age recipients: tinker-cookbook's `weights.download` decrypts one, every recipient can, and
no plaintext reaches the data dir.

One keyed server (--auth keys) for the module; alice exports, bob is the foreign tenant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pyrage
import pytest
import safetensors.torch
import tinker
import torch
from peft import PeftModel
from tinker_cookbook import weights
from transformers import AutoModelForCausalLM

from loraplex.runtime.control.downloads import DownloadSigner
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout
from tests.age_keys import SSH_PRIVATE_KEY, SSH_PUBLIC_KEY
from tests.e2e.conftest import REPO, Server
from tests.e2e.sdk import PHRASE, client, create_key, logprobs, new_run, sft_steps

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]
AGE_FILES = [f"{name}.age" for name in ADAPTER_FILES]  # an encrypted export's, as the cookbook expects


@pytest.fixture(scope="module")
def keyed(start_module_server: Callable[..., Server]) -> tuple[Server, dict[str, str]]:
    server = start_module_server("--auth", "keys")
    return server, {who: create_key(server.data_dir, who) for who in ("alice", "bob")}


@pytest.fixture(scope="module")
def export(keyed: tuple[Server, dict[str, str]]) -> tuple[str, np.ndarray]:
    """alice's run after 3 steps, exported: the export's path and the server's logprobs of PHRASE."""
    server, keys = keyed
    run = new_run(client(server, keys["alice"]), server, seed=5)
    sft_steps(run, 3)
    path = run.save_weights_external("final").result().path
    return path, logprobs(run)


def _rest(server: Server, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


def tinker_cli(server: Server, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
    cmd = [sys.executable, "-m", "tinker.cli", *args]  # the `tinker` command
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def peft_logprobs(server: Server, adapter_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """PHRASE's logprobs from HF peft with the adapter in `adapter_dir`, and from the base model alone."""
    base = AutoModelForCausalLM.from_pretrained(server.data_dir / "models" / "tiny", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note on tied embeddings
        model = PeftModel.from_pretrained(base, adapter_dir).eval()
    rows, targets = torch.arange(len(PHRASE) - 1), torch.tensor(PHRASE[1:])
    with torch.no_grad():
        adapted = torch.log_softmax(model(torch.tensor([PHRASE[:-1]])).logits[0], -1)[rows, targets]
        with model.disable_adapter():
            plain = torch.log_softmax(model(torch.tensor([PHRASE[:-1]])).logits[0], -1)[rows, targets]
    return adapted.numpy(), plain.numpy()


def test_the_cli_downloads_an_export_that_peft_loads_to_the_servers_logprobs(
    keyed: tuple[Server, dict[str, str]], export: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    server, keys = keyed
    path, server_logprobs = export
    assert path.endswith("/external_weights/final")
    done = tinker_cli(server, keys["alice"], "checkpoint", "download", path, "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr
    target = tmp_path / path.removeprefix("tinker://").replace("/", "_")
    assert sorted(p.name for p in target.iterdir()) == ADAPTER_FILES
    adapted, plain = peft_logprobs(server, target)
    np.testing.assert_allclose(adapted, server_logprobs, atol=1e-4)
    assert np.abs(plain - server_logprobs).max() > 1e-2  # the adapter matters, so the match means something

    listed = _rest(server, keys["alice"]).list_checkpoints(CheckpointPath.parse(path).run_id).result()
    (external,) = [c for c in listed.checkpoints if c.tinker_path == path]
    assert external.checkpoint_type == "external"
    assert external.size_bytes == sum(f.stat().st_size for f in target.iterdir())


def test_urls_are_per_file_ranged_and_refused_to_other_tenants_and_when_expired(
    keyed: tuple[Server, dict[str, str]], export: tuple[str, np.ndarray]
) -> None:
    server, keys = keyed
    path, _ = export
    answer = _rest(server, keys["alice"]).get_external_weights_urls(path).result()
    assert sorted(answer.urls) == ADAPTER_FILES
    assert 3500 < answer.expires.timestamp() - time.time() <= 3600
    url = answer.urls["adapter_model.safetensors"]
    assert url.startswith(f"{server.base_url}/api/v1/downloads/")
    whole = httpx.get(url)  # no API key: the URL is the credential
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
    part = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206
    assert part.content == whole.content[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(whole.content)}"

    with pytest.raises(tinker.NotFoundError):  # bob gets no URL for alice's export
        _rest(server, keys["bob"]).get_external_weights_urls(path).result()
    signer, checkpoint = DownloadSigner(server.data_dir), CheckpointPath.parse(path)
    base = f"{server.base_url}/api/v1/downloads"
    relpath = "adapter_config.json"
    as_bob = httpx.get(f"{base}/{signer.sign('bob', checkpoint, relpath, int(time.time()) + 60)}/{relpath}")
    assert as_bob.status_code == 404 and "not found" in as_bob.json()["detail"]
    expired = httpx.get(f"{base}/{signer.sign('alice', checkpoint, relpath, int(time.time()) - 1)}/{relpath}")
    assert expired.status_code == 403 and "expired" in expired.json()["detail"]
    token = url.split("/")[-2]
    other_file = httpx.get(f"{base}/{token}/{relpath}")  # a token is for its one file
    assert other_file.status_code == 403 and "another file" in other_file.json()["detail"]
    forged = httpx.get(f"{base}/{token[:-4]}AAAA/adapter_model.safetensors")
    assert forged.status_code == 403 and forged.json()["detail"] == "invalid download token"
    assert (server.data_dir / "secret.key").stat().st_mode & 0o777 == 0o600


def test_cookbook_download_of_a_training_checkpoint_decrypts_an_adapter_that_gives_the_servers_logprobs(
    keyed: tuple[Server, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tinker_cookbook.weights.download, unmodified, on a tinker://.../weights/... path: it loads the
    checkpoint into a new run, exports it encrypted to a key it generates, downloads the `.age` files,
    decrypts them and deletes the export."""
    server, keys = keyed
    run = new_run(client(server, keys["alice"]), server, seed=11)
    sft_steps(run, 3)
    state = run.save_state("trained").result().path
    served = logprobs(run)
    monkeypatch.setenv("TINKER_API_KEY", keys["alice"])
    out = Path(
        weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"), base_url=server.base_url)
    )
    assert sorted(p.name for p in out.iterdir()) == ADAPTER_FILES
    adapted, plain = peft_logprobs(server, out)
    np.testing.assert_allclose(adapted, served, atol=1e-4)  # fp32 on both sides: rounding only
    assert np.abs(plain - served).max() > 1e-2  # the adapter matters, so the match means something

    exports = list((server.data_dir / "checkpoints").glob("*/external_weights/download"))
    assert exports == []  # the cookbook deleted its temporary export
    assert _plaintext_under(server.data_dir, (out / "adapter_model.safetensors").read_bytes()) == []


def _plaintext_under(root: Path, safetensors_file: bytes) -> list[Path]:
    """Files under `root` that hold the adapter's PEFT safetensors file (its header names every tensor the
    PEFT way, so only a plaintext copy of this export matches; training checkpoints and parked runs hold
    the same weights in their own format, as they must)."""
    return [p for p in root.rglob("*") if p.is_file() and safetensors_file in p.read_bytes()]


def _encrypted_export(
    server: Server, key: str, name: str, recipients: list[str], seed: int
) -> tuple[str, dict[str, bytes]]:
    """A run's export encrypted to `recipients`, and its files as the signed URLs serve them."""
    run = new_run(client(server, key), server, seed=seed)
    sft_steps(run, 2)
    saved = run.save_weights_external(name, age_encryption_recipients=recipients).result()
    urls = _rest(server, key).get_external_weights_urls(saved.path).result().urls
    served = {relpath: httpx.get(url).content for relpath, url in urls.items()}
    listed = _rest(server, key).list_checkpoints(CheckpointPath.parse(saved.path).run_id).result()
    (export,) = [c for c in listed.checkpoints if c.tinker_path == saved.path]
    assert export.size_bytes == sum(len(data) for data in served.values())  # the ciphertext's size
    return saved.path, served


def test_an_encrypted_export_is_only_age_files_on_disk_and_no_plaintext_reaches_the_data_dir(
    keyed: tuple[Server, dict[str, str]],
) -> None:
    server, keys = keyed
    identity = pyrage.x25519.Identity.generate()
    path, served = _encrypted_export(server, keys["alice"], "sealed", [str(identity.to_public())], seed=12)
    assert sorted(served) == AGE_FILES
    directory = DiskLayout(server.data_dir).checkpoint_dir(CheckpointPath.parse(path))
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == served
    assert [p.name for p in directory.parent.iterdir()] == ["sealed"]  # no temporary copy left beside it
    stranger = pyrage.x25519.Identity.generate()
    for data in served.values():
        assert data.startswith(b"age-encryption.org/v1\n")
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(data, [stranger])
    plaintext = {name: pyrage.decrypt(data, [identity]) for name, data in served.items()}
    assert json.loads(plaintext["adapter_config.json.age"])["r"] == 8
    assert _plaintext_under(server.data_dir, plaintext["adapter_model.safetensors.age"]) == []


def test_every_recipient_of_an_encrypted_export_decrypts_it(keyed: tuple[Server, dict[str, str]]) -> None:
    server, keys = keyed
    natives = [pyrage.x25519.Identity.generate() for _ in range(2)]
    recipients = [str(i.to_public()) for i in natives] + [SSH_PUBLIC_KEY]
    _, served = _encrypted_export(server, keys["bob"], "shared", recipients, seed=13)
    identities = [*natives, pyrage.ssh.Identity.from_buffer(SSH_PRIVATE_KEY)]
    for name, data in served.items():
        decrypted = {pyrage.decrypt(data, [identity]) for identity in identities}
        assert len(decrypted) == 1, name  # each recipient alone reads the same file
    adapter = safetensors.torch.load(pyrage.decrypt(served["adapter_model.safetensors.age"], [identities[2]]))
    assert len(adapter) > 0 and all(key.startswith("base_model.model.") for key in adapter)  # PEFT's names


@pytest.mark.parametrize(
    ("recipients", "message"),
    [
        (["age1abc"], r"age_encryption_recipients\[0\] 'age1abc' is not an age recipient"),
        (["GOOD", "ssh-ed25519 AAAA"], r"age_encryption_recipients\[1\] 'ssh-ed25519 AAAA' is not an age"),
        (["GOOD"] * 11, r"has 11 recipients; at most 10 are allowed"),
    ],
    ids=["malformed-age1", "malformed-ssh", "too-many"],
)
def test_a_bad_recipient_is_refused_naming_it_and_nothing_is_exported(
    keyed: tuple[Server, dict[str, str]], recipients: list[str], message: str
) -> None:
    server, keys = keyed
    run = new_run(client(server, keys["alice"]), server, seed=6)
    good = str(pyrage.x25519.Identity.generate().to_public())
    refused = run.save_weights_external(
        "enc", age_encryption_recipients=[good if r == "GOOD" else r for r in recipients]
    )
    with pytest.raises(tinker.RequestFailedError, match=message):
        refused.result()
    assert not (server.data_dir / "checkpoints" / run.model_id).exists()  # nothing written for the run
    listed = _rest(server, keys["alice"]).list_checkpoints(run.model_id).result().checkpoints
    assert listed == []
    assert len(sft_steps(run, 1)) == 1  # the run goes on


def test_a_published_checkpoint_is_readable_by_other_tenants_until_unpublished(
    keyed: tuple[Server, dict[str, str]],
) -> None:
    server, keys = keyed
    run = new_run(client(server, keys["alice"]), server, seed=7)
    sft_steps(run, 2)
    state, sampler = (
        run.save_state("shared").result().path,
        run.save_weights_for_sampler("shared").result().path,
    )
    alice, bob, bob_service = (
        _rest(server, keys["alice"]),
        _rest(server, keys["bob"]),
        client(server, keys["bob"]),
    )
    with pytest.raises(tinker.NotFoundError):
        bob_service.create_training_client_from_state(state).result()
    alice.publish_checkpoint_from_tinker_path(state).result()
    alice.publish_checkpoint_from_tinker_path(sampler).result()
    listed = {c.tinker_path: c.public for c in alice.list_user_checkpoints().result().checkpoints}
    assert listed[state] is True and listed[sampler] is True

    loaded = bob_service.create_training_client_from_state(state).result()  # bob's own run from alice's
    np.testing.assert_allclose(logprobs(loaded), logprobs(run), atol=1e-5)
    params = tinker.types.SamplingParams(max_tokens=4, temperature=0.0)
    prompt = tinker.types.ModelInput.from_ints(PHRASE[:3])
    theirs = bob_service.create_sampling_client(model_path=sampler).sample(prompt, 1, params).result()
    ours = client(server, keys["alice"]).create_sampling_client(model_path=sampler).sample(prompt, 1, params)
    assert theirs.sequences[0].tokens == ours.result().sequences[0].tokens
    with pytest.raises(tinker.NotFoundError):  # reading is all: bob cannot change or delete it
        bob.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    with pytest.raises(tinker.NotFoundError):
        bob.delete_checkpoint_from_tinker_path(state).result()

    alice.unpublish_checkpoint_from_tinker_path(state).result()
    assert {c.tinker_path: c.public for c in alice.list_user_checkpoints().result().checkpoints}[
        state
    ] is False
    with pytest.raises(tinker.NotFoundError):
        bob_service.create_training_client_from_state(state).result()


def test_set_ttl_sets_and_clears_a_checkpoints_expiry(keyed: tuple[Server, dict[str, str]]) -> None:
    server, keys = keyed
    run = new_run(client(server, keys["alice"]), server, seed=8)
    path = run.save_state("ttl").result().path
    rest = _rest(server, keys["alice"])

    def expires_at() -> float | None:
        (found,) = [c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == path]
        return found.expires_at.timestamp() if found.expires_at else None

    assert expires_at() is None
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    assert 7100 < (expires_at() or 0) - time.time() <= 7200
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert expires_at() is None
    with pytest.raises(tinker.UnprocessableEntityError):  # below an hour, as Tinker
        rest.set_checkpoint_ttl_from_tinker_path(path, 60).result()


def test_sessions_list_their_runs_and_samplers(keyed: tuple[Server, dict[str, str]]) -> None:
    server, keys = keyed
    service = client(server, keys["bob"])
    run = new_run(service, server, seed=9)
    sampler = run.save_weights_and_get_sampling_client().result()
    session_id = run.model_id.split(":train:")[0]
    rest = _rest(server, keys["bob"])
    assert session_id in rest.list_sessions(limit=100).result().sessions
    assert session_id not in _rest(server, keys["alice"]).list_sessions(limit=100).result().sessions
    details = rest.get_session(session_id).result()
    assert details.training_run_ids == [run.model_id]
    assert len(details.sampler_ids) == 1 and details.sampler_ids[0].startswith(f"{session_id}:sample:")
    assert sampler is not None
    with pytest.raises(tinker.NotFoundError):
        _rest(server, keys["alice"]).get_session(session_id).result()
