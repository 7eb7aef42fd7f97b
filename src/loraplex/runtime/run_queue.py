"""One training run's command log, ordered by seq_id, plus the run's live state (slot, config).

Requests may arrive out of order; a command becomes ready only when every lower seq_id has arrived.
A resent seq_id returns the first future and is never queued twice. Not thread-safe: the service
holds its lock around every call. No tensors, no SQL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraplex.engine.types import LoraConfig
from loraplex.errors import UserError
from loraplex.runtime.commands import Command

# A run's state word, as persisted: live in a slot, parked on disk, or lost in a restart.
LIVE, PARKED, LOST = "live", "parked", "lost"


@dataclass
class Entry:
    """One submitted command and the future that reports it; `command` None = already failed at submission."""

    seq_id: int
    future_id: str
    command: Command | None
    arrived_at: float = 0.0  # time.monotonic() at submission: the scheduler gathers passes by it


class RunQueue:
    """The seq_id-ordered command log of one run."""

    def __init__(self, next_seq_id: int = 0) -> None:
        self.next_seq_id = next_seq_id  # the lowest seq_id not yet handed out for execution
        self._held: dict[int, Entry] = {}  # arrived, not yet executed (maybe waiting for a gap)
        self._seen: dict[int, str] = {}  # seq_id -> future id, for idempotent resubmission

    def future_for(self, seq_id: int) -> str | None:
        """The future of an already submitted seq_id, if any."""
        return self._seen.get(seq_id)

    def add(self, entry: Entry) -> None:
        """Hold a command until it is contiguous; UserError for a seq_id already executed."""
        if entry.seq_id < self.next_seq_id:
            raise UserError(
                f"seq_id {entry.seq_id} was already executed on this run (next expected {self.next_seq_id})"
            )
        self._held[entry.seq_id] = entry
        self._seen[entry.seq_id] = entry.future_id

    def ready(self) -> list[Entry]:
        """The contiguous commands from next_seq_id on (entries failed at submission are skipped over)."""
        self._drop_failed_heads()
        out, seq = [], self.next_seq_id
        while seq in self._held:
            entry = self._held[seq]
            if entry.command is None:
                break
            out.append(entry)
            seq += 1
        return out

    def pop(self, count: int) -> list[Entry]:
        """Take the first `count` ready commands for execution."""
        taken = self.ready()[:count]
        for entry in taken:
            del self._held[entry.seq_id]
            self.next_seq_id = entry.seq_id + 1
        self._drop_failed_heads()
        return taken

    def is_idle(self) -> bool:
        """Nothing held: no command waiting or queued."""
        self._drop_failed_heads()
        return not self._held

    def pending(self) -> list[Entry]:
        """Every held entry, in seq_id order (for failing them all)."""
        return [self._held[s] for s in sorted(self._held)]

    def _drop_failed_heads(self) -> None:
        while (head := self._held.get(self.next_seq_id)) is not None and head.command is None:
            del self._held[self.next_seq_id]
            self.next_seq_id += 1


@dataclass
class RunState:
    """A training run as the runtime holds it in memory."""

    run_id: str
    tenant: str
    session_id: str
    base_model: str
    queue: RunQueue
    lora_config: LoraConfig | None = None  # known once created
    slot: int | None = None
    status: str = LIVE
    user_metadata: dict[str, str] = field(default_factory=dict)
    parked_dir: Path | None = None

    def has_slot(self) -> bool:
        """Whether the run's adapter is resident in the engine."""
        return self.slot is not None
