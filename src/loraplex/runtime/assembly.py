"""The runtime of one server, assembled: every collaborator built once over one engine, store and config, and
the threads that run them started and stopped in order.

This is where the rooms meet; nothing else holds all of them. The API takes the collaborators it needs
from here one by one (api/app.py) and hands each route only what it uses. Threads, and what each owns
(docs/ARCHITECTURE.md): the engine loop (the engine), the writer (outcomes to the database), housekeeping
(retention). No tensors, no HTTP.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from loraplex.config import ServerConfig
from loraplex.engine.host_memory import release_freed_memory
from loraplex.engine.interface import Engine, EngineInfo
from loraplex.runtime.control.aliases import AliasTable, import_alias_file
from loraplex.runtime.control.catalog import Catalog
from loraplex.runtime.control.downloads import DownloadSigner
from loraplex.runtime.control.futures import FutureTable
from loraplex.runtime.control.housekeeping import Housekeeping
from loraplex.runtime.control.keys import ConsoleLogins, TenantResolver
from loraplex.runtime.control.recovery import recover
from loraplex.runtime.control.retention import Retention, RetentionPolicy
from loraplex.runtime.control.samplers import SamplerService
from loraplex.runtime.control.service import TrainingService
from loraplex.runtime.control.session_search import SessionSearch
from loraplex.runtime.control.session_trace import SessionTraces
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.outage import DatabaseWatch
from loraplex.runtime.control.writer import JournalWriter
from loraplex.runtime.core.checkpoints import DiskLayout
from loraplex.runtime.core.disk_space import DiskSpace
from loraplex.runtime.core.duty import DutyMeter, MeteredEngine
from loraplex.runtime.core.engine_loop import EngineLoop
from loraplex.runtime.core.executor import Executor
from loraplex.runtime.core.host_tier import default_host_slots
from loraplex.runtime.core.sampler_backend import EngineSampler, SamplerBackend
from loraplex.runtime.core.scheduler import Gathering, Scheduler
from loraplex.runtime.core.state import SharedState
from loraplex.runtime.observability.console import Console
from loraplex.runtime.observability.history import MetricHistory
from loraplex.runtime.observability.progress import ProgressBoard
from loraplex.runtime.observability.telemetry import Occupancy, Telemetry
from loraplex.runtime.serving.inference import InferenceService
from loraplex.runtime.serving.text_codec import TextCodec


class Runtime:
    """One server's runtime over `engine`, `store` and `config`."""

    def __init__(self, engine: Engine, store: Store, config: ServerConfig) -> None:
        self.engine, self.store, self.config = engine, store, config
        self.layout = DiskLayout(config.data_dir)
        self.disk = DiskSpace(config.data_dir, config.min_free_bytes)
        self.telemetry = Telemetry(engine.info.device, model_name=engine.info.model_name)
        # On /metrics from the start, not from the engine loop's first cycle (its threads are not running).
        self.telemetry.record_usage(engine.usage())
        store.observe = self.telemetry.record_db_call
        self.state = SharedState(config.max_queued_samples, config.max_queued_samples_per_tenant)
        self.futures = FutureTable(
            store, config.future_retention_s, config.long_poll_s, telemetry=self.telemetry
        )
        self.telemetry.occupancy_source = self._occupancy
        self.writer = JournalWriter(store, self.futures)
        self.sessions = SessionTable(store, config.session_timeout_s)
        self.catalog = Catalog(store, self.layout)
        self.session_search = SessionSearch(store, self.sessions.is_live)
        self.session_traces = SessionTraces(store, self.catalog)
        self.tenants = TenantResolver(store, config.auth)
        self.logins = ConsoleLogins(store, config.auth)
        self.downloads = DownloadSigner(config.data_dir)
        self.history = MetricHistory(store)
        self.progress = ProgressBoard()
        self.console = Console(
            store,
            self.layout,
            self.catalog,
            self.history,
            self.progress,
            self.telemetry,
            self.downloads,
            engine.info,
        )
        self.training = TrainingService(
            engine, self.state, self.futures, self.writer, self.sessions, self.catalog, store, config
        )
        # The engine thread's calls are timed (core/duty.py); other threads call `engine` itself.
        meter = DutyMeter(self.telemetry)
        metered = cast(Engine, MeteredEngine(engine, meter))
        self.sampler = self._sampler_backend(metered)
        self.telemetry.sampler_servers = self.sampler.servers
        self.samplers = SamplerService(
            engine, self.state, self.futures, self.sessions, self.catalog, store, self.sampler
        )
        import_alias_file(store, config.data_dir)  # an earlier release's aliases.json, once
        self.inference = InferenceService(
            engine.info,
            self.samplers,
            self.futures,
            self.sessions,
            self.catalog,
            AliasTable(store),
            TextCodec.load(engine.info.tokenizer_dir),
        )
        recover(store, self.layout, self.state, config.max_seq_ids_ahead, config.max_queued_bytes_per_run)
        self.database_watch = DatabaseWatch(store.reachability, store.ping)
        self.housekeeping = Housekeeping(
            Retention(store, self.layout, RetentionPolicy.of(config)),
            self.state,
            self.sessions,
            self.layout,
            config.retention_sweep_s,
            on_removed=self.sampler.forget_snapshot,
        )
        host_slots = config.host_slots
        if host_slots is None:
            host_slots = default_host_slots(engine.host_bytes_per_slot())
        executor = Executor(
            metered,
            self.writer,
            self.layout,
            self.state,
            meter,
            self.telemetry,
            self.progress,
            config.max_prefill_tokens,
            host_slots,
            self.disk,
            self.sampler,
        )
        scheduler = Scheduler(
            config.pass_token_budget,
            engine.max_slots,
            Gathering(config.pass_gather_quiet_ms / 1000, config.pass_gather_max_ms / 1000),
            config.slot_wait_s,
        )
        self.engine_loop = EngineLoop(
            executor,
            scheduler,
            self.state,
            self.sessions.is_live,
            config.seq_gap_timeout_s,
            self.telemetry,
            meter,
        )

    def _sampler_backend(self, metered: Engine) -> SamplerBackend:
        """The backend `--sampler` names: the engine's own sampler, or vLLM servers (runtime/vllm/)."""
        if self.config.sampler == "loraplex":
            return EngineSampler(metered)
        from loraplex.runtime.vllm.sampler import VllmSampler

        return VllmSampler.from_config(self.config, metered, wake=self.state.wake)

    @classmethod
    def open(cls, engine: Engine, config: ServerConfig) -> Runtime:
        """A runtime on the configured data directory and database (created if missing)."""
        config.data_dir.mkdir(parents=True, exist_ok=True)
        return cls(engine, Store(config.resolved_database_url(), config.database_outage_s), config)

    @property
    def info(self) -> EngineInfo:
        """What the engine serves."""
        return self.engine.info

    def start(self, with_engine_loop: bool = True) -> None:
        """Start the writer and housekeeping, and the engine loop on a thread of its own unless the caller
        runs it (`loraplex serve` runs it on the main thread: EngineLoop.run)."""
        self.writer.start()
        self.housekeeping.start()
        self.database_watch.start()
        self.sampler.start()
        if with_engine_loop:
            self.engine_loop.start()

    def stop(self) -> None:
        """Stop the engine loop, park the runs it held (so a restart resumes them), write what is left to
        write, stop housekeeping, close the database."""
        self.engine_loop.stop()
        self.sampler.close()
        self.engine_loop.park_all()
        self.housekeeping.close()
        self.writer.close()
        self.database_watch.close()
        self.store.close()

    @staticmethod
    def release_freed_memory() -> None:
        """Hand the memory a refused large request took back to the system (engine/host_memory.py)."""
        release_freed_memory()

    def _occupancy(self) -> Occupancy:
        occupancy = self.state.occupancy(self.engine.max_slots)
        return dataclasses.replace(
            occupancy,
            futures_pending=self.futures.pending_count(),
            database_up=self.store.reachability.is_up,
            data_dir_free_bytes=self.disk.free_bytes(),
            data_dir_reserve_bytes=self.disk.reserve_bytes,
        )
