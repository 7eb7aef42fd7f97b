"""Exports encrypted to age recipients (save_weights_external's `age_encryption_recipients`).

Every file of such an export is encrypted with age (pyrage) to all of its recipients and stored as
`<name>.age`: what the hosted Tinker service stores and what tinker-cookbook's `weights.download` looks for.
The plaintext exists only in memory: the engine serialises the adapter to bytes (Engine.snapshot_files),
they are encrypted here, and only the ciphertext is written, atomically like every directory. The server
keeps no identity, so it can neither read such an export back nor load or sample it. No torch, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyrage

from loraplex.durable import write_files_atomically
from loraplex.errors import UserError

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10  # as the Tinker service: the SDK documents "at most 10"
_SSH_PREFIXES = ("ssh-ed25519 ", "ssh-rsa ")  # the SSH keys age encrypts to

# The extension module ships no type information.
_pyrage: Any = pyrage


def parse_recipients(texts: Sequence[str]) -> list[Any]:
    """age recipients from their text: native X25519 (`age1...`) or SSH (`ssh-ed25519 ...`, `ssh-rsa ...`)
    public keys. UserError naming the first one that is neither, or if there are too many."""
    if len(texts) > MAX_RECIPIENTS:
        raise UserError(
            f"age_encryption_recipients has {len(texts)} recipients; at most {MAX_RECIPIENTS} are allowed"
        )
    return [_parse_recipient(index, text) for index, text in enumerate(texts)]


def _parse_recipient(index: int, text: str) -> Any:
    kind = _pyrage.ssh if text.startswith(_SSH_PREFIXES) else _pyrage.x25519
    try:
        return kind.Recipient.from_str(text)
    except _pyrage.RecipientError as error:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise UserError(
            f"age_encryption_recipients[{index}] {shown!r} is not an age recipient ({error}): expected an "
            "X25519 public key 'age1...' or an SSH public key 'ssh-ed25519 ...' / 'ssh-rsa ...'"
        ) from None


def write_encrypted(directory: Path, files: Mapping[str, bytes], recipients: Sequence[Any]) -> int:
    """Write each file encrypted to every recipient as `<name>.age` in `directory`, atomically; return
    bytes written (the ciphertext's)."""
    encrypted = {name + AGE_SUFFIX: _pyrage.encrypt(data, list(recipients)) for name, data in files.items()}
    return write_files_atomically(directory, encrypted)


def is_encrypted(directory: Path) -> bool:
    """Whether a checkpoint directory holds an encrypted export (the server cannot read its files)."""
    return directory.is_dir() and any(p.name.endswith(AGE_SUFFIX) for p in directory.iterdir())
