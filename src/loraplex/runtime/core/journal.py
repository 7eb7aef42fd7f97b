"""The journal: how the engine loop hands on what each engine call produced, to be made durable elsewhere.

The engine thread only computes. What a call produced — its requests' outcomes, and the facts beside them
(a run created, a checkpoint saved, a run's status, each request's metrics) — goes into one `Record`,
which the journal writes on its own thread (runtime/control/writer.py) and answers with a `Receipt`.

The ordering rule (docs/ARCHITECTURE.md, "Durability"):
- A request's outcome is visible to its waiter only once durable: the writer wakes waiters after the
  record's transaction commits.
- The engine thread does not wait for that commit; it goes on with what cannot be affected (planning,
  sampler steps). Before its next call that may change an adapter slot it settles the last record that
  can be taken back (`executor.py`): if that record could not be written, the call is taken back first
  (`Engine.undo_last`, or freeing a created slot), so a client told "nothing was kept" never finds its
  work kept.
- An optimizer step's outcome is known before its kernels run (`Engine.prepare_step`): its record is
  written first and the kernels run only once it is durable, so a step needs no copy to be taken back;
  its waiters wake once the kernels have run (`Record.is_held_until_applied`, `Receipt.publish`).

No SQL, no HTTP, no tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loraplex.engine.types import LoraConfig, PassResult, SampleResult
from loraplex.runtime.core.checkpoints import CheckpointPath

# What a completed request returns: a pass's or a sample's result, or the JSON object of any other request.
Result = dict[str, Any] | PassResult | SampleResult
Outcome = Result | BaseException


# The kinds of request whose metrics a run's history keeps (sample: a request of a sampler of the run's
# weights, core/sample_history.py).
FORWARD_BACKWARD, FORWARD, OPTIM_STEP, SAMPLE = "forward_backward", "forward", "optim_step", "sample"


@dataclass(frozen=True)
class MetricsRecorded:
    """One request's metrics in its run's history (the console's charts): a forward_backward's or forward's,
    an optim_step's, or a sample request's. `step` is the optimizer step it belongs to
    (observability/history.py)."""

    run_id: str
    seq_id: int  # the run's seq_id of the request; sample requests': the first one's on its sampler
    step: int
    kind: str  # forward_backward | forward | optim_step | sample
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class RunCreated:
    """A run got its adapter: the row that makes it known after a restart."""

    run_id: str
    session_id: str
    tenant: str
    base_model: str
    lora_config: LoraConfig
    user_metadata: Mapping[str, str]


@dataclass(frozen=True)
class RunStatusChanged:
    """A run became live, parked or lost (run_queue.py)."""

    run_id: str
    status: str


@dataclass(frozen=True)
class CheckpointSaved:
    """A named checkpoint's files were written."""

    path: CheckpointPath
    tenant: str
    size_bytes: int
    ttl_seconds: int | None
    user_metadata: Mapping[str, str]


@dataclass(frozen=True)
class SamplerCreated:
    """An unnamed save_weights_for_sampler wrote the snapshot its new sampling session reads."""

    sampler_id: str
    session_id: str
    tenant: str
    base_model: str
    snapshot_dir: Path


Fact = MetricsRecorded | RunCreated | RunStatusChanged | CheckpointSaved | SamplerCreated


@dataclass
class Record:
    """What one engine call (or one refusal) produced, written in one transaction or not at all."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)  # future id -> result or error
    facts: list[Fact] = field(default_factory=list)
    # A directory the call wrote that no row will name if the record cannot be written: removed then.
    written: Path | None = None
    # Directories the record makes obsolete (a parked run's state once it is live again): removed after.
    obsolete: list[Path] = field(default_factory=list)
    # The engine takes the call back if the record cannot be written: its requests' error says so.
    is_undone_if_unwritten: bool = False
    # Written before the call it reports has run (an optimizer step): its waiters wake when the engine
    # loop says the call ran (Receipt.publish), not at the commit.
    is_held_until_applied: bool = False

    def __bool__(self) -> bool:
        return bool(self.outcomes or self.facts or self.obsolete)


class Receipt:
    """The journal's answer to one record: set once the record is durable, or known never to be."""

    def __init__(self) -> None:
        self._settled = threading.Event()
        self._is_durable = False
        self._publish: Callable[[], None] | None = None

    def settle(self, is_durable: bool, publish: Callable[[], None] | None = None) -> None:
        """Called by the writer, once; `publish` wakes a held record's waiters."""
        self._is_durable, self._publish = is_durable, publish
        self._settled.set()

    def publish(self) -> None:
        """Wake the waiters of a record held until applied (once its call ran); nothing otherwise."""
        publish, self._publish = self._publish, None
        if publish is not None:
            publish()

    @property
    def is_settled(self) -> bool:
        """Whether the writer has answered."""
        return self._settled.is_set()

    def wait(self) -> bool:
        """Block until the writer answers; True if the record is durable."""
        self._settled.wait()
        return self._is_durable


class Journal(Protocol):
    """Where records go: `append` takes a record and returns at once; the receipt settles later."""

    def append(self, record: Record) -> Receipt:
        """Queue `record` to be made durable."""
        ...
