"""What a served model is, told once for every face that lists or describes models: a ``ModelCard``.

Built from the catalog entry (when the model is one) and the GGUF's header (``homepd.models.gguf``: its
architecture, parameter count, context and embedding lengths, file type, chat template), off any event loop:
reading a header with a 49,000-token vocabulary takes about 0.1 s.  The Ollama API's ``/api/tags`` and
``/api/show`` read it, and so can the app; what a model can do (``capabilities``) follows Ollama's names.
A model whose file is missing still gets a card (from the catalog alone, ``is_present`` False), so a
listing never fails for it.
"""
from __future__ import annotations

import datetime as dt
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from homepd.chat.format import detect as detect_chat_format
from homepd.errors import ModelError
from homepd.models.catalog import CatalogEntry, load_catalog
from homepd.models.gguf import read_gguf_header

# llama.cpp's llama_ftype -> its name (include/llama.h), for a model the catalog does not describe
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 24: "IQ1_S", 25: "IQ4_NL", 30: "IQ4_XS", 32: "BF16"}
DEFAULT_TAG = "latest"


@dataclass(frozen=True)
class ModelCard:
    """One configured model as clients are told of it.  ``name`` carries a tag (``smollm2:latest``, as
    Ollama names models); ``role`` is ``chat`` or ``embedding``; ``aliases`` are the other names it answers
    to (its catalog name, its file name, ``--served-model-name``)."""
    name: str
    spec: str
    role: str
    path: str | None = None
    is_present: bool = True
    size_bytes: int = 0
    digest: str = ""
    modified_at: str = ""
    family: str = ""
    architecture: str = ""
    parameter_size: str = ""
    n_params: int = 0
    quantization_level: str = ""
    context_length: int | None = None
    embedding_length: int | None = None
    template: str | None = None
    license: str = ""
    capabilities: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    model_info: dict = field(default_factory=dict)

    def answers_to(self, name: str) -> bool:
        """Whether a request's ``model`` names this model (with or without ``:latest``)."""
        bare = name.removesuffix(":" + DEFAULT_TAG)
        return bare in (self.name.removesuffix(":" + DEFAULT_TAG), *self.aliases) or name in self.aliases

    def with_aliases(self, *names: str) -> "ModelCard":
        return replace(self, aliases=tuple(dict.fromkeys((*self.aliases, *(n for n in names if n)))))


def tagged(name: str) -> str:
    """``name`` with Ollama's default tag where it has none."""
    return name if ":" in name else f"{name}:{DEFAULT_TAG}"


def parameter_size(n_params: int) -> str:
    """Ollama's way of writing a parameter count: 134.52M, 1.24B."""
    return f"{n_params / 1e9:.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:.2f}M"


def describe(spec: str, path: str | None, role: str, *, catalog: dict[str, CatalogEntry] | None = None,
             is_fake: bool = False) -> ModelCard:
    """The card of the model ``spec`` (a catalog name or a GGUF path) whose file is ``path`` (None: not
    resolved, or not there).  ``is_fake``: the fake backend's stand-in, which has no file."""
    catalog = load_catalog() if catalog is None else catalog
    entry = catalog.get(spec)
    stem = Path(spec).stem if entry is None else entry.name
    card = ModelCard(name=tagged(stem), spec=spec, role=role, path=path, aliases=(stem, spec))
    if entry is not None:
        card = replace(card, size_bytes=entry.size_bytes, digest=entry.sha256, family=entry.family,
                       architecture=entry.architecture, n_params=entry.n_params,
                       parameter_size=parameter_size(entry.n_params), quantization_level=entry.quantization,
                       license=entry.license)
    if is_fake:
        return replace(card, family=card.family or "fake", architecture=card.architecture or "fake",
                       size_bytes=card.size_bytes or 1 << 20, capabilities=capabilities(role, None),
                       modified_at=_iso(time.time()))
    if path is None:
        return replace(card, is_present=False, capabilities=capabilities(role, None))
    try:
        header = read_gguf_header(path)
        mtime_s = os.stat(path).st_mtime
    except (ModelError, OSError):
        return replace(card, is_present=False, capabilities=capabilities(role, None))
    arch = header.architecture or card.architecture or "unknown"
    hp = header.hparams or {}
    info = {"general.architecture": arch, "general.parameter_count": header.n_params,
            **({"general.name": header.name} if header.name else {}), **hp}
    return replace(
        card, size_bytes=header.size_bytes, modified_at=_iso(mtime_s), architecture=arch,
        family=card.family or arch, n_params=header.n_params, parameter_size=parameter_size(header.n_params),
        quantization_level=card.quantization_level or FILE_TYPES.get(header.file_type, "unknown"),
        context_length=hp.get(f"{arch}.context_length"), embedding_length=hp.get(f"{arch}.embedding_length"),
        template=header.chat_template, capabilities=capabilities(role, header.chat_template), model_info=info)


def capabilities(role: str, template: str | None) -> tuple[str, ...]:
    """Ollama's capability names, each only when true.  Every chat model takes tools (a template without a
    tool format gets homepd's generic, grammar-enforced envelope); none here sees images or inserts."""
    if role == "embedding":
        return ("embedding",)
    thinks = detect_chat_format(template).think is not None
    return ("completion", "tools", *(("thinking",) if thinks else ()))


def _iso(t_s: float) -> str:
    """A file time as ISO 8601 with an offset (Open WebUI and HA parse it)."""
    return dt.datetime.fromtimestamp(t_s, dt.timezone.utc).astimezone().isoformat()
