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
decodes within an ITL budget, less a margin of the model's recent error (the box's noise is part of
what an ITL budget must hold).
"""
from __future__ import annotations

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
        self.coef = [0.0] * N_FEATURES

    def observe(self, n_prompt: int, n_decode: int, kv_in_use: int, step_ms: float) -> None:
        if n_prompt <= 0 and n_decode <= 0 or not math.isfinite(step_ms) or step_ms < 0:
            return
        x = features(n_prompt, n_decode, kv_in_use)
        if self.ready:
            err = step_ms - sum(c * xi for c, xi in zip(self.coef, x))
            # why one-sided: the error is the margin a step keeps below its budget, against running longer than
            # predicted; a step shorter than predicted needs none (its prediction already left room), and counting
            # it twice starved the chunk.  Scaled by √2, symmetric noise gives its RMS.
            late = math.sqrt(2.0) * max(0.0, err)
            # why the median and the clip: one step the model could not know (a cold first prompt, a page fault, a
            # neighbour's burst) was 240 ms off here, and at a 5 % weight it held the margin (twice the error) over
            # 50 ms for ~60 steps: every chunk beside a decode fell to the minimum while the steps ran at half the
            # ITL budget.  So the error starts from the median of the first few, and then no step moves it by more
            # than ERROR_CLIP times its current value (or the floor's): a lasting change of the noise is followed
            # within a few dozen steps (1 → over 4 ms in 60 steps of 10 ms jitter), a single outlier barely moves it.
            # But a lateness N_CONFIRM steps in a row show (the least of them) is taken whole: the box changed (a
            # neighbour's load, a deeper context the fit has not seen), and at the clip alone the margin took ~10
            # steps to follow one: gap-ceiling steps predicted at 114 ms ran 152-168 ms in a row (RAG, 1 thread)
            self._recent_late.append(late)
            if len(self._first_errors) < N_FIRST_ERRORS:
                self._first_errors.append(late)
                self._err2 = statistics.median(self._first_errors) ** 2
            else:
                confirmed = min(self._recent_late) if len(self._recent_late) == N_CONFIRM else 0.0
                late = min(late, max(confirmed, ERROR_CLIP * max(self.error_ms, ERROR_FLOOR_MS)))
                self._err2 = (1 - ERROR_WEIGHT) * self._err2 + ERROR_WEIGHT * late * late
        lam = self.forget
        for i in range(N_FEATURES):
            self.xty[i] = lam * self.xty[i] + x[i] * step_ms
            row = self.xtx[i]
            for j in range(N_FEATURES):
                row[j] = lam * row[j] + x[i] * x[j]
        self.n_steps += 1
        self.n_prompt_steps += n_prompt > 0
        self.coef = self._solve()

    def _solve(self) -> list[float]:
        """(XᵀX + ρ·diag) c = Xᵀy + ρ·diag·c_prev: ridge towards the previous estimate."""
        scale = max(self.xtx[0][0], 1e-9)
        a = [row[:] for row in self.xtx]
        b = self.xty[:]
        for i in range(N_FEATURES):
            rho = RIDGE * scale * (1.0 if i == 0 else 1e-2)
            a[i][i] += rho
            b[i] += rho * self.coef[i]
        solved = _gauss(a, b)
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

    def estimate(self) -> StepEstimate | None:
        if not self.ready:
            return None
        return StepEstimate(*self.coef, n_steps=self.n_steps, error_ms=self.error_ms,
                            n_prompt_steps=self.n_prompt_steps)


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out
