"""Whether a candidate's twin is trusted: its predictions beside the measured probes.

A twin that is never checked is a guess.  Each measured probe of a candidate is simulated as it ran (its own
requests, arrivals and prompts) and compared (``TwinCheck``).  The twin is trusted for the candidate when the
median error of its attainment over the probes is within ``MAX_ATTAINMENT_ERROR_POINTS`` points: the capacity is a
crossing of the attainment curve, so that is the figure the answer stands on.  A probe of ~20 requests near the
crossing is itself noisy (one request is 5 points, and a 90 % share has a binomial deviation of ~7 points), so the
bound is set above that noise.  Latencies are shown beside it (TTFT p50 and p90, the largest gap's p90) and named
in the verdict when they are far off, but they do not decide it alone.
"""
from __future__ import annotations

import statistics

from homepd.twin.records import TwinCheck

MAX_ATTAINMENT_ERROR_POINTS = 15.0
FAR_OFF = 0.5          # a latency figure this far off (relative) is named in the verdict


def verdict(checks: tuple[TwinCheck, ...]) -> tuple[bool, str, float | None]:
    """(trusted, why, median attainment error in points) of a candidate's checks."""
    if not checks:
        return False, "no measured probe to check the twin against", None
    error = statistics.median(c.attainment_error_points for c in checks)
    far = [f"{figure.replace('_ms_', ' ')} off by {e:.0%}" for figure in ("ttft_ms_p50", "ttft_ms_p90", "gap_ms_p90")
           if (e := _median_error(checks, figure)) is not None and e > FAR_OFF]
    detail = f"attainment off by {error:.0f} points over {len(checks)} probe(s)" + (f"; {', '.join(far)}" if far
                                                                                   else "")
    if error <= MAX_ATTAINMENT_ERROR_POINTS:
        return True, f"checked: {detail} (within {MAX_ATTAINMENT_ERROR_POINTS:.0f})", error
    return False, f"not trusted: {detail} (over {MAX_ATTAINMENT_ERROR_POINTS:.0f})", error


def _median_error(checks: tuple[TwinCheck, ...], figure: str) -> float | None:
    errors = [e for c in checks if (e := c.relative_error(figure)) is not None]
    return statistics.median(errors) if errors else None
