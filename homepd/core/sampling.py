"""Sampling parameters, grammars and token log-probabilities (pure numpy).

What a request asks of its sampler is ``SamplingParams``: the chain llama.cpp runs for it (``homepd.llm.sampler``),
in this order, is logit bias, penalties (repeat / presence / frequency over the last ``repeat_last_n`` generated
tokens), top-k, top-p, min-p, temperature, then the seeded draw; a ``Grammar`` (structured output, tool calls)
restricts the draw to the tokens it allows.  Greedy (``temperature == 0``) is argmax after bias and penalties.

``homepd.fakellm.ReferenceSampler`` is the same semantics in numpy, for the fake backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from homepd.errors import RequestError

MAX_STOP_STRINGS = 32     # Continue sends 9-14; the cost per token is benchmarks/sampling_cost.py's
MAX_TOP_LOGPROBS = 20     # OpenAI's limit
MAX_LOGIT_BIAS = 1024     # entries of logit_bias
MIN_TEMPERATURE = 1e-3    # below it (but above 0) logits/temperature overflow; 0 means greedy
BAN_BIAS = -100.0         # OpenAI: -100 bans a token; homepd makes it exact (-inf), as llama-server does for false
MAX_REPEAT_LAST_N = 1 << 16


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar the sampled text must follow (llama.cpp's grammar sampler).

    ``trigger_patterns`` make it lazy: free text until one of the regexes matches the text generated so far,
    then the grammar applies from the start of the match's first capture group (the whole match if it has
    none), as ``llama_sampler_init_grammar_lazy_patterns`` does: a tool call's opening marker.
    ``origin`` says what asked for it (``json_schema``, ``json_object``, ``tools``, ``grammar``), for errors
    and metrics."""
    gbnf: str
    origin: str = "grammar"
    root: str = "root"
    trigger_patterns: tuple[str, ...] = ()

    @property
    def is_lazy(self) -> bool:
        return bool(self.trigger_patterns)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's distribution (before the sampler's cuts, as
    OpenAI and llama-server report it), with the ``top`` most likely tokens: (id, bytes, logprob)."""
    token: int
    piece: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0           # 0 = off
    top_p: float = 1.0       # 1 = off
    min_p: float = 0.0       # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False         # never end: every end-of-generation token is banned (llama-server's meaning)
    repeat_penalty: float = 1.0      # 1 = off (llama.cpp's penalty_repeat)
    repeat_last_n: int = 64          # the penalties look at this many of the latest generated tokens (0 = off)
    presence_penalty: float = 0.0    # OpenAI's, -2..2
    frequency_penalty: float = 0.0   # OpenAI's, -2..2
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias); <= -100 bans the token
    n_logprobs: int | None = None    # None: no log-probabilities; k: the sampled token's and the top k
    grammar: Grammar | None = None

    def validated(self) -> "SamplingParams":
        """Return self if every field is in range, else raise RequestError naming the field."""
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"bad sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0 \
                or 0 < self.temperature < MIN_TEMPERATURE:
            raise bad("temperature", f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 = off)")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1] (0 = off)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer or None")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if not _is_number(self.repeat_penalty) or not (0.0 < self.repeat_penalty <= 10.0):
            raise bad("repeat_penalty", "must be in (0, 10] (1 = off)")
        if not _is_int(self.repeat_last_n) or not 0 <= self.repeat_last_n <= MAX_REPEAT_LAST_N:
            raise bad("repeat_last_n", f"must be an integer in 0..{MAX_REPEAT_LAST_N} (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2] (0 = off)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0 or not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"entry {token!r}: {bias!r} must map a token id >= 0 to a bias in "
                                        "[-100, 100]")
        if self.n_logprobs is not None and (not _is_int(self.n_logprobs)
                                            or not 0 <= self.n_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("n_logprobs", f"must be None or an integer in 0..{MAX_TOP_LOGPROBS}")
        if self.grammar is not None and not (isinstance(self.grammar, Grammar) and self.grammar.gbnf.strip()):
            raise bad("grammar", "must be a non-empty Grammar")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that changes the argmax: the fast path (one argmax, no chain)."""
        return self.is_greedy and not self.has_penalties and not self.logit_bias and self.grammar is None

    def check_vocab(self, n_vocab: int) -> None:
        """Raise RequestError when a logit_bias token is not in a vocabulary of ``n_vocab`` tokens."""
        for token, _ in self.logit_bias:
            if token >= n_vocab:
                raise RequestError(f"logit_bias: token {token} is not in this model's vocabulary "
                                   f"(ids 0..{n_vocab - 1})")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def derived_seed(seed: int | None, n_generated: int) -> int | None:
    """The 32-bit seed of a sampler that starts after ``n_generated`` tokens of a request seeded ``seed``
    (None: unseeded).  # why: a sampler that moves with its request (a KV handoff, a resume) is rebuilt,
    not copied; deriving its seed keeps a seeded request reproducible wherever it continues."""
    if seed is None:
        return None
    x = (seed * 0x9E3779B97F4A7C15 + n_generated * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & 0xFFFFFFFF


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - math.log(float(np.exp(z).sum()))


def top_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` and the ``k`` most likely (id, logprob), most likely first, under
    the softmax of the raw ``logits``."""
    lp = log_softmax(logits)
    if k <= 0:
        return float(lp[token]), []
    top = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
    top = top[np.argsort(-lp[top], kind="stable")]
    return float(lp[token]), [(int(t), float(lp[t])) for t in top]


def bias_and_penalize(z: np.ndarray, params: SamplingParams, history) -> None:
    """Apply ``params``' logit bias, then its penalties over the latest ``repeat_last_n`` of ``history``, to the
    logits row ``z`` in place, as llama.cpp's logit-bias and penalties samplers do (a repeated token's logit is
    divided by ``repeat_penalty`` when positive, multiplied when not, then lowered by count x frequency and by
    presence).  # why: in place on the few tokens concerned, not over the whole vocabulary: llama.cpp's
    penalties sampler looks every candidate up in a hash map (3.6 ms a token on a 49k vocabulary here)."""
    for token, bias in params.logit_bias:
        if token < z.size:
            z[token] = -np.inf if bias <= BAN_BIAS else z[token] + bias
    if params.has_penalties and len(history):
        ids, counts = np.unique(np.asarray(history[-params.repeat_last_n:]), return_counts=True)
        keep = ids < z.size
        ids, counts = ids[keep], counts[keep]
        v = z[ids]
        v = np.where(v <= 0, v * params.repeat_penalty, v / params.repeat_penalty)
        z[ids] = v - counts * params.frequency_penalty - params.presence_penalty
