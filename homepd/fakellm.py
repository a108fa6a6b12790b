"""A deterministic stand-in for ``homepd.llm``, behind the same interface: no model, no llama.cpp.

For tests of logic that does not depend on numerics (engine, recovery, HTTP,
TUI) in real worker processes, in milliseconds.  Selected with
``EngineConfig(backend="fake")``.

* Tokens are UTF-8 bytes (id = byte + 3); 1 is BOS, 2 is EOS, and with
  ``parse_special`` the texts ``<s>`` and ``</s>`` are those control tokens.
* The "KV cache" of a sequence is the list of tokens it holds, checked for
  contiguous positions, bounded by ``n_ctx`` cells like a unified KV cache.
* The next token is a pure function of the sequence's last tokens and the
  position (printable ASCII), so output is repeatable and a scheduling bug — a
  token fed twice, dropped, or into another sequence — changes it.
* KV state export/import writes the token list (int32) into the caller's
  buffer, so a disaggregated handoff goes through the real shared memory.
* Sampling is ``ReferenceSampler`` (the chain's semantics
  in numpy) over those logits.  Under a grammar the fake writes the grammar's
  shortest sentence (``homepd.structured.gbnf.shortest``), a byte a token, then EOS:
  its output always follows the grammar.  A lazy grammar (a tool call's
  trigger) never triggers: the fake writes its usual text.
"""
from __future__ import annotations

import os
import re
import struct
import time

import numpy as np

from homepd.structured.gbnf import GbnfError, shortest
from homepd.core.terms import ReuseMode, SpecialToken
from homepd.core.sampling import Grammar, SamplingParams, bias_and_penalize, derived_seed
from homepd.errors import ModelError, RequestError, WorkerError

FAKE_MODEL_PATH = "fake://model"
# a model path the fake refuses to load, as llama.cpp refuses a corrupt GGUF (tests of a failed load)
FAKE_BROKEN_PREFIX = "fake://broken"
# a model path whose worker process dies while it loads (tests of a worker crash during a load)
FAKE_CRASH_PREFIX = "fake://crash"
# seconds a fake context takes to create, in its worker process (tests that need a load to last: several models)
LOAD_DELAY_ENV = "HOMEPD_FAKE_LOAD_DELAY_S"
BOS, EOS, N_VOCAB = 1, 2, 259
_MAGIC = b"FAKEKV01"
SPECIAL_TOKENS = (SpecialToken("</s>", EOS), SpecialToken("<s>", BOS))
_SPECIAL_RE = re.compile("(</s>|<s>)")
_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class FakeModel:
    """Tokenizer and vocabulary of the fake backend; ``path`` is recorded, not read."""

    def __init__(self, path: str | os.PathLike = FAKE_MODEL_PATH, n_gpu_layers: int = 0, vocab_only: bool = False):
        if str(path).startswith(FAKE_BROKEN_PREFIX):
            raise ModelError(f"{path}: not a GGUF file (bad magic): the fake's stand-in for a corrupt model")
        self.path = path
        self.n_vocab = N_VOCAB
        self.n_ctx_train = 1 << 16
        self.bos_id, self.eos_id = BOS, EOS
        self.size_bytes = 1 << 20
        self.add_bos = True

    def close(self) -> None:
        pass

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ids = [BOS] if add_special else []
        for i, piece in enumerate(_SPECIAL_RE.split(text) if parse_special else [text]):
            ids += [BOS if piece == "<s>" else EOS] if i % 2 else [b + 3 for b in piece.encode("utf-8")]
        return ids

    def special_tokens(self) -> tuple[SpecialToken, ...]:
        return SPECIAL_TOKENS

    def token_to_piece(self, token: int) -> bytes:
        return bytes([token - 3]) if token >= 3 else b""

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_to_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return {BOS: "<s>", EOS: "</s>"}.get(token, "")

    def chat_template(self) -> str | None:
        return os.environ.get("HOMEPD_FAKE_CHAT_TEMPLATE") or _TEMPLATE

    def check_grammar(self, grammar: Grammar) -> None:
        """RequestError unless the grammar parses and derives a sentence (what the fake will write)."""
        grammar_script(grammar)


def grammar_script(grammar: Grammar) -> list[int]:
    """The tokens the fake writes under ``grammar``: its shortest sentence, a byte a token, then EOS."""
    try:
        return [b + 3 for b in shortest(grammar.gbnf, grammar.root).encode("utf-8")] + [EOS]
    except GbnfError as exc:
        raise RequestError(f"the {grammar.origin} grammar does not parse: {exc}") from None


class FakeSampler:
    """The reference sampler over the fake's logits; under a (non-lazy) grammar, the grammar's script."""

    def __init__(self, ctx: "FakeContext", params: SamplingParams, history: tuple[int, ...] = ()):
        params.check_vocab(N_VOCAB)
        self.ctx, self.params = ctx, params
        self.reference = ReferenceSampler(params, history, eog_ids=(EOS,))
        grammar = params.grammar
        self.script = grammar_script(grammar)[len(history):] if grammar is not None and not grammar.is_lazy \
            else None

    def sample(self, row: int) -> int:
        logits = self.ctx.logits(row)  # why: a missing row fails here as it would in llama.cpp
        if self.script is not None:
            token = self.script.pop(0) if self.script else EOS
            self.reference.history.append(token)
            return token
        return self.reference.sample(logits)


def next_token(tokens: list[int]) -> int:
    """The fake model's greedy choice after ``tokens`` (printable ASCII, never EOS)."""
    a = tokens[-1] if tokens else 0
    b = tokens[-2] if len(tokens) > 1 else 0
    return 3 + 32 + (a * 7 + b * 13 + len(tokens) * 3) % 95


class FakeContext:
    """``n_seq_max`` sequences over ``n_ctx`` cells (unified) or over streams of ``n_ctx / n_seq_max`` cells each;
    ``decode`` validates positions like llama.cpp would."""

    def __init__(self, model: FakeModel, n_ctx: int, n_batch: int, n_seq_max: int, n_threads: int,
                 n_ubatch: int | None = None, kv_unified: bool = True, flash_attn: bool | None = None):
        if str(model.path).startswith(FAKE_CRASH_PREFIX):
            os._exit(3)  # why: the worker dies as a llama.cpp abort would, before it reports ready
        if os.environ.get(LOAD_DELAY_ENV):
            time.sleep(float(os.environ[LOAD_DELAY_ENV]))  # why: a load that lasts, in the worker (never the loop)
        self.model = model
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        self.kv_unified = kv_unified
        self.n_ctx_seq = n_ctx if kv_unified else n_ctx // n_seq_max
        self._seqs: dict[int, list[int]] = {}
        self._cells: dict[int, list[int]] = {}  # per sequence, the cell of each position (shared by seq_copy)
        self._next_cell = 0
        self._rows: list[np.ndarray] = []

    def close(self) -> None:
        self._seqs.clear()

    def decode(self, tokens: list[int], positions: list[int], seq_ids: list[int], wants_logits: list[bool]) -> None:
        n = len(tokens)
        assert 0 < n <= self.n_batch and len(positions) == len(seq_ids) == len(wants_logits) == n
        if self.n_cells_used + n > self.n_ctx:
            raise WorkerError(f"llama_decode returned 1 for a batch of {n} tokens "
                              f"(1 = no KV slot: context {self.n_ctx} too small for what is running)")
        rows = []
        for token, pos, sid, wants in zip(tokens, positions, seq_ids, wants_logits):
            if not 0 <= sid < self.n_seq_max:
                raise WorkerError(f"sequence id {sid} out of range")
            seq = self._seqs.setdefault(sid, [])
            if not self.kv_unified and len(seq) >= self.n_ctx_seq:
                raise WorkerError(f"llama_decode returned 1 for a batch of {n} tokens (1 = no KV slot: sequence "
                                  f"{sid}'s stream of {self.n_ctx_seq} cells is full)")
            if pos != len(seq):
                raise WorkerError(f"fake decode: sequence {sid} holds {len(seq)} tokens, got position {pos}")
            seq.append(int(token))
            self._cells.setdefault(sid, []).append(self._next_cell)
            self._next_cell += 1
            if wants:
                logits = np.zeros(N_VOCAB, dtype=np.float32)
                logits[next_token(seq)] = 10.0
                rows.append(logits)
            else:
                rows.append(None)
        self._rows = rows

    def new_sampler(self, params: SamplingParams, history: tuple[int, ...] = ()) -> FakeSampler:
        return FakeSampler(self, params, history)

    def logits(self, row: int) -> np.ndarray:
        logits = self._rows[row] if 0 <= row < len(self._rows) else None
        if logits is None:
            raise WorkerError(f"no logits for batch row {row}")
        return logits

    def seq_rm(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._cells.pop(seq_id, None)

    reuse_mode = ReuseMode.PREFIX

    @property
    def can_share(self) -> bool:
        return self.kv_unified

    def seq_copy(self, src_id: int, dst_id: int, n_cells: int) -> int:
        assert not self._seqs.get(dst_id)
        self._seqs[dst_id] = self._seqs.get(src_id, [])[:n_cells]
        self._cells[dst_id] = self._cells.get(src_id, [])[:n_cells]
        return len(self._seqs[dst_id])

    def seq_trim(self, seq_id: int, n_keep: int) -> int | None:
        tokens = self._seqs.get(seq_id, [])
        del tokens[n_keep:]
        del self._cells.get(seq_id, [])[n_keep:]
        return len(tokens)

    @property
    def n_cells_used(self) -> int:
        """Cells held by any sequence, each once (what a unified cache has in use)."""
        return len(set().union(*self._cells.values()))

    def seq_n_pos(self, seq_id: int) -> int:
        return len(self._seqs.get(seq_id, ()))

    # KV state of one sequence ------------------------------------------------
    def state_size(self, seq_id: int) -> int:
        return len(_MAGIC) + 4 + 4 * len(self._seqs.get(seq_id, ()))

    def state_get(self, seq_id: int, buffer) -> int:
        tokens = self._seqs.get(seq_id, [])
        data = _MAGIC + struct.pack("<I", len(tokens)) + np.asarray(tokens, dtype="<i4").tobytes()
        view = memoryview(buffer).cast("B")
        if len(data) > view.nbytes:
            raise WorkerError(f"state_get: buffer of {view.nbytes} bytes, state is {len(data)}")
        view[:len(data)] = data
        return len(data)

    def state_set(self, seq_id: int, buffer, n_bytes: int) -> int:
        data = bytes(memoryview(buffer).cast("B")[:n_bytes])
        if data[:len(_MAGIC)] != _MAGIC:
            raise WorkerError(f"llama_state_seq_set_data refused {n_bytes} bytes for sequence {seq_id}")
        (count,) = struct.unpack_from("<I", data, len(_MAGIC))
        self._seqs[seq_id] = np.frombuffer(data, dtype="<i4", count=count, offset=len(_MAGIC) + 4).tolist()
        self._cells[seq_id] = list(range(self._next_cell, self._next_cell + count))
        self._next_cell += count
        return n_bytes


FAKE_EMBEDDING_PATH = "fake://embedding"
FAKE_N_EMBD, FAKE_EMBED_CTX, FAKE_EMBED_VOCAB = 384, 512, 30522
_WORD_RE = re.compile(r"[a-z0-9]+")
# why: a few words that tests' paraphrases swap, so the fake's vectors rank a paraphrase like a real model
_SYNONYMS = {"couch": "sofa", "naps": "sleeping", "kids": "children", "automobile": "car", "purchased": "bought"}


class FakeEmbedder:
    """The embedding backend's stand-in: a word is a token (its id a hash), an input's vector the mean of its
    words' fixed random vectors, L2-normalised; inputs sharing words are near, so paraphrases rank above
    unrelated pairs, as a real model ranks them.  ``[CLS]`` is 101 and ``[SEP]`` 102, as in BERT."""

    def __init__(self, path: str | os.PathLike = FAKE_EMBEDDING_PATH, n_threads: int = 1, n_gpu_layers: int = 0):
        self.path = path
        self.n_embd, self.n_ctx_train = FAKE_N_EMBD, FAKE_EMBED_CTX
        self.n_vocab = FAKE_EMBED_VOCAB
        self._rows: dict[int, np.ndarray] = {}

    def close(self) -> None:
        pass

    def tokenize(self, text: str) -> list[int]:
        words = [_SYNONYMS.get(w, w) for w in _WORD_RE.findall(text.lower())]
        return [101, *(1000 + int.from_bytes(w.encode()[:8].ljust(8, b"\0"), "little") % 29_000 for w in words), 102]

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        out = np.stack([np.mean([self._row(t) for t in ids], axis=0) for ids in inputs]).astype(np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def _row(self, token: int) -> np.ndarray:
        if token not in self._rows:
            self._rows[token] = np.random.default_rng(token).standard_normal(FAKE_N_EMBD)
        return self._rows[token]


class ReferenceSampler:
    """The chain's semantics over a logits row, in numpy (the fake backend's sampler): slow on a real
    vocabulary (a sort per token), which is why the real path runs llama.cpp's chain.

    ``history``: tokens this request generated before this sampler existed (they count for the penalties).
    ``eog_ids``: the vocabulary's end-of-generation tokens, banned under ``ignore_eos``.
    The grammar is not applied here: the fake backend drives a grammar itself (``homepd.fakellm``).
    """

    def __init__(self, params: SamplingParams, history: tuple[int, ...] = (), eog_ids: tuple[int, ...] = ()):
        self.params = params
        self.banned = list(eog_ids) if params.ignore_eos else []
        self.rng = np.random.default_rng(derived_seed(params.seed, len(history)))
        self.history: list[int] = list(history)

    def adjusted(self, logits: np.ndarray) -> np.ndarray:
        """The logits after ``ignore_eos``'s ban, logit bias and penalties (what greedy takes the argmax of)."""
        z = logits.astype(np.float64, copy=True)
        z[self.banned] = -np.inf
        bias_and_penalize(z, self.params, self.history)
        return z

    def sample(self, logits: np.ndarray) -> int:
        token = self._draw(logits)
        self.history.append(token)
        return token

    def _draw(self, logits: np.ndarray) -> int:
        p = self.params
        z = self.adjusted(logits)
        if p.is_greedy:
            return int(np.argmax(z))
        order = np.argsort(-z, kind="stable")
        if p.top_k and p.top_k < order.size:
            order = order[:p.top_k]
        cand = z[order]
        finite = np.isfinite(cand)
        order, cand = order[finite], cand[finite]
        if p.top_p < 1.0 or p.min_p > 0.0:
            probs = np.exp(cand - cand[0])
            probs /= probs.sum()
            n = cand.size
            if p.top_p < 1.0:
                n = min(n, int(np.searchsorted(np.cumsum(probs), p.top_p) + 1))
            if p.min_p > 0.0:
                n = min(n, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
            order, cand = order[:n], cand[:n]
        scaled = cand / p.temperature
        probs = np.exp(scaled - scaled[0])
        probs /= probs.sum()
        return int(order[self.rng.choice(order.size, p=probs)])
