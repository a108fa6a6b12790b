"""A service's recorded traffic as a trace: the same arrivals, lengths, classes and prefix structure.

``homepd serve`` records each request as a ``RecordedRequest`` (no text unless
asked).  ``traffic_trace`` turns a window of them into a ``Trace`` that
``homepd advise`` replays on every candidate:

* arrivals at the recorded offsets (from the first request of the window),
  or scaled to another mean rate (``trace_at_rate``), the order kept;
* each prompt synthetic text of exactly the recorded prompt token count
  (raw text, no chat template: the recorded count already holds the
  template's tokens), built from *units* that are one token each for the
  model's tokenizer (``one_token_units``), so lengths are exact, not
  estimated;
* prefixes: a request whose first N tokens an earlier request of the window
  began with (``prefix_parent``) starts with that request's first N tokens,
  then differs; a prefix first seen before the window is replayed as fresh
  text (the replay starts cold);
* outputs: the recorded output token count, with ``ignore_eos``.

Longer traces (a capacity probe that needs more requests than the window
holds) repeat the window, each repetition with fresh text and the same
structure.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

from homepd.core.terms import RequestClass
from homepd.core.records import FinishReason
from homepd.measure.trace.model import LONG_PROMPT_TOKENS, Trace, TraceError, TraceRequest

# why: these are one token in the BPE vocabularies of the models homepd serves (a leading space
# starts a word, so a sequence of them never merges); single letters serve byte-level tokenizers (the fake)
WORD_UNITS = tuple(" " + w for w in (
    "the of and to in is that for it was on with as at by from this be are or an not but all have one "
    "we they you he she his her more can will if so no when what which up out about time new").split())
LETTER_UNITS = tuple("abcdefghijklmnopqrstuvwxyz")
DEFAULT_OVERHEAD_TOKENS = 1  # a raw prompt's BOS


class Tokenizer(Protocol):
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...


class Route(str, enum.Enum):
    """Which OpenAI route a recorded request came by."""
    CHAT = "chat"                  # /v1/chat/completions
    COMPLETIONS = "completions"    # /v1/completions

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RecordedRequest:
    """One request as ``homepd serve`` recorded it (a row of the store's ``traffic`` table)."""
    request_id: str
    arrived_unix_s: float                # wall time of arrival
    n_prompt_tokens: int                 # after the chat template: what the engine prefilled
    n_output_tokens: int
    request_class: RequestClass = RequestClass.INTERACTIVE
    route: Route = Route.CHAT
    finish_reason: FinishReason | None = None
    max_tokens: int | None = None        # what the request allowed
    n_prefix_tokens: int = 0             # leading tokens an earlier prompt began with (whole blocks)
    prefix_parent: str | None = None     # the request id of that earlier prompt
    n_cached_tokens: int = 0             # what the engine's prefix cache reused (may differ: evictions)
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    service_id: str = ""
    arrived_at: str = ""                 # arrived_unix_s as ISO 8601 UTC
    prompt_text: str | None = None       # only with serve --record-text
    slo_met: bool | None = None          # met every SLO target of its class (None: not judged)

    def __post_init__(self):  # why: rows come back from sqlite as plain strings
        object.__setattr__(self, "request_class", RequestClass.parse(self.request_class))
        object.__setattr__(self, "route", Route(self.route))
        object.__setattr__(self, "finish_reason", FinishReason.parse(self.finish_reason))
        if self.slo_met is not None:
            object.__setattr__(self, "slo_met", bool(self.slo_met))


@dataclass(frozen=True)
class TextUnits:
    """Strings that are one token each, alone and in any sequence, for one tokenizer, and the special
    tokens a raw prompt gets besides (its BOS)."""
    units: tuple[str, ...] = WORD_UNITS
    overhead_tokens: int = DEFAULT_OVERHEAD_TOKENS


def one_token_units(tokenizer: Tokenizer | None) -> TextUnits:
    """The ``TextUnits`` of ``tokenizer`` (checked on a seeded sequence of 256); without one, the word units
    with one BOS (right for the BPE models homepd serves)."""
    if tokenizer is None:
        return TextUnits()
    rng = random.Random(0)
    for family in (WORD_UNITS, LETTER_UNITS):
        units = tuple(u for u in family
                      if len(tokenizer.tokenize(u, add_special=False, parse_special=False)) == 1)
        if len(units) < 8:
            continue
        probe = "".join(rng.choice(units) for _ in range(256))
        if len(tokenizer.tokenize(probe, add_special=False, parse_special=False)) == 256:
            overhead = len(tokenizer.tokenize(probe, add_special=True, parse_special=False)) - 256
            return TextUnits(units, overhead)
    raise TraceError("found no one-token text units for this model's tokenizer: recorded traffic cannot be "
                     "replayed at its exact lengths on it")


def traffic_trace(recorded: Sequence[RecordedRequest], *, rate_rps: float | None = None,
                  n_requests: int | None = None, units: TextUnits | None = None, seed: int = 0,
                  name: str = "traffic") -> Trace:
    """The replay of ``recorded`` (in arrival order): see the module docstring.  ``rate_rps``: scale the
    arrivals to that mean rate (None: as recorded); ``n_requests``: repeat or cut the window to that many;
    ``units``: the replaying model's ``one_token_units`` (default: the word units); ``seed``: the text only
    (the schedule, lengths and prefix structure are the recording's whatever the seed)."""
    if not recorded:
        raise TraceError("no recorded requests to replay")
    recorded = sorted(recorded, key=lambda r: r.arrived_unix_s)
    units, overhead = (units or TextUnits()).units, (units or TextUnits()).overhead_tokens
    n = len(recorded) if n_requests is None else n_requests
    if n < 1:
        raise TraceError(f"a trace needs at least one request, got n_requests={n}")
    t0 = recorded[0].arrived_unix_s
    span_s = recorded[-1].arrived_unix_s - t0
    period_s = span_s + (span_s / (len(recorded) - 1) if len(recorded) > 1 else 1.0)
    index_of = {r.request_id: i for i, r in enumerate(recorded)}
    words: list[list[str]] = []
    requests = []
    for k in range(n):
        cycle, i = divmod(k, len(recorded))
        rec = recorded[i]
        rng = random.Random(f"{seed}/{cycle}/{i}")
        n_units = max(1, rec.n_prompt_tokens - overhead)
        parent = index_of.get(rec.prefix_parent) if rec.prefix_parent is not None else None
        shared: list[str] = []
        avoid = None
        if parent is not None and parent < i:
            parent_words = words[cycle * len(recorded) + parent]
            shared = parent_words[:max(0, min(rec.n_prefix_tokens - overhead, n_units, len(parent_words)))]
            avoid = parent_words[len(shared)] if shared and len(shared) < len(parent_words) else None
        own = list(shared)
        while len(own) < n_units:
            unit = rng.choice(units)
            if unit == avoid and len(own) == len(shared):
                continue  # why: the prompt must differ where its parent's prefix ends, or the prefix grows
            own.append(unit)
        words.append(own)
        kind = "long" if rec.n_prompt_tokens >= LONG_PROMPT_TOKENS else "short"
        requests.append(TraceRequest(
            arrival_s=round(cycle * period_s + rec.arrived_unix_s - t0, 4), prompt="".join(own),
            max_tokens=max(1, rec.n_output_tokens), kind=kind,
            request_class=rec.request_class,
            ignore_eos=True))
    trace = Trace(tuple(requests), name=name, seed=seed, generator={
        "source": "recorded traffic", "n_recorded": len(recorded), "first_arrival_unix_s": t0,
        "span_s": span_s, "units_overhead_tokens": overhead})
    return trace if rate_rps is None else trace_at_rate(trace, rate_rps)


def observed_rate_rps(trace: Trace) -> float | None:
    """The trace's mean arrival rate, (n - 1) / span; None when it has fewer than 2 requests or no span."""
    if len(trace) < 2:
        return None
    span_s = max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace)
    return (len(trace) - 1) / span_s if span_s > 0 else None


def trace_at_rate(trace: Trace, rate_rps: float) -> Trace:
    """``trace`` with its arrival offsets scaled so that its mean rate is ``rate_rps``: the same requests in
    the same order with the same relative gaps (burstiness kept).  Raises ``TraceError`` for a trace whose
    rate is undefined (fewer than 2 requests, all at one instant) or a rate that is not a positive number."""
    if not (isinstance(rate_rps, (int, float)) and rate_rps > 0 and math.isfinite(rate_rps)):
        raise TraceError(f"a trace's rate must be a finite number > 0 req/s, got {rate_rps!r}")
    observed = observed_rate_rps(trace)
    if observed is None:
        raise TraceError(f"trace {trace.name!r} has no arrival rate to scale ({len(trace)} request(s), "
                         "arriving at one instant or fewer than two)")
    factor = observed / rate_rps
    scaled = tuple(dataclasses.replace(r, arrival_s=round(r.arrival_s * factor, 4)) for r in trace)
    return Trace(scaled, name=trace.name, seed=trace.seed, concurrency=trace.concurrency,
                 generator={**trace.generator, "rate_per_s": rate_rps, "scaled_from_rate_per_s": observed})

