"""The `loraplex` command: subcommands `serve` and `keys`, each registered by a small function.

To add a subcommand (bench, demo, engine-worker), write `_add_<name>(subparsers)` that sets
`handler=` on its parser and list it in SUBCOMMANDS. Server options come from ServerConfig's fields,
so a field's description is its --help text. The engine is imported lazily, only by `serve`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from loraplex.config import ServerConfig
from loraplex.errors import UserError

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
        else:
            kwargs["type"] = kind
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, **kwargs)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed arguments: given options over field defaults."""
    given = {k: v for k, v in vars(args).items() if k in ServerConfig.model_fields and v is not None}
    return ServerConfig(**given)


# --- serve
def _add_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="Serve the Tinker API over one base model.")
    _config_options(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from loraplex.engine.local import build_local_engine  # heavy (torch); only `serve` needs it

    config = config_from_args(args)
    engine = build_local_engine(
        config.model, config.data_dir, config.device, config.max_slots, config.max_rank, config.model_name
    )
    run_server(config, engine)
    return 0


def run_server(config: ServerConfig, engine: Any) -> None:
    """Serve `engine` with `config` until interrupted (also used by tests with a fake engine)."""
    import uvicorn

    from loraplex.api.app import create_app
    from loraplex.runtime.service import TrainingService

    service = TrainingService.open(engine, config)
    info = engine.info
    log.info("model %s (%s) on device %s", info.model_name, config.model, info.device)
    log.info(
        "database %s; data in %s; auth %s", service.store.display_url, config.data_dir.resolve(), config.auth
    )
    log.info("listening on http://%s:%d (Tinker base_url)", config.host, config.port)
    uvicorn.run(create_app(service), host=config.host, port=config.port, log_level="warning")


# --- keys
def _add_keys(subparsers: Any) -> None:
    parser = subparsers.add_parser("keys", help="Create, list and revoke API keys (for --auth keys).")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser(
        "create", help="Print a new tml- key for a tenant (only its digest is stored)."
    )
    create.add_argument("--tenant", required=True, help="Tenant the key belongs to.")
    actions.add_parser("list", help="List keys by id, tenant and state.")
    revoke = actions.add_parser("revoke", help="Revoke a key by its id.")
    revoke.add_argument("key_id", help="The key id shown by `keys list`.")
    for sub in (create, actions.choices["list"], revoke):
        _config_options(sub, only=("data_dir", "database_url"))
        sub.set_defaults(handler=_keys)


def _keys(args: argparse.Namespace) -> int:
    from loraplex.runtime import keys
    from loraplex.runtime.store import Store

    config = config_from_args(args)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.resolved_database_url())
    try:
        if args.action == "create":
            print(keys.create_key(store, args.tenant))
        elif args.action == "list":
            for key in keys.list_keys(store):
                state = "revoked" if key.revoked else "active"
                print(f"{key.key_id}\t{key.tenant}\t{state}\t{key.created_at.isoformat()}")
        else:
            keys.revoke_key(store, args.key_id)
            print(f"revoked {args.key_id}")
    finally:
        store.close()
    return 0


SUBCOMMANDS: list[Callable[[Any], None]] = [_add_serve, _add_keys]


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
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
