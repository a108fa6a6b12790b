"""A step-time model fitted online, one step at a time, from a worker's own step log.

``step_ms ≈ base + per_prompt · n_prompt + per_decode · n_decode + per_kv · (n_prompt + n_decode) · kv / 1000``:
one llama_decode costs a fixed part (reading the weights once), a part per prompt token, a part per decode
token, and attention: every token of the batch attends over the KV cells in use (``kv``: with llama.cpp's
unified cache, the cells of every running sequence, measured here to add ~30 % to a 16-token step at a few
hundred cells).  Exponentially weighted least squares (a
forgetting factor, so the model follows the box when it gets busier or quieter), with a small ridge
towards the previous estimate so that a run of identical steps (the same chunk again and again) cannot
make it degenerate.  Pure: no clock, no numpy (4×4 solves in Python are ~20 µs, once per step).

``chunk_for_itl`` turns the model around: the largest prompt budget that keeps a step with ``n_decode``
decodes within an ITL budget at the tail of the box's noise (the box's noise is part of what an ITL budget
must hold): less a margin of the model's recent error, and within the 99th percentile of the recent steps'
lateness as a share of their prediction (``late_share``), whichever holds the step shorter.
"""
from __future__ import annotations

import bisect
import collections
import math
import statistics

from homepd.core.terms import StepEstimate

N_FEATURES = 4
MIN_STEPS = 8            # steps seen before the model is trusted
FORGET = 0.98            # weight of the past per step: ~50 steps of memory
RIDGE = 1e-3
ERROR_WEIGHT = 0.05      # the recent error: an exponentially weighted RMS, ~20 steps of memory
ERROR_CLIP = 3.0         # no single step moves it by more than this many times its current value
ERROR_FLOOR_MS = 2.0     # the least it is clipped from (an error of 0 would clip every later one to 0)
N_FIRST_ERRORS = 5       # it starts from the median of this many
N_CONFIRM = 3            # a lateness this many steps in a row show is a change of the box, not an outlier
LATE_WINDOW = 256        # the recent steps whose lateness (a share of their prediction) the tail is read from
MIN_LATE_STEPS = 64      # fewer than this, and the tail is not read (the absolute margin alone holds)
LATE_QUANTILE = 0.99
# why a clip: a step more than twice as long as predicted was stopped by something its size did not cause (the
# VM's neighbour, a page fault: 6-token steps of ~90 ms ran 2.9 and 3.2 s here); a smaller step would not have
# avoided it, and taking it whole would shrink every budget to the minimum for the window's 256 steps
LATE_CLIP = 1.0


def features(n_prompt: int, n_decode: int, kv_in_use: int) -> tuple[float, ...]:
    return (1.0, float(n_prompt), float(n_decode), (n_prompt + n_decode) * kv_in_use / 1000.0)


class OnlineStepModel:
    """Exponentially weighted least squares over (n_prompt, n_decode, kv_in_use) → step ms."""

    def __init__(self, forget: float = FORGET):
        self.forget = forget
        self.xtx = [[0.0] * N_FEATURES for _ in range(N_FEATURES)]
        self.xty = [0.0] * N_FEATURES
        self.n_steps = 0
        self.n_prompt_steps = 0
        self._err2 = 0.0
        self._first_errors: list[float] = []
        self._recent_late: collections.deque[float] = collections.deque(maxlen=N_CONFIRM)
        # the window's lateness in the order seen and sorted (the tail read per step: sorted, it costs ~1 µs; a
        # heap's nlargest over the window was a tenth of the twin's time)
        self._late_shares: collections.deque[float] = collections.deque()
        self._late_sorted: list[float] = []
        self.coef = [0.0] * N_FEATURES
        self._estimate: StepEstimate | None = None  # of the current coefficients (estimate() is read per plan)

    def observe(self, n_prompt: int, n_decode: int, kv_in_use: int, step_ms: float) -> None:
        if n_prompt <= 0 and n_decode <= 0 or not math.isfinite(step_ms) or step_ms < 0:
            return
        x = features(n_prompt, n_decode, kv_in_use)
        if self.n_steps >= MIN_STEPS:   # ready
            c0, c1, c2, c3 = self.coef
            predicted = c0 + c1 * x[1] + c2 * x[2] + c3 * x[3]
            err = step_ms - predicted
            if predicted >= 1.0:
                share = min(LATE_CLIP, max(0.0, err) / predicted)
                self._late_shares.append(share)
                bisect.insort(self._late_sorted, share)
                if len(self._late_shares) > LATE_WINDOW:
                    del self._late_sorted[bisect.bisect_left(self._late_sorted, self._late_shares.popleft())]
            # why one-sided: the error is the margin a step keeps below its budget; a step shorter than predicted
            # needs none, and counting it twice starved the chunk.  Scaled by √2, symmetric noise gives its RMS.
            late = math.sqrt(2.0) * max(0.0, err)
            # why the median and the clip: one step the model could not know (a cold prompt, a page fault) was 240 ms
            # off here and held every chunk at the minimum for ~60 steps; so the error starts from the median of the
            # first few, and no step moves it by more than ERROR_CLIP times its value (a lasting change is followed
            # within a few dozen steps).  But a lateness N_CONFIRM steps in a row show is taken whole: the box
            # changed (gap-ceiling steps predicted at 114 ms ran 152-168 ms in a row: RAG, 1 thread)
            self._recent_late.append(late)
            if len(self._first_errors) < N_FIRST_ERRORS:
                self._first_errors.append(late)
                self._err2 = statistics.median(self._first_errors) ** 2
            else:
                confirmed = min(self._recent_late) if len(self._recent_late) == N_CONFIRM else 0.0
                late = min(late, max(confirmed, ERROR_CLIP * max(self.error_ms, ERROR_FLOOR_MS)))
                self._err2 = (1 - ERROR_WEIGHT) * self._err2 + ERROR_WEIGHT * late * late
        lam = self.forget
        self.xty = [lam * v + xi * step_ms for v, xi in zip(self.xty, x)]
        self.xtx = [[lam * v + xi * xj for v, xj in zip(row, x)] for row, xi in zip(self.xtx, x)]
        self.n_steps += 1
        self.n_prompt_steps += n_prompt > 0
        self.coef = self._solve()
        self._estimate = None

    def _solve(self) -> list[float]:
        """(XᵀX + ρ·diag) c = Xᵀy + ρ·diag·c_prev: ridge towards the previous estimate."""
        scale = max(self.xtx[0][0], 1e-9)
        r0, r = RIDGE * scale * 1.0, RIDGE * scale * 1e-2
        (a00, _, _, _), (a10, a11, _, _), (a20, a21, a22, _), (a30, a31, a32, a33) = self.xtx
        (b0, b1, b2, b3), (c0, c1, c2, c3) = self.xty, self.coef
        # why the lower triangle only, as tuples: it is all _solve_spd reads, and this runs after every step
        a = ((a00 + r0,), (a10, a11 + r), (a20, a21, a22 + r), (a30, a31, a32, a33 + r))
        b = [b0 + r0 * c0, b1 + r * c1, b2 + r * c2, b3 + r * c3]
        solved = _solve_spd(a, b)
        if solved is None:
            return self.coef
        # a step never costs less for more work: clamp the marginal costs at zero
        base, per_prompt, per_decode, per_kv = solved
        return [max(0.0, base), max(1e-3, per_prompt), max(0.0, per_decode), max(0.0, per_kv)]

    @property
    def ready(self) -> bool:
        return self.n_steps >= MIN_STEPS

    @property
    def error_ms(self) -> float:
        return math.sqrt(self._err2)

    @property
    def late_share(self) -> float:
        """The ``LATE_QUANTILE`` of the recent steps' lateness as a share of their prediction (0 before
        ``MIN_LATE_STEPS``): one step in a hundred ran this much longer than predicted, or more."""
        n = len(self._late_sorted)
        if n < MIN_LATE_STEPS:
            return 0.0
        return self._late_sorted[n - max(1, math.ceil(n * (1.0 - LATE_QUANTILE)))]

    def estimate(self) -> StepEstimate | None:
        if not self.ready:
            return None
        if self._estimate is None:
            self._estimate = StepEstimate(*self.coef, n_steps=self.n_steps, error_ms=self.error_ms,
                                          n_prompt_steps=self.n_prompt_steps, late_share=self.late_share)
        return self._estimate


def _solve_spd(a: tuple[tuple[float, ...], ...], b: list[float]) -> list[float] | None:
    """Solve ``a`` x = ``b`` for the 4×4 symmetric positive definite ``a`` (the ridged normal equations; its lower
    triangle, rows of 1 to 4) by
    Cholesky, written out; None when it is not positive definite.  # why written out: it runs after every step,
    in every worker and every simulated one (``homepd.twin``), and loops cost 4x here."""
    (a00,), (a10, a11), (a20, a21, a22), (a30, a31, a32, a33) = a
    if a00 <= 1e-12:
        return None
    l00 = math.sqrt(a00)
    l10, l20, l30 = a10 / l00, a20 / l00, a30 / l00
    d1 = a11 - l10 * l10
    if d1 <= 1e-12:
        return None
    l11 = math.sqrt(d1)
    l21, l31 = (a21 - l20 * l10) / l11, (a31 - l30 * l10) / l11
    d2 = a22 - l20 * l20 - l21 * l21
    if d2 <= 1e-12:
        return None
    l22 = math.sqrt(d2)
    l32 = (a32 - l30 * l20 - l31 * l21) / l22
    d3 = a33 - l30 * l30 - l31 * l31 - l32 * l32
    if d3 <= 1e-12:
        return None
    l33 = math.sqrt(d3)
    y0 = b[0] / l00
    y1 = (b[1] - l10 * y0) / l11
    y2 = (b[2] - l20 * y0 - l21 * y1) / l22
    y3 = (b[3] - l30 * y0 - l31 * y1 - l32 * y2) / l33
    x3 = y3 / l33
    x2 = (y2 - l32 * x3) / l22
    x1 = (y1 - l21 * x2 - l31 * x3) / l11
    x0 = (y0 - l10 * x1 - l20 * x2 - l30 * x3) / l00
    return [x0, x1, x2, x3]
