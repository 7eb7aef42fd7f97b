"""Downloads of external-weights exports, served by this server itself.

`external_weights_urls` (RestClient.get_external_weights_urls, `tinker checkpoint download`) answers one
signed URL per file of the export, keyed by its path relative to the checkpoint root, as the SDK expects.
Each URL names this server's `/api/v1/downloads/{token}/{relpath}`, which needs no API key: the token
(runtime/control/downloads.py) binds the tenant, the checkpoint, the file and an expiry. The file is streamed,
with single and multiple byte ranges (Starlette's FileResponse).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.deps import Downloads, Layout, Runs
from loraplex.errors import NotFoundError
from loraplex.runtime.control.downloads import URL_LIFETIME_S
from loraplex.runtime.core.checkpoints import CheckpointPath

router = APIRouter()


@router.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls")
def external_weights_urls(
    run_id: str,
    name: str,
    request: Request,
    catalog: Runs,
    layout: Layout,
    downloads: Downloads,
    tenant: Tenant,
) -> dict[str, Any]:
    path = CheckpointPath.parse(f"tinker://{run_id}/external_weights/{name}")
    catalog.checkpoint(tenant, path)
    root = layout.checkpoint_dir(path)
    expires = int(time.time()) + URL_LIFETIME_S
    base = str(request.base_url).rstrip("/")
    urls = {}
    for relpath in _files(root):
        token = downloads.sign(tenant, path, relpath, expires)
        urls[relpath] = f"{base}/api/v1/downloads/{token}/{quote(relpath)}"
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}


@router.get("/downloads/{token}/{relpath:path}")
def download(token: str, relpath: str, catalog: Runs, layout: Layout, downloads: Downloads) -> FileResponse:
    grant = downloads.verify(token, relpath)
    catalog.checkpoint(grant.tenant, grant.checkpoint)  # deleted or no longer readable: 404
    root = layout.checkpoint_dir(grant.checkpoint)
    file = root / relpath
    if relpath not in _files(root) or not file.is_file():
        raise NotFoundError(f"{relpath} is not a file of {grant.checkpoint}")
    return FileResponse(file, media_type="application/octet-stream")


def _files(root: Path) -> list[str]:
    """The regular files under a checkpoint directory, as sorted relative POSIX paths."""
    if not root.is_dir():
        return []
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.is_symlink()
    )
