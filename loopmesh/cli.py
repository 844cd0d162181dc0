"""The ``loopmesh`` command.

Commands are a registry of name → module: the commands people type live in
:mod:`loopmesh.commands`, beside the client they use; each service keeps only the command
that starts it (``loop_worker.cli``, ``tool_worker.cli``, ...). A command's module is
imported only to build its parser or run it, so a service that is not installed (or not
written yet) costs nothing and says so plainly. Each module exposes::

    HELP: str
    def configure(parser: argparse.ArgumentParser) -> None: ...
    async def main(args: argparse.Namespace) -> int: ...

Every command also gets the common options ``--config``, ``--nats-url``,
``--log-level`` (or ``-v``) and ``--log-json``; :func:`config_from_args` reads a
service's settings with them applied. A module may set ``LOG_LEVEL`` (default ``INFO``):
the commands people run at a terminal set ``WARNING``, so that only their own output
shows unless ``-v`` or ``--log-level`` asks for logs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TypeVar, cast

import msgspec

from . import tracing
from .aio import run
from .errors import LoopmeshError, StoppedAtOnce
from .log import setup_logging
from .settings import CONFIG_VAR, RuntimeConfig, load

T = TypeVar("T")

#: Command name → the module that implements it.
COMMANDS: dict[str, str] = {
    "up": "loopmesh.up",
    "loop-worker": "loop_worker.cli",
    "tool-worker": "tool_worker.cli",
    "gateway": "gateway.cli",
    "run": "loopmesh.commands.run",
    "events": "loopmesh.commands.events",
    "approve": "loopmesh.commands.approval",
    "deny": "loopmesh.commands.approval",
    "cancel": "loopmesh.commands.cancel",
    "erase": "loopmesh.commands.erase",
    "sessions": "loopmesh.commands.sessions",
    "pause": "loopmesh.commands.pause",
    "resume": "loopmesh.commands.pause",
    "fork": "loopmesh.commands.branch",
    "rewind": "loopmesh.commands.branch",
    "tools": "loopmesh.commands.tools",
    "agents": "loopmesh.commands.agents",
    "schedules": "loopmesh.commands.schedules",
    "memory": "loopmesh.commands.memory",
    "exporter": "loopmesh.exporter",
    "webhooks": "webhooks.cli",
    "nats-agents": "nats_agents.cli",
    "nats-mappings": "loopmesh.commands.mappings",
}

DESCRIPTION = "Run LLM agent loops as a distributed system on NATS."
EPILOG = f"""\
settings:
  Every command reads one TOML file (--config, else ${CONFIG_VAR}) whose top-level
  tables ([nats], [llm], [loop], ...) configure the services; a variable
  LOOPMESH_<TABLE>__<FIELD> overrides one field, e.g. LOOPMESH_LOOP__MAX_ITERATIONS=5.

Run `loopmesh COMMAND --help` for a command's own options.
"""


class CommandUnavailable(Exception):
    def __init__(self, name: str, module: str, reason: str) -> None:
        super().__init__(f"command {name!r} is not installed ({module}: {reason})")
        self.name = name


def load_command(name: str) -> ModuleType:
    """Import the module of command ``name``; raise :class:`CommandUnavailable`."""
    path = COMMANDS[name]
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name and (path == exc.name or path.startswith(exc.name + ".")):
            raise CommandUnavailable(name, path, "module not found") from None
        raise CommandUnavailable(name, path, f"missing dependency {exc.name!r}") from None
    except ImportError as exc:
        raise CommandUnavailable(name, path, f"cannot import: {exc}") from None
    for attr in ("HELP", "configure", "main"):
        if not hasattr(module, attr):
            raise CommandUnavailable(name, path, f"defines no {attr}")
    return module


def add_common_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """``--config``, ``--nats-url``, ``--log-level``, ``-v``, ``--log-json``. With ``suppress``
    the options set nothing unless given, so a subcommand's copy does not reset a value
    given before the command name."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("common options")
    group.add_argument(
        "--config", metavar="PATH", default=default(None),
        help=f"TOML settings file (default: ${CONFIG_VAR}, else built-in defaults)",
    )  # fmt: skip
    group.add_argument(
        "--nats-url", metavar="URL", default=default(None),
        help="NATS server URL(s), comma-separated; overrides [nats] url",
    )  # fmt: skip
    group.add_argument(
        "--log-level", metavar="LEVEL", default=default(None),
        help="DEBUG, INFO, WARNING or ERROR (default: INFO for services, WARNING for "
        "up, run and the other commands people type)",
    )  # fmt: skip
    group.add_argument(
        "-v", "--verbose", action="count", default=default(0),
        help="show logs: -v for INFO, -vv for DEBUG (same as --log-level)",
    )  # fmt: skip
    group.add_argument(
        "--log-json", action="store_true", default=default(False),
        help="log JSON lines instead of key=value",
    )  # fmt: skip


def build_parser(modules: dict[str, ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopmesh",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_options(parser)
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, module in modules.items():
        help_text: str = module.HELP
        command = sub.add_parser(
            name, help=help_text.split("\n\n")[0], description=help_text,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        add_common_options(command, suppress=True)
        module.configure(command)
    return parser


def add_metrics_options(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host``, for a service's ``metrics_*`` settings."""
    parser.add_argument("--metrics-port", type=int, help="serve /metrics and /healthz here")
    parser.add_argument("--metrics-host", help="bind address (default 127.0.0.1)")


def metrics_changes(args: argparse.Namespace) -> dict[str, object]:
    """The ``metrics_port`` / ``metrics_host`` settings the command line gives (none under
    ``loopmesh up``, whose arguments lack them)."""
    changes: dict[str, object] = {}
    if getattr(args, "metrics_port", None) is not None:
        changes["metrics_port"] = args.metrics_port
    if getattr(args, "metrics_host", None):
        changes["metrics_host"] = args.metrics_host
    return changes


def modules_from_cwd() -> None:
    """Let an option that names a module (``--module``, ``--tools-module``) name one of the
    current folder, as uvicorn and celery do: the folder goes first on ``sys.path``. (The
    ``loopmesh`` script has its own folder there instead; ``python -m`` has the current one.)
    A process started from here in the same folder finds it the same way."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def config_from_args(type_: type[T], args: argparse.Namespace) -> T:
    """Load ``type_`` (see :func:`loopmesh.settings.load`) from ``--config`` and the
    environment, then apply ``--nats-url`` to its ``nats`` table if it has one."""
    config = load(type_, getattr(args, "config", None))
    url = getattr(args, "nats_url", None)
    nats = getattr(config, "nats", None)
    if url and nats is not None:
        replaced: Any = msgspec.structs.replace(
            cast(Any, config), nats=msgspec.structs.replace(nats, url=url)
        )
        return cast(T, replaced)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _command_name(argv)
    modules: dict[str, ModuleType] = {}
    if chosen is not None:
        try:
            modules[chosen] = load_command(chosen)
        except CommandUnavailable as exc:
            print(f"loopmesh: error: {exc}", file=sys.stderr)
            return 2
    else:
        for name in COMMANDS:
            try:
                modules[name] = load_command(name)
            except CommandUnavailable:
                continue  # listed only once it can run
    parser = build_parser(modules)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        setup_logging(log_level(args, modules[args.command]), args.log_json)
    except ValueError as exc:
        parser.error(str(exc))
    stop_tracing = None
    try:
        runtime = load(RuntimeConfig, getattr(args, "config", None)).runtime
        stop_tracing = tracing.setup(f"loopmesh-{args.command}")  # OTEL_*; off by default
        return int(run(modules[args.command].main(args), event_loop=runtime.event_loop) or 0)
    except KeyboardInterrupt:
        return 130
    except StoppedAtOnce as exc:
        print(f"loopmesh {args.command}: {exc}", file=sys.stderr)
        return 128 + exc.signal  # as a shell reports a process the signal ended
    except LoopmeshError as exc:
        print(f"loopmesh {args.command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if stop_tracing is not None:
            stop_tracing()  # flushes the spans still buffered


def log_level(args: argparse.Namespace, module: ModuleType) -> str:
    """``--log-level`` if given, else ``-v`` (INFO) / ``-vv`` (DEBUG), else the
    command's own ``LOG_LEVEL`` (INFO unless the module says otherwise)."""
    if args.log_level:
        return str(args.log_level)
    if args.verbose:
        return "INFO" if args.verbose == 1 else "DEBUG"
    return str(getattr(module, "LOG_LEVEL", "INFO"))


def _command_name(argv: list[str]) -> str | None:
    """The registered command named in ``argv``, skipping common options' values."""
    takes_value = {"--config", "--nats-url", "--log-level"}
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None
