"""Arrival traces: the same requests at the same offsets, for any architecture.

Pure and seeded: a trace is a list of ``TraceRequest`` (arrival offset,
prompt text, max_tokens); ``make_trace`` builds the short / long / mixed
presets from a deterministic text source so both architectures see
byte-identical prompts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from homepd.errors import ConfigError

PRESETS = ("short", "long", "mixed")

_TOPICS = ["the sea", "a mountain village", "an old library", "a night train", "a robot gardener",
           "the first winter", "a lost map", "a market at dawn"]
_SENTENCES = [
    "The report describes how the system was built, what was measured and what was left out.",
    "Each section lists the inputs, the expected outputs and the checks that were run.",
    "Measurements were taken on a small home server with two cores and no accelerator.",
    "The team compared several designs and kept the one that met both latency targets.",
    "Logs from every run were stored so that the evidence could be inspected later.",
    "A long document like this one is typical of retrieval-augmented prompts.",
]


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float     # offset from the start of the run
    prompt: str
    max_tokens: int
    kind: str            # "short" | "long"

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as a one-turn chat (instruct models answer it; raw text often ends at once)."""
        return [{"role": "user", "content": self.prompt}]


def _short_prompt(rng: random.Random) -> str:
    return f"Write two sentences about {rng.choice(_TOPICS)}."


def _long_prompt(rng: random.Random, n_sentences: int) -> str:
    body = " ".join(rng.choice(_SENTENCES) for _ in range(n_sentences))
    return f"Read this document and summarise it in one sentence.\n\n{body}\n\nSummary:"


def make_trace(preset: str = "mixed", n_requests: int = 8, rate_per_s: float = 2.0, max_tokens: int = 32,
               long_sentences: int = 24, seed: int = 0) -> list[TraceRequest]:
    """A seeded trace: Poisson arrivals at ``rate_per_s``; 'mixed' is 1 long prompt in 4."""
    if preset not in PRESETS:
        raise ConfigError(f"trace preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if n_requests < 1 or rate_per_s <= 0 or max_tokens < 1 or long_sentences < 1:
        raise ConfigError("trace needs n_requests >= 1, rate_per_s > 0, max_tokens >= 1, long_sentences >= 1")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n_requests):
        is_long = preset == "long" or (preset == "mixed" and i % 4 == 1)
        prompt = _long_prompt(rng, long_sentences) if is_long else _short_prompt(rng)
        out.append(TraceRequest(arrival_s=round(t, 4), prompt=prompt, max_tokens=max_tokens,
                                kind="long" if is_long else "short"))
        t += rng.expovariate(rate_per_s)
    return out
