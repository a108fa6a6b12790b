"""The models a service serves, by name and role, with their cards and their state.

Today a service serves one chat model (its engine's, loaded at start and kept for as long as the service runs)
and at most one embedding model (``--embedding-model``, loaded on first use and unloaded when its keep-alive
runs out: ``homepd.engine.embedder``).  Every face asks here which model a request's ``model`` names
(``find``), what it can do (its ``ModelCard``: ``homepd.models.card``) and whether it is loaded (``state``,
``expires_at``).  The cards are read from the catalog at once and from the GGUF headers off the loop
(``refresh``), so a listing answers in milliseconds even while the chat model loads.

This is the seam of "several models on one box" (issue 45): the two slots become a table of models, each with
its own engine or embedder, loaded on demand under a memory budget; ``find``, ``state`` and ``keep_alive``
keep their meaning.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from dataclasses import replace

from homepd.engine.embedder import DEFAULT, EmbeddingModel, ModelState
from homepd.errors import ConfigError, ModelError
from homepd.fakellm import FAKE_EMBEDDING_PATH, FAKE_EMBED_CTX, FAKE_N_EMBD, FakeModel
from homepd.models.card import ModelCard, capabilities, describe
from homepd.models.catalog import load_catalog
from homepd.models.resolve import resolve_model

log = logging.getLogger("homepd.serve")
CHAT, EMBEDDING = "chat", "embedding"
# why: Ollama writes a model kept for good as expiring in about three centuries; clients parse a date
FOREVER = dt.datetime(2318, 1, 1, tzinfo=dt.timezone.utc)


class ModelRegistry:
    def __init__(self, service):
        self.service = service
        config, settings = service.config, service.settings
        self.is_fake = config.backend == "fake"
        catalog = load_catalog()
        for role, spec, other in ((CHAT, config.model, EMBEDDING), (EMBEDDING, settings.embedding_model, CHAT)):
            entry = catalog.get(spec or "")
            if entry is not None and entry.role != role:
                raise ConfigError(f"{spec} is {'an' if other == EMBEDDING else 'a'} {other} model: serve it with "
                                  f"{'--embedding-model' if other == EMBEDDING else '--model'} {spec}")
        self.specs = {CHAT: config.model, **({EMBEDDING: settings.embedding_model} if settings.embedding_model else {})}
        self.cards: dict[str, ModelCard] = {
            role: describe(spec, None, role, catalog=catalog, is_fake=self.is_fake).with_aliases(
                *(settings.served_model_names if role == CHAT else ()))
            for role, spec in self.specs.items()}
        self.embedder: EmbeddingModel | None = None
        self.missing: dict[str, str] = {}   # role -> why its model's file could not be found (the 503's words)
        self.described = asyncio.Event()
        self.chat_keep_alive_s: float | None = None    # asked by the last request that said (the chat model stays)

    async def refresh(self) -> None:
        """Read each model's GGUF header (off the loop) into its card; make the embedding model's handle."""
        try:
            cards = await asyncio.to_thread(self._describe_all)
        except Exception as exc:  # a card from the catalog is still a card: never fail a listing for this
            log.warning("homepd: could not read the models' headers: %s", exc)
        else:
            self.cards = cards
        finally:
            self.described.set()
        card = self.cards.get(EMBEDDING)
        if card is not None and self.embedder is None and (card.path is not None or self.is_fake):
            config, settings = self.service.config, self.service.settings
            self.embedder = EmbeddingModel(card.path or "", backend=config.backend,
                                           n_threads=config.effective_n_threads,
                                           n_gpu_layers=config.n_gpu_layers if config.gpu_index is not None else 0,
                                           keep_alive_s=settings.embedding_keep_alive_s)

    def _describe_all(self) -> dict[str, ModelCard]:
        config, catalog = self.service.config, load_catalog()
        cards = {}
        for role, spec in self.specs.items():
            path = None
            if self.is_fake:
                path = FAKE_EMBEDDING_PATH if role == EMBEDDING else None
            else:
                try:
                    path = str(resolve_model(spec, config.models_dir, pull=False, catalog=catalog))
                except ModelError as exc:
                    log.warning("homepd: the %s model %s is not here: %s", role, spec, exc)
                    self.missing[role] = str(exc)
            card = describe(spec, None if self.is_fake else path, role, catalog=catalog, is_fake=self.is_fake)
            card = card.with_aliases(os.path.splitext(os.path.basename(path))[0] if path and not self.is_fake
                                     else "", *(self.service.settings.served_model_names if role == CHAT else ()))
            cards[role] = _fake(card, path) if self.is_fake else card
        return cards

    async def close(self) -> None:
        if self.embedder is not None:
            await self.embedder.close()

    # names ---------------------------------------------------------------------------------
    def find(self, name: str) -> ModelCard | None:
        """The model a request's ``model`` names, or None."""
        return next((card for card in self.cards.values() if card.answers_to(name)), None)

    def all(self) -> list[ModelCard]:
        return list(self.cards.values())

    def card(self, role: str) -> ModelCard | None:
        return self.cards.get(role)

    # state -----------------------------------------------------------------------------------
    def state(self, card: ModelCard) -> ModelState:
        if card.role == CHAT:
            service = self.service
            if service.state == "starting":
                return ModelState.LOADING
            return ModelState.LOADED if service.engine is not None and service.state in ("ready", "switching",
                                                                                        "draining") \
                else ModelState.UNLOADED
        return self.embedder.state if self.embedder is not None else ModelState.UNLOADED

    def expires_at(self, card: ModelCard) -> dt.datetime:
        """When the model unloads: the chat model stays for as long as the service runs (FOREVER)."""
        if card.role == EMBEDDING and self.embedder is not None and self.embedder.expires_at_unix_s is not None:
            return dt.datetime.fromtimestamp(self.embedder.expires_at_unix_s, dt.timezone.utc)
        return FOREVER

    def context_length(self, card: ModelCard) -> int | None:
        if card.role == CHAT:
            return self.service.config.n_ctx
        return self.embedder.n_ctx if self.embedder is not None and self.embedder.n_ctx else card.context_length

    async def load(self, card: ModelCard, timeout_s: float) -> float:
        """Make ``card``'s model loaded (the chat model: wait for the engine's start); the seconds waited."""
        t0 = time.monotonic()
        if card.role == EMBEDDING:
            return await self.embedding_model().load()
        while self.service.state == "starting" and time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    async def keep_alive(self, card: ModelCard, keep_alive_s: float | None | object) -> bool:
        """Apply a request's keep-alive after it; True when the model was unloaded (keep-alive 0).  The chat
        model is this service's one engine and stays loaded: its keep-alive is noted, and nothing is freed
        (issue 45 unloads it)."""
        if keep_alive_s is DEFAULT:
            return False
        if card.role == CHAT:
            self.chat_keep_alive_s = keep_alive_s
            return False
        embedder = self.embedding_model()
        if keep_alive_s == 0:
            await embedder.unload()
            return True
        embedder.keep_alive(keep_alive_s)
        return False

    def embedding_model(self) -> EmbeddingModel:
        if self.embedder is None:
            raise ModelError(self.missing.get(EMBEDDING) or "the embedding model is not available yet (its file "
                                                            "is being looked up); retry in a moment")
        return self.embedder


def _fake(card: ModelCard, path: str | None) -> ModelCard:
    """The fake backend's card: its stand-in's template and sizes, as a GGUF header would tell them."""
    if card.role == EMBEDDING:
        n_ctx, n_embd, template = FAKE_EMBED_CTX, FAKE_N_EMBD, None
    else:
        fake = FakeModel()
        n_ctx, n_embd, template = fake.n_ctx_train, 64, fake.chat_template()
    info = {"general.architecture": "fake", "fake.context_length": n_ctx, "fake.embedding_length": n_embd}
    return replace(card, path=path, template=template, capabilities=capabilities(card.role, template),
                   context_length=n_ctx, embedding_length=n_embd, model_info=info)
