"""Signed download tokens for the files of external-weights exports and for session traces.

A token binds (tenant, subject, file, expiry), the subject being a checkpoint path or a session id, under
an HMAC-SHA256 with a server secret that is generated once and kept in the data dir (`secret.key`, mode
0600), so tokens survive restarts and no one without the secret can mint or alter one. Whoever holds a
token may fetch that one file until it expires, and only while the tenant it names still owns (or may
read) the checkpoint or session. No HTTP, no tensors.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import PermissionDeniedError, ServerError
from loraplex.runtime.core.checkpoints import CheckpointPath

SECRET_FILE = "secret.key"
URL_LIFETIME_S = 3600


class DownloadDeniedError(PermissionDeniedError):
    """A download token that is forged, altered or expired (403)."""


@dataclass(frozen=True)
class Grant:
    """What a valid token allows: one file of one subject, for one tenant, until `expires` (epoch s)."""

    tenant: str
    subject: str  # a checkpoint's tinker:// path, or a session id
    relpath: str
    expires: int

    @property
    def checkpoint(self) -> CheckpointPath:
        """The subject as a checkpoint path (UserError if it is not one: a token for something else)."""
        return CheckpointPath.parse(self.subject)


class DownloadSigner:
    """Makes and checks download tokens with the data dir's secret."""

    def __init__(self, data_dir: Path) -> None:
        self._secret_file = data_dir / SECRET_FILE
        self._secret: bytes | None = None

    def sign(self, tenant: str, subject: CheckpointPath | str, relpath: str, expires: int) -> str:
        """A URL-safe token for one file of a checkpoint, or of a session (its trace)."""
        payload = _b64(json.dumps([tenant, str(subject), relpath, expires], separators=(",", ":")).encode())
        return f"{payload}.{self._mac(payload)}"

    def verify(self, token: str, relpath: str, now: float | None = None) -> Grant:
        """The grant of a token for `relpath`; DownloadDeniedError if it is forged, for another file, or
        expired."""
        payload, _, mac = token.partition(".")
        if not mac or not hmac.compare_digest(mac, self._mac(payload)):
            raise DownloadDeniedError("invalid download token")
        try:
            tenant, subject, signed_relpath, expires = json.loads(base64.urlsafe_b64decode(payload + "=="))
        except ValueError as error:
            raise DownloadDeniedError("invalid download token") from error
        if signed_relpath != relpath:
            raise DownloadDeniedError("this download token is for another file")
        if (time.time() if now is None else now) >= expires:
            raise DownloadDeniedError(
                "this download URL has expired; get a new one (RestClient.get_external_weights_urls, "
                "RestClient.export_session_trace)"
            )
        return Grant(tenant, subject, relpath, int(expires))

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._key(), payload.encode(), hashlib.sha256).digest())

    def _key(self) -> bytes:
        if self._secret is None:
            self._secret = _load_or_create(self._secret_file)
        return self._secret


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _load_or_create(file: Path) -> bytes:
    """The secret in `file`, created (32 random bytes, hex, mode 0600) if missing; racing creators agree."""
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
    for _ in range(50):  # another process may have created it and not yet written it
        secret = file.read_text().strip()
        if secret:
            return bytes.fromhex(secret)
        time.sleep(0.01)
    raise ServerError(f"the download secret {file} is empty")
