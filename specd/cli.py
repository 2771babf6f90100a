"""The `specd` command: one entry point, a subcommand per job. User errors print one line, not a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from specd_api.errors import SpecdError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (plus where to look), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    from controller import cli as controller_cli
    from decoder import generate_cli, tiny
    from decoder.distill import cli as distill_cli
    from decoder.worker import cli as worker_cli
    from specd.demo import cli as demo_cli

    parser = OneLineParser(prog="specd", description="Adaptive speculative decoding.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    commands.required = True
    generate_cli.add_parser(commands)
    controller_cli.add_parsers(commands)
    distill_cli.add_parser(commands)
    worker_cli.add_parser(commands)
    demo_cli.add_parser(commands)
    tiny_parser = commands.add_parser("tiny-pair", help="write a tiny random target/draft pair (for trying things)")
    tiny.add_arguments(tiny_parser)
    tiny_parser.set_defaults(handler=tiny.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except SpecdError as e:
        print(f"specd {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
