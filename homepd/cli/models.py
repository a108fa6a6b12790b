"""``homepd models list|pull``: the model catalog and what is on this box."""
from __future__ import annotations

import argparse
import sys
import time

from homepd.errors import ModelError
from homepd.models.catalog import DEFAULT_MODEL, catalog_entry, load_catalog
from homepd.models.resolve import MODELS_DIR_ENV, is_present, models_dir as _models_dir, pull, validate_gguf


def register(subparsers) -> None:
    """Add ``homepd models list|pull`` to the ``homepd`` parser."""
    parser = subparsers.add_parser("models", help="list and fetch models", description="List and fetch catalog models.")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION")
    dir_flag = argparse.ArgumentParser(add_help=False)
    dir_flag.add_argument(
        "--models-dir", metavar="DIR",
        help=f"where models live (default ${MODELS_DIR_ENV}, else $XDG_DATA_HOME/homepd/models, else ~/.local/share/homepd/models)",
    )
    list_parser = actions.add_parser("list", parents=[dir_flag], help="show catalog models and which are here")
    list_parser.set_defaults(func=_cmd_list)
    pull_parser = actions.add_parser("pull", parents=[dir_flag], help="download, assemble and verify a catalog model")
    pull_parser.add_argument("name", metavar="NAME", help="a catalog model name (see `homepd models list`)")
    pull_parser.add_argument("--force", action="store_true", help="fetch again even if a good copy is present")
    pull_parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    pull_parser.set_defaults(func=_cmd_pull)


def _cmd_list(args: argparse.Namespace) -> int:
    directory = _models_dir(args.models_dir)
    rows = [("NAME", "DEFAULT", "ROLE", "SIZE", "LOCAL", "PATH")]
    for entry in load_catalog().values():
        path = directory / entry.file_name
        local = "yes" if is_present(entry, directory) else ("damaged" if path.exists() else "no")
        rows.append((entry.name, "*" if entry.name == DEFAULT_MODEL else "", entry.role,
                     f"{entry.size_bytes / 1e6:.1f} MB", local, str(path)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    entry = catalog_entry(args.name)
    directory = _models_dir(args.models_dir)
    path = directory / entry.file_name
    if not args.force and is_present(entry, directory):
        try:
            validate_gguf(path, entry)
        except ModelError as exc:
            print(f"{exc}; fetching it again", file=sys.stderr)
        else:
            print(f"{entry.name} is already present", file=sys.stderr)
            print(path)
            return 0
    start_s = time.monotonic()
    path = pull(entry.name, directory, progress=not args.quiet, force=True)
    if not args.quiet:
        elapsed_s = time.monotonic() - start_s
        print(f"pulled {entry.name} ({entry.size_bytes / 1e6:.1f} MB, sha256 verified) in {elapsed_s:.1f} s", file=sys.stderr)
    print(path)
    return 0
