"""Sampling parameters and the token sampler (pure numpy, no llama_cpp).

Greedy when ``temperature == 0``; otherwise temperature, then top-k, then
top-p over the softmax, drawn from a per-request generator seeded with
``seed`` so a seeded request is reproducible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from homepd.errors import RequestError

MAX_STOP_STRINGS = 8
MIN_TEMPERATURE = 1e-3  # below it (but above 0) logits/temperature overflow; 0 means greedy


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False

    def validated(self) -> "SamplingParams":
        """Return self if every field is in range, else raise RequestError naming the field."""
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"bad sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0 \
                or 0 < self.temperature < MIN_TEMPERATURE:
            raise bad("temperature", f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 = off)")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer or None")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class TokenSampler:
    """Samples one token from a logits row according to ``SamplingParams``."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> int:
        p = self.params
        if p.is_greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < scaled.size:
            candidates = np.argpartition(scaled, -p.top_k)[-p.top_k:]
        else:
            candidates = np.arange(scaled.size)
        cand_logits = scaled[candidates]
        order = np.argsort(-cand_logits)
        candidates, cand_logits = candidates[order], cand_logits[order]
        probs = np.exp(cand_logits - cand_logits[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
        return int(candidates[self.rng.choice(candidates.size, p=probs)])
