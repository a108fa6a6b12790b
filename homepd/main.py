"""The ``homepd`` command: one dispatcher above every face.

Each command lives in its face's own module, which exposes
``register(subparsers)``; the parser it adds sets ``func(args) -> int`` as its
default.  Faces (``cli``, ``serve``, ``tui``) never import each other; only
this module sees them all.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from homepd.errors import HomepdError
from homepd.osutil import single_thread_blas

# the module of each command, in help order: a command line that names one imports that module alone (every
# module's implementation was 1.1 s of imports, the advise campaign's, the store's, numpy's, before any command
# ran: 0.9 s more for each `homepd serve`); tests/unit/test_main.py checks it against what each module registers
COMMAND_OWNERS = {"advise": "homepd.advise.command", "app": "homepd.tui.command", "serve": "homepd.serve.command",
                  "service": "homepd.serve.command", "history": "homepd.cli.history", "run": "homepd.cli.run",
                  "trace": "homepd.cli.trace", "probe": "homepd.cli.probe", "models": "homepd.cli.models",
                  "bench": "homepd.bench.command"}
# modules that add commands, in help order; every one ships with homepd (its libraries are required
# dependencies), so one that fails to import is a broken install or a bug, never a face to skip
COMMAND_MODULES = tuple(dict.fromkeys(COMMAND_OWNERS.values()))


class FaceImportError(ImportError):
    """A command module that does not import: homepd stops with a traceback instead of losing the command."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone where it is one (``COMMAND_OWNERS``)."""
    parser = argparse.ArgumentParser(
        prog="homepd",
        description="Single-box LLM serving: colocated chunked prefill, disaggregated prefill/decode or replicas — measured on this box, recommended, served.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (COMMAND_OWNERS[command],) if command in COMMAND_OWNERS else COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            raise FaceImportError(f"the command module {name} failed to import ({type(exc).__name__}: {exc}); "
                                  "reinstall homepd, or see the traceback above for the bug") from exc
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    single_thread_blas(os.environ)  # why here: before a command's modules import numpy
    try:
        argv = sys.argv[1:] if argv is None else argv
        parser = build_parser(argv[0] if argv else None)  # reads HOMEPD_* defaults: may raise ConfigError
        args = parser.parse_args(argv)
        if not getattr(args, "func", None) and not argv and _is_terminal() and _has_command(parser, "app"):
            args = parser.parse_args(["app"])  # `homepd` alone, in a terminal: the app
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except HomepdError as exc:
        print(f"homepd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _is_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _has_command(parser: argparse.ArgumentParser, name: str) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) and name in a.choices for a in parser._actions)


if __name__ == "__main__":
    sys.exit(main())
