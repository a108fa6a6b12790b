"""Step-time model: fitted from a step log, and the chunk it picks for an ITL target."""
import pytest

from homepd.core.protocol import StepRecord
from homepd.measure.steptime import fit_step_time


def steps_from(base, per_prompt, per_decode, shapes, role="colocated"):
    out, t = [], 0.0
    for i, (n_prompt, n_decode) in enumerate(shapes):
        ms = base + per_prompt * n_prompt + per_decode * n_decode
        out.append(StepRecord(role, i, t, t + ms / 1e3, tuple(f"d{j}" for j in range(n_decode)),
                              (("p", n_prompt),) if n_prompt else ()))
        t += ms / 1e3
    return out


def test_fit_recovers_the_coefficients_and_the_chunk_meets_the_target():
    shapes = [(p, d) for p in (0, 16, 64, 256) for d in (1, 2, 4)]
    model = fit_step_time(steps_from(10.0, 0.5, 2.0, shapes))
    assert model.base_ms == pytest.approx(10.0, abs=1e-6) and model.ms_per_prompt_token == pytest.approx(0.5)
    chunk = model.chunk_for_itl(100.0, n_decode=4)
    assert chunk == 164 and model.predict_ms(chunk, 4) == pytest.approx(100.0)
    assert model.predict_ms(chunk + 1, 4) > 100.1


def test_chunk_is_clamped_and_too_few_steps_give_no_model():
    model = fit_step_time(steps_from(50.0, 1.0, 1.0, [(p, 1) for p in (0, 8, 32, 64, 128, 256, 0, 16)]))
    assert model.chunk_for_itl(40.0, n_decode=1) == 8           # even an empty step is over target
    assert model.chunk_for_itl(10_000.0, n_decode=1) == 2048
    assert fit_step_time(steps_from(1, 1, 1, [(8, 1)] * 3)) is None
    assert fit_step_time(steps_from(1, 1, 1, [(0, 1)] * 20)) is None  # no prompt tokens: nothing to fit
    assert fit_step_time(steps_from(1, 1, 1, [(8, 1)] * 20, role="decode"), role="colocated") is None
