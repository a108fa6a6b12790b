"""Seeded benchmark traces: a prompt mix on an arrival process.

Mixes: ``short`` — chat questions (class interactive, 32-128 output tokens);
``long`` — a document passage of about ``long_tokens`` tokens to summarise
(class background, 64-160 output tokens); ``mixed`` — every fourth request
(the 2nd, 6th, 10th, ...) long, the rest short.  Those are one-turn chats.
``chat`` (multi-turn conversations with think time) and ``rag`` (several
questions about each of a few documents): ``conversations``.

Reproducible: one seed gives the same trace, byte for byte.  Arrivals, prompts
and output lengths draw from separate streams, so changing the rate or the
arrival process leaves the prompts and output lengths as they were (a rate
sweep compares like with like).
"""
from __future__ import annotations

import math
import random

from homepd.errors import ConfigError
from homepd.measure.trace import corpus
from homepd.measure.trace.arrivals import arrival_offsets
from homepd.measure.trace.conversations import CHAT_THINK_S, CHAT_TURNS, RAG_DOCUMENTS, make_chat, make_rag
from homepd.measure.trace.model import CHARS_PER_TOKEN, CLASS_OF_KIND, Trace, TraceRequest

MIXES = ("short", "long", "mixed", "chat", "rag")
OUTPUT_TOKENS = {"short": (32, 128), "long": (64, 160)}  # inclusive range per kind, when max_tokens is not fixed
DEFAULT_LONG_TOKENS = 400  # about 400 SmolLM2 tokens (+ the chat template): fits n_ctx 512 with room to answer
MIXED_LONG_EVERY = 4


def make_trace(mix: str = "mixed", n_requests: int = 8, rate_per_s: float = 2.0, *, arrival: str = "poisson",
               burstiness: float = 1.0, concurrency: int | None = None, max_tokens: int | None = None,
               long_tokens: int = DEFAULT_LONG_TOKENS, ignore_eos: bool = True, seed: int = 0,
               name: str | None = None, turns: int = CHAT_TURNS, think_s: float = CHAT_THINK_S,
               documents: int = RAG_DOCUMENTS, long_share: float | None = None) -> Trace:
    """A seeded benchmark trace.

    ``arrival``/``rate_per_s``/``burstiness``: the open-loop arrival process
    (see ``arrivals``); ``concurrency``: a closed loop of that many requests in
    flight instead (arrival offsets all 0).  ``max_tokens``: every request's
    output budget, else drawn per kind from ``OUTPUT_TOKENS``.  ``long_tokens``:
    the estimated size of a long prompt (and of a ``rag`` document).
    ``long_share`` (``mixed``): each request long with this probability (its
    own seeded stream) instead of every fourth one (what-if: "documents are
    half my requests").
    ``ignore_eos``: requests generate exactly their ``max_tokens`` (vLLM's
    ``--ignore-eos``), the default for a benchmark.  ``chat``: ``n_requests``
    turns in conversations of ``turns``, ``rate_per_s`` conversations per
    second, think times of mean ``think_s``; ``rag``: ``n_requests`` questions
    about ``documents`` passages.
    """
    if mix not in MIXES:
        raise ConfigError(f"trace mix must be one of {', '.join(MIXES)}, got {mix!r}")
    if n_requests < 1:
        raise ConfigError(f"a trace needs at least one request, got {n_requests}")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    if long_tokens < 32:
        raise ConfigError(f"long_tokens must be >= 32, got {long_tokens}")
    if concurrency is not None and concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    if mix in ("chat", "rag"):
        return _shared_prefix_trace(mix, n_requests, rate_per_s, arrival=arrival, burstiness=burstiness,
                                    concurrency=concurrency, max_tokens=max_tokens, long_tokens=long_tokens,
                                    ignore_eos=ignore_eos, seed=seed, name=name, turns=turns, think_s=think_s,
                                    documents=documents)
    if concurrency is None:
        offsets = arrival_offsets(n_requests, rate_per_s, random.Random(f"{seed}/arrivals"), arrival=arrival,
                                  burstiness=burstiness)
    else:
        offsets = [0.0] * n_requests
    prompts = random.Random(f"{seed}/prompts")
    outputs = random.Random(f"{seed}/outputs")
    questions = _shuffled_cycle(corpus.chat_questions(), prompts)
    kinds = random.Random(f"{seed}/kinds")
    if long_share is not None and not 0.0 <= long_share <= 1.0:
        raise ConfigError(f"long_share must be in 0..1, got {long_share}")
    requests = []
    for i, t in enumerate(offsets):
        if mix == "mixed" and long_share is not None:
            is_long = kinds.random() < long_share
        else:
            is_long = mix == "long" or (mix == "mixed" and i % MIXED_LONG_EVERY == 1)
        kind = "long" if is_long else "short"
        content = _summary_request(prompts, long_tokens) if kind == "long" else next(questions)
        requests.append(TraceRequest(
            arrival_s=t, messages=({"role": "user", "content": content},),
            max_tokens=max_tokens or outputs.randint(*OUTPUT_TOKENS[kind]), kind=kind,
            request_class=CLASS_OF_KIND[kind], ignore_eos=ignore_eos))
    generator = {"mix": mix, "n_requests": n_requests, "max_tokens": max_tokens, "long_tokens": long_tokens,
                 "ignore_eos": ignore_eos, **({"long_share": long_share} if long_share is not None else {})}
    return _trace(requests, generator, name or mix, seed, concurrency, arrival, rate_per_s, burstiness)


def _shared_prefix_trace(mix: str, n_requests: int, rate_per_s: float, *, arrival: str, burstiness: float,
                         concurrency: int | None, max_tokens: int | None, long_tokens: int, ignore_eos: bool,
                         seed: int, name: str | None, turns: int, think_s: float, documents: int) -> Trace:
    """A ``chat`` or ``rag`` trace; with ``concurrency``, a closed loop of that many conversations (chat) or
    requests (rag) in flight."""
    common = dict(arrival=arrival, burstiness=burstiness, output_tokens=OUTPUT_TOKENS["short"],
                  max_tokens=max_tokens, ignore_eos=ignore_eos, seed=seed)
    if mix == "chat":
        requests = make_chat(n_requests, rate_per_s, turns=turns, think_s=think_s, **common)
        shape = {"turns": turns, "think_s": think_s}
    else:
        requests = make_rag(n_requests, rate_per_s, documents=documents, long_tokens=long_tokens, **common)
        shape = {"documents": documents, "long_tokens": long_tokens}
    generator = {"mix": mix, "n_requests": n_requests, "max_tokens": max_tokens, "ignore_eos": ignore_eos, **shape}
    return _trace(requests, generator, name or mix, seed, concurrency, arrival, rate_per_s, burstiness)


def _trace(requests, generator: dict, name: str, seed: int, concurrency: int | None, arrival: str,
           rate_per_s: float, burstiness: float) -> Trace:
    """The trace, its generator record completed with how it arrives: the open-loop process, or the closed
    loop's concurrency."""
    if concurrency is None:
        generator.update(arrival=arrival, rate_per_s="inf" if math.isinf(rate_per_s) else rate_per_s,
                         burstiness=burstiness)
    else:
        generator.update(concurrency=concurrency)
    return Trace(tuple(requests), name=name, seed=seed, concurrency=concurrency, generator=generator)


def _summary_request(rng: random.Random, long_tokens: int) -> str:
    return corpus.passage(rng, round(long_tokens * CHARS_PER_TOKEN),
                          head='Summarise this passage from "{title}" in a few sentences.\n\n')


def _shuffled_cycle(items, rng: random.Random):
    while True:
        order = list(items)
        rng.shuffle(order)
        yield from order
