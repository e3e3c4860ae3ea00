"""`specvoice`: one console script, one subcommand per job.

Each subcommand lives in its own module under `demo/commands/` and exposes
`HELP` (one line), `DESCRIPTION` (the --help text), `add_arguments(parser)` and
`run(args) -> int`. Modules import heavy libraries (torch, faster-whisper) inside
`run`, so `specvoice --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (name, module) in the order `specvoice --help` lists them.
COMMANDS: list[tuple[str, str]] = [
    ("call", "demo.commands.call"),
    ("chat", "demo.commands.chat"),
    ("serve", "demo.commands.serve"),
    ("mic", "demo.commands.mic"),
    ("report", "demo.commands.report"),
    ("bookings", "demo.commands.bookings"),
    ("generate", "demo.commands.generate"),
    ("transcribe", "demo.commands.transcribe"),
    ("say", "demo.commands.say"),
    ("models", "demo.commands.models"),
    ("bench", "demo.commands.bench"),
]

EPILOG = """\
first run, offline, on the embedded default models:
  specvoice models pull          # fetch, verify and convert the models (once)
  specvoice call                 # a simulated phone call against the agent, with a latency table

run `specvoice COMMAND --help` for each command's options."""


def add_subcommands(sub, entries: list[tuple[str, str]], run_key: str) -> None:
    """One subparser per (name, module); the module's `run` is stored under `run_key`."""
    for name, module_name in entries:
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(
            name, help=module.HELP, description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(cmd)
        cmd.set_defaults(**{run_key: module.run})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specvoice",
        description="A real-time voice agent whose LLM answers through speculative decoding.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_subcommands(sub, COMMANDS, "_run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
