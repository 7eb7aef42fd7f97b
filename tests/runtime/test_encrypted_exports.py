"""Exports encrypted to age recipients, through the Runtime and fake engine: only ciphertext is written, it
decrypts to the engine's snapshot files, and bad recipients or encrypted sources are refused precisely."""

from __future__ import annotations

import re
from pathlib import Path

import pyrage
import pytest

from loraplex.errors import UserError
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import CreateRunFromCheckpoint, SaveExternal
from loraplex.runtime.core.encrypted_exports import parse_recipients
from tests.age_keys import SSH_PUBLIC_KEY
from tests.fakes import FakeEngine
from tests.runtime.conftest import create_run, result_of, train_steps


def _export(service: Runtime, run: str, seq: int, name: str, recipients: tuple[str, ...]):
    command = SaveExternal(name, age_recipients=recipients)
    return result_of(service, service.training.submit("local", run, seq, command))


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


class _NoPlaintextEngine(FakeEngine):
    """A fake engine that may not write snapshot files: an encrypted export must take them in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.may_write_snapshots = True

    def save_snapshot(self, slot: int, directory: Path) -> int:
        assert self.may_write_snapshots, f"plaintext snapshot files written to {directory}"
        return super().save_snapshot(slot, directory)


def test_an_encrypted_export_writes_only_ciphertext_that_decrypts_to_the_plain_exports_files(
    service_factory,
) -> None:
    engine = _NoPlaintextEngine()
    service = service_factory(engine)
    run = create_run(service)
    train_steps(service, run, 2)
    identity = pyrage.x25519.Identity.generate()
    engine.may_write_snapshots = False
    record = _export(service, run, 5, "enc", (str(identity.to_public()),))
    engine.may_write_snapshots = True
    plain = _export(service, run, 6, "plain", ())
    assert record.status == "complete" and plain.status == "complete"
    layout = service.layout
    encrypted = _files(layout.checkpoint_dir(CheckpointPath(run, "external_weights", "enc")))
    plaintext = _files(layout.checkpoint_dir(CheckpointPath(run, "external_weights", "plain")))
    assert sorted(encrypted) == ["meta.json.age", "state.npz.age"]  # the fake engine's snapshot files
    assert record.result == {
        "path": f"tinker://{run}/external_weights/enc",
        "type": "save_weights_external",
        "size_bytes": sum(len(data) for data in encrypted.values()),
    }
    for name, data in plaintext.items():
        assert data not in encrypted[name + ".age"]
        assert pyrage.decrypt(encrypted[name + ".age"], [identity]) == data


@pytest.mark.parametrize(
    ("recipients", "message"),
    [
        (("GOOD", "age1abc"), r"age_encryption_recipients\[1\] 'age1abc' is not an age recipient"),
        (("AGE-SECRET-KEY-1QQQ",), r"age_encryption_recipients\[0\] 'AGE-SECRET-KEY-1QQQ' is not an age"),
        (("ssh-ed25519 AAAAnot-a-key",), r"\[0\] 'ssh-ed25519 AAAAnot-a-key' is not an age recipient"),
        (("GOOD",) * 11, "has 11 recipients; at most 10 are allowed"),
    ],
    ids=["malformed-age1", "an-identity", "malformed-ssh", "too-many"],
)
def test_a_bad_recipient_fails_the_export_naming_it_and_writes_nothing(
    service_factory, recipients: tuple[str, ...], message: str
) -> None:
    service = service_factory()
    run = create_run(service)
    good = str(pyrage.x25519.Identity.generate().to_public())
    record = _export(service, run, 1, "enc", tuple(good if r == "GOOD" else r for r in recipients))
    assert record.category == "user" and re.search(message, record.error or "")
    assert not service.layout.checkpoint_dir(CheckpointPath(run, "external_weights", "enc")).exists()
    assert service.catalog.checkpoints("local", run) == []
    assert train_steps(service, run, 1, first_seq=2)  # the run goes on


def test_x25519_and_ssh_recipients_parse_and_mix() -> None:
    native = str(pyrage.x25519.Identity.generate().to_public())
    assert len(parse_recipients([native, SSH_PUBLIC_KEY])) == 2
    assert parse_recipients([]) == []


def test_an_encrypted_export_name_that_exists_is_refused_and_the_export_kept(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    assert _export(service, run, 1, "enc", (recipient,)).status == "complete"
    directory = service.layout.checkpoint_dir(CheckpointPath(run, "external_weights", "enc"))
    before = _files(directory)
    train_steps(service, run, 1, first_seq=2)
    again = _export(service, run, 4, "enc", (recipient,))
    assert again.category == "user" and "already exists" in again.error
    assert _files(directory) == before


def test_an_encrypted_export_cannot_be_loaded_or_sampled(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    path = _export(service, run, 1, "enc", (recipient,)).result["path"]
    session = service.sessions.create("local", {})
    with pytest.raises(UserError, match="is encrypted to its age recipients"):
        service.samplers.create_sampler("local", session, 1, path, None)
    with pytest.raises(UserError, match="is encrypted to its age recipients"):
        command = CreateRunFromCheckpoint(CheckpointPath.parse(path), with_optimizer=False)
        service.training.create_run("local", session, 0, command)


def test_an_export_whose_encryption_fails_midway_leaves_no_files_and_no_checkpoint(
    service_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = service_factory()
    run = create_run(service)
    encrypted: list[bytes] = []
    encrypt = pyrage.encrypt

    def encrypt_once(data: bytes, recipients: list) -> bytes:
        if encrypted:
            raise pyrage.EncryptError("the second file fails")
        encrypted.append(encrypt(data, recipients))
        return encrypted[-1]

    monkeypatch.setattr(pyrage, "encrypt", encrypt_once)
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    record = _export(service, run, 1, "enc", (recipient,))
    assert record.category == "server"  # logged with its cause; the client gets the request id
    assert len(encrypted) == 1  # one file was encrypted before the failure
    parent = service.layout.checkpoint_dir(CheckpointPath(run, "external_weights", "enc")).parent
    assert not parent.exists() or list(parent.iterdir()) == []
    assert service.catalog.checkpoints("local", run) == []
    assert train_steps(service, run, 1, first_seq=2)  # the run goes on
