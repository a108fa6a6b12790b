"""Sentence embeddings on llama.cpp: a context with ``embeddings`` on, the model's own pooling, L2-normalised.

``LlamaEmbedder`` packs several inputs into one batch (one sequence id each, up to ``n_batch`` tokens and
``n_seq_max`` inputs), runs it and reads each sequence's pooled vector (``llama_get_embeddings_seq``).  An
encoder (BERT) runs ``llama_encode``, a decoder with a pooling type ``llama_decode``; nothing is kept between
batches.  An input longer than the model's trained context is cut by the caller (``homepd.engine.embedder``),
never here: positions past it have no embedding.
"""
from __future__ import annotations

import ctypes

import numpy as np

import llama_cpp as C

from homepd.errors import ModelError, WorkerError
from homepd.llm import LlamaModel

DEFAULT_N_BATCH = 2048     # tokens of one llama_encode: four inputs of a 512-token BERT, or many short ones
DEFAULT_N_SEQ_MAX = 32     # inputs of one batch


class LlamaEmbedder:
    """An embedding model loaded for pooled sentence vectors (``pooling``: its GGUF's pooling type)."""

    def __init__(self, path, n_threads: int, n_gpu_layers: int = 0, n_batch: int = DEFAULT_N_BATCH,
                 n_seq_max: int = DEFAULT_N_SEQ_MAX):
        self.model = LlamaModel(path, n_gpu_layers)
        self.n_embd = int(C.llama_model_n_embd(self.model._model))
        self.n_ctx_train = self.model.n_ctx_train
        self.n_batch = max(n_batch, self.n_ctx_train)
        params = C.llama_context_default_params()
        params.n_ctx = self.n_batch
        params.n_batch = params.n_ubatch = self.n_batch  # why: a non-causal model sees its input in one ubatch
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = n_threads
        params.embeddings = True
        params.pooling_type = C.LLAMA_POOLING_TYPE_UNSPECIFIED  # the model's own (mean for all-MiniLM)
        params.no_perf = True
        self._ctx = C.llama_init_from_model(self.model._model, params)
        if not self._ctx:
            self.model.close()
            raise ModelError(f"llama.cpp could not create an embedding context for {path}")
        self.pooling = int(C.llama_pooling_type(self._ctx))
        if self.pooling in (C.LLAMA_POOLING_TYPE_NONE, C.LLAMA_POOLING_TYPE_RANK):
            self.close()
            raise ModelError(f"{path} pools no sentence vector (pooling type {self.pooling}): it is not an "
                             "embedding model")
        self.n_seq_max = n_seq_max
        self._is_encoder = bool(C.llama_model_has_encoder(self.model._model)) and \
            not C.llama_model_has_decoder(self.model._model)
        self._mem = C.llama_get_memory(self._ctx)
        self._batch = C.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        if self._ctx:
            C.llama_batch_free(self._batch)
            C.llama_free(self._ctx)
            self._ctx = None
        self.model.close()

    def tokenize(self, text: str) -> list[int]:
        """The input's tokens with the model's own markers (BERT: [CLS] ... [SEP]); text is never control."""
        return self.model.tokenize(text, add_special=True, parse_special=False)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One L2-normalised row per input (each at most ``n_ctx_train`` tokens, none empty)."""
        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        start = 0
        while start < len(inputs):
            end, n_tokens = start, 0
            while end < len(inputs) and end - start < self.n_seq_max and n_tokens + len(inputs[end]) <= self.n_batch:
                n_tokens += len(inputs[end])
                end += 1
            out[start:end] = self._run(inputs[start:end])
            start = end
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms > 0, norms, 1.0)

    def _run(self, group: list[list[int]]) -> np.ndarray:
        batch, i = self._batch, 0
        for seq, ids in enumerate(group):
            for pos, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, True
                i += 1
        batch.n_tokens = i
        if self._mem:
            C.llama_memory_clear(self._mem, True)
        rc = C.llama_encode(self._ctx, batch) if self._is_encoder else C.llama_decode(self._ctx, batch)
        if rc != 0:
            raise WorkerError(f"llama.cpp could not embed a batch of {len(group)} inputs ({i} tokens): rc {rc}")
        rows = np.empty((len(group), self.n_embd), dtype=np.float32)
        for seq in range(len(group)):
            ptr = C.llama_get_embeddings_seq(self._ctx, seq)
            if not ptr:
                raise WorkerError(f"llama.cpp gave no pooled embedding for input {seq} of a batch")
            rows[seq] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_embd,))
        return rows
