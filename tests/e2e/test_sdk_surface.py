"""docs/SDK_SURFACE.md is true: it lists every public method of the SDK's clients and every `tinker` CLI
command (found here by introspection, so a method or command the SDK adds fails the test until the page
says what it does), and each one, run against a real server, does what its row says: works (a value is
checked, tests/e2e/surface_checks.py) or fails with the row's message.

One server for the module, on the built-in tiny model; its one tenant is `local`.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import tinker
from click.testing import CliRunner
from tinker.cli.__main__ import main_cli

from tests.e2e.conftest import REPO, Server
from tests.e2e.sdk import client, logprobs, sft_steps
from tests.e2e.surface_checks import ADAPTER_FILES, CLIENT_CHECKS, KEY, Call, World

SURFACE = REPO / "docs" / "SDK_SURFACE.md"
CLIENTS = (
    tinker.ServiceClient,
    tinker.TrainingClient,
    tinker.SamplingClient,
    tinker.RestClient,
    tinker.AdminClient,
)
CLI_SECTION = "The `tinker` CLI"


# --- the page
@dataclass(frozen=True)
class Row:
    """One row of the page: a method (or a CLI command) and what it does against loraplex."""

    section: str  # the client's class name, or CLI_SECTION
    name: str
    has_async: bool
    message: str | None  # None: works

    @property
    def key(self) -> str:
        return self.name if self.section == CLI_SECTION else f"{self.section}.{self.name}"

    @property
    def message_pattern(self) -> str:
        """The message as a regular expression, `{…}` standing for the id the call named."""
        return re.escape(self.message or "").replace(re.escape("{…}"), r"[^ )/]+")


def _rows() -> list[Row]:
    rows, section = [], ""
    for line in SURFACE.read_text().splitlines():
        if line.startswith("## "):
            section = line.removeprefix("## ")
        elif line.startswith("| `"):
            name_cell, status = (cell.strip() for cell in line.strip("|").split("|")[:2])
            name = name_cell.split("`")[1]
            refused = re.fullmatch(r"not supported: `(.+)`", status)
            assert refused or status == "works", f"{name}: the status is `works` or `not supported: ...`"
            rows.append(Row(section, name, "`_async`" in name_cell, refused.group(1) if refused else None))
    return rows


ROWS = _rows()


def _public_methods(cls: type) -> set[str]:
    return {name for name, value in inspect.getmembers(cls) if not name.startswith("_") and callable(value)}


def _cli_commands(group: click.Group = main_cli, words: tuple[str, ...] = ("tinker",)) -> set[str]:
    context = click.Context(group)
    found: set[str] = set()
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if isinstance(command, click.Group):
            found |= _cli_commands(command, (*words, name))
        else:
            found.add(" ".join((*words, name)))
    return found


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda cls: cls.__name__)
def test_the_page_lists_every_public_method_of_each_client(cls: type) -> None:
    rows = [row for row in ROWS if row.section == cls.__name__]
    listed = {row.name for row in rows} | {f"{row.name}_async" for row in rows if row.has_async}
    assert listed == _public_methods(cls)


def test_the_page_lists_every_cli_command() -> None:
    assert {row.name for row in ROWS if row.section == CLI_SECTION} == _cli_commands()


def test_every_row_has_a_check() -> None:
    assert {row.key for row in ROWS} == set(CLIENT_CHECKS) | set(CLI_CHECKS)


# --- the server
@pytest.fixture(scope="module")
def world(start_module_server: Callable[..., Server]) -> World:
    # The checks make about 20 runs; with a slot for each, none waits for another to be parked.
    module_server = start_module_server("--max-slots", "32")
    service = client(module_server, KEY, display_name="sdk surface", user_metadata={"suite": "sdk"})
    rest = tinker.RestClient(base_url=module_server.base_url, api_key=KEY)
    model = rest.get_server_capabilities().result().supported_models[0].model_name
    assert model is not None
    run = service.create_lora_training_client(model, rank=8, seed=3).result()
    sft_steps(run, 1)
    sampler_path = run.save_weights_for_sampler("base").result().path
    return World(
        server=module_server,
        service=service,
        model=model,
        run=run,
        state_path=run.save_state("base").result().path,
        state_logprobs=logprobs(run),
        sampler_path=sampler_path,
        sampler=service.create_sampling_client(model_path=sampler_path).result(),
        export_path=run.save_weights_external("export").result().path,
        rest=rest,
        admin=tinker.AdminClient(base_url=module_server.base_url, api_key=KEY),
    )


@pytest.mark.parametrize(
    ("row", "is_async"),
    [(row, False) for row in ROWS if row.section != CLI_SECTION]
    + [(row, True) for row in ROWS if row.has_async],
    ids=lambda value: value.key if isinstance(value, Row) else ("async" if value else "sync"),
)
def test_each_method_does_what_its_row_says(world: World, row: Row, is_async: bool) -> None:
    check = CLIENT_CHECKS[row.key]
    if row.message is None:
        check(world, Call(is_async))
    else:
        with pytest.raises(Exception, match=row.message_pattern):
            check(world, Call(is_async))


# --- the CLI, run in this process (click's runner) with the environment a user sets
class CliFailedError(Exception):
    """A command that exited non-zero, with the error it printed."""


@dataclass(frozen=True)
class Cli:
    """Runs `tinker ARGS...` against the world's server, HOME (the stored credentials) in `home`."""

    world: World
    home: Path

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        env = {
            "TINKER_BASE_URL": self.world.server.base_url,
            "TINKER_API_KEY": KEY,
            "TINKER_TELEMETRY": "0",
            "HOME": str(self.home),
        }
        result = CliRunner().invoke(main_cli, list(args), env=env, input=stdin)
        if result.exit_code != 0:
            error = result.exception
            raise CliFailedError(f"{getattr(error, 'message', error)}\n{getattr(error, 'details', '')}")
        return result.output

    def json(self, *args: str) -> dict:
        return json.loads(self("--format", "json", *args))


CliCheck = Callable[[Cli], None]


def _login(cli: Cli) -> None:
    cli("auth", "login", stdin=f"{KEY}\n")


def _logout(cli: Cli) -> None:
    credentials = cli.home / ".tinker" / "credentials.json"
    credentials.parent.mkdir()
    stored = {"version": 1, "default": "k1", "keys": {"k1": {"type": "manual", "key": KEY, "name": "mine"}}}
    credentials.write_text(json.dumps(stored))
    assert "Removed credential 'mine'" in cli("auth", "logout")
    assert json.loads(credentials.read_text())["keys"] == {}


def _checkpoint_storage(cli: Cli) -> None:
    (row,) = cli.json("billing", "checkpoint-storage")["data"]
    assert (row["checkpoint_count"], row["size_bytes"]) == cli.world.checkpoints_on_disk()


def _delete(cli: Cli) -> None:
    path = cli.world.checkpoint("cli-doomed")
    cli("checkpoint", "delete", path, "--yes")
    assert cli.world.listed(path) is None


def _download(cli: Cli) -> None:
    cli("checkpoint", "download", cli.world.export_path, "--output", str(cli.home))
    target = cli.home / cli.world.export_path.removeprefix("tinker://").replace("/", "_")
    assert sorted(p.name for p in target.iterdir()) == ADAPTER_FILES


def _publishes(public: bool) -> CliCheck:
    def check(cli: Cli) -> None:
        path = cli.world.checkpoint(f"cli-public-{public}")
        cli.world.rest.publish_checkpoint_from_tinker_path(path).result()
        cli("checkpoint", "publish" if public else "unpublish", path)
        assert cli.world.listed(path).public is public  # type: ignore[union-attr]

    return check


def _set_ttl(cli: Cli) -> None:
    path = cli.world.checkpoint("cli-ttl")
    cli("checkpoint", "set-ttl", path, "--ttl", "7200")
    checkpoint = cli.world.listed(path)
    assert checkpoint is not None and checkpoint.expires_at is not None


def _export_trace(cli: Cli) -> None:
    cli("session", "export-trace", cli.world.session_id, "--output", str(cli.home / "trace.pftrace"))
    events = json.loads((cli.home / "trace.pftrace").read_text())["traceEvents"]
    assert cli.world.run.model_id in [e["args"]["name"] for e in events if e["name"] == "process_name"]


def _not_run(cli: Cli) -> None:
    pytest.skip("push-hf uploads to the Hugging Face Hub, which this test cannot reach")


Word = str | Callable[[World], str]


def _runs(*args: Word, printing: Word | None = None) -> CliCheck:
    """Runs a command (words may be taken from the world) and, if given, finds `printing` in its output."""

    def check(cli: Cli) -> None:
        def word(w: Word) -> str:
            return w(cli.world) if callable(w) else w

        output = cli(*(word(a) for a in args))
        if printing is not None:
            assert word(printing) in output

    return check


CLI_CHECKS: dict[str, CliCheck] = {
    "tinker auth login": _login,
    "tinker auth logout": _logout,
    "tinker auth status": _runs("auth", "status", printing="Tinker accessible: yes"),
    "tinker auth whoami": _runs("auth", "whoami"),
    "tinker billing checkpoint-storage": _checkpoint_storage,
    "tinker billing usage": _runs("billing", "usage", "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"),
    "tinker checkpoint delete": _delete,
    "tinker checkpoint download": _download,
    "tinker checkpoint info": _runs(
        "--format", "json", "checkpoint", "info", lambda w: w.state_path, printing=lambda w: w.state_path
    ),
    "tinker checkpoint list": _runs(
        "--format",
        "json",
        "checkpoint",
        "list",
        "--run-id",
        lambda w: w.run.model_id,
        printing=lambda w: w.state_path,
    ),
    "tinker checkpoint publish": _publishes(True),
    "tinker checkpoint push-hf": _not_run,
    "tinker checkpoint set-ttl": _set_ttl,
    "tinker checkpoint unpublish": _publishes(False),
    "tinker model list": _runs("--format", "json", "model", "list", printing=lambda w: w.model),
    "tinker run info": _runs(
        "--format", "json", "run", "info", lambda w: w.run.model_id, printing=lambda w: w.run.model_id
    ),
    "tinker run list": _runs("--format", "json", "run", "list", printing=lambda w: w.run.model_id),
    "tinker session export-trace": _export_trace,
    "tinker version": _runs("version", printing=f"tinker {tinker.__version__}"),
}


@pytest.mark.parametrize("row", [row for row in ROWS if row.section == CLI_SECTION], ids=lambda row: row.name)
def test_each_cli_command_does_what_its_row_says(world: World, row: Row, tmp_path: Path) -> None:
    cli = Cli(world, tmp_path)
    if row.message is None:
        CLI_CHECKS[row.name](cli)
    else:
        with pytest.raises(CliFailedError, match=row.message_pattern):
            CLI_CHECKS[row.name](cli)
