"""The rows of the legacy store fixtures (made by release 31f5bb0, before migrations; make.py) as plain
values: what make.py wrote through that release's Store, and what test_migrations.py expects to read back
after the upgrade. Times are UTC."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np

from loraplex.engine.types import PassResult, SampledSequence, SampleResult

RELEASE = "31f5bb0"  # the commit whose code made the fixtures
SQLITE_FILE = f"store_{RELEASE}.db"
POSTGRES_DUMP = f"store_{RELEASE}.sql"  # pg_dump --inserts of the same rows in PostgreSQL 15


def _at(hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, 2, hour, minute, 30, 250000, tzinfo=UTC)


TENANT = "alice"
SESSION_ID = "s-legacy"
RUN_ID = f"{SESSION_ID}:train:0"
SAMPLER_ID = f"{SESSION_ID}:sample:0"

KEY = {
    "digest": "ab" * 32,
    "key_id": "key-legacy",
    "tenant": TENANT,
    "created_at": _at(8),
    "revoked_at": None,
    "admin": True,
}
SESSION = {
    "id": SESSION_ID,
    "tenant": TENANT,
    "created_at": _at(9),
    "last_heartbeat_at": _at(9, 40),
    "finished_reason": None,
    "user_metadata": {"project": "legacy"},
    "display_name": "the legacy session",
}
RUN = {
    "id": RUN_ID,
    "session_id": SESSION_ID,
    "tenant": TENANT,
    "base_model": "tiny",
    "lora_config": {"rank": 8, "train_mlp": True},
    "user_metadata": {"purpose": "fixture"},
    "status": "parked",
    "created_at": _at(9, 1),
    "last_request_at": _at(9, 30),  # its last future's (add_futures stamps it)
    "last_seq_id": 7,
    "last_step": 2,  # the last metric row's step (add_metrics stamps it)
}
CHECKPOINT = {
    "run_id": RUN_ID,
    "kind": "sampler_weights",
    "name": "final",
    "tenant": TENANT,
    "size_bytes": 2**31 - 1,  # the most a 32-bit column holds
    "created_at": _at(9, 20),
    "expires_at": _at(21, 20),
    "user_metadata": {"note": "kept"},
    "public": True,
}
MODEL_PATH = f"tinker://{RUN_ID}/sampler_weights/final"
SAMPLER = {
    "id": SAMPLER_ID,
    "session_id": SESSION_ID,
    "tenant": TENANT,
    "base_model": "tiny",
    "model_path": MODEL_PATH,
    "snapshot_dir": None,
    "created_at": _at(9, 21),
    "last_used_at": _at(9, 25),  # its future's (add_futures stamps it)
}


def pass_result() -> PassResult:
    """A forward_backward's result over two datums."""
    return PassResult(
        outputs=[
            {
                "logprobs": np.array([-0.5, -1.25, -2.0], np.float32),
                "elementwise_loss": np.array([0.5, 1.25, 2.0], np.float32),
            },
            {"logprobs": np.array([-3.0], np.float32), "elementwise_loss": np.array([3.0], np.float32)},
        ],
        metrics={"loss:sum": 9.0},
    )


def sample_result() -> SampleResult:
    """A sample with prompt scores, top-k and a sequence without them."""
    return SampleResult(
        sequences=[
            SampledSequence(
                np.array([4, 5], np.int32),
                np.array([-0.5, -0.25], np.float32),
                "length",
                np.array([[4, 2], [5, -1]], np.int32),
                np.array([[-0.5, -1.5], [-0.25, np.nan]], np.float32),
            ),
            SampledSequence(np.array([9], np.int32), np.array([-1.0], np.float32), "stop"),
        ],
        prompt_logprobs=np.array([np.nan, -1.0, -2.0], np.float32),
        topk_prompt_ids=np.array([[-1, -1], [3, 1], [2, 0]], np.int32),
        topk_prompt_logprobs=np.array([[np.nan, np.nan], [-1.0, -2.0], [-2.0, -3.5]], np.float32),
    )


SAVE_RESULT = {"path": MODEL_PATH, "type": "save_weights_for_sampler"}

# Each future: its columns but result, and the result it holds (None: none).
FUTURES: list[tuple[dict[str, Any], Any]] = [
    (
        {
            "id": "req-pass",
            "tenant": TENANT,
            "request_type": "ForwardBackward",
            "run_id": RUN_ID,
            "seq_id": 1,
            "status": "complete",
            "error": None,
            "category": None,
            "created_at": _at(9, 10),
            "completed_at": _at(9, 11),
        },
        pass_result(),
    ),
    (
        {
            "id": "req-sample",
            "tenant": TENANT,
            "request_type": "Sample",
            "run_id": SAMPLER_ID,
            "seq_id": 3_000_000_001,  # a cloned SamplingClient's: past 32 bits already in that release
            "status": "complete",
            "error": None,
            "category": None,
            "created_at": _at(9, 25),
            "completed_at": _at(9, 26),
        },
        sample_result(),
    ),
    (
        {
            "id": "req-save",
            "tenant": TENANT,
            "request_type": "SaveWeightsForSampler",
            "run_id": RUN_ID,
            "seq_id": 7,
            "status": "complete",
            "error": None,
            "category": None,
            "created_at": _at(9, 30),
            "completed_at": _at(9, 31),
        },
        SAVE_RESULT,
    ),
    (
        {
            "id": "req-failed",
            "tenant": TENANT,
            "request_type": "OptimStep",
            "run_id": RUN_ID,
            "seq_id": 2,
            "status": "failed",
            "error": "learning_rate must be > 0, not -1.0",
            "category": "user",
            "created_at": _at(9, 12),
            "completed_at": _at(9, 12),
        },
        None,
    ),
    (
        {
            "id": "req-pending",
            "tenant": TENANT,
            "request_type": "CreateSession",
            "run_id": None,
            "seq_id": None,
            "status": "pending",
            "error": None,
            "category": None,
            "created_at": _at(9, 29),
            "completed_at": None,
        },
        None,
    ),
]

# Metric history rows (MetricRow's columns but id), in the order they were written.
METRICS = [
    {
        "run_id": RUN_ID,
        "seq_id": 1,
        "step": 1,
        "kind": "forward_backward",
        "metrics": '{"loss:sum": 9.0}',
        "recorded_at": _at(9, 11),
    },
    {
        "run_id": RUN_ID,
        "seq_id": 3,
        "step": 1,
        "kind": "optim_step",
        "metrics": '{"grad_norm": 0.75, "learning_rate": 0.0001}',
        "recorded_at": _at(9, 13),
    },
    {
        "run_id": RUN_ID,
        "seq_id": 5,
        "step": 2,
        "kind": "optim_step",
        "metrics": '{"grad_norm": 0.5, "learning_rate": 0.0001}',
        "recorded_at": _at(9, 15),
    },
]

# The aliases.json that release kept in the data directory: tenant -> alias -> model.
ALIASES = {"alice": {"sft/latest": MODEL_PATH}, "bob": {"latest": "tinker://s-bob:train:0/sampler_weights/x"}}
