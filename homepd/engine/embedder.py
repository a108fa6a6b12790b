"""The embedding model of a service: loaded on first use, one batch at a time on its own thread, unloaded when
its keep-alive runs out.

Beside the chat engine's workers, an embedding model needs no scheduler: a request is a batch of inputs, each
encoded whole.  So ``EmbeddingModel`` runs them on one dedicated thread (llama.cpp releases the GIL while it
computes): the event loop never waits on it, and concurrent requests queue in arrival order, each answered in
turn.  The queue is bounded (``max_waiting`` requests; more: ``EmbedQueueFull``), and so is a request
(the service's ``--max-embedding-inputs``).  Loading is single flight: requests that arrive during a load
wait for that one load.  Its keep-alive is Ollama's: after each request the model stays loaded for
``keep_alive_s`` (a request may say otherwise; None: until the service stops; 0: unload now).

This is one model's lifecycle (unloaded -> loading -> loaded); the "several models on one box" work (issue
45) is meant to hold many of these, chat engines beside them, under one memory budget.
"""
from __future__ import annotations

import asyncio
import enum
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from homepd.backends import embedder_class
from homepd.errors import EngineError, RequestError

DEFAULT_MAX_WAITING = 64
DEFAULT = object()  # a request that says nothing of its keep-alive: the model's own


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"   # being unloaded: its last requests finish, then its memory is freed


class EmbedQueueFull(EngineError):
    """More embedding requests are waiting than the queue holds (the face answers 503 with Retry-After)."""


@dataclass(frozen=True)
class Embeddings:
    """The answer to one embedding request: one L2-normalised row per input (``vectors``, float32), the
    tokens each input took (after any cut), how many were cut to the context, and where the time went."""
    vectors: object                 # numpy array (n_inputs, n_embd)
    n_tokens: tuple[int, ...]
    n_truncated: int
    load_s: float
    queue_s: float
    total_s: float

    @property
    def n_prompt_tokens(self) -> int:
        return sum(self.n_tokens)


class EmbeddingModel:
    """One embedding model (``path``: its GGUF, or the fake's stand-in) for a service."""

    def __init__(self, path: str, *, backend: str = "llama", n_threads: int = 1, n_gpu_layers: int = 0,
                 keep_alive_s: float | None = 300.0, max_waiting: int = DEFAULT_MAX_WAITING):
        self.path, self.backend = path, backend
        self.n_threads, self.n_gpu_layers = n_threads, n_gpu_layers
        self.default_keep_alive_s = keep_alive_s
        self.max_waiting = max_waiting
        self.state = ModelState.UNLOADED
        self.expires_at_unix_s: float | None = None   # when it unloads (None: loaded for good, or not loaded)
        self.n_loads = 0
        self.n_waiting = 0
        self._model = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="homepd-embed")
        self._load_lock = asyncio.Lock()
        self._expiry: asyncio.Task | None = None
        self._busy = 0

    @property
    def n_embd(self) -> int | None:
        return self._model.n_embd if self._model is not None else None

    @property
    def n_ctx(self) -> int | None:
        return self._model.n_ctx_train if self._model is not None else None

    async def load(self) -> float:
        """Load the model unless it is loaded (single flight); returns the seconds this call waited on a load."""
        if self.state is ModelState.LOADED:
            return 0.0
        t0 = time.monotonic()
        async with self._load_lock:
            if self.state is not ModelState.LOADED:
                self.state = ModelState.LOADING
                try:
                    cls = embedder_class(self.backend)
                    self._model = await self._run(cls, self.path, self.n_threads, self.n_gpu_layers)
                except BaseException:
                    self.state = ModelState.UNLOADED
                    raise
                self.state, self.n_loads = ModelState.LOADED, self.n_loads + 1
        return time.monotonic() - t0

    async def unload(self) -> None:
        """Free the model now (a request under way finishes first: it holds the thread)."""
        async with self._load_lock:
            self._cancel_expiry()
            model, self._model = self._model, None
            self.state, self.expires_at_unix_s = ModelState.UNLOADED, None
            if model is not None:
                await self._run(model.close)

    async def embed(self, inputs: list[str] | list[list[int]], *, truncate: bool,
                    keep_alive_s: float | None | object = DEFAULT) -> Embeddings:
        """Embed ``inputs`` (texts, or token-id lists), loading the model first if needed.  An input longer
        than the model's context is cut to it when ``truncate`` (its last token, BERT's [SEP], kept), else
        a RequestError names it.  ``keep_alive_s`` (``DEFAULT``: the model's own) applies after it."""
        if self.n_waiting >= self.max_waiting:
            raise EmbedQueueFull(f"{self.n_waiting} embedding requests are waiting (the most is "
                                 f"{self.max_waiting}); retry in a moment")
        t0 = time.monotonic()
        self.n_waiting += 1
        self._busy += 1
        self._cancel_expiry()
        try:
            load_s = await self.load()
            t_queued = time.monotonic()
            vectors, n_tokens, n_cut, started = await self._run(self._embed_now, inputs, truncate)
        finally:
            self.n_waiting -= 1
            self._busy -= 1
            self.keep_alive(self.default_keep_alive_s if keep_alive_s is DEFAULT else keep_alive_s)
        t1 = time.monotonic()
        return Embeddings(vectors, n_tokens, n_cut, load_s, max(0.0, started - t_queued), t1 - t0)

    def keep_alive(self, keep_alive_s: float | None) -> None:
        """Keep the loaded model for ``keep_alive_s`` from now (None: for good; 0: unload once idle)."""
        if self.state is not ModelState.LOADED or self._busy:
            return
        self._cancel_expiry()
        if keep_alive_s is None:
            self.expires_at_unix_s = None
            return
        self.expires_at_unix_s = time.time() + keep_alive_s
        self._expiry = asyncio.get_running_loop().create_task(self._expire_after(keep_alive_s))

    async def close(self) -> None:
        """Unload and stop the thread (the service is stopping)."""
        await self.unload()
        await asyncio.to_thread(self._executor.shutdown, cancel_futures=True)

    # on the model's thread ------------------------------------------------------------
    def _embed_now(self, inputs, truncate: bool):
        started = time.monotonic()
        model, n_ctx = self._model, self._model.n_ctx_train
        if inputs and isinstance(inputs[0], str):
            ids = [model.tokenize(text) for text in inputs]
        else:
            ids = [list(x) for x in inputs]
            for i, row in enumerate(ids):
                bad = next((t for t in row if not 0 <= t < model.n_vocab), None) if row else -1
                if bad is not None:
                    raise RequestError(f"input[{i}]: " + ("an empty token list" if bad == -1 else
                                       f"token {bad} is not in the model's vocabulary (0..{model.n_vocab - 1})"))
        n_cut = 0
        for i, row in enumerate(ids):
            if len(row) > n_ctx:
                if not truncate:
                    raise RequestError(f"input[{i}] is {len(row)} tokens; the embedding model's context is {n_ctx} "
                                       "tokens: shorten it, or ask for truncation (truncate: true)")
                ids[i] = row[:n_ctx - 1] + row[-1:]
                n_cut += 1
        vectors = model.embed(ids) if ids else None
        return vectors, tuple(len(row) for row in ids), n_cut, started

    # ------------------------------------------------------------------------------------
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _expire_after(self, delay_s: float) -> None:
        await asyncio.sleep(max(0.0, delay_s))
        if not self._busy and self.n_waiting == 0:
            self._expiry = None  # why: unload cancels the expiry task, which must not be this one
            await self.unload()

    def _cancel_expiry(self) -> None:
        if self._expiry is not None and self._expiry is not asyncio.current_task():
            self._expiry.cancel()
        self._expiry = None
