"""`kvreplay` command line. Each subcommand lives in its own module with a `register(subparsers)`
function that adds its parser and sets `func` (called with the parsed args)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Re-exported: the engine flags live with the commands that use them (generated from EngineConfig).
from kvreplay.commands.flags import add_engine_args, engine_config_from_args

__all__ = ["main", "build_parser", "add_engine_args", "engine_config_from_args"]

# module -> subcommands it registers
SUBCOMMAND_MODULES = [
    "kvreplay.commands.generate",   # generate, chat
    "kvreplay.commands.serve",      # serve
    "kvreplay.commands.plan",       # plan
    "kvreplay.commands.bench",      # bench serve, bench quality
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvreplay",
        description="LLM inference with a tiered, recomputable KV cache. "
                    "Run `kvreplay COMMAND --help` for a command's options.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at debug level: a line per engine step (batch, tokens, KV usage)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # kvreplay's own INFO lines (loading, the startup summary) show by default, its DEBUG lines
    # with -v; other libraries only warn
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("kvreplay").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (ValueError, TypeError) as exc:  # user errors: one clear line, no traceback
        print(f"kvreplay {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
