"""Where a replayed trace comes from when it is not a built-in mix: recorded traffic, or a trace file.

A *trace source* makes the trace of one advise mix at any rate and length::

    source.trace(rate_rps=None, n_requests=None, seed=0) -> Trace

``rate_rps=None`` keeps the source's own arrivals; a rate scales them
(``trace_at_rate``: same order, same relative gaps); ``n_requests`` cuts or
repeats it (the capacity search asks for probes of a given length).  Also
here: ``parse_since``, the SINCE of ``advise --traffic service:SINCE``.
"""
from __future__ import annotations

import dataclasses
import datetime
import re
from dataclasses import dataclass, field

from homepd.measure.trace.model import Trace, TraceError
from homepd.measure.trace.traffic import RecordedRequest, TextUnits, observed_rate_rps, trace_at_rate, traffic_trace

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0}


def parse_duration_s(text: str, what: str = "a duration") -> float:
    """``90s``, ``30m``, ``2h``, ``1d``, ``1w`` or plain seconds, as seconds (> 0); ``TraceError`` otherwise."""
    m = _DURATION.match(text)
    try:
        value = float(m.group(1)) * _UNIT_S[m.group(2).lower()] if m else float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise TraceError(f"cannot read {what} {text!r}: give seconds or a duration (90s, 30m, 2h)")
    return value


def parse_since(text: str, now_unix_s: float) -> float:
    """SINCE as Unix seconds: a duration back from now (``90s``, ``30m``, ``2h``, ``1d``, ``1w``) or an ISO
    8601 time (``2026-12-01T09:00``; without a zone it is local time).  ``TraceError`` says what is accepted."""
    m = _DURATION.match(text)
    if m:
        return now_unix_s - float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise TraceError(f"cannot read SINCE {text!r}: give a duration back from now (30m, 2h, 1d, 1w) or an "
                         "ISO 8601 time (2026-12-01T09:00, 2026-12-01T09:00+00:00)") from None
    if when.tzinfo is None:
        when = when.astimezone()  # why: a bare time typed by a user is their wall clock's
    return when.timestamp()


@dataclass(frozen=True)
class RecordedTraffic:
    """A window of a service's recorded traffic (``requests`` in arrival order) as a trace source."""
    requests: tuple[RecordedRequest, ...]
    label: str = "service"                    # e.g. "service:2h", for the record
    units: TextUnits = field(default_factory=TextUnits)
    name: str = "traffic"

    def trace(self, rate_rps: float | None = None, n_requests: int | None = None, seed: int = 0) -> Trace:
        return traffic_trace(self.requests, rate_rps=rate_rps, n_requests=n_requests, units=self.units,
                             seed=seed, name=self.name)

    def describe(self) -> dict:
        """What the record of an advise run keeps about the source (no text)."""
        own = self.trace()
        return {"source": self.label, "n_requests": len(self.requests), "rate_per_s": observed_rate_rps(own),
                "span_s": own.generator["span_s"],
                "n_prefix_tokens": sum(r.n_prefix_tokens for r in self.requests),
                "n_prompt_tokens": sum(r.n_prompt_tokens for r in self.requests)}


@dataclass(frozen=True)
class TraceFileSource:
    """A trace read from a file, as a trace source (repeating it repeats its text: prefixes included)."""
    base: Trace
    label: str = ""
    name: str = "trace"

    def trace(self, rate_rps: float | None = None, n_requests: int | None = None, seed: int = 0) -> Trace:
        requests = self.base.requests
        if n_requests is not None:
            if n_requests < 1:
                raise TraceError(f"a trace needs at least one request, got n_requests={n_requests}")
            span_s = max(r.arrival_s for r in requests)
            period_s = span_s + (span_s / (len(requests) - 1) if len(requests) > 1 else 1.0)
            requests = tuple(dataclasses.replace(requests[k % len(requests)], arrival_s=round(
                (k // len(requests)) * period_s + requests[k % len(requests)].arrival_s, 4)) for k in range(n_requests))
        out = Trace(requests, name=self.name, seed=self.base.seed, concurrency=self.base.concurrency,
                    generator={**self.base.generator, "source": self.label})
        return out if rate_rps is None else trace_at_rate(out, rate_rps)

    def describe(self) -> dict:
        return {"source": self.label, "n_requests": len(self.base), "rate_per_s": observed_rate_rps(self.base)}
