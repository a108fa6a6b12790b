"""A step-time model fitted from the step log, and the prefill chunk it predicts for an ITL target.

``step_ms ≈ base_ms + ms_per_prompt_token · n_prompt + ms_per_decode_token · n_decode`` by least squares
over recorded steps of one worker.  In a colocated step every running decode waits for the whole step,
so the largest chunk that keeps a step with ``n_decode`` decodes under the ITL target is
``(target - base - per_decode · n_decode) / per_prompt``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from homepd.core.protocol import StepRecord

MIN_STEPS = 8


@dataclass(frozen=True)
class StepTimeModel:
    base_ms: float
    ms_per_prompt_token: float
    ms_per_decode_token: float
    n_steps: int
    rmse_ms: float

    def predict_ms(self, n_prompt: int, n_decode: int) -> float:
        return self.base_ms + self.ms_per_prompt_token * n_prompt + self.ms_per_decode_token * n_decode

    def chunk_for_itl(self, itl_target_ms: float, n_decode: int, lo: int = 8, hi: int = 2048) -> int:
        """The largest prompt-token budget per step that keeps a step with ``n_decode`` decodes within
        ``itl_target_ms`` (clamped to [lo, hi]; ``lo`` when even an empty step is over target)."""
        room = itl_target_ms - self.base_ms - self.ms_per_decode_token * n_decode
        if self.ms_per_prompt_token <= 0:
            return hi
        return int(max(lo, min(hi, room / self.ms_per_prompt_token + 1e-9)))


def fit_step_time(steps: list[StepRecord], role: str | None = None) -> StepTimeModel | None:
    """Least-squares fit over ``steps`` (of ``role`` when given); None with too few or degenerate steps."""
    rows = [s for s in steps if role is None or s.worker_role == role]
    rows = [s for s in rows if s.n_prompt_tokens or s.n_decode_tokens]
    if len(rows) < MIN_STEPS or not any(s.n_prompt_tokens for s in rows):
        return None
    x = np.array([[1.0, s.n_prompt_tokens, s.n_decode_tokens] for s in rows])
    y = np.array([s.duration_ms for s in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    base, per_prompt, per_decode = (float(c) for c in coef)
    rmse = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return StepTimeModel(max(0.0, base), max(1e-6, per_prompt), max(0.0, per_decode), len(rows), rmse)
