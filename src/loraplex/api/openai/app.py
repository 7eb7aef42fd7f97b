"""The OpenAI-compatible app, mounted at /v1 beside the Tinker routes: its own routes and error bodies
(OpenAI's shape) over the same runtime: its samplers, futures and keys. No tensors."""

from __future__ import annotations

from fastapi import FastAPI

from loraplex.api.openai.errors import install_error_handlers
from loraplex.api.openai.routes import router
from loraplex.api.openai.tokenization import router as tokenization_router
from loraplex.api.tinker.codec_pool import CodecPool
from loraplex.runtime.control.keys import TenantResolver
from loraplex.runtime.serving.inference import InferenceService


def create_openai_app(inference: InferenceService, tenants: TenantResolver, codecs: CodecPool) -> FastAPI:
    """The /v1 app; it starts nothing (the Tinker app's lifespan runs the runtime and the codec pool)."""
    app = FastAPI(title="loraplex OpenAI-compatible API")
    app.state.inference, app.state.tenants, app.state.codecs = inference, tenants, codecs
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tokenization_router)
    return app
