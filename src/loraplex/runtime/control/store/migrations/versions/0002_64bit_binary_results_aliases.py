"""Every integer column 64-bit, futures' results as bytes, and the tenants' model aliases in the database.

- Counts, sizes, steps and numeric ids become BIGINT (a checkpoint of 2 GiB or more did not fit
  checkpoints.size_bytes on PostgreSQL), and PostgreSQL's sequence behind checkpoints.id with them.
  SQLite stores every integer in up to 64 bits already; its tables are recreated (batch mode) only so
  that their declared types match schema.py, and autoincrement ids stay INTEGER (its rowid).
- futures.result: the base64 JSON text of earlier releases becomes the bytes of results.py, converted
  row by row in batches (a large table is never read whole). A stored result this revision cannot read
  stops the upgrade, and the transaction it runs in leaves the database as it was.
- The aliases table, empty: aliases.py imports an aliases.json file of earlier releases at start-up.

Results are written with the current results.encode_result: its format carries its version (the magic),
so a later format change is a later revision converting the older blobs.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import sqlalchemy as sa
from alembic import op

from loraplex.engine.types import PassResult, SampledSequence, SampleResult
from loraplex.runtime.control.store.results import Result, encode_result

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")  # as schema._BIG_ID, frozen here
# Every integer column of the schema, with the type it becomes.
_WIDENED: dict[str, dict[str, sa.types.TypeEngine[Any]]] = {
    "training_runs": {"last_seq_id": sa.BigInteger(), "last_step": sa.BigInteger()},
    "checkpoints": {"id": _BIG_ID, "size_bytes": sa.BigInteger()},
    "futures": {"seq_id": sa.BigInteger()},
    "run_metrics": {"id": _BIG_ID, "seq_id": sa.BigInteger(), "step": sa.BigInteger()},
}
_BATCH_ROWS = 500  # futures converted per round trip


def upgrade() -> None:
    bind = op.get_bind()
    for table, columns in _WIDENED.items():
        _widen(bind, table, columns)
    _convert_results(bind)
    op.create_table(
        "aliases",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("alias", sa.String(128), primary_key=True),
        sa.Column("model", sa.String(500), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def _widen(bind: sa.Connection, table: str, columns: dict[str, sa.types.TypeEngine[Any]]) -> None:
    """Give `columns` of `table` their 64-bit types where the database declares another (a database made by
    an earlier release may already have some)."""
    declared = {c["name"]: c["type"] for c in sa.inspect(bind).get_columns(table)}
    narrow = {
        name: kind
        for name, kind in columns.items()
        if declared[name].compile(dialect=bind.dialect) != kind.compile(dialect=bind.dialect)
    }
    if not narrow:
        return
    with op.batch_alter_table(table) as batch:
        for name, kind in narrow.items():
            batch.alter_column(name, type_=kind, existing_type=declared[name])
    if bind.dialect.name == "postgresql" and "id" in narrow:  # SERIAL's sequence is `AS integer`
        sequence = bind.scalar(sa.text(f"SELECT pg_get_serial_sequence('{table}', 'id')"))
        if sequence is not None:
            op.execute(f"ALTER SEQUENCE {sequence} AS bigint")


def _convert_results(bind: sa.Connection) -> None:
    """futures.result from base64 JSON text to results.py's bytes, `_BATCH_ROWS` rows at a time by id."""
    op.add_column("futures", sa.Column("result_bytes", sa.LargeBinary, nullable=True))
    futures = sa.table(
        "futures", sa.column("id", sa.String), sa.column("result", sa.Text), sa.column("result_bytes")
    )
    page = (
        sa.select(futures.c.id, futures.c.result)
        .where(futures.c.result.is_not(None), futures.c.id > sa.bindparam("after"))
        .order_by(futures.c.id)
        .limit(_BATCH_ROWS)
    )
    store = (
        sa.update(futures)
        .where(futures.c.id == sa.bindparam("future_id"))
        .values(result_bytes=sa.bindparam("blob", type_=sa.LargeBinary))
    )
    after = ""
    while rows := bind.execute(page, {"after": after}).all():
        blobs = [
            {"future_id": fid, "blob": encode_result(_read_base64_json(fid, text))} for fid, text in rows
        ]
        bind.execute(store, blobs)
        after = rows[-1].id
    with op.batch_alter_table("futures") as batch:
        batch.drop_column("result")
        batch.alter_column("result_bytes", new_column_name="result", existing_type=sa.LargeBinary)


# --- the results format of earlier releases: JSON objects as they were; pass and sample results tagged,
# each numpy array as {"dtype", "shape", "data": base64}. A field missing from older text reads as absent.
_PROMPT_FIELDS = (
    "prompt_logprobs",
    "topk_prompt_ids",
    "topk_prompt_logprobs",
    "target_prompt_logprobs",
    "prompt_alt_ids",
    "prompt_alt_logprobs",
)
_SEQUENCE_FIELDS = ("topk_ids", "topk_logprobs")


def _read_base64_json(future_id: str, text: str) -> Result:
    try:
        return _from_base64_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(
            f"future {future_id!r}: its stored result is not the base64 JSON of earlier releases "
            f"({type(exc).__name__}: {exc}); the upgrade changed nothing"
        ) from exc


def _from_base64_json(value: Any) -> Result:
    if isinstance(value, dict) and "pass_result" in value:
        body = value["pass_result"]
        outputs = [{k: _array(v) for k, v in out.items()} for out in body["outputs"]]
        return PassResult(outputs=outputs, metrics=body["metrics"])
    if isinstance(value, dict) and "sample_result" in value:
        body = value["sample_result"]
        sequences = [
            SampledSequence(
                _array(s["tokens"]),
                _array(s["logprobs"]),
                s["stop"],
                **{name: _maybe_array(s.get(name)) for name in _SEQUENCE_FIELDS},
            )
            for s in body["sequences"]
        ]
        prompt = {name: _maybe_array(body.get(name)) for name in _PROMPT_FIELDS}
        is_sparse = body.get("target_prompt_is_sparse", False)
        return SampleResult(sequences, **prompt, target_prompt_is_sparse=is_sparse)
    return value


def _array(value: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(value["data"], validate=True)
    return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"])


def _maybe_array(value: dict[str, Any] | None) -> np.ndarray | None:
    return None if value is None else _array(value)
