"""TrainingService: training submissions. Each is checked, queued for the engine loop and answered at once
with a future.

Every method is cheap and never touches the engine's state (only the engine's `validate_*_request`
checks, which are pure and read no slot). Every seq_id a training request names is accounted for: a
request refused for any reason once its run and seq_id are known (its body, its decoding, an unknown
loss, a feature this server lacks) is recorded as that seq_id's failed future (a `Submission` with its
refusal), so the run's later requests are never held behind it. Database reads and writes happen outside
the shared lock, which the engine loop takes to plan, so a slow database never stalls the engine;
`submit_many` writes a burst of submissions' futures in one transaction. No tensors, no HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loraplex.config import ServerConfig
from loraplex.engine.interface import Engine
from loraplex.engine.types import PassRequest
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.control.catalog import Catalog
from loraplex.runtime.control.futures import FutureRecord, FutureTable
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.control.store import Store
from loraplex.runtime.core.checkpoints import CheckpointPath, is_run_id, owner_digest, validate_name
from loraplex.runtime.core.commands import (
    Command,
    CreateRun,
    CreateRunFromCheckpoint,
    ForwardBackward,
    LoadState,
    SaveExternal,
    SaveSnapshot,
    SaveState,
)
from loraplex.runtime.core.executor import lost_run_error
from loraplex.runtime.core.journal import Journal, Record
from loraplex.runtime.core.run_queue import LOST, Entry, RunQueue, RunQueueFullError, RunState
from loraplex.runtime.core.state import SharedState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """A request of an existing run as the API hands it over: its command, or the refusal that kept it
    from becoming one (recorded as its seq_id's failed future, so the run's later requests go on)."""

    tenant: str
    run_id: str
    seq_id: int
    request_type: str
    command: Command | None = None
    refusal: UserError | None = None


class TrainingService:
    """Creates runs and accepts their commands."""

    def __init__(
        self,
        engine: Engine,
        state: SharedState,
        futures: FutureTable,
        journal: Journal,
        sessions: SessionTable,
        catalog: Catalog,
        store: Store,
        config: ServerConfig,
    ) -> None:
        self.engine, self.state, self.futures, self.journal = engine, state, futures, journal
        self.sessions, self.catalog, self.store, self.config = sessions, catalog, store, config

    # --- runs
    def create_run(self, tenant: str, session_id: str, model_seq_id: int, command: Command) -> FutureRecord:
        """Submit seq 0 of a new run `{session}:train:{n}` (create_model or create-via-load_weights)."""
        self.sessions.owned(session_id, tenant)
        self.sessions.touch(session_id)
        run_id = f"{session_id}:train:{model_seq_id}"
        if (existing := self.state.run(run_id)) is not None:
            return self._resubmitted(existing, tenant, 0)
        if (first := self.store.future_id_for(run_id, 0)) is not None:  # a create that failed before
            return self.futures.get(first, tenant)
        command = self._checked_new_run(tenant, command)
        run = RunState(
            run_id,
            tenant,
            session_id,
            self._base_model_of(command),
            RunQueue(0, self.config.max_seq_ids_ahead, self.config.max_queued_bytes_per_run),
            user_metadata=getattr(command, "user_metadata", {}),
        )
        with self.state.cond:  # the run and its seq 0 are claimed together, so a racing copy finds both
            winner = self.state.runs.setdefault(run_id, run)
            if winner is run:
                record = self.futures.new(tenant, command.request_type)
                run.queue.reserve(0, record.id)
        if winner is not run:  # a copy of this request got there first: answer with its future
            return self._resubmitted(winner, tenant, 0)
        failed = self._persist_and_queue([_Claim(run, 0, record, command, None)])
        if failed:
            with self.state.cond:  # not created: a retry must find no trace of this attempt
                if self.state.runs.get(run_id) is run and run.queue.is_idle():
                    del self.state.runs[run_id]
            raise failed[record.id]
        return record

    def submit(self, tenant: str, run_id: str, seq_id: int, command: Command) -> FutureRecord:
        """Submit a command of an existing run; a resent (run, seq_id) returns its first future."""
        return _one(self.submit_many([Submission(tenant, run_id, seq_id, command.request_type, command)]))

    def submit_many(self, submissions: Sequence[Submission]) -> list[FutureRecord | Exception]:
        """Submit several requests at once, their new futures written in one database transaction: each
        gets its future, or the error that refused it without touching the others. A request whose row
        cannot be written gets that error and leaves its seq_id free for the retry."""
        outcomes: list[FutureRecord | Exception] = []
        claims: list[_Claim] = []
        for submission in submissions:
            try:
                claimed = self._claim(submission)
            except Exception as error:  # this request's refusal (or fault) only
                outcomes.append(error)
                continue
            if isinstance(claimed, _Claim):
                claims.append(claimed)
                claimed = claimed.record
            outcomes.append(claimed)
        failed = self._persist_and_queue(claims) if claims else {}
        return [failed.get(o.id, o) if isinstance(o, FutureRecord) else o for o in outcomes]

    def run_state(self, tenant: str, run_id: str) -> RunState:
        """A created run of `tenant` (for get_info); reads memory only, so the event loop may call it."""
        run = self.state.run(run_id)
        if run is None or run.tenant != tenant:
            raise NotFoundError(f"training run {run_id!r} not found")
        if run.lora_config is None:
            raise NotFoundError(f"training run {run_id!r} is still being created")
        return run

    # --- internals
    def _claim(self, submission: Submission) -> _Claim | FutureRecord:
        """Check a submission and claim its (run, seq_id) for a new future in memory; a copy of a request
        already claimed, or executed (maybe before a restart), gets that request's future instead."""
        run = self._owned_run(submission.tenant, submission.run_id)
        seq_id, command, rejection = submission.seq_id, submission.command, submission.refusal
        _check_seq_id(seq_id)
        self.sessions.touch(run.session_id)
        if rejection is None:
            assert command is not None
            try:
                command = self._checked_command(run, command)
                rejection = lost_run_error(run.run_id) if run.status == LOST else None
            except UserError as exc:
                rejection = exc
        with self.state.cond:
            if (first := run.queue.future_for(seq_id)) is not None:  # a copy of this request, or a retry
                return self.futures.get(first, run.tenant)
            executed = seq_id < run.queue.next_seq_id
            if not executed:
                record = self.futures.new(run.tenant, submission.request_type)
                try:
                    nbytes = command.nbytes if isinstance(command, ForwardBackward) and not rejection else 0
                    run.queue.reserve(seq_id, record.id, nbytes)
                except (UserError, RunQueueFullError):
                    self.futures.drop(record.id)
                    raise
        if executed:
            return self._earlier_future(run, seq_id)
        return _Claim(run, seq_id, record, None if rejection else command, rejection)

    def _persist_and_queue(self, claims: list[_Claim]) -> dict[str, Exception]:
        """Write claimed futures' rows (outside the lock), then queue their entries; a rejected one's
        future fails through the journal. Returns the errors of the claims whose rows could not be
        written, by future id; those claims are let go."""
        try:
            failed = self._persist(claims)
        except BaseException:
            self._let_go(claims)
            raise
        self._let_go([claim for claim in claims if claim.record.id in failed])
        written = [claim for claim in claims if claim.record.id not in failed]
        now = time.monotonic()
        with self.state.cond:
            for claim in written:
                claim.run.queue.add(Entry(claim.seq_id, claim.record.id, claim.command, now))
                self.state.active[claim.run.run_id] = claim.run
            self.state.cond.notify_all()
        if rejections := {c.record.id: c.rejection for c in written if c.rejection is not None}:
            self.journal.append(Record(rejections))  # type: ignore[arg-type]
        return failed

    def _persist(self, claims: list[_Claim]) -> dict[str, Exception]:
        """Write the claims' rows in one transaction; if it fails, each alone, so that one request's bad
        row does not refuse the others beside it. The errors of the rows not written, by future id."""
        try:
            self.futures.persist([(claim.record, claim.run.run_id, claim.seq_id) for claim in claims])
        except Exception as error:
            if len(claims) == 1:
                return {claims[0].record.id: error}
            log.warning(
                "writing %d futures in one transaction failed (%r); writing each alone", len(claims), error
            )
            return {key: e for claim in claims for key, e in self._persist([claim]).items()}
        return {}

    def _let_go(self, claims: list[_Claim]) -> None:
        """Release claims whose rows were not written: their seq_ids are free again, their futures gone."""
        with self.state.cond:
            for claim in claims:
                claim.run.queue.release(claim.seq_id)
        for claim in claims:
            self.futures.drop(claim.record.id)

    def _earlier_future(self, run: RunState, seq_id: int) -> FutureRecord:
        future_id = self.store.future_id_for(run.run_id, seq_id)
        if future_id is None:
            raise UserError(
                f"seq_id {seq_id} is behind this run's log (next expected {run.queue.next_seq_id})"
            )
        return self.futures.get(future_id, run.tenant)

    def _resubmitted(self, run: RunState, tenant: str, seq_id: int) -> FutureRecord:
        if run.tenant != tenant:
            raise NotFoundError(f"training run {run.run_id!r} not found")
        with self.state.cond:
            future_id = run.queue.future_for(seq_id)
        if future_id is None:  # executed already: its future is in the database
            future_id = self.store.future_id_for(run.run_id, seq_id)
        if future_id is None:
            raise UserError(f"training run {run.run_id} already exists")
        return self.futures.get(future_id, tenant)

    def _owned_run(self, tenant: str, run_id: str) -> RunState:
        """A run of `tenant`; one it no longer holds is looked up in the database, to say why."""
        run = self.state.run(run_id)
        if run is not None and run.tenant == tenant:
            return run
        row = self.store.get_run(run_id) if run is None and is_run_id(run_id) else None
        if row is not None and row.tenant == tenant:  # retention deleted its live state
            raise NotFoundError(
                f"training run {run_id!r} was unused for over {self.config.parked_retention_s:g} s after its "
                "session ended, and its live state was deleted (--parked-retention-s); resume it from one of "
                "its checkpoints with ServiceClient.create_training_client_from_state(tinker_path)"
            )
        raise NotFoundError(f"training run {run_id!r} not found")

    def _checked_new_run(self, tenant: str, command: Command) -> Command:
        """The first command of a new run, checked, with what the engine loop needs resolved."""
        if isinstance(command, CreateRun):
            self._check_base_model(command.base_model)
            rank = command.lora_config.rank
            if not 1 <= rank <= self.config.max_rank:
                raise UserError(
                    f"lora_config.rank must be in [1, {self.config.max_rank}] on this server (got {rank})"
                )
            return command
        if isinstance(command, CreateRunFromCheckpoint):
            owner = self._source_owner(tenant, command.source, command.with_optimizer)
            return replace(command, source_owner=owner)
        raise UserError(
            f"a new training run must start with create_model or load_weights, not {command.request_type}"
        )

    def _checked_command(self, run: RunState, command: Command) -> Command:
        """Everything checkable before execution — limits, names, references, the engine's input rules — and
        the command with what the engine loop needs resolved (it reads no database)."""
        if isinstance(command, ForwardBackward):
            self._check_limits(command)
            # The slot is the engine loop's to change: validation reads only the request.
            self.engine.validate_pass_request(
                PassRequest(
                    None, command.loss_fn, command.loss_fn_config, command.datums, command.forward_only
                )
            )
        elif isinstance(command, SaveState | SaveSnapshot | SaveExternal):
            self._check_save(run, command)
        elif isinstance(command, LoadState):
            owner = self._source_owner(run.tenant, command.source, command.with_optimizer)
            return replace(command, source_owner=owner)
        elif isinstance(command, CreateRun | CreateRunFromCheckpoint):
            raise UserError(f"training run {run.run_id} already exists")
        return command

    def _check_save(self, run: RunState, command: SaveState | SaveSnapshot | SaveExternal) -> None:
        """A save's name, and that it does not exist yet (unless the save overwrites)."""
        if isinstance(command, SaveSnapshot) and command.name is None:  # names a new sampling session
            if command.sampler_id is not None and self.store.get_sampler(command.sampler_id) is not None:
                raise UserError(
                    f"sampling session {command.sampler_id} already exists; each sampling_session_seq_id "
                    "of a session names one sampler"
                )
            return
        assert command.name is not None  # only an unnamed sampler save has none
        validate_name(command.name)
        path = CheckpointPath(run.run_id, _SAVE_KINDS[type(command)], command.name)
        if getattr(command, "overwrite", False):
            return
        if self.store.get_checkpoint(path.run_id, path.kind, path.name) is not None:
            raise UserError(
                f"checkpoint {path} already exists; pick another name or save with overwrite=True"
            )

    def _check_limits(self, command: ForwardBackward) -> None:
        cfg = self.config
        _check_limit(
            f"request has {len(command.datums)} datums", len(command.datums), cfg.max_datums_per_request
        )
        for i, datum in enumerate(command.datums):
            _check_limit(
                f"datum {i} has {len(datum.tokens)} tokens", len(datum.tokens), cfg.max_tokens_per_datum
            )
        _check_limit(
            f"request has {command.num_tokens} tokens", command.num_tokens, cfg.max_tokens_per_request
        )

    def _source_owner(self, tenant: str, source: CheckpointPath, with_optimizer: bool) -> str:
        """The owner digest of a checkpoint the tenant may load (its own, or a published one)."""
        view = self.catalog.loadable_checkpoint(tenant, source)
        if with_optimizer and source.kind != "weights":
            raise UserError(
                f"{source} holds no optimizer state; load it without the optimizer or use a weights/ path"
            )
        return owner_digest(view.owner)

    def _check_base_model(self, base_model: str) -> None:
        served = self.engine.info.model_name
        if base_model.split(":")[0] != served.split(":")[0]:
            raise UserError(f"this server serves base model {served!r}, not {base_model!r}")

    def _base_model_of(self, command: Command) -> str:
        return command.base_model if isinstance(command, CreateRun) else self.engine.info.model_name


_SAVE_KINDS = {SaveState: "weights", SaveSnapshot: "sampler_weights", SaveExternal: "external_weights"}


@dataclass(frozen=True)
class _Claim:
    """A (run, seq_id) claimed in memory for a new future whose row is not written yet; `rejection` set:
    the future fails as soon as it is written."""

    run: RunState
    seq_id: int
    record: FutureRecord
    command: Command | None
    rejection: Exception | None


def _one(outcomes: list[FutureRecord | Exception]) -> FutureRecord:
    """The only outcome of a one-request `submit_many`, raised if it is an error."""
    (outcome,) = outcomes
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _check_seq_id(seq_id: int) -> None:
    if seq_id < 1:
        raise UserError(f"seq_id must be >= 1 (got {seq_id})")


def _check_limit(what: str, value: int, limit: int) -> None:
    if value > limit:
        raise UserError(f"{what}; this server allows at most {limit}")
