"""The models a service serves, by name and role, with their cards, their state and their leases.

One ``ModelSlot`` per configured model (``homepd.config.models``: ``--model`` given more than once,
``[models.NAME]`` tables, ``--embedding-model``).  Every face asks here which model a request's ``model``
names (``find``; with one chat model any name is served, as llama-server does), what it can do (its
``ModelCard``), whether it is loaded (``state``, ``expires_at``), and takes a lease on it for a request
(``acquire``/``release``), which loads it on demand under the memory budget (``homepd.serve.loader``) and
keeps it from being evicted while the request runs.  The cards are read from the catalog at once and from
the GGUF headers off the loop (``refresh``), so a listing answers in milliseconds even while a model loads.

With one chat model the service behaves as it did before several models: that model is loaded at start,
pinned, and stays for as long as the service runs.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from dataclasses import replace

from homepd.config.models import ModelRole, ModelSpec
from homepd.engine.embedder import DEFAULT, EmbeddingModel, ModelState
from homepd.errors import ConfigError, ModelError
from homepd.fakellm import FAKE_EMBEDDING_PATH, FAKE_EMBED_CTX, FAKE_N_EMBD, FakeModel
from homepd.models.card import ModelCard, capabilities, describe
from homepd.models.catalog import load_catalog
from homepd.models.resolve import resolve_model
from homepd.serve.budget import UNBOUNDED_BYTES
from homepd.serve.loader import MULTI_MODEL_KV_STORE_BYTES, Loader
from homepd.serve.slots import ModelSlot

log = logging.getLogger("homepd.serve")
CHAT, EMBEDDING = ModelRole.CHAT, ModelRole.EMBEDDING
# why: Ollama writes a model kept for good as expiring in about three centuries; clients parse a date
FOREVER = dt.datetime(2318, 1, 1, tzinfo=dt.timezone.utc)
__all__ = ["CHAT", "EMBEDDING", "FOREVER", "ModelRegistry", "ModelState"]


class ModelRegistry:
    def __init__(self, service, specs: tuple[ModelSpec, ...], budget_bytes: int, store_opener=None):
        self.service = service
        config, settings = service.config, service.settings
        self.is_fake = config.backend == "fake"
        catalog = load_catalog()
        for spec in specs:
            entry = catalog.get(spec.source)
            if entry is not None and entry.role != spec.role:
                flag = "--embedding-model" if entry.role == EMBEDDING else "--model"
                raise ConfigError(f"{spec.source} is {'an' if entry.role == EMBEDDING else 'a'} {entry.role} model: "
                                  f"serve it with {flag} {spec.source}" + (" (or role = \"embedding\" in its table)"
                                                                          if entry.role == EMBEDDING else ""))
        chats = [s for s in specs if s.role is CHAT]
        self.is_multi = len(chats) > 1
        self.loader = Loader(service, budget_bytes, None if self.is_fake else store_opener,
                             settings.load_timeout_s)
        self.slots = self.loader.slots
        for spec in specs:
            if spec.role is CHAT and not self.is_multi:  # today's one-model service: loaded at start, for good
                spec = replace(spec, is_pinned=True, keep_alive_s=None)
            engine_config = None
            if spec.role is CHAT:
                engine_config = spec.engine_config(config)
                if self.is_multi and engine_config.kv_store_bytes is None and not self.is_fake:
                    engine_config = replace(engine_config, kv_store_bytes=MULTI_MODEL_KV_STORE_BYTES)
            card = describe(spec.source, None, spec.role, catalog=catalog, is_fake=self.is_fake)
            card = replace(card, name=card.name if spec.name == card.name.removesuffix(":latest") else
                           f"{spec.name}:latest").with_aliases(spec.name, *spec.aliases, *(
                               settings.served_model_names if spec is chats[0] or spec.name == chats[0].name else ()))
            self.slots[spec.name] = ModelSlot(spec, card, engine_config)
        self.default = self.slots[chats[0].name]
        self.missing: dict[str, str] = {}   # model name -> why its file could not be found (the 503's words)
        self.described = asyncio.Event()
        self._by_request: dict[str, ModelSlot] = {}   # request id -> the model it runs on (its lease)

    async def refresh(self) -> None:
        """Read each model's GGUF header (off the loop) into its card; make the embedding models' handles."""
        try:
            cards = await asyncio.to_thread(self._describe_all)
        except Exception as exc:  # a card from the catalog is still a card: never fail a listing for this
            log.warning("homepd: could not read the models' headers: %s", exc)
        else:
            for name, card in cards.items():
                self.slots[name].card = card
        finally:
            self.described.set()
        config, settings = self.service.config, self.service.settings
        for slot in self.slots.values():
            if slot.is_chat or slot.embedder is not None or (slot.card.path is None and not self.is_fake):
                continue
            slot.embedder = EmbeddingModel(slot.card.path or "", backend=config.backend,
                                           n_threads=config.effective_n_threads,
                                           n_gpu_layers=config.n_gpu_layers if config.gpu_index is not None else 0,
                                           keep_alive_s=settings.embedding_keep_alive_s)

    def _describe_all(self) -> dict[str, ModelCard]:
        config, catalog = self.service.config, load_catalog()
        cards = {}
        for name, slot in self.slots.items():
            spec, path = slot.spec, None
            if self.is_fake:
                path = FAKE_EMBEDDING_PATH if spec.role is EMBEDDING else None
            else:
                try:
                    path = str(resolve_model(spec.source, config.models_dir, pull=False, catalog=catalog))
                except ModelError as exc:
                    log.warning("homepd: the %s model %s is not here: %s", spec.role, spec.source, exc)
                    self.missing[name] = str(exc)
            card = describe(spec.source, None if self.is_fake else path, spec.role, catalog=catalog,
                            is_fake=self.is_fake)
            card = replace(card, name=slot.card.name).with_aliases(
                *slot.card.aliases, os.path.splitext(os.path.basename(path))[0] if path and not self.is_fake else "")
            cards[name] = _fake(card, path) if self.is_fake else card
        return cards

    async def close(self) -> None:
        await self.loader.close()
        for slot in self.slots.values():
            if slot.embedder is not None:
                await slot.embedder.close()

    # names ---------------------------------------------------------------------------------
    def find(self, name: str) -> ModelCard | None:
        """The model a request's ``model`` names, or None."""
        slot = self.slot_named(name)
        return slot.card if slot is not None else None

    def slot_named(self, name: str) -> ModelSlot | None:
        return next((s for s in self.slots.values() if s.card.answers_to(name)), None)

    def slot_of(self, card: ModelCard | None) -> ModelSlot:
        """The slot of ``card``; None (a name no model answers to): the chat model of a one-model service."""
        if card is None:
            return self.default
        return next(s for s in self.slots.values() if s.card.name == card.name)

    def all(self) -> list[ModelCard]:
        return [s.card for s in self.slots.values()]

    def known_names(self) -> str:
        return ", ".join(s.name for s in self.slots.values())

    def card(self, role: str) -> ModelCard | None:
        """The first model of ``role`` (the default chat model; the embedding model)."""
        return next((s.card for s in self.slots.values() if s.spec.role == role), None)

    # state -----------------------------------------------------------------------------------
    def state(self, card: ModelCard) -> ModelState:
        slot = self.slot_of(card)
        if slot is self.default and self.service.state == "starting":
            return ModelState.LOADING
        return slot.current_state()

    def expires_at(self, card: ModelCard) -> dt.datetime:
        """When the model unloads: FOREVER for a model kept until its memory is needed."""
        slot = self.slot_of(card)
        at = slot.expires_at_unix_s if slot.is_chat else (slot.embedder.expires_at_unix_s if slot.embedder else None)
        return dt.datetime.fromtimestamp(at, dt.timezone.utc) if at is not None else FOREVER

    def context_length(self, card: ModelCard) -> int | None:
        slot = self.slot_of(card)
        if slot.is_chat:
            return slot.config.n_ctx
        return slot.embedder.n_ctx if slot.embedder is not None and slot.embedder.n_ctx else card.context_length

    @property
    def default_engine(self):
        return self.default.engine

    def engine_of(self, request_id: str):
        """The engine a request runs on (``bind``), else the default model's."""
        slot = self._by_request.get(request_id)
        return slot.engine if slot is not None else self.default.engine

    # leases ------------------------------------------------------------------------------------
    async def acquire(self, slot: ModelSlot, capacity: int | None = None) -> float:
        """A lease on ``slot`` for one request: load it if needed (single flight, waiting in a queue of at most
        ``capacity`` requests for the model; more is ``QueueFull``); the seconds waited.  ``release`` it."""
        if capacity is not None and slot.n_in_flight >= capacity:
            raise QueueFull(f"{slot.n_in_flight} requests are running or waiting for {slot.name} (the most is "
                            f"{capacity}); retry later")
        slot.lease()
        try:
            if slot.name in self.missing and slot.current_state() is ModelState.UNLOADED:
                raise ModelError(self.missing[slot.name])
            waited_s = await self.loader.ensure_loaded(slot)
        except BaseException:
            self.release(slot)
            raise
        slot.used(time.monotonic())
        slot.keep_alive_s = slot.spec.keep_alive_s  # why: a keep-alive a request sends holds after that request only
        return waited_s

    def release(self, slot: ModelSlot) -> None:
        slot.n_in_flight -= 1
        assert slot.n_in_flight >= 0, slot.name
        slot.last_used_s = time.monotonic()
        if slot.n_in_flight == 0:
            self.loader.went_idle(slot)

    def bind(self, request_id: str, slot: ModelSlot) -> None:
        """``request_id`` runs on ``slot`` until ``request_done``: its lease is released then."""
        self._by_request[request_id] = slot

    def request_done(self, request_id: str) -> None:
        slot = self._by_request.pop(request_id, None)
        if slot is not None:
            self.release(slot)

    async def load(self, card: ModelCard, timeout_s: float) -> float:
        """Make ``card``'s model loaded (the default model while the service starts: wait for it); the
        seconds waited."""
        t0 = time.monotonic()
        slot = self.slot_of(card)
        if slot is self.default and self.service.state == "starting":
            while self.service.state == "starting" and time.monotonic() - t0 < timeout_s:
                await asyncio.sleep(0.05)
            return time.monotonic() - t0
        waited_s = await self.acquire(slot)
        self.release(slot)
        if not slot.is_chat:
            waited_s += await slot.embedder.load()
        return waited_s

    async def keep_alive(self, card: ModelCard, keep_alive_s: float | None | object) -> bool:
        """Apply a request's keep-alive after it (capped by the model's own); True when the model was unloaded
        (keep-alive 0).  The chat model of a one-model service stays (it is the service's engine)."""
        if keep_alive_s is DEFAULT:
            return False
        slot = self.slot_of(card)
        if not slot.is_chat:
            embedder = self.embedding_model(card)
            if keep_alive_s == 0:
                await embedder.unload()
                return True
            embedder.keep_alive(keep_alive_s)
            return False
        if slot.is_pinned:
            return False
        own = slot.spec.keep_alive_s
        slot.keep_alive_s = own if keep_alive_s is None else keep_alive_s if own is None else min(own, keep_alive_s)
        if keep_alive_s == 0 and slot.n_in_flight == 0:
            await self.loader.unload(slot)
            return True
        if slot.n_in_flight == 0:
            self.loader.went_idle(slot)
        return False

    def embedding_model(self, card: ModelCard | None = None) -> EmbeddingModel:
        slot = self.slot_of(card) if card is not None else next(
            (s for s in self.slots.values() if not s.is_chat), None)
        if slot is None or slot.embedder is None:
            why = self.missing.get(slot.name) if slot is not None else None
            raise ModelError(why or "the embedding model is not available yet (its file is being looked up); "
                                    "retry in a moment")
        return slot.embedder

    def status(self) -> dict:
        """Per model: state, footprint, uses, loads, evictions; the budget; the recent loads with reasons."""
        budget = self.loader.budget_bytes
        return {"budget_bytes": budget if budget < UNBOUNDED_BYTES else None, "used_bytes": self.loader.used_bytes(),
                "models": [s.to_dict() for s in self.slots.values()],
                "recent_loads": [e.to_dict() for e in self.loader.recent]}


class QueueFull(ModelError):
    """More requests wait for one model than its queue holds."""


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
