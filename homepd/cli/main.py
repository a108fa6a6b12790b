"""The ``homepd`` command line.

Each command lives in its own module, which exposes ``register(subparsers)``;
the parser it adds sets ``func(args) -> int`` as its default.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from homepd.errors import HomepdError

# modules under homepd/cli/ that add commands, in help order
COMMAND_MODULES = ("run", "models", "bench", "probe")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="homepd",
        description="Single-box LLM serving: colocated chunked prefill vs. disaggregated prefill/decode, measured.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"homepd.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # reads HOMEPD_* defaults: may raise ConfigError
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except HomepdError as exc:
        print(f"homepd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
