"""The one module that touches llama-cpp-python (its low-level ctypes API).

``LlamaModel`` is a loaded GGUF (optionally vocab-only, for tokenizing in the
controller); ``LlamaContext`` is one context with ``n_seq_max`` sequences over
a unified KV cache, a reusable batch, and per-sequence KV state export/import
into caller-given buffers.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import llama_cpp as C

from homepd.chat.format import detect as detect_chat_format
from homepd.core.terms import ReuseMode, SpecialToken
from homepd.core.sampling import Grammar, SamplingParams
from homepd.errors import ModelError, WorkerError
from homepd.llm.sampler import CandidateBuffer, LlamaSampler, grammar_sampler

_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        C.llama_backend_init()
        if os.environ.get("HOMEPD_LLAMA_LOG", "") != "1":
            C.llama_log_set(_silent_log, ctypes.c_void_p(0))
        _backend_ready = True


@C.llama_log_callback
def _silent_log(level, text, user_data):  # pragma: no cover - called from C
    return None


class LlamaModel:
    """A loaded GGUF model (weights on CPU or offloaded with ``n_gpu_layers``)."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, vocab_only: bool = False):
        _init_backend()
        self.path = Path(path)
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        # whether any layer can run on a GPU (a CPU-only build keeps every layer on the CPU whatever it is asked)
        self.offloads = n_gpu_layers != 0 and bool(C.llama_supports_gpu_offload())
        params.use_mmap = True
        self._model = C.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ModelError(f"llama.cpp could not load {self.path} (corrupt or unsupported GGUF?)")
        self._vocab = C.llama_model_get_vocab(self._model)
        self.n_vocab = C.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = C.llama_model_n_ctx_train(self._model)
        self.bos_id = C.llama_vocab_bos(self._vocab)
        self.eos_id = C.llama_vocab_eos(self._vocab)
        self.size_bytes = int(C.llama_model_size(self._model))
        self.add_bos = bool(C.llama_vocab_get_add_bos(self._vocab))
        self.n_swa = int(C.llama_model_n_swa(self._model))  # sliding-window size, 0 = none
        self.is_recurrent = bool(C.llama_model_is_recurrent(self._model) or C.llama_model_is_hybrid(self._model))
        self._pieces: dict[int, bytes] = {}
        self._special_tokens: tuple[SpecialToken, ...] | None = None
        self._shown = self._marker_tokens()

    def close(self) -> None:
        if self._model:
            C.llama_model_free(self._model)
            self._model = None

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self._vocab, token))

    @functools.cached_property
    def eog_ids(self) -> np.ndarray:
        """Every end-of-generation token of the vocabulary (what ``ignore_eos`` bans), found once (~30 ms)."""
        return np.array([t for t in range(self.n_vocab) if C.llama_vocab_is_eog(self._vocab, t)], dtype=np.int64)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def _marker_tokens(self) -> set[int]:
        """The control tokens whose text the reply parser reads (a tool call's or a reasoning block's markers:
        ``ChatFormat.control_texts``), which a piece must show although control tokens are otherwise hidden."""
        shown = set()
        for text in detect_chat_format(self.chat_template()).control_texts:
            ids = self.tokenize(text, add_special=False, parse_special=True)
            if len(ids) == 1 and C.llama_vocab_get_attr(self._vocab, ids[0]) & C.LLAMA_TOKEN_ATTR_CONTROL:
                shown.add(ids[0])
        return shown

    def token_to_piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            special = token in self._shown
            n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_to_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """The token's special text (e.g. '<|im_end|>'), for chat templates."""
        if token < 0:
            return ""
        text = C.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    def special_tokens(self) -> tuple[SpecialToken, ...]:
        """The control tokens that ``parse_special=True`` matches in text, longest (in bytes) first, as
        llama.cpp tries them; read once from the vocabulary."""
        if self._special_tokens is None:
            found = []
            for token in range(self.n_vocab):
                attr = C.llama_vocab_get_attr(self._vocab, token)
                if attr & (C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN) and (text := self.token_text(token)):
                    found.append(SpecialToken(text, token, bool(attr & C.LLAMA_TOKEN_ATTR_LSTRIP),
                                              bool(attr & C.LLAMA_TOKEN_ATTR_RSTRIP)))
            self._special_tokens = tuple(sorted(found, key=lambda s: -len(s.text.encode())))
        return self._special_tokens

    def chat_template(self) -> str | None:
        tmpl = C.llama_model_chat_template(self._model, None)
        return tmpl.decode("utf-8") if tmpl else None

    def check_grammar(self, grammar: Grammar) -> None:
        """Raise RequestError unless llama.cpp parses ``grammar`` on this vocabulary (the controller checks a
        request's grammar here, before a worker sees it)."""
        C.llama_sampler_free(grammar_sampler(self._vocab, grammar))


# why off on a CPU, not llama.cpp's auto (which turns it on): the CPU kernel for a step of fewer than 64 tokens
# (GGML_FA_TILE_Q) reads the KV cells one query row at a time, so a 4..32-token chunk of a document 600 cells
# deep cost 2.4x a token of it without (9.7 against 4.0 ms at 2 threads) and three decodes 1,500 cells deep
# 1.6-1.8x (77 against 42-49 ms); only whole 128-token steps gained from it (benchmarks/step_cost.py
# --flash-attn on|off).  homepd's steps are small by design (the adaptive chunk).
# The V cache's layout follows the setting (transposed when off), so contexts that trade KV state (the
# disaggregated handoff, the KV store) must agree: the engine resolves it once, ``WorkerSpec.flash_attn``.
def flash_attn_type(flash_attn: bool) -> int:
    """llama.cpp's flash-attention setting for a context: on, or off."""
    return C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED


class LlamaContext:
    """One llama.cpp context: ``n_seq_max`` sequences sharing one unified KV cache, or (``kv_unified`` False) each
    in its own stream of ``n_ctx_seq`` cells.  ``flash_attn``: None is on where the model offloads to a GPU and
    off on a CPU (``flash_attn_type``)."""

    def __init__(self, model: LlamaModel, n_ctx: int, n_batch: int, n_seq_max: int,
                 n_threads: int, n_ubatch: int | None = None, kv_unified: bool = True,
                 flash_attn: bool | None = None):
        self.model = model
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch or 512, n_batch)
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        # why: without kv_unified, llama.cpp splits n_ctx into n_seq_max equal streams, a prompt longer than one
        # fails with llama_decode() == 1, and each step attends only over its own sequence's stream
        # (benchmarks/kv_layout.py measures both; --kv-layout)
        params.kv_unified = kv_unified
        params.flash_attn_type = flash_attn_type(model.offloads if flash_attn is None else flash_attn)
        params.no_perf = True
        self._ctx = C.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise ModelError(f"llama.cpp could not create a context (n_ctx={n_ctx}) for {model.path}")
        self.n_ctx = C.llama_n_ctx(self._ctx)
        self.n_ctx_seq = C.llama_n_ctx_seq(self._ctx)  # the cells one sequence may hold: n_ctx, or one stream
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.kv_unified = kv_unified
        self._mem = C.llama_get_memory(self._ctx)
        self._batch = C.llama_batch_init(n_batch, 0, 1)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))
        self._logit_flags = np.ctypeslib.as_array(
            ctypes.cast(self._batch.logits, ctypes.POINTER(ctypes.c_int8)), shape=(n_batch,))
        self._seq_ptrs = [self._batch.seq_id[i] for i in range(n_batch)]
        self._nseq[:] = 1
        self._row_type = ctypes.c_float * model.n_vocab
        self._candidates: CandidateBuffer | None = None

    @property
    def n_threads(self) -> tuple[int, int]:
        """(n_threads, n_threads_batch) as llama.cpp reports them for this context (decode, prompt)."""
        return int(C.llama_n_threads(self._ctx)), int(C.llama_n_threads_batch(self._ctx))

    def close(self) -> None:
        if self._ctx:
            C.llama_batch_free(self._batch)
            C.llama_free(self._ctx)
            self._ctx = None


    def decode(self, tokens: list[int], positions: list[int], seq_ids: list[int],
               wants_logits: list[bool]) -> None:
        """Run one llama_decode over a mixed batch; logits are kept for the flagged rows."""
        n = len(tokens)
        assert 0 < n <= self.n_batch and len(positions) == len(seq_ids) == len(wants_logits) == n
        self._tok[:n] = tokens
        self._pos[:n] = positions
        self._logit_flags[:n] = wants_logits
        ptrs = self._seq_ptrs
        for i, sid in enumerate(seq_ids):
            ptrs[i][0] = sid
        self._batch.n_tokens = n
        rc = C.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise WorkerError(f"llama_decode returned {rc} for a batch of {n} tokens "
                              f"(1 = no KV slot: context {self.n_ctx} too small for what is running)")

    def new_sampler(self, params: SamplingParams, history: tuple[int, ...] = ()) -> LlamaSampler:
        """A request's sampler on this context (``history``: the tokens it generated before, elsewhere)."""
        return LlamaSampler(self, params, history)

    def candidates(self) -> CandidateBuffer:
        """The context's vocabulary-sized candidate array (grammar sampling), made on first use."""
        if self._candidates is None:
            self._candidates = CandidateBuffer(self.model.n_vocab)
        return self._candidates

    def logits(self, row: int) -> np.ndarray:
        """Logits of batch row ``row`` of the last decode (a view; copy to keep)."""
        ptr = C.llama_get_logits_ith(self._ctx, row)
        if not ptr:
            raise WorkerError(f"no logits for batch row {row}")
        # why: np.ctypeslib.as_array builds a new ctypes type per call (~20 us per token)
        return np.frombuffer(self._row_type.from_address(ctypes.addressof(ptr.contents)), dtype=np.float32)

    def seq_rm(self, seq_id: int) -> None:
        C.llama_memory_seq_rm(self._mem, seq_id, -1, -1)

    # prefix reuse (homepd.core.prefixreuse) ---------------------------------------
    @property
    def reuse_mode(self) -> ReuseMode:
        """What this cache type allows to reuse.  A sliding-window cache keeps only the last ``n_swa``
        positions of a sequence, and a recurrent or hybrid one only its final state, so neither can drop a
        tail and resume earlier: only a whole kept sequence is continued (``EXACT``), as llama-server falls
        back to (its issues #14157, #22746); a plain cache drops any tail (``PREFIX``)."""
        return ReuseMode.EXACT if self.model.n_swa > 0 or self.model.is_recurrent else ReuseMode.PREFIX

    @property
    def can_share(self) -> bool:
        """Whether ``seq_copy`` shares cells: on a unified cache it adds an id to cells; across the streams
        of a split cache llama.cpp copies whole streams only."""
        return self.kv_unified and self.reuse_mode is ReuseMode.PREFIX

    def seq_copy(self, src_id: int, dst_id: int, n_cells: int) -> int:
        """Empty ``dst_id`` gets positions ``0..n_cells-1`` of ``src_id`` (``llama_memory_seq_cp``: shared
        cells); returns the positions ``dst_id`` holds."""
        assert self.can_share
        C.llama_memory_seq_cp(self._mem, src_id, dst_id, 0, n_cells)
        return self.seq_n_pos(dst_id)

    def seq_trim(self, seq_id: int, n_keep: int) -> int | None:
        """Keep positions ``0..n_keep-1`` of ``seq_id`` and drop the rest; returns the positions kept, None
        when the cache refuses (``llama_memory_seq_rm`` is False) or the kept part no longer starts at 0
        (a sliding window already dropped its head)."""
        if not C.llama_memory_seq_rm(self._mem, seq_id, n_keep, -1):
            return None
        # why: llama-server's rule; a window of n_swa positions before the resume point must still be there
        if C.llama_memory_seq_pos_min(self._mem, seq_id) > max(0, n_keep - self.model.n_swa if self.model.n_swa else 0):
            return None
        if C.llama_memory_seq_pos_max(self._mem, seq_id) != n_keep - 1:
            return None
        return n_keep

    def seq_n_pos(self, seq_id: int) -> int:
        """Positions ``seq_id`` holds (``llama_memory_seq_pos_max`` + 1; 0 when empty)."""
        return int(C.llama_memory_seq_pos_max(self._mem, seq_id)) + 1

    # KV state of one sequence ------------------------------------------------
    def state_size(self, seq_id: int) -> int:
        return int(C.llama_state_seq_get_size(self._ctx, seq_id))

    def state_get(self, seq_id: int, buffer) -> int:
        """Write seq_id's KV state into ``buffer`` (a writable buffer, e.g. a shared-memory view)."""
        size = memoryview(buffer).nbytes
        n = self._with_bytes(buffer, size, lambda ptr: C.llama_state_seq_get_data(self._ctx, ptr, size, seq_id))
        if n == 0:
            raise WorkerError(f"llama_state_seq_get_data wrote nothing for sequence {seq_id} (buffer {size} bytes)")
        return n

    def state_set(self, seq_id: int, buffer, n_bytes: int) -> int:
        """Load a KV state (from ``llama_state_seq_get_data``) into seq_id."""
        n = self._with_bytes(buffer, n_bytes, lambda ptr: C.llama_state_seq_set_data(self._ctx, ptr, n_bytes, seq_id))
        if n == 0:
            raise WorkerError(f"llama_state_seq_set_data refused {n_bytes} bytes for sequence {seq_id}")
        return n

    @staticmethod
    def _with_bytes(buffer, n_bytes: int, call) -> int:
        """Call ``call(ptr)`` with a uint8 pointer onto ``buffer``, no copy.

        # why: the ctypes array pins the buffer's export; it must be gone before
        # the caller releases the memoryview (the KV arena does so on hand-over).
        """
        ptr = (ctypes.c_uint8 * n_bytes).from_buffer(buffer)
        try:
            return int(call(ptr))
        finally:
            del ptr


@dataclass(frozen=True)
class BuildInfo:
    """What the installed llama.cpp build can do; a field it cannot report is None (NA)."""
    version: str | None               # llama-cpp-python's version
    supports_gpu_offload: bool | None
    system_info: str | None           # llama_print_system_info(): "CUDA : ARCHS = 890 | ... | CPU : SSE3 = 1 | ..."


def build_info(lib=C) -> BuildInfo:
    """Read the build's capabilities from ``lib`` (llama_cpp; tests pass a stand-in).

    Needs no model and no backend initialisation.  An entry point that is
    missing or fails gives None for its field, never an exception.
    """
    try:
        offload = bool(lib.llama_supports_gpu_offload())
    except Exception:
        offload = None
    try:
        info = lib.llama_print_system_info()
        system_info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    except Exception:
        system_info = None
    return BuildInfo(getattr(lib, "__version__", None), offload, system_info)
