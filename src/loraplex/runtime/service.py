"""TrainingService: the runtime's face to the API. Submissions are checked, queued and answered at once
with a future; the engine worker does the rest.

Every method is cheap and never touches the engine's state (only the engine's `validate_*_request`
checks, which are pure). A training request that fails validation still consumes its seq_id, as a
failed future, so the run's later requests are not held forever; a sampling request has no order to
keep, so it is refused at once (4xx with a body). No tensors, no HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from loraplex.config import ServerConfig
from loraplex.engine.interface import Engine, EngineInfo
from loraplex.engine.types import LoraConfig, PassRequest
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.catalog import Catalog
from loraplex.runtime.checkpoints import CheckpointPath, DiskLayout, validate_name
from loraplex.runtime.commands import (
    Command,
    CreateRun,
    CreateRunFromCheckpoint,
    LoadState,
    Pass,
    SaveSnapshot,
    SaveState,
)
from loraplex.runtime.futures import FutureRecord, FutureTable
from loraplex.runtime.keys import TenantResolver
from loraplex.runtime.run_queue import LOST, PARKED, Entry, RunQueue, RunState
from loraplex.runtime.sampling import SampleJob, SampleQueue, SampleRequest
from loraplex.runtime.scheduler import Gathering, Scheduler
from loraplex.runtime.sessions import SessionTable
from loraplex.runtime.store import Store, utcnow
from loraplex.runtime.store.schema import SamplerRow
from loraplex.runtime.worker import EngineWorker, lost_run_error

log = logging.getLogger(__name__)

RESTART_ERROR = "the server restarted before this request finished; submit it again"


class TrainingService:
    """Sessions, runs, submissions and futures over one engine."""

    def __init__(self, engine: Engine, store: Store, config: ServerConfig) -> None:
        self.engine, self.store, self.config = engine, store, config
        self.layout = DiskLayout(config.data_dir)
        self.futures = FutureTable(store)
        self.sessions = SessionTable(store, config.session_timeout_s)
        self.catalog = Catalog(store, self.layout)
        self.tenants = TenantResolver(store, config.auth)
        self._cond = threading.Condition()
        self._runs: dict[str, RunState] = {}
        self.samples = SampleQueue(config.max_queued_samples)
        self._recover()
        self.worker = EngineWorker(
            engine,
            store,
            self.futures,
            self.sessions,
            self.layout,
            Scheduler(
                config.pass_token_budget,
                Gathering(config.pass_gather_quiet_ms / 1000, config.pass_gather_max_ms / 1000),
            ),
            self._runs,
            self.samples,
            config.max_prefill_tokens,
            self._cond,
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
        self.worker.start()

    def stop(self) -> None:
        """Stop the engine worker and close the database."""
        self.worker.stop()
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
        self._check_new_run(tenant, command)
        run = RunState(
            run_id,
            tenant,
            session_id,
            self._base_model_of(command),
            RunQueue(0),
            user_metadata=getattr(command, "user_metadata", {}),
        )
        with self._cond:
            self._runs.setdefault(run_id, run)
        return self._enqueue(run, 0, command, None)

    def submit(self, tenant: str, run_id: str, seq_id: int, command: Command) -> FutureRecord:
        """Submit a command of an existing run; a resent (run, seq_id) returns its first future."""
        run = self._owned_run(tenant, run_id)
        if seq_id < 1:
            raise UserError(f"seq_id must be >= 1 (got {seq_id})")
        with self._cond:
            if run.queue.future_for(seq_id) is not None:
                return self._resubmitted(run, tenant, seq_id)
        self.sessions.touch(run.session_id)
        try:
            self._check_command(run, command)
            rejection = lost_run_error(run_id) if run.status == LOST else None
        except UserError as exc:
            rejection = exc
        return self._enqueue(run, seq_id, command, rejection)

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
            self.catalog.checkpoint(tenant, CheckpointPath.parse(model_path))
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
        with self._cond:  # held throughout, so two copies of one request cannot both be queued
            if (first := self.store.future_id_for(sampler_id, seq_id)) is not None:
                return self.futures.get(first, tenant)
            # A pending export has no snapshot on disk yet; everything else about the request is checked now.
            self.engine.validate_sample_request(job_request if sampler.export_from is None else request)
            self.samples.check_room(request.num_samples)
            record = self.futures.create(tenant, "Sample", sampler_id, seq_id)
            self.samples.add(SampleJob(record.id, tenant, job_request, sampler.export_from))
            self._cond.notify_all()
        return record

    # --- internals
    def _enqueue(
        self, run: RunState, seq_id: int, command: Command, rejection: UserError | Exception | None
    ) -> FutureRecord:
        with self._cond:
            if (first := run.queue.future_for(seq_id)) is not None:  # lost a race with its own retry
                return self.futures.get(first, run.tenant)
            if seq_id < run.queue.next_seq_id:  # executed before a restart: answer with its first future
                return self._earlier_future(run, seq_id)
            record = self.futures.create(run.tenant, command.request_type, run.run_id, seq_id)
            run.queue.add(Entry(seq_id, record.id, None if rejection else command, time.monotonic()))
            self._cond.notify_all()
        if rejection is not None:
            self.futures.fail(record.id, rejection)
        return record

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
        future_id = run.queue.future_for(seq_id)
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
        if isinstance(command, Pass):
            self._check_limits(command)
            self.engine.validate_pass_request(
                PassRequest(
                    run.slot, command.loss_fn, command.loss_fn_config, command.datums, command.forward_only
                )
            )
        elif isinstance(command, SaveState | SaveSnapshot) and command.name is not None:
            validate_name(command.name)
        elif isinstance(command, LoadState):
            self._check_source(run.tenant, command.source, command.with_optimizer)
        elif isinstance(command, CreateRun | CreateRunFromCheckpoint):
            raise UserError(f"training run {run.run_id} already exists")

    def _check_limits(self, command: Pass) -> None:
        cfg = self.config
        if not command.datums:
            raise UserError("forward_backward needs at least one datum")
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
        self.catalog.checkpoint(tenant, source)
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
        """After a restart: fail in-flight futures; runs come back parked (if they were) or lost."""
        failed = self.store.fail_pending_futures(RESTART_ERROR)
        last_seq = self.store.last_seq_ids()
        for row in self.store.all_runs():
            parked = self.layout.parked_dir(row.id)
            status = PARKED if row.status == PARKED and parked.exists() else LOST
            if status != row.status:
                self.store.update_run(row.id, status=status)
            self._runs[row.id] = RunState(
                row.id,
                row.tenant,
                row.session_id,
                row.base_model,
                RunQueue(last_seq.get(row.id, 0) + 1),
                lora_config=LoraConfig(**row.lora_config),
                status=status,
                user_metadata=row.user_metadata or {},
                parked_dir=parked if status == PARKED else None,
            )
        if failed or self._runs:
            log.info("recovered %d runs; failed %d requests that were in flight", len(self._runs), failed)


def _check_limit(what: str, value: int, limit: int) -> None:
    if value > limit:
        raise UserError(f"{what}; this server allows at most {limit}")
