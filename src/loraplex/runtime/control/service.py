"""TrainingService: the runtime's face to the API. Submissions are checked, queued and answered at once
with a future; the engine worker does the rest.

Every method is cheap and never touches the engine's state (only the engine's `validate_*_request`
checks, which are pure and read no slot). Every seq_id a training request names is accounted for: a
request refused for any reason once its run and seq_id are known (its body, its decoding, an unknown
loss, a feature this server lacks) is recorded as that seq_id's failed future (a `Submission` with its
refusal), so the run's later requests are never held behind it. A sampling request has no order to keep,
so it is refused at once (4xx with a body). Database writes happen outside the service lock, which the
engine worker takes to plan, so a slow database never stalls the engine; `submit_many` writes a burst of
submissions in one transaction. No tensors, no HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

from loraplex.config import ServerConfig
from loraplex.engine.interface import Engine, EngineInfo
from loraplex.engine.types import LoraConfig, PassRequest
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.control.catalog import Catalog
from loraplex.runtime.control.downloads import DownloadSigner
from loraplex.runtime.control.futures import FutureRecord, FutureTable
from loraplex.runtime.control.keys import ConsoleLogins, TenantResolver
from loraplex.runtime.control.retention import Retention, RetentionPolicy
from loraplex.runtime.control.session_search import SessionSearch
from loraplex.runtime.control.session_trace import SessionTraces
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.control.store import Store, utcnow
from loraplex.runtime.control.store.schema import SamplerRow
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout, validate_name
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
from loraplex.runtime.core.duty import DutyMeter, MeteredEngine
from loraplex.runtime.core.engine_loop import EngineLoop
from loraplex.runtime.core.executor import Executor, lost_run_error
from loraplex.runtime.core.run_queue import LOST, PARKED, Entry, RunQueue, RunState
from loraplex.runtime.core.sampling import SampleJob, SampleQueue, SampleRequest
from loraplex.runtime.core.scheduler import Gathering, Scheduler
from loraplex.runtime.observability.console import Console
from loraplex.runtime.observability.history import MetricHistory
from loraplex.runtime.observability.progress import ProgressBoard
from loraplex.runtime.observability.telemetry import Occupancy, Telemetry, queue_kind

log = logging.getLogger(__name__)

RESTART_ERROR = "the server restarted before this request finished; submit it again"


class TrainingService:
    """Sessions, runs, submissions and futures over one engine."""

    def __init__(self, engine: Engine, store: Store, config: ServerConfig) -> None:
        self.engine, self.store, self.config = engine, store, config
        self.telemetry = Telemetry(engine.info.device)
        self.telemetry.occupancy_source = self._occupancy
        store.observe = self.telemetry.record_db_call
        self.layout = DiskLayout(config.data_dir)
        self.futures = FutureTable(store, config.future_retention_s, telemetry=self.telemetry)
        self.sessions = SessionTable(store, config.session_timeout_s)
        self.catalog = Catalog(store, self.layout)
        self.session_search = SessionSearch(store, self.sessions.is_live)
        self.session_traces = SessionTraces(store, self.catalog)
        self.tenants = TenantResolver(store, config.auth)
        self.downloads = DownloadSigner(config.data_dir)
        self.history = MetricHistory(store)
        self.progress = ProgressBoard()
        self.logins = ConsoleLogins(store, config.auth)
        self.console = Console(
            store, self.layout, self.catalog, self.history, self.progress, self.telemetry, self.downloads
        )
        self._cond = threading.Condition()
        self._runs: dict[str, RunState] = {}  # every run this server knows
        self._active: dict[str, RunState] = {}  # the runs the scheduler looks at: resident or with commands
        self._sampler_seqs: dict[tuple[str, int], str] = {}  # (sampler, seq_id) -> future, while written
        self.samples = SampleQueue(config.max_queued_samples)
        self._recover()
        scheduler = Scheduler(
            config.pass_token_budget,
            engine.max_slots,
            Gathering(config.pass_gather_quiet_ms / 1000, config.pass_gather_max_ms / 1000),
            config.slot_wait_s,
        )
        # The engine thread's calls are timed (duty.py); other threads call `engine` itself (validation).
        meter = DutyMeter(self.telemetry)
        metered = cast(Engine, MeteredEngine(engine, meter))
        executor = Executor(
            metered,
            store,
            self.futures,
            self.layout,
            self._runs,
            self._cond,
            self.telemetry,
            self.history,
            self.progress,
        )
        self.engine_loop = EngineLoop(
            metered,
            executor,
            self.futures,
            self.sessions,
            self.layout,
            scheduler,
            self._active,
            self.samples,
            Retention(
                store,
                self.layout,
                RetentionPolicy(
                    config.future_retention_s,
                    config.snapshot_idle_s,
                    config.session_timeout_s,
                    config.metric_retention_s,
                    config.max_metrics_per_run,
                ),
            ),
            config.retention_sweep_s,
            config.seq_gap_timeout_s,
            config.max_prefill_tokens,
            self._cond,
            self.telemetry,
            meter,
        )

    @classmethod
    def open(cls, engine: Engine, config: ServerConfig) -> TrainingService:
        """A service on the configured data directory and database (created if missing)."""
        config.data_dir.mkdir(parents=True, exist_ok=True)
        return cls(engine, Store(config.resolved_database_url()), config)

    @property
    def info(self) -> EngineInfo:
        """What the engine serves."""
        return self.engine.info

    def start(self) -> None:
        """Start the engine worker."""
        self.engine_loop.start()

    def stop(self) -> None:
        """Stop the engine worker, park the runs it held (so a restart resumes them), close the database."""
        self.engine_loop.stop()
        self.engine_loop.park_all()
        self.history.flush()
        self.store.close()

    # --- runs
    def create_run(self, tenant: str, session_id: str, model_seq_id: int, command: Command) -> FutureRecord:
        """Submit seq 0 of a new run `{session}:train:{n}` (create_model or create-via-load_weights)."""
        self.sessions.owned(session_id, tenant)
        self.sessions.touch(session_id)
        run_id = f"{session_id}:train:{model_seq_id}"
        with self._cond:
            existing = self._runs.get(run_id)
        if existing is not None:
            return self._resubmitted(existing, tenant, 0)
        if (first := self.store.future_id_for(run_id, 0)) is not None:  # a create that failed before
            return self.futures.get(first, tenant)
        self._check_new_run(tenant, command)
        run = RunState(
            run_id,
            tenant,
            session_id,
            self._base_model_of(command),
            RunQueue(0, self.config.max_seq_ids_ahead),
            user_metadata=getattr(command, "user_metadata", {}),
        )
        with self._cond:  # the run and its seq 0 are claimed together, so a racing copy finds both
            winner = self._runs.setdefault(run_id, run)
            if winner is run:
                record = self.futures.new(tenant, command.request_type)
                run.queue.reserve(0, record.id)
        if winner is not run:  # a copy of this request got there first: answer with its future
            return self._resubmitted(winner, tenant, 0)
        if failed := self._persist_and_queue([_Claim(run, 0, record, command, None)]):
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
        """A created run of `tenant` (for get_info)."""
        run = self._owned_run(tenant, run_id)
        if run.lora_config is None:
            raise NotFoundError(f"training run {run_id!r} is still being created")
        return run

    async def retrieve(self, tenant: str, future_id: str) -> FutureRecord:
        """Long-poll a future: its outcome, or the still-pending record after long_poll_s."""
        return await self.futures.wait(future_id, tenant, self.config.long_poll_s)

    # --- samplers
    def create_sampler(
        self, tenant: str, session_id: str, seq: int, model_path: str | None, base_model: str | None
    ) -> str:
        """Register a sampling session over a checkpoint path or the base model; return its id."""
        self.sessions.owned(session_id, tenant)
        sampler_id = f"{session_id}:sample:{seq}"
        if (existing := self.store.get_sampler(sampler_id)) is not None:
            self.catalog.sampler(tenant, existing.id)
            return sampler_id
        if model_path is not None:
            self.catalog.readable_checkpoint(tenant, CheckpointPath.parse(model_path))
        elif base_model is not None:
            self._check_base_model(base_model)
        else:
            raise UserError("create_sampling_session needs model_path or base_model")
        self.store.add_sampler(
            SamplerRow(
                id=sampler_id,
                session_id=session_id,
                tenant=tenant,
                base_model=self.info.model_name,
                model_path=model_path,
                snapshot_dir=None,
                created_at=utcnow(),
            )
        )
        return sampler_id

    def sample(self, tenant: str, sampler_id: str, seq_id: int, request: SampleRequest) -> FutureRecord:
        """Queue an asample on one of the tenant's samplers; a resent (sampler, seq_id) gets its first future.

        SamplingBackpressureError (429, which the SDK resends) when too much sampling is queued.
        """
        sampler = self.catalog.sampler(tenant, sampler_id)
        job_request = replace(request, snapshot=sampler.snapshot)
        key = (sampler_id, seq_id)
        if (first := self.store.future_id_for(sampler_id, seq_id)) is not None:
            return self.futures.get(first, tenant)
        # A pending export has no snapshot on disk yet; everything else about the request is checked now.
        self.engine.validate_sample_request(job_request if sampler.export_from is None else request)
        with self._cond:  # a copy of this request being written right now answers with the same future
            if (first := self._sampler_seqs.get(key)) is not None:
                return self.futures.get(first, tenant)
            self.samples.reserve_room(request.num_samples)
            record = self.futures.new(tenant, "Sample")
            self._sampler_seqs[key] = record.id
        try:
            self.futures.persist([(record, sampler_id, seq_id)])
        except BaseException:
            with self._cond:
                self.samples.release_room(request.num_samples)
                del self._sampler_seqs[key]
            self.futures.drop(record.id)
            raise
        with self._cond:
            del self._sampler_seqs[key]
            self.samples.add(SampleJob(record.id, tenant, job_request, sampler.export_from))
            self._cond.notify_all()
        return record

    # --- internals
    def _occupancy(self) -> Occupancy:
        """Slots, runs and queues now, for telemetry snapshots (under the lock: O(runs + queued))."""
        depth: dict[str, int] = {}
        with self._cond:
            resident = sum(run.slot is not None for run in self._active.values())
            parked = sum(run.status == PARKED for run in self._runs.values())
            waiting = 0
            for run in self._active.values():
                pending = run.queue.pending()
                waiting += run.slot is None and bool(pending)
                for entry in pending:
                    if entry.command is not None:
                        kind = queue_kind(entry.command)
                        depth[kind] = depth.get(kind, 0) + 1
            depth["sample"] = len(self.samples.jobs())
        return Occupancy(
            slots_used=resident,
            slots_total=self.engine.max_slots,
            runs_parked=parked,
            runs_waiting=waiting,
            queue_depth=depth,
            futures_pending=self.futures.pending_count(),
        )

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
                self._check_command(run, command)
                rejection = lost_run_error(run.run_id) if run.status == LOST else None
            except UserError as exc:
                rejection = exc
        with self._cond:
            if (first := run.queue.future_for(seq_id)) is not None:  # a copy of this request, or a retry
                return self.futures.get(first, run.tenant)
            executed = seq_id < run.queue.next_seq_id
            if not executed:
                record = self.futures.new(run.tenant, submission.request_type)
                try:
                    run.queue.reserve(seq_id, record.id)
                except UserError:
                    self.futures.drop(record.id)
                    raise
        if executed:
            return self._earlier_future(run, seq_id)
        return _Claim(run, seq_id, record, None if rejection else command, rejection)

    def _persist_and_queue(self, claims: list[_Claim]) -> dict[str, Exception]:
        """Write claimed futures' rows (outside the lock), then queue their entries; a rejected one's
        future fails at once. Returns the errors of the claims whose rows could not be written, by future
        id; those claims are let go."""
        try:
            failed = self._persist(claims)
        except BaseException:
            self._let_go(claims)
            raise
        self._let_go([claim for claim in claims if claim.record.id in failed])
        written = [claim for claim in claims if claim.record.id not in failed]
        now = time.monotonic()
        with self._cond:
            for claim in written:
                claim.run.queue.add(Entry(claim.seq_id, claim.record.id, claim.command, now))
                self._active[claim.run.run_id] = claim.run
            self._cond.notify_all()
        if rejections := {c.record.id: c.rejection for c in written if c.rejection is not None}:
            self.futures.finish(rejections)
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
        with self._cond:
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
        with self._cond:
            future_id = run.queue.future_for(seq_id)
        if future_id is None:  # executed already: its future is in the database
            future_id = self.store.future_id_for(run.run_id, seq_id)
        if future_id is None:
            raise UserError(f"training run {run.run_id} already exists")
        return self.futures.get(future_id, tenant)

    def _owned_run(self, tenant: str, run_id: str) -> RunState:
        with self._cond:
            run = self._runs.get(run_id)
        if run is None or run.tenant != tenant:
            raise NotFoundError(f"training run {run_id!r} not found")
        return run

    def _check_new_run(self, tenant: str, command: Command) -> None:
        if isinstance(command, CreateRun):
            self._check_base_model(command.base_model)
            rank = command.lora_config.rank
            if not 1 <= rank <= self.config.max_rank:
                raise UserError(
                    f"lora_config.rank must be in [1, {self.config.max_rank}] on this server (got {rank})"
                )
        elif isinstance(command, CreateRunFromCheckpoint):
            self._check_source(tenant, command.source, command.with_optimizer)
        else:
            raise UserError(
                f"a new training run must start with create_model or load_weights, not {command.request_type}"
            )

    def _check_command(self, run: RunState, command: Command) -> None:
        """Everything checkable before execution: limits, names, references, the engine's input rules."""
        if isinstance(command, ForwardBackward):
            self._check_limits(command)
            # The slot is the worker's to change: validation reads only the request.
            self.engine.validate_pass_request(
                PassRequest(
                    None, command.loss_fn, command.loss_fn_config, command.datums, command.forward_only
                )
            )
        elif isinstance(command, SaveState | SaveSnapshot | SaveExternal) and command.name is not None:
            validate_name(command.name)
        elif isinstance(command, LoadState):
            self._check_source(run.tenant, command.source, command.with_optimizer)
        elif isinstance(command, CreateRun | CreateRunFromCheckpoint):
            raise UserError(f"training run {run.run_id} already exists")

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

    def _check_source(self, tenant: str, source: CheckpointPath, with_optimizer: bool) -> None:
        self.catalog.readable_checkpoint(tenant, source)
        if with_optimizer and source.kind != "weights":
            raise UserError(
                f"{source} holds no optimizer state; load it without the optimizer or use a weights/ path"
            )

    def _check_base_model(self, base_model: str) -> None:
        served = self.info.model_name
        if base_model.split(":")[0] != served.split(":")[0]:
            raise UserError(f"this server serves base model {served!r}, not {base_model!r}")

    def _base_model_of(self, command: Command) -> str:
        return command.base_model if isinstance(command, CreateRun) else self.info.model_name

    def _recover(self) -> None:
        """After a restart: fail in-flight futures; runs come back parked (if their state is on disk) or
        lost; half-written directories a crash left behind are removed."""
        failed = self.store.fail_pending_futures(RESTART_ERROR)
        last_seq = self.store.last_seq_ids()
        removed = self.layout.remove_staging()
        for row in self.store.all_runs():
            parked = self.layout.parked_dir(row.id)
            status = PARKED if parked.is_dir() else LOST
            if status != row.status:
                self.store.update_run(row.id, status=status)
            self._runs[row.id] = RunState(
                row.id,
                row.tenant,
                row.session_id,
                row.base_model,
                RunQueue(last_seq.get(row.id, 0) + 1, self.config.max_seq_ids_ahead),
                lora_config=LoraConfig(**row.lora_config),
                status=status,
                user_metadata=row.user_metadata or {},
                parked_dir=parked if status == PARKED else None,
                optim_steps=row.last_step or 0,
            )
        if failed or self._runs or removed:
            log.info(
                "recovered %d runs; failed %d requests that were in flight; removed %d unfinished writes",
                len(self._runs),
                failed,
                removed,
            )


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
