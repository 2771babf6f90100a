"""The `specd` command: one entry point, a subcommand per job. User errors print one line, not a traceback.

Every subcommand's parser is built on every call, so the command modules import nothing heavy at module level: the
base install (the controller) has no torch, uvicorn or rich. A command that needs what an extra brings says which
extra to install, in one line."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from specd_api.errors import SpecdError, UsageError

# gRPC's core logs one INFO line per refused TLS handshake, with no rate limit: a client reconnecting without a
# certificate to a mutual-TLS port writes ~1 GB of log an hour. Errors only, unless the environment says.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (plus where to look), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


Handler = Callable[[argparse.Namespace], int]

PROJECT_PACKAGES = frozenset(
    {"specd", "specd_api", "specd_client", "decoder", "controller", "workloads", "refmodels", "distill"}
)
DEMO_EXTRA_MODULES = frozenset({"rich", "matplotlib", "httpx"})  # pyproject's demo extra; the rest is worker's
LLAMA_EXTRA_MODULES = frozenset({"gguf"})  # pyproject's llama extra


def extra_for(error: ModuleNotFoundError) -> str | None:
    """The extra that brings the missing module, or None when the module is the project's own (a bug, not an
    install choice)."""
    top = (error.name or "").partition(".")[0]
    if not top or top in PROJECT_PACKAGES:
        return None
    if top in LLAMA_EXTRA_MODULES:
        return "llama"
    return "demo" if top in DEMO_EXTRA_MODULES else "worker"


def needs_extra(error: ModuleNotFoundError) -> str:
    return (
        f"needs the module {error.name!r}, which the base install (the controller) leaves out: "
        f"pip install 'specd[{extra_for(error)}]'"
    )


def build_parser() -> argparse.ArgumentParser:
    from controller import cli as controller_cli
    from decoder import generate_cli, tiny
    from decoder.worker import cli as worker_cli
    from distill import cli as distill_cli
    from specd.llama import cli as llama_cli

    parser = OneLineParser(prog="specd", description="Adaptive speculative decoding.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    commands.required = True
    generate_cli.add_parser(commands)
    controller_cli.add_parsers(commands)
    distill_cli.add_parser(commands)
    worker_cli.add_parser(commands)
    llama_cli.add_parsers(commands)
    add_extra_parser(commands, "demo", "the demo")
    add_extra_parser(commands, "bench", "the benchmark")
    tiny_parser = commands.add_parser(
        "tiny-pair", help="write a random target/draft pair: tiny (for trying things), or --shape 1b (to measure costs)"
    )
    tiny.add_arguments(tiny_parser)
    tiny_parser.set_defaults(handler=tiny.run)
    return parser


def add_extra_parser(commands: Any, name: str, what: str) -> None:
    """`specd demo` / `specd bench` (they need the demo extra: rich, matplotlib, httpx; and the worker's), or,
    without it, a stand-in that says which extra to install."""
    try:
        module = importlib.import_module(f"specd.{name}.cli")
    except ModuleNotFoundError as e:
        if extra_for(e) is None:
            raise
        missing = e

        def explain(args: argparse.Namespace) -> int:
            raise UsageError(needs_extra(missing))

        stand_in = commands.add_parser(name, help=f"{what} (needs the demo extra)", add_help=False)
        stand_in.set_defaults(handler=explain, any_arguments=True)  # the real parser's are unknown here
        return
    module.add_parser(commands)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # what parse_args says
    handler: Handler = args.handler
    try:
        return handler(args)
    except SpecdError as e:
        print(f"specd {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if extra_for(e) is None:
            raise
        print(f"specd {args.command}: error: {needs_extra(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
