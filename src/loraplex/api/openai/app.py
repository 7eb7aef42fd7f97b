"""The OpenAI-compatible app, mounted at /v1 beside the Tinker routes: its own routes and error bodies
(OpenAI's shape) over the same TrainingService, keys and sampler. No tensors."""

from __future__ import annotations

from fastapi import FastAPI

from loraplex.api.openai.errors import install_error_handlers
from loraplex.api.openai.routes import router
from loraplex.runtime.control.aliases import AliasTable
from loraplex.runtime.control.service import TrainingService
from loraplex.runtime.serving.inference import InferenceService
from loraplex.runtime.serving.text_codec import TextCodec


def create_openai_app(service: TrainingService) -> FastAPI:
    """The /v1 app; it starts nothing (the Tinker app's lifespan runs the service)."""
    app = FastAPI(title="loraplex OpenAI-compatible API")
    app.state.inference = InferenceService(
        service, AliasTable(service.config.data_dir), TextCodec.load(service.info.tokenizer_dir)
    )
    install_error_handlers(app)
    app.include_router(router)
    return app
