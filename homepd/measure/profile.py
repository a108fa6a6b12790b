"""The live traffic profile: what a service has been serving lately, over rolling windows (5 min, 1 h, 24 h).

Pure and bounded: each window is a ring of ``n_buckets`` time buckets (a window of 5 minutes keeps 30 buckets
of 10 s), each bucket a tally of counts and token sums plus two log-spaced histograms (prompt and output
tokens, ``TOKEN_BINS_PER_OCTAVE`` bins per doubling: a quantile read from them is within 9 % of the exact
one).  Memory does not grow with traffic: ``len(windows) * n_buckets`` tallies at most.

    profile = TrafficProfile(windows_s=(300, 3600, 86400), since_unix_s=now)
    profile.arrive(arrived_unix_s, request_class)    # as a request asks (optional: its rate counts then)
    profile.observe(FinishedRequest(arrived_unix_s, request_class, n_prompt_tokens, n_output_tokens, ...))
    profile.window(300, now_unix_s) -> WindowProfile   # rate per class, token quantiles, shares, SLO attainment

The rate counts a request in the bucket of its arrival: as it arrives when the caller says so (``arrive``), so
that a backlog or refused requests show as soon as they are asked for, not as they end; else when it ends
(a profile rebuilt from the store's traffic table).  A bucket counts, per class, the larger of the two, so a
request told both ways counts once.

Times are wall-clock Unix seconds, so that a profile rebuilt from the store after a restart lines up with
the one before it.  The interference index is not in the tallies: the caller passes its live reading.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from homepd.core.terms import RequestClass
from homepd.measure.trace.model import LONG_PROMPT_TOKENS

DEFAULT_WINDOWS_S = (300.0, 3600.0, 86_400.0)
N_BUCKETS = 30
TOKEN_BINS_PER_OCTAVE = 4
N_TOKEN_BINS = 1 + 20 * TOKEN_BINS_PER_OCTAVE   # up to 2 ** 20 tokens; larger counts share the last bin
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class FinishedRequest:
    """What the profile keeps of one finished request (the service's view, or a row of the traffic table)."""
    arrived_unix_s: float
    request_class: RequestClass
    n_prompt_tokens: int
    n_output_tokens: int
    n_cached_tokens: int = 0
    slo_met: bool | None = None     # None: not judged (a row recorded before the SLO was kept)

    @classmethod
    def of(cls, lc, slo_met: bool | None, now_unix_s: float, now_monotonic_s: float) -> "FinishedRequest":
        """A finished ``Lifecycle`` (its times on the monotonic clock) placed on the wall clock."""
        return cls(now_unix_s - (now_monotonic_s - lc.arrived_s), lc.request_class, lc.n_prompt_tokens,
                   len(lc.token_times_s), lc.n_cached_tokens, slo_met)


def token_bin(n_tokens: int) -> int:
    """The histogram bin of a token count: 0 for 0, then ``TOKEN_BINS_PER_OCTAVE`` bins per doubling."""
    if n_tokens <= 0:
        return 0
    return min(N_TOKEN_BINS - 1, 1 + int(math.log2(n_tokens) * TOKEN_BINS_PER_OCTAVE))


def bin_value(b: int) -> float:
    """The token count a bin stands for (the geometric middle of its range)."""
    return 0.0 if b == 0 else 2.0 ** ((b - 1 + 0.5) / TOKEN_BINS_PER_OCTAVE)


@dataclass
class Tally:
    """Counts and sums of the requests in one bucket (or several, merged)."""
    n_by_class: dict[RequestClass, int] = field(default_factory=dict)
    met_by_class: dict[RequestClass, int] = field(default_factory=dict)
    judged_by_class: dict[RequestClass, int] = field(default_factory=dict)
    n_long: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    prompt_hist: list[int] = field(default_factory=lambda: [0] * N_TOKEN_BINS)
    output_hist: list[int] = field(default_factory=lambda: [0] * N_TOKEN_BINS)
    arrived_by_class: dict[RequestClass, int] = field(default_factory=dict)  # told as they arrived (``arrive``)

    @property
    def n_requests(self) -> int:
        return sum(self.n_by_class.values())

    def offered_by_class(self) -> dict[RequestClass, int]:
        """Requests that arrived in this bucket, per class: as told on arrival, or as finished if more."""
        return {c: max(self.arrived_by_class.get(c, 0), self.n_by_class.get(c, 0))
                for c in {*self.arrived_by_class, *self.n_by_class}}

    def add(self, r: FinishedRequest) -> None:
        c = r.request_class
        self.n_by_class[c] = self.n_by_class.get(c, 0) + 1
        if r.slo_met is not None:
            self.judged_by_class[c] = self.judged_by_class.get(c, 0) + 1
            self.met_by_class[c] = self.met_by_class.get(c, 0) + int(r.slo_met)
        self.n_long += r.n_prompt_tokens >= LONG_PROMPT_TOKENS
        self.prompt_tokens += r.n_prompt_tokens
        self.output_tokens += r.n_output_tokens
        self.cached_tokens += min(r.n_cached_tokens, r.n_prompt_tokens)
        self.prompt_hist[token_bin(r.n_prompt_tokens)] += 1
        self.output_hist[token_bin(r.n_output_tokens)] += 1

    def merge(self, other: "Tally") -> None:
        for mine, theirs in ((self.n_by_class, other.n_by_class), (self.met_by_class, other.met_by_class),
                             (self.judged_by_class, other.judged_by_class),
                             (self.arrived_by_class, other.arrived_by_class)):
            for c, n in theirs.items():
                mine[c] = mine.get(c, 0) + n
        self.n_long += other.n_long
        self.prompt_tokens += other.prompt_tokens
        self.output_tokens += other.output_tokens
        self.cached_tokens += other.cached_tokens
        for b in range(N_TOKEN_BINS):
            self.prompt_hist[b] += other.prompt_hist[b]
            self.output_hist[b] += other.output_hist[b]


def hist_quantile(hist: list[int], q: float) -> float | None:
    """The ``q`` quantile of a token histogram (a bin's value); None when it is empty."""
    total = sum(hist)
    if not total:
        return None
    rank, seen = q * total, 0
    for b, n in enumerate(hist):
        seen += n
        if seen >= rank and n:
            return bin_value(b)
    return bin_value(max(b for b, n in enumerate(hist) if n))


@dataclass(frozen=True)
class WindowProfile:
    """The traffic of the last ``window_s`` seconds (``span_s``: the part of it the profile has seen)."""
    window_s: float
    span_s: float
    n_requests: int
    rate_rps: float
    rate_by_class: dict[str, float]
    prompt_tokens: dict[str, float | None]      # quantile ("p50", "p90", "p99") -> tokens
    output_tokens: dict[str, float | None]
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    long_share: float | None                    # prompts of at least LONG_PROMPT_TOKENS
    background_share: float | None
    prefix_hit_share: float | None              # prompt tokens served from a reused prefix
    prefill_decode_ratio: float | None          # computed prompt tokens per output token
    slo_attainment: dict[str, float | None]     # class -> share of its judged requests meeting its SLO
    interference_slowdown: float | None = None  # the live interference index, when the caller has one

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _Ring:
    def __init__(self, window_s: float, n_buckets: int):
        self.window_s, self.n_buckets = window_s, n_buckets
        self.bucket_s = window_s / n_buckets
        self.buckets: dict[int, Tally] = {}

    def _bucket(self, t_unix_s: float) -> Tally:
        k = int(t_unix_s // self.bucket_s)
        tally = self.buckets.setdefault(k, Tally())
        if len(self.buckets) > self.n_buckets + 1:  # why: bounded even when no one reads the window
            newest = max(self.buckets)
            for old in [j for j in self.buckets if j <= newest - self.n_buckets - 1]:
                del self.buckets[old]
        return tally

    def add(self, r: FinishedRequest) -> None:
        self._bucket(r.arrived_unix_s).add(r)

    def arrive(self, t_unix_s: float, request_class: RequestClass) -> None:
        arrived = self._bucket(t_unix_s).arrived_by_class
        arrived[request_class] = arrived.get(request_class, 0) + 1

    def _in_window(self, now_unix_s: float) -> list[Tally]:
        """The buckets whose time lies within the window ending now (whole buckets: up to one bucket more)."""
        k_now = int(now_unix_s // self.bucket_s)
        return [tally for k, tally in self.buckets.items() if k_now - self.n_buckets < k <= k_now]

    def total(self, now_unix_s: float) -> Tally:
        out = Tally()
        for tally in self._in_window(now_unix_s):
            out.merge(tally)
        return out

    def offered(self, now_unix_s: float) -> dict[RequestClass, int]:
        """Requests that arrived within the window, per class (``Tally.offered_by_class``, bucket by bucket)."""
        out: dict[RequestClass, int] = {}
        for tally in self._in_window(now_unix_s):
            for c, n in tally.offered_by_class().items():
                out[c] = out.get(c, 0) + n
        return out


class TrafficProfile:
    """Rolling tallies over several windows (see the module docstring).  ``since_unix_s``: when observation
    began (a window longer than that is judged over the part seen: its rate is not diluted by time before)."""

    def __init__(self, windows_s: tuple[float, ...] = DEFAULT_WINDOWS_S, *, since_unix_s: float,
                 n_buckets: int = N_BUCKETS):
        assert windows_s and all(w > 0 for w in windows_s) and n_buckets >= 1
        self.windows_s = tuple(sorted(windows_s))
        self.since_unix_s = since_unix_s
        self._rings = {w: _Ring(w, n_buckets) for w in self.windows_s}
        self.n_observed = 0

    def observe(self, r: FinishedRequest) -> None:
        """Count one request (O(windows): a few dictionary updates)."""
        self.since_unix_s = min(self.since_unix_s, r.arrived_unix_s)
        for ring in self._rings.values():
            ring.add(r)
        self.n_observed += 1

    def arrive(self, arrived_unix_s: float, request_class: RequestClass) -> None:
        """Count one request as it arrives (before it is admitted, so refused ones count too), for the rate."""
        self.since_unix_s = min(self.since_unix_s, arrived_unix_s)
        for ring in self._rings.values():
            ring.arrive(arrived_unix_s, request_class)

    def window(self, window_s: float, now_unix_s: float, interference_slowdown: float | None = None
               ) -> WindowProfile:
        """The profile of the window of ``window_s`` (one of ``windows_s``) ending at ``now_unix_s``."""
        ring = self._rings[window_s]
        t = ring.total(now_unix_s)
        offered = ring.offered(now_unix_s)
        span_s = max(ring.bucket_s, min(window_s, now_unix_s - self.since_unix_s))
        n = t.n_requests
        share = (lambda part: part / n if n else None)
        computed = t.prompt_tokens - t.cached_tokens
        return WindowProfile(
            window_s=window_s, span_s=span_s, n_requests=n, rate_rps=sum(offered.values()) / span_s,
            rate_by_class={c.value: k / span_s for c, k in sorted(offered.items())},
            prompt_tokens={f"p{round(q * 100)}": hist_quantile(t.prompt_hist, q) for q in QUANTILES},
            output_tokens={f"p{round(q * 100)}": hist_quantile(t.output_hist, q) for q in QUANTILES},
            mean_prompt_tokens=share(t.prompt_tokens), mean_output_tokens=share(t.output_tokens),
            long_share=share(t.n_long), background_share=share(t.n_by_class.get(RequestClass.BACKGROUND, 0)),
            prefix_hit_share=t.cached_tokens / t.prompt_tokens if t.prompt_tokens else None,
            prefill_decode_ratio=computed / t.output_tokens if t.output_tokens else None,
            slo_attainment={c.value: (t.met_by_class.get(c, 0) / j if j else None)
                            for c, j in sorted(t.judged_by_class.items())},
            interference_slowdown=interference_slowdown)

    def windows(self, now_unix_s: float, interference_slowdown: float | None = None) -> tuple[WindowProfile, ...]:
        return tuple(self.window(w, now_unix_s, interference_slowdown) for w in self.windows_s)
