"""What a KV store save costs on this box: a fixed part and a part per token, fitted over every save so far.

# why not a mean per token: a save's time is mostly fixed.  Measured on the 2-vCPU VM (SmolLM2, no flash
# attention), 61 saves: ~80-token prefixes took 5-33 ms (median 14), ~450-token documents 16-72 ms (median 27).
# The mean per token (0.10-0.18 ms) priced a ~460-token document's save at ~87 ms, and the twin, which adds a
# save's time between two steps as the worker does, gave every chat decoding beside a document that ended a gap of
# ~101 ms (the save and a 14-ms decode step): 16 of the 18 requests it had miss the gap budget on a check's trace.
"""
from __future__ import annotations


class SaveCost:
    """Least squares of ms = ``base_ms`` + ``ms_per_token`` x tokens over the saves added, kept physical (neither
    part negative); with one size of save seen, all of it per token (the mean, as before the fit)."""

    def __init__(self) -> None:
        self.n = 0
        self._sx = self._sy = self._sxx = self._sxy = 0.0

    def add(self, n_tokens: int, ms: float) -> None:
        x = float(n_tokens)
        self.n += 1
        self._sx += x
        self._sy += ms
        self._sxx += x * x
        self._sxy += x * ms

    def fit(self) -> tuple[float, float] | None:
        """(base_ms, ms_per_token); None before the first save."""
        if not self.n or self._sx <= 0:
            return None
        mean_x, mean_y = self._sx / self.n, self._sy / self.n
        var = self._sxx / self.n - mean_x * mean_x
        if var <= 1e-9 * max(1.0, mean_x * mean_x):
            return 0.0, self._sy / self._sx
        slope = (self._sxy / self.n - mean_x * mean_y) / var
        base = mean_y - slope * mean_x
        if slope < 0:
            return mean_y, 0.0
        if base < 0:
            return 0.0, self._sy / self._sx
        return base, slope
