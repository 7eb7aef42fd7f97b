"""The runtime collaborators a Tinker route may ask for, one FastAPI dependency each, so a route's signature
names exactly what it touches. `create_app` puts each one on the app's state (api/app.py). No tensors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request

from loraplex.api.tinker.codec_pool import CodecPool
from loraplex.api.tinker.submissions import SubmissionThread
from loraplex.engine.interface import EngineInfo
from loraplex.runtime.control.catalog import Catalog
from loraplex.runtime.control.downloads import DownloadSigner
from loraplex.runtime.control.futures import FutureTable
from loraplex.runtime.control.samplers import SamplerService
from loraplex.runtime.control.service import TrainingService
from loraplex.runtime.control.session_search import SessionSearch
from loraplex.runtime.control.session_trace import SessionTraces
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.control.store.outage import Reachability
from loraplex.runtime.core.checkpoints import DiskLayout
from loraplex.runtime.core.disk_space import DiskSpace
from loraplex.runtime.core.sampler_backend import SamplerBackend


def _from_app(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency returning the app state's `name` (async: no thread hop for an attribute read)."""

    async def collaborator(request: Request) -> Any:
        return getattr(request.app.state, name)

    collaborator.__name__ = name
    return collaborator


Training = Annotated[TrainingService, Depends(_from_app("training"))]
Samplers = Annotated[SamplerService, Depends(_from_app("samplers"))]
Futures = Annotated[FutureTable, Depends(_from_app("futures"))]
Sessions = Annotated[SessionTable, Depends(_from_app("sessions"))]
Runs = Annotated[Catalog, Depends(_from_app("catalog"))]
Downloads = Annotated[DownloadSigner, Depends(_from_app("downloads"))]
Search = Annotated[SessionSearch, Depends(_from_app("session_search"))]
Traces = Annotated[SessionTraces, Depends(_from_app("session_traces"))]
Info = Annotated[EngineInfo, Depends(_from_app("info"))]
Database = Annotated[Reachability, Depends(_from_app("database"))]
Layout = Annotated[DiskLayout, Depends(_from_app("layout"))]
Disk = Annotated[DiskSpace, Depends(_from_app("disk"))]
Sampler = Annotated[SamplerBackend, Depends(_from_app("sampler"))]
Submissions = Annotated[SubmissionThread, Depends(_from_app("submissions"))]
Codecs = Annotated[CodecPool, Depends(_from_app("codecs"))]
