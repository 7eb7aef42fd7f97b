"""SamplerService: sampling sessions and their requests.

A sampling session (a sampler) reads a checkpoint path, an unnamed snapshot, or the base model; its asample
requests go to the engine loop's sampling queue and are answered at once with a future. Sampling has no
order to keep, so a bad request is refused at once (4xx with a body). A resent (sampler, seq_id) gets its
first future, also when two copies race (the database's unique (sampler, seq_id) decides). A request
stamps its sampler as it is accepted, in the same transaction as its future: retention deletes a sampler
only if that stamp has not moved since it looked (store: delete_unused_sampler), so it never deletes one
from under a request. A request nobody waits for any more can be cancelled (`cancel`: the /v1 endpoints,
whose clients can go away; the SDK has no cancel). No tensors, no HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from loraplex.engine.interface import Engine
from loraplex.errors import UserError
from loraplex.runtime.control.catalog import Catalog
from loraplex.runtime.control.futures import FutureRecord, FutureTable
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.control.store import SeqIdTakenError, Store
from loraplex.runtime.control.store.schema import SamplerRow
from loraplex.runtime.core.checkpoints import CheckpointPath, owner_digest
from loraplex.runtime.core.sampler_backend import SamplerBackend
from loraplex.runtime.core.sampling import SampleJob, SampleProgress, SampleRequest, SampleRoom
from loraplex.runtime.core.state import SharedState
from loraplex.timestamps import utcnow


class SamplerService:
    """Creates sampling sessions and queues their requests."""

    def __init__(
        self,
        engine: Engine,
        state: SharedState,
        futures: FutureTable,
        sessions: SessionTable,
        catalog: Catalog,
        store: Store,
        backend: SamplerBackend,
    ) -> None:
        self.engine, self.state, self.futures = engine, state, futures
        self.backend = backend  # the sampler backend that decodes the requests, which checks them first
        self.sessions, self.catalog, self.store = sessions, catalog, store

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
            self.catalog.loadable_checkpoint(tenant, CheckpointPath.parse(model_path))
        elif base_model is not None:
            served = self.engine.info.model_name
            if base_model.split(":")[0] != served.split(":")[0]:
                raise UserError(f"this server serves base model {served!r}, not {base_model!r}")
        else:
            raise UserError("create_sampling_session needs model_path or base_model")
        self.store.add_sampler(
            SamplerRow(
                id=sampler_id,
                session_id=session_id,
                tenant=tenant,
                base_model=self.engine.info.model_name,
                model_path=model_path,
                snapshot_dir=None,
                created_at=utcnow(),
            )
        )
        return sampler_id

    @property
    def max_queued_samples(self) -> int:
        """Samples the queue holds at most for one tenant (--max-queued-samples, or the per-tenant limit)."""
        samples = self.state.samples
        return min(samples.max_queued_samples, samples.max_queued_samples_per_tenant)

    @property
    def queue_limit_flag(self) -> str:
        """The flag that sets `max_queued_samples`."""
        samples = self.state.samples
        is_tenant_limit = samples.max_queued_samples_per_tenant < samples.max_queued_samples
        return "--max-queued-samples-per-tenant" if is_tenant_limit else "--max-queued-samples"

    def reserve(self, num_samples: int, tenant: str) -> SampleRoom:
        """Room for several of a tenant's requests' samples at once (all or nothing:
        SamplingBackpressureError, 429, if they do not fit), for `sample(..., room=)`; `release` what is
        left once they are all queued."""
        with self.state.cond:
            return self.state.samples.reserve_room(num_samples, tenant)

    def release(self, room: SampleRoom) -> None:
        """Give back what no request took of `room`."""
        with self.state.cond:
            self.state.samples.release_room(room)

    def cancel(self, future_ids: Iterable[str], reason: str) -> None:
        """Drop these requests if unfinished (out of the queue, or out of the engine's batch at its next
        cycle) and fail their futures with `reason`; finished ones keep their results."""
        with self.state.cond:
            for future_id in future_ids:
                self.state.samples.cancel(future_id, reason)
            self.state.cond.notify_all()

    def sample(
        self,
        tenant: str,
        sampler_id: str,
        seq_id: int,
        request: SampleRequest,
        room: SampleRoom | None = None,
        on_progress: Callable[[SampleProgress], None] | None = None,
    ) -> FutureRecord:
        """Queue an asample on one of the tenant's samplers; a resent (sampler, seq_id) gets its first future.

        Its samples are counted against the queue's limit now (SamplingBackpressureError, 429, which the
        SDK resends, when too much sampling is queued), or taken from `room`, reserved beforehand. With
        `on_progress`, the engine thread calls it with the tokens of each step (SampleJob.on_progress).
        """
        sampler = self.catalog.sampler(tenant, sampler_id)
        job_request = replace(request, snapshot=sampler.snapshot, streams=on_progress is not None)
        if (first := self.store.future_id_for(sampler_id, seq_id)) is not None:
            return self.futures.get(first, tenant)
        # A pending export has no snapshot on disk yet; everything else about the request is checked now.
        self.backend.validate_sample_request(job_request if sampler.export_from is None else request)
        export_owner = ""
        if sampler.export_from is not None:
            export_owner = owner_digest(self.catalog.readable_checkpoint(tenant, sampler.export_from).owner)
        own_room = room is None
        room = self.reserve(request.num_samples, tenant) if room is None else room
        record = self.futures.new(tenant, "Sample")
        try:
            self.futures.persist_sample(record, sampler_id, seq_id)
        except BaseException as error:
            if own_room:
                self.release(room)
            self.futures.drop(record.id)
            if isinstance(error, SeqIdTakenError):  # a copy of this request wrote its future first
                first = self.store.future_id_for(sampler_id, seq_id)
                if first is not None:
                    return self.futures.get(first, tenant)
            raise
        job = SampleJob(
            record.id, tenant, job_request, sampler.export_from, export_owner, seq_id, on_progress
        )
        with self.state.cond:
            self.state.samples.add(job, room)
            self.state.cond.notify_all()
        return record
