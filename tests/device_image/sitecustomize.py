"""The GPU machine's Python, imitated: on PYTHONPATH, this makes every project dependency that its image
lacks fail to import, so bench/gpu_check.sh's dry run (tests/test_gpu_scripts.py) proves the script needs
only what is there. The machine has torch, numpy, safetensors, tokenizers, transformers, peft, protobuf,
httpx, huggingface_hub, prometheus_client, jinja2 and pytest, and none of those below (the H200 machine's
image as listed in November 2026; its python3 ran torch 2.11)."""

from __future__ import annotations

import sys

# A None entry is how Python marks a module that cannot be imported: `import` raises ModuleNotFoundError
# and importlib.util.find_spec answers None, as for a package that is not installed (libraries that probe
# for optional packages, transformers among them, then go without).
for name in (
    "alembic",
    "fastapi",
    "httptools",
    "psycopg",
    "pydantic",
    "sqlalchemy",
    "starlette",
    "tinker",
    "uvicorn",
    "zstandard",
):
    sys.modules[name] = None  # type: ignore[assignment]
