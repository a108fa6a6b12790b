"""Seeded arrival processes: when each request of an open-loop trace arrives.

* ``poisson``: exponential gaps at ``rate_per_s``.
* ``gamma``: gamma-distributed gaps with vLLM's burstiness convention —
  shape = burstiness, scale = 1 / (rate_per_s * burstiness), so the mean rate
  is ``rate_per_s`` whatever the burstiness; 1 is Poisson, below 1 is burstier
  (coefficient of variation of the gaps = 1 / sqrt(burstiness)).
* ``rate_per_s = inf``: every request at 0 (vLLM's ``--request-rate inf``).

The first request arrives at 0; offsets are rounded to 0.1 ms so a trace file
round-trips exactly.  A closed loop (fixed concurrency) is not an arrival
process: it is ``Trace.concurrency``, and replay ignores the offsets.
"""
from __future__ import annotations

import math
import random

from homepd.errors import ConfigError

ARRIVALS = ("poisson", "gamma")


def arrival_offsets(n: int, rate_per_s: float, rng: random.Random, *, arrival: str = "poisson",
                    burstiness: float = 1.0) -> list[float]:
    """``n`` non-decreasing arrival offsets in seconds, the first at 0."""
    if arrival not in ARRIVALS:
        raise ConfigError(f"arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    if n < 0 or not rate_per_s > 0:
        raise ConfigError(f"arrivals need n >= 0 and rate_per_s > 0, got n={n}, rate_per_s={rate_per_s}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ConfigError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate_per_s):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 4))
        if arrival == "poisson":
            t += rng.expovariate(rate_per_s)
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate_per_s * burstiness))
    return out
