"""The models one service serves: ``--model`` given more than once, and ``[models.NAME]`` tables of the config file.

Each ``ModelSpec`` is frozen data: the name it is served under, its catalog name or GGUF path, its aliases, its
role (chat or embedding), its own engine settings (any ``EngineConfig`` key, as the file's top level takes
them: ``mode``, ``n_ctx``, ``n_seq_max``, ``n_threads``, ``gpu_index``, ``kv_store_bytes``...), its
keep-alive and whether it is pinned.  A table looks like::

    [models.assist]                 # served as "assist"
    model = "smollm2-135m-instruct-q4_1"
    aliases = ["home-assistant", "gpt-4o-mini"]
    n_ctx = 2048
    keep_alive = "-1"               # until memory is needed (the default); "10m": unload after 10 idle minutes
    pin = true                      # never evicted

Read once, here; the registry (``homepd.serve.registry``) loads each on demand.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

from homepd.config import EngineConfig, config_file_values
from homepd.errors import ConfigError

MODELS_TABLE = "models"
OWN_KEYS = ("model", "aliases", "role", "keep_alive", "pin")  # a table's keys that are not EngineConfig's
_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}


class ModelRole(enum.StrEnum):
    CHAT = "chat"
    EMBEDDING = "embedding"


@dataclass(frozen=True)
class ModelSpec:
    """One configured model.  ``overrides``: its ``EngineConfig`` values, beside the service's own."""
    name: str
    source: str
    role: ModelRole = ModelRole.CHAT
    aliases: tuple[str, ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()
    keep_alive_s: float | None = None      # None: stays until its memory is needed (or the service stops)
    is_pinned: bool = False

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The engine settings of this model: ``base`` (the service's) with its own on top."""
        return dataclasses.replace(base, model=self.source, **dict(self.overrides)).validated()


def parse_keep_alive_s(value) -> float | None:
    """A keep-alive: seconds, or a duration ("90s", "5m", "2h"); negative: for good (None)."""
    text = str(value).strip().lower()
    if text.startswith("-"):
        return None
    unit = _UNITS_S.get(text[-1:], None)
    try:
        seconds = float(text[:-1] if unit else text) * (unit or 1.0)
    except ValueError:
        raise ConfigError(f"not a keep-alive: {value!r} (seconds, 90s, 5m, 2h; -1 for good)") from None
    return seconds


def spec_name(source: str) -> str:
    """The name a model given by ``--model`` is served under: its catalog name, or its file's stem."""
    return Path(source).stem if source.endswith(".gguf") or "/" in source else source


def models_from_tables(document: dict) -> list[ModelSpec]:
    """The ``[models.NAME]`` tables of a parsed config file, in their order; a bad key or value is a
    ConfigError naming the table."""
    tables = document.get(MODELS_TABLE) or {}
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ConfigError(f"config file: [{MODELS_TABLE}] holds one table per model ([{MODELS_TABLE}.NAME])")
    out = []
    for name, table in tables.items():
        where = f"config file [{MODELS_TABLE}.{name}]"
        engine = {k: v for k, v in table.items() if k not in OWN_KEYS}
        try:
            overrides = config_file_values(EngineConfig, None, engine)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}".replace("config file: ", "")) from None
        if "model" in overrides:
            raise ConfigError(f"{where}: model is the model's own key here")
        role = str(table.get("role", ModelRole.CHAT))
        if role not in tuple(ModelRole):
            raise ConfigError(f"{where}: role must be chat or embedding, got {role!r}")
        aliases = table.get("aliases", ())
        if isinstance(aliases, str) or not all(isinstance(a, str) and a for a in aliases):
            raise ConfigError(f"{where}: aliases must be a list of names, got {aliases!r}")
        try:
            keep_alive_s = parse_keep_alive_s(table["keep_alive"]) if "keep_alive" in table else None
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        pin = table.get("pin", False)
        if not isinstance(pin, bool):
            raise ConfigError(f"{where}: pin must be true or false, got {pin!r}")
        out.append(ModelSpec(name=name, source=str(table.get("model", name)), role=ModelRole(role),
                             aliases=tuple(aliases), overrides=tuple(sorted(overrides.items())),
                             keep_alive_s=keep_alive_s, is_pinned=pin))
    return out


def served_models(sources: tuple[str, ...], document: dict, *, keep_alive_s: float | None = None,
                  embedding_model: str | None = None) -> tuple[ModelSpec, ...]:
    """Every model a service serves: each ``--model`` (``sources``; one that names a table, by its name or
    its ``model``, takes that table's settings), then the tables not named, then the embedding model.
    ``keep_alive_s``: the keep-alive of a model whose table does not say (``--keep-alive``).  Two models
    answering to one name is a ConfigError."""
    tables = models_from_tables(document)
    by_name = {t.name: t for t in tables} | {t.source: t for t in tables}
    specs: list[ModelSpec] = []
    for source in dict.fromkeys(sources):
        table = by_name.get(source)
        specs.append(table if table is not None else
                     ModelSpec(name=spec_name(source), source=source, keep_alive_s=keep_alive_s))
    specs += [t for t in tables if t not in specs]
    specs = [s if s.keep_alive_s is not None or "keep_alive" in _table(document, s.name)
             else dataclasses.replace(s, keep_alive_s=keep_alive_s) for s in specs]
    if embedding_model and not any(s.source == embedding_model or s.name == embedding_model for s in specs):
        specs.append(ModelSpec(name=spec_name(embedding_model), source=embedding_model, role=ModelRole.EMBEDDING))
    if not any(s.role is ModelRole.CHAT for s in specs):
        raise ConfigError("no chat model to serve: give --model, or a [models.NAME] table without role = "
                          "\"embedding\"")
    seen: dict[str, str] = {}
    for s in specs:
        for alias in (s.name, *s.aliases):
            if seen.setdefault(alias, s.name) != s.name:
                raise ConfigError(f"two models answer to {alias!r}: {seen[alias]} and {s.name}; rename one")
    return tuple(specs)


def _table(document: dict, name: str) -> dict:
    return (document.get(MODELS_TABLE) or {}).get(name) or {}
