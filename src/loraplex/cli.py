"""The `loraplex` command: subcommands `serve`, `engine-worker`, `keys`, `doctor`, `gc`, `demo`, `bench` and
`memory-plan`, each registered by a small function.

To add a subcommand (e.g. bench), write `_add_<name>(subparsers)` that sets
`handler=` on its parser and list it in SUBCOMMANDS. Server options come from ServerConfig's fields,
so a field's description is its --help text. The engine is imported lazily, only by the commands that
run it (`serve`, `engine-worker`).
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import logging
import os
import signal
import sys
import threading
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pydantic

from loraplex import os_threads
from loraplex.config import ServerConfig
from loraplex.errors import ServerError, UserError
from loraplex.heap import freeze_startup_heap
from loraplex.log_format import configure_logging

if TYPE_CHECKING:
    from loraplex.engine.distributed.group import RankEnv, RankTimeouts
    from loraplex.engine.distributed.launch import EngineBuilder, LocalRanks
    from loraplex.engine.local import LocalEngine
    from loraplex.engine.sampler.validation import SamplingLimits
    from loraplex.model.tensor_parallel import TensorParallel

log = logging.getLogger("loraplex")


def _config_options(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """One --option per ServerConfig field (or the `only` ones); unset options keep the field default."""
    for name, field in ServerConfig.model_fields.items():
        if only is not None and name not in only:
            continue
        kind: Any = field.annotation
        if isinstance(kind, types.UnionType):  # `X | None`: the option takes an X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        kwargs: dict[str, Any] = {"default": None, "help": f"{field.description} (default: {field.default})"}
        if typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif kind is bool:  # a switch: given means True
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = kind
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, **kwargs)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed arguments: given options over field defaults."""
    given = {k: v for k, v in vars(args).items() if k in ServerConfig.model_fields and v is not None}
    return ServerConfig(**given)


def config_to_args(config: ServerConfig, only: Sequence[str]) -> list[str]:
    """The command-line options that give `config`'s `only` fields their values (None fields omitted)."""
    args = []
    for name in only:
        value, option = getattr(config, name), f"--{name.replace('_', '-')}"
        if value is True:
            args.append(option)
        elif value is not None and value is not False:
            args += [option, str(value)]
    return args


# --- serve
def _add_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="Serve the Tinker API over one base model.")
    _config_options(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    # This thread becomes the engine thread: named before the engine starts the threads that inherit it.
    os_threads.name_os_thread(os_threads.ENGINE)
    config = config_from_args(args)
    check_exposure(config)
    if config.nproc % config.tp:
        raise UserError(
            f"--tp {config.tp} must divide --nproc {config.nproc}: the ranks form --nproc / --tp "
            "data-parallel groups of --tp tensor-parallel ranks"
        )
    if config.nproc > 1:
        from loraplex.engine.distributed.group import RankEnv, rank_device
        from loraplex.engine.distributed.launch import LocalRanks

        rank_device(config.device, config.nproc - 1)  # too few GPUs: a UserError here, not in a child
        env = RankEnv.on_this_machine(config.nproc)
        options = config_to_args(config, _ENGINE_OPTIONS)
        worker = [sys.executable, "-m", "loraplex.cli", "engine-worker", *options]
        return _serve_ranks(config, env, LocalRanks.spawn(worker, env))
    from loraplex.model.tensor_parallel import SINGLE

    if config.tp > 1:
        raise UserError(f"--tp {config.tp} needs --nproc of at least {config.tp}: one engine rank per part")
    run_server(config, _engine_builder(config)(config.device, SINGLE))
    return 0


def check_exposure(config: ServerConfig) -> None:
    """Refuse --auth none on a host other than loopback unless the operator said so; log the choice."""
    if config.auth != "none" or _is_loopback(config.host):
        return
    if not config.allow_unauthenticated_remote:
        raise UserError(
            f"--auth none on --host {config.host} would let anyone who can reach port {config.port} act as "
            "this server's one tenant; use --auth keys (keys from `loraplex keys create`), serve on "
            "127.0.0.1, or pass --allow-unauthenticated-remote to accept that"
        )
    log.warning(
        "--auth none on %s (--allow-unauthenticated-remote): anyone who can reach port %d is the one tenant",
        config.host,
        config.port,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address: only localhost is known to stay on this machine
        return host == "localhost"


def sampling_limits(config: ServerConfig) -> SamplingLimits:
    """What `config` lets sampling use."""
    from loraplex.engine.sampler.validation import SamplingLimits

    return SamplingLimits(
        max_topk_prompt_logprobs=config.max_topk_prompt_logprobs,
        max_topk_sample_logprobs=config.max_topk_sample_logprobs,
        max_request_kv_bytes=config.max_sample_kv_mib << 20,
        kv_budget_bytes=config.sample_kv_budget_mib << 20,
    )


def _engine_builder(config: ServerConfig) -> EngineBuilder:
    """Builds the configured model's LocalEngine on the device it is given, holding the part of the model
    its tensor-parallel group gives it (heavy imports: only here)."""
    from loraplex.engine.determinism import use_deterministic_kernels
    from loraplex.engine.local import build_local_engine

    def build(device: str, tp: TensorParallel) -> LocalEngine:
        if config.deterministic:
            use_deterministic_kernels()
        engine = build_local_engine(
            config.model,
            config.data_dir,
            device,
            config.max_slots,
            config.max_rank,
            config.model_name,
            config.pass_token_budget,
            tp,
            config.compile,
            config.max_sampling_snapshots,
            config.cuda_graphs,
        )
        engine.sampler.limits = sampling_limits(config)
        engine.sampler.max_batch = config.max_sampling_batch
        return engine

    return build


def _serve_ranks(config: ServerConfig, env: RankEnv, local_ranks: LocalRanks | None) -> int:
    """Serve as rank 0 of the engine ranks; exit 1 with the cause if a rank fails."""
    from loraplex.engine.distributed.coordinator import start_coordinator

    # A failed rank stops the server with SIGTERM (a second one while stopping does no harm, unlike
    # Ctrl-C, which forces the exit). SIGTERM ends like Ctrl-C (uvicorn's graceful shutdown, then
    # KeyboardInterrupt) rather than killing the process, so the ranks are shut down in order below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        engine = start_coordinator(
            env,
            _engine_builder(config),
            config.device,
            _rank_timeouts(config),
            config.tp,
            on_failure=lambda _cause: os.kill(os.getpid(), signal.SIGTERM),
            local_ranks=local_ranks,
        )
    except ServerError as exc:  # a rank died while starting (its own output says why)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        run_server(config, engine)
    except KeyboardInterrupt:  # a stop before uvicorn took over the signals
        pass
    finally:
        engine.close()
    if engine.failure is not None:
        print(f"error: {engine.failure}", file=sys.stderr)
        return 1
    return 0


def hold_data_dir(data_dir: Path) -> IO[str]:
    """Take the data dir's lock for this process's lifetime (released when the returned file closes or
    the process ends, kill -9 included); UserError if another server holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = open(data_dir / "serve.lock", "a+")  # noqa: SIM115 (held open until the server stops)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(f"another loraplex server is running on --data-dir {data_dir}") from None
    return lock


def run_server(config: ServerConfig, engine: Any) -> None:
    """Serve `engine` with `config` until interrupted (also used by tests with a fake engine)."""
    import uvicorn

    from loraplex.api.app import create_app
    from loraplex.api.http_protocol import read_timeout_protocol
    from loraplex.model.hub_cache import offer_tiny_tokenizer
    from loraplex.model.tiny import TINY_MODEL_NAME
    from loraplex.runtime.assembly import Runtime

    configure_logging(config.log_format, config.log_level)
    lock = hold_data_dir(config.data_dir)  # one server per data dir; `loraplex gc` checks it too
    runtime = Runtime.open(engine, config)
    info = engine.info
    # Only the built-in model under its own name: never a cache entry for an operator's --model-name.
    is_builtin = config.model == "tiny" and info.model_name == TINY_MODEL_NAME
    if is_builtin and (cached := offer_tiny_tokenizer(Path(info.tokenizer_dir))) is not None:
        log.info("the built-in model's tokenizer is in the Hugging Face cache for local clients: %s", cached)
    log.info("model %s (%s) on device %s", info.model_name, config.model, info.device)
    log.info(
        "database %s; data in %s; auth %s", runtime.store.display_url, config.data_dir.resolve(), config.auth
    )
    log.info("listening on http://%s:%d (Tinker base_url)", config.host, config.port)
    app = create_app(runtime, run_service=False)
    freeze_startup_heap()
    # The C parser and event loop (pinned dependencies): each request's Python time is time the engine's
    # thread may wait for the GIL, and the SDK makes two requests per forward_backward or optim_step.
    # The protocol adds read timeouts to uvicorn's (api/http_protocol.py): a stalled client is closed.
    http_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        http=read_timeout_protocol(config.http_header_timeout_s, config.http_body_idle_timeout_s),
        loop="uvloop",
        timeout_keep_alive=config.http_keep_alive_s,
    )
    server = uvicorn.Server(http_config)
    # HTTP on a thread, the engine on this main thread, where its passes run fastest (EngineLoop.run).
    # uvicorn installs no signal handlers off the main thread: SIGINT and SIGTERM stop the engine loop
    # after its current plan, then the HTTP server.
    http = threading.Thread(target=_named(os_threads.HTTP, server.run), name="loraplex-http", daemon=True)
    stop = runtime.engine_loop.request_stop
    previous = {sig: signal.signal(sig, lambda *_: stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    runtime.start(with_engine_loop=False)
    http.start()
    try:
        runtime.engine_loop.run(keep_running=http.is_alive)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        http.join(timeout=30)
        runtime.stop()
        lock.close()
    if not server.started:
        raise ServerError(f"the HTTP server did not start on {config.host}:{config.port} (see the log above)")


def _named(name: str, target: Callable[[], object]) -> Callable[[], None]:
    """`target`, run on a thread the kernel knows as `name`."""

    def run() -> None:
        os_threads.name_os_thread(name)
        target()

    return run


# --- engine-worker
# The ServerConfig fields a worker rank needs: what to load, where, and how long to wait on rank 0.
_ENGINE_OPTIONS = (
    "model",
    "model_name",
    "device",
    "compile",
    "cuda_graphs",
    "max_slots",
    "max_rank",
    "data_dir",
    "rank_timeout_s",
    "rank_start_timeout_s",
    "pass_token_budget",
    "tp",
    "max_sampling_snapshots",
)


def _add_engine_worker(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "engine-worker",
        help="One data-parallel engine rank, as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT); rank 0 serves the API with the serve options. `serve --nproc` starts these itself.",
    )
    _config_options(parser)
    parser.set_defaults(handler=_engine_worker)


def _engine_worker(args: argparse.Namespace) -> int:
    from loraplex.engine.distributed.group import RankEnv
    from loraplex.engine.distributed.rank_loop import run_rank

    config = config_from_args(args)
    if config.nproc > 1:
        raise UserError("engine-worker takes its rank and world size from torchrun; --nproc is for serve")
    env = RankEnv.from_environ()
    if env.rank == 0:
        check_exposure(config)
        return _serve_ranks(config, env, local_ranks=None)
    return run_rank(env, _engine_builder(config), config.device, _rank_timeouts(config), config.tp)


def _rank_timeouts(config: ServerConfig) -> RankTimeouts:
    from loraplex.engine.distributed.group import RankTimeouts

    return RankTimeouts(collective_s=config.rank_timeout_s, start_s=config.rank_start_timeout_s)


# --- keys
def _add_keys(subparsers: Any) -> None:
    parser = subparsers.add_parser("keys", help="Create, list and revoke API keys (for --auth keys).")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser(
        "create", help="Print a new tml- key for a tenant (only its digest is stored)."
    )
    create.add_argument("--tenant", required=True, help="Tenant the key belongs to.")
    create.add_argument(
        "--admin",
        action="store_true",
        help="An admin's key: in the web console (/console) it sees every tenant's runs, checkpoints, "
        "samplers and requests. Through the API it is its tenant's key like any other.",
    )
    actions.add_parser("list", help="List keys by id, tenant and state.")
    revoke = actions.add_parser("revoke", help="Revoke a key by its id.")
    revoke.add_argument("key_id", help="The key id shown by `keys list`.")
    for sub in (create, actions.choices["list"], revoke):
        _config_options(sub, only=("data_dir", "database_url"))
        sub.set_defaults(handler=_keys)


def _keys(args: argparse.Namespace) -> int:
    from loraplex.runtime.control import keys
    from loraplex.runtime.control.store import Store

    config = config_from_args(args)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.resolved_database_url())
    try:
        if args.action == "create":
            print(keys.create_key(store, args.tenant, admin=args.admin))
        elif args.action == "list":
            for key in keys.list_keys(store):
                state = "revoked" if key.revoked else "active"
                role = "admin" if key.admin else "tenant"
                print(f"{key.key_id}\t{key.tenant}\t{state}\t{role}\t{key.created_at.isoformat()}")
        else:
            keys.revoke_key(store, args.key_id)
            print(f"revoked {args.key_id}")
    finally:
        store.close()
    return 0


# --- doctor and gc
_RETENTION_OPTIONS = (
    "data_dir",
    "database_url",
    "future_retention_s",
    "snapshot_idle_s",
    "session_timeout_s",
    "metric_retention_s",
    "max_metrics_per_run",
    "parked_retention_s",
)


def _add_doctor(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor", help="Report data-dir usage by kind and what retention would remove now (changes nothing)."
    )
    _config_options(parser, only=_RETENTION_OPTIONS)
    parser.set_defaults(handler=_doctor)


def _add_gc(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gc",
        help="Remove what retention says is due (expired results, checkpoints and snapshots), as a running "
        "server does every --retention-sweep-s; for a stopped server's data dir.",
    )
    _config_options(parser, only=_RETENTION_OPTIONS)
    parser.set_defaults(handler=_doctor, apply=True)


def _doctor(args: argparse.Namespace) -> int:
    from loraplex.runtime.control.retention import Retention, RetentionPolicy
    from loraplex.runtime.control.store import Store
    from loraplex.runtime.core.checkpoints import DiskLayout
    from loraplex.timestamps import utcnow

    config = config_from_args(args)
    if not config.data_dir.is_dir():
        raise UserError(f"--data-dir {config.data_dir} does not exist")
    apply = getattr(args, "apply", False)
    if apply:  # a running server sweeps on its own, sparing what its requests read; gc cannot see those
        hold_data_dir(config.data_dir)
    layout = DiskLayout(config.data_dir)
    print(f"data dir {config.data_dir.resolve()}")
    for kind, (files, size) in sorted(layout.usage().items()):
        print(f"  {kind:<28} {files:>7} files {size / 2**20:>12.1f} MiB")
    store = Store(config.resolved_database_url())
    try:
        print(f"database {store.display_url}: {store.count_futures()} request results stored")
        print(f"  {store.count_metrics()} metric history records (the console's charts)")
        retention = Retention(store, layout, RetentionPolicy.of(config))
        removal = retention.sweep(utcnow()) if apply else retention.due(utcnow())
        paths = ", ".join(map(str, removal.checkpoints)) or "-"
        print("removed:" if apply else "retention would remove:")
        print(f"  {removal.futures} request results finished over {config.future_retention_s:g} s ago")
        print(f"  {len(removal.checkpoints)} expired checkpoints: {paths}")
        print(
            f"  {removal.metrics} metric records: of runs unused for {config.metric_retention_s:g} s, or "
            f"past {config.max_metrics_per_run} per run"
        )
        print(f"  {len(removal.samplers)} unreachable samplers and their snapshots")
        parked_mib = removal.parked_bytes / 2**20
        print(
            f"  the parked state of {len(removal.expired_runs)} runs ({parked_mib:.1f} MiB) unused for "
            f"{config.parked_retention_s:g} s after their session ended, and the rows of {len(removal.runs)} "
            "of them with no checkpoint left"
        )
        print(f"  {len(removal.sessions)} session rows with no run or sampler left")
        print(f"  {removal.bytes / 2**20:.1f} MiB of checkpoint and snapshot files")
    finally:
        store.close()
    return 0


# --- demo
def _add_demo(subparsers: Any) -> None:
    from loraplex import demo  # light: the demo imports the SDK and matplotlib only when it runs

    parser = subparsers.add_parser("demo", help=demo.HELP)
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.run)


# --- bench
def _add_bench(subparsers: Any) -> None:
    from loraplex.bench.cli import add_bench_parser  # light: workloads import torch only when they run

    add_bench_parser(subparsers)


# --- memory-plan
def _add_memory_plan(subparsers: Any) -> None:
    from loraplex import memory_report  # light: arithmetic over configs, no torch

    parser = subparsers.add_parser("memory-plan", help=memory_report.HELP)
    memory_report.add_arguments(parser)
    parser.set_defaults(handler=memory_report.run)


SUBCOMMANDS: list[Callable[[Any], None]] = [
    _add_serve,
    _add_engine_worker,
    _add_keys,
    _add_doctor,
    _add_gc,
    _add_demo,
    _add_bench,
    _add_memory_plan,
]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="loraplex", description="Multi-tenant LoRA post-training over the Tinker API."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except pydantic.ValidationError as exc:  # an option out of its range: a usage error, not a crash
        problems = "; ".join(
            f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in exc.errors()
        )
        print(f"error: {problems}", file=sys.stderr)
        return 2
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
