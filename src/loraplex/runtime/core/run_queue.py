"""One training run's command log, ordered by seq_id, plus the run's live state (slot, config).

Requests may arrive out of order; a command becomes ready only when every lower seq_id has arrived.
A resent seq_id returns the first future and is never queued twice. Every seq_id a request names is
accounted for: a request refused before it became a command is held as a failed entry (command None)
and skipped when its turn comes, so the run's later requests are never wedged behind it. Only seq_ids
within `window` of the next expected one are accepted, and the log forgets entries once executed (the
database answers for older seq_ids). The requests it holds are bounded in bytes too (`max_bytes`, the
decoded arrays of their datums): past it a request is told to come again later (429), except the next
expected seq_id, which is always taken, so that a run never waits for a request it refuses. Not
thread-safe: the service holds its lock around every call. No tensors, no SQL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraplex.engine.types import LoraConfig
from loraplex.errors import CapacityError, UserError
from loraplex.runtime.core.commands import Command

# A run's state word, as persisted: live in a slot, parked on disk, lost in a restart, or expired: its
# parked state deleted by retention after --parked-retention-s unused (control/retention.py).
LIVE, PARKED, LOST, EXPIRED = "live", "parked", "lost", "expired"


class RunQueueFullError(CapacityError):
    """The run holds as many bytes of requests as it may; the SDK backs off about a second and resends
    (HTTP 429 with Retry-After), by when the run has worked some of them off."""

    status_code = 429
    retry_after_s = 1


@dataclass
class Entry:
    """One submitted command and the future that reports it; `command` None = already failed at submission."""

    seq_id: int
    future_id: str
    command: Command | None
    arrived_at: float = 0.0  # time.monotonic() at submission: the scheduler gathers passes by it


class RunQueue:
    """The seq_id-ordered command log of one run."""

    def __init__(self, next_seq_id: int = 0, window: int = 1024, max_bytes: int = 2**30) -> None:
        self.next_seq_id = next_seq_id  # the lowest seq_id not yet handed out for execution
        self.window = window  # how far ahead of next_seq_id a seq_id may be
        self.max_bytes = max_bytes  # how many bytes of requests the run may hold (--max-queued-bytes-per-run)
        self._held: dict[int, Entry] = {}  # arrived, not yet executed (maybe waiting for a gap)
        self._reserved: dict[int, str] = {}  # seq_id -> future id, between acceptance and add()
        self._bytes: dict[int, int] = {}  # seq_id -> bytes of a reserved or held request
        self.held_bytes = 0  # their sum

    def future_for(self, seq_id: int) -> str | None:
        """The future of a seq_id that is held or being added, if any (executed ones: ask the database)."""
        entry = self._held.get(seq_id)
        return entry.future_id if entry is not None else self._reserved.get(seq_id)

    def reserve(self, seq_id: int, future_id: str, nbytes: int = 0) -> None:
        """Claim a seq_id for a future whose record is being written, holding `nbytes` of request (UserError
        outside the window; RunQueueFullError past the bytes a run may hold)."""
        if seq_id < self.next_seq_id:
            raise UserError(
                f"seq_id {seq_id} was already executed on this run (next expected {self.next_seq_id})"
            )
        if seq_id >= self.next_seq_id + self.window:
            raise UserError(
                f"seq_id {seq_id} is too far ahead: this run expects seq_id {self.next_seq_id} next and "
                f"holds at most {self.window} requests ahead of it"
            )
        if seq_id != self.next_seq_id and self.held_bytes + nbytes > self.max_bytes:
            raise RunQueueFullError(
                f"this run holds {self.held_bytes} bytes of requests not yet executed, and this one's "
                f"{nbytes} would pass the {self.max_bytes} it may hold (--max-queued-bytes-per-run); it "
                f"expects seq_id {self.next_seq_id} next: send again once earlier requests are done"
            )
        self._reserved[seq_id] = future_id
        self._bytes[seq_id] = nbytes
        self.held_bytes += nbytes

    def release(self, seq_id: int) -> None:
        """Give up a reservation whose record could not be written."""
        if self._reserved.pop(seq_id, None) is not None:
            self._forget_bytes(seq_id)

    def add(self, entry: Entry) -> None:
        """Hold a reserved command until it is contiguous."""
        self._reserved.pop(entry.seq_id, None)
        self._held[entry.seq_id] = entry

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
            self._forget_bytes(entry.seq_id)
            self.next_seq_id = entry.seq_id + 1
        self._drop_failed_heads()
        return taken

    def is_idle(self) -> bool:
        """Nothing held: no command waiting or queued."""
        self._drop_failed_heads()
        return not self._held and not self._reserved

    def abandon_gap(self) -> list[Entry]:
        """When the requests before a gap will never come (their session expired): drop every held entry,
        move past them, and return the ones whose futures still need failing (commands not None)."""
        return [] if self.ready() else self.abandon_all()

    def abandon_all(self) -> list[Entry]:
        """Drop every held entry and move past them; return the ones whose futures still need failing."""
        if not self._held:
            return []
        dropped = [self._held.pop(seq) for seq in sorted(self._held)]
        for entry in dropped:
            self._forget_bytes(entry.seq_id)
        self.next_seq_id = max(self.next_seq_id, dropped[-1].seq_id + 1)
        return [entry for entry in dropped if entry.command is not None]

    def pending(self) -> list[Entry]:
        """Every held entry, in seq_id order (for failing them all)."""
        return [self._held[s] for s in sorted(self._held)]

    def _drop_failed_heads(self) -> None:
        while (head := self._held.get(self.next_seq_id)) is not None and head.command is None:
            del self._held[self.next_seq_id]
            self._forget_bytes(self.next_seq_id)
            self.next_seq_id += 1

    def _forget_bytes(self, seq_id: int) -> None:
        self.held_bytes -= self._bytes.pop(seq_id, 0)


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
    # The key of the engine's host-memory copy of its state while it is in the host tier (executor.py):
    # no slot, status still LIVE (it lives in this process only, as a slot's state does).
    host_key: int | None = None
    # Residency (scheduler.py): gradients accumulated since the last optim_step pin the run to its slot;
    # a run without a slot that has work waits in order of `waiting_since` (time.monotonic()).
    pending_gradients: bool = False
    waiting_since: float | None = None
    last_active: float = 0.0  # time.monotonic() of its last planned work: the least recent is parked first
    # Optimizer steps taken on this server (the engine worker's to change): numbers its metric history.
    optim_steps: int = 0

    def has_slot(self) -> bool:
        """Whether the run's adapter is resident in the engine."""
        return self.slot is not None

    def is_held(self) -> bool:
        """Whether the engine holds the run's state: in a slot, or in the host tier."""
        return self.slot is not None or self.host_key is not None
