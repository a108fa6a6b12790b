"""The twin's calibration (homepd.twin.calibration) fitted on constructed step logs: a step's noise beside another
worker's prompt step is drawn from its own residuals, not from every step's."""
from __future__ import annotations

import random

import pytest

from homepd.core.protocol import StepRecord
from homepd.twin.calibration import (ALONE, BESIDE_PROMPT, MIN_BESIDE_RESIDUALS, STALL_RATIO, StepCost,
                                     step_cost)


def decode_worker_and_prefill_neighbour(n: int = 400, seed: int = 3) -> tuple[list[StepRecord], list[StepRecord]]:
    """A decode worker's 1-decode steps of 20 ms (±1 ms), every other one of them under a long prefill step of the
    other worker, where one in five runs 2.5× as long (the box's shared cores), as on a 2-vCPU VM."""
    rng = random.Random(seed)
    steps, t = [], 0.0
    for i in range(n):
        ms = 20.0 + rng.uniform(-1.0, 1.0)
        if (i // 10) % 2 == 1 and rng.random() < 0.2:
            ms *= 2.5
        steps.append(StepRecord("decode", i, t, t + ms / 1e3, ("a",), ()))
        t += ms / 1e3 + 0.001
    # the prefill worker's step spans each odd block of ten
    others = [StepRecord("prefill", k, steps[k * 10].t_start_s, steps[k * 10 + 9].t_end_s, (), (("b", 64),))
              for k in range(1, n // 10, 2)]
    return steps, others


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[int(0.99 * (len(values) - 1))]


def test_steps_beside_a_prompt_step_draw_their_own_tail():
    steps, others = decode_worker_and_prefill_neighbour()
    cost = step_cost(steps, others)
    alone, beside = cost.residuals_beside[ALONE], cost.residuals_beside[BESIDE_PROMPT]
    assert len(alone) >= MIN_BESIDE_RESIDUALS and len(beside) >= MIN_BESIDE_RESIDUALS
    assert max(beside) > max(alone) + 0.5   # the 2.5x steps are beside the prefill, none alone
    rng, noise = random.Random(1), cost.start_noise(random.Random(1))
    drawn_alone = [cost.draw_ms(rng, noise, 0, 1, 0, ALONE) for _ in range(2000)]
    drawn_beside = [cost.draw_ms(rng, noise, 0, 1, 0, BESIDE_PROMPT) for _ in range(2000)]
    # the measured tails: alone within ~25 ms, beside a prompt step ~50 ms for one step in five
    assert p99(drawn_alone) < 30.0
    assert p99(drawn_beside) > 40.0


def test_a_neighbour_with_few_steps_draws_from_every_step():
    steps, others = decode_worker_and_prefill_neighbour()
    cost = step_cost(steps, others)
    thin = StepCost(cost.coef, cost.residuals, 0.0, 0.0, (), cost.n_steps,
                    residuals_beside=((), (), cost.residuals_beside[BESIDE_PROMPT][:MIN_BESIDE_RESIDUALS - 1]))
    rng = random.Random(2)
    drawn = {round(thin.draw_ms(rng, [0.0], 0, 1, 0, BESIDE_PROMPT), 9) for _ in range(3000)}
    from_all = {round(thin.predict_ms(0, 1, 0, BESIDE_PROMPT) * (1 + r), 9) for r in cost.residuals}
    assert drawn <= from_all and len(drawn) > MIN_BESIDE_RESIDUALS


def test_a_calibration_stored_before_the_pools_draws_from_every_step():
    steps, others = decode_worker_and_prefill_neighbour()
    cost = step_cost(steps, others)
    old = StepCost(cost.coef, cost.residuals, 0.0, 0.0, (), cost.n_steps)
    rng = random.Random(4)
    assert all(old.draw_ms(rng, [0.0], 0, 1, 0, BESIDE_PROMPT) > 0 for _ in range(100))


def test_noise_that_forgets_itself_in_a_step_or_two_is_drawn_as_measured():
    from homepd.twin.calibration import MIN_SLOW_RHO, autocorrelation, persistence

    rng = random.Random(7)
    white = [rng.gauss(0, 0.05) + (0.6 if rng.random() < 0.02 else 0.0) for _ in range(2000)]
    rel, level = [], 0.0
    for w in white:  # weakly persistent (0.4 a step): fast noise with a heavy tail, not a drift
        level = 0.4 * level + w
        rel.append(level)
    fitted_rho = (autocorrelation(rel, 5) / autocorrelation(rel, 1)) ** 0.25
    assert 0.3 < fitted_rho < MIN_SLOW_RHO      # an AR(1) fit would have taken ~80 % of the variance as "slow"
    assert persistence(rel) == (0.0, 0.0)
    slow, level = [], 0.0   # a drift that persists (0.95 a step) is the slow part
    for w in white:
        level = 0.95 * level + 0.3 * w
        slow.append(level + rng.gauss(0, 0.01))
    rho, share = persistence(slow)
    assert rho > 0.8 and share > 0.5


def test_steps_the_box_stopped_are_counted_and_the_rest_are_not():
    """Steps of a burst that ran over STALL_RATIO times their fitted time are counted and left out of the fit and
    the noise (the burst is then not pooled: homepd.advise.campaign.pooled); the box's ordinary noise, up to twice
    a step's time, is neither."""
    rng = random.Random(5)
    steps, t = [], 0.0
    for i in range(200):
        n = 1 + i % 8
        ms = (10.0 + 5.0 * n) * (2.0 if i % 50 == 7 else rng.uniform(0.9, 1.1))   # four steps at 2x: noise
        steps.append(StepRecord("colocated", i, t, t + ms / 1e3, ("a",) * n, ()))
        t += ms / 1e3 + 0.001
    assert step_cost(steps).n_stalled == 0
    stalled = list(steps)
    for i in (30, 31, 120):   # the box stopped three steps (a page-fault storm)
        s = stalled[i]
        stalled[i] = StepRecord(s.worker_role, s.index, s.t_start_s, s.t_start_s + (s.t_end_s - s.t_start_s) * 8,
                                s.decode_request_ids, s.prefill)
    cost = step_cost(stalled)
    assert cost.n_stalled == 3 and cost.n_steps == 197
    # left out of the fit and the noise: the fitted time and the worst residual are the quiet burst's
    quiet = step_cost(steps)
    assert all(abs(cost.predict_ms(0, n) / quiet.predict_ms(0, n) - 1) < 0.02 for n in (1, 4, 8))
    assert max(cost.residuals) < STALL_RATIO - 1.0 and max(cost.residuals) < 1.5 * max(quiet.residuals)



def test_a_busy_or_stalling_burst_is_unusable_and_its_rerun_kept_when_quieter():
    import dataclasses

    from homepd.twin.calibration import BUSY_CORES, Calibration, WorkerCalibration, quieter

    def burst(other_cores: float, n_steps: int, n_stalled: int) -> Calibration:
        cost = StepCost((20.0, 1.0), (), 0.0, 0.0, (), n_steps, n_stalled=n_stalled)
        worker = WorkerCalibration("colocated", None, cost)
        return Calibration("c", (worker,), other_cpu_cores=other_cores)

    quiet, busy, stalling = burst(0.01, 170, 1), burst(BUSY_CORES + 0.28, 170, 0), burst(0.02, 130, 41)
    assert not quiet.unusable and busy.unusable and stalling.unusable
    assert quieter(busy, quiet) is quiet and quieter(quiet, busy) is quiet
    # both unusable: the less disturbed (0.02 cores and 24 % of steps stalled, against 0.53 cores)
    assert quieter(stalling, busy) is stalling and quieter(busy, stalling) is stalling
    less_busy = dataclasses.replace(busy, other_cpu_cores=BUSY_CORES + 0.1)
    assert quieter(busy, less_busy) is less_busy and quieter(less_busy, busy) is less_busy


def test_a_worker_whose_burst_ran_no_prompt_step_prices_prompt_tokens_as_the_prefill_worker_does():
    """A disaggregated burst: the prefill worker runs 128- and 256-token chunks, the decode worker batches of 1-4
    decodes, half of them beside a chunk (each 1.3x as long there), some chunks alone.  Alone, on the same kind of
    core, a token of either costs 4.5 ms, a decode 10 ms more (its logits and sample) and 10 ms per 1,000 cells of
    KV (its attention), a step 18 ms.  The decode worker's own steps cannot tell a prompt token from a decode
    token; it takes the prefill worker's cost per token, and its decode steps stay as its own fit put them."""
    from homepd.twin.burst import worker_costs

    def alone_ms(n_prompt: int, n_decode: int, kv: int = 0) -> float:
        return 18.0 + 4.5 * (n_prompt + n_decode) + 10.0 * n_decode + 10.0 * n_decode * kv / 1e3

    rng = random.Random(11)
    decode, prefill, t = [], [], 0.0
    for block in range(40):
        beside = block % 2 == 1
        start = t
        for i in range(8):
            n, kv = 1 + (block + i) % 4, 100 * (1 + (block + 3 * i) % 8)
            ms = alone_ms(0, n, kv) * (1.3 if beside else 1.0) * rng.uniform(0.95, 1.05)
            decode.append(StepRecord("decode", len(decode), t, t + ms / 1e3, tuple(f"r{k}" for k in range(n)), (),
                                     kv_in_use=kv))
            t += ms / 1e3 + 0.001
        if beside:   # one chunk spans the block (its own time is its own: 18 + 4.5 a token)
            chunk = 128 if block % 4 == 1 else 256
            prefill.append(StepRecord("prefill", len(prefill), start, start + alone_ms(chunk, 0) * 1.3 / 1e3, (),
                                      ((f"d{block}", chunk),)))
            t = max(t, prefill[-1].t_end_s) + 0.001
        if block % 4 == 2:   # and one runs alone, while the decode worker waits for a handoff
            prefill.append(StepRecord("prefill", len(prefill), t, t + alone_ms(256, 0) / 1e3, (),
                                      ((f"e{block}", 256),)))
            t = prefill[-1].t_end_s + 0.001
    steps = sorted(decode + prefill, key=lambda s: s.t_start_s)
    costs = worker_costs(steps, ["prefill", "decode"])
    fitted = costs["decode"]
    assert abs(fitted.predict_ms(17, 1) / alone_ms(17, 1) - 1) < 0.15
    assert abs(fitted.predict_ms(64, 2) / alone_ms(64, 2) - 1) < 0.15
    # beside 600 cells of other sequences, a prompt pays no decode's attention (every running sequence's cells
    # count in kv_in_use, and a decode reads its own): 20 tokens at 600 cells, not 120 ms more
    assert abs(fitted.predict_ms(20, 0, 600) / alone_ms(20, 0, 600) - 1) < 0.15
    own = step_cost(decode, prefill)
    for n, kv in ((1, 100), (2, 400), (4, 800)):   # its decode steps, alone and beside a chunk, as its own put them
        for beside, truth in ((ALONE, alone_ms(0, n, kv)), (BESIDE_PROMPT, 1.3 * alone_ms(0, n, kv))):
            assert abs(fitted.predict_ms(0, n, kv, beside) / own.predict_ms(0, n, kv, beside) - 1) < 0.03
            assert abs(fitted.predict_ms(0, n, kv, beside) / truth - 1) < 0.08
    # fitted on its own steps alone, a prompt token costs what its fit gave a decode token's terms: 17 of them well
    # over the truth
    assert own.predict_ms(17, 1) > 1.25 * alone_ms(17, 1)


def test_a_step_after_idleness_is_priced_apart_and_left_out_of_the_fit():
    """A busy worker's steps (10 + 5 ms a token) and, now and then, one after 0.3 s idle that runs 30 ms longer
    (threads asleep, caches cold): the fit is the busy steps', and what the idle ones add is measured."""
    from homepd.twin.calibration import COLD_IDLE_MS

    def worker(idle: bool) -> list[StepRecord]:
        rng = random.Random(9)
        steps, t = [], 0.0
        for i in range(240):
            n = 1 + i % 8
            after_idle = idle and i % 30 == 29
            if after_idle:
                t += 0.3
            ms = (10.0 + 5.0 * n) * rng.uniform(0.97, 1.03) + (30.0 if after_idle else 0.0)
            steps.append(StepRecord("colocated", i, t, t + ms / 1e3, ("a",) * n, ()))
            t += ms / 1e3 + 0.001
        return steps

    cost, busy = step_cost(worker(idle=True)), step_cost(worker(idle=False))
    assert cost.n_cold == 8 and abs(cost.cold_ms - 30.0) < 2.0
    assert busy.n_cold == 0 and busy.cold_ms == 0.0
    assert all(abs(cost.predict_ms(0, n) / busy.predict_ms(0, n) - 1) < 0.01 for n in (1, 4, 8))
    rng2 = random.Random(1)
    warm = cost.draw_ms(rng2, [0.0], 0, 4, 0, ALONE, idle_ms=COLD_IDLE_MS - 1)
    rng2 = random.Random(1)
    cold = cost.draw_ms(rng2, [0.0], 0, 4, 0, ALONE, idle_ms=300.0)
    assert cold == pytest.approx(warm + cost.cold_ms)


def test_a_decode_token_is_never_priced_below_a_prompt_token_in_the_same_batch():
    """A decode token does what a prompt token does and more (its row of logits, its sample).  A burst can look
    otherwise: a fixed chunk of 256 ran its decodes in batches and its prompts whole, and the least squares put
    -26 ms on each decode token and 36 ms on each of a batch's first prompt tokens, pricing a 40-token prompt at
    2.6x what it took.  Here decodes look cheaper a token (3 ms against 6): the fit keeps them at a prompt
    token's price or more, and prices both kinds of step within the measured ones."""
    rng = random.Random(4)
    steps, t = [], 0.0
    for i in range(160):
        n = 1 + i % 8
        prompt = i % 2 == 0
        ms = (5.0 + (6.0 if prompt else 3.0) * n) * rng.uniform(0.97, 1.03)
        steps.append(StepRecord("colocated", i, t, t + ms / 1e3, () if prompt else ("a",) * n,
                                (("b", n),) if prompt else ()))
        t += ms / 1e3 + 0.001
    cost = step_cost(steps)
    for n in range(1, 9):
        assert cost.predict_ms(0, n) >= cost.predict_ms(n, 0) - 1e-9
        assert 5.0 + 3.0 * n <= cost.predict_ms(n, 0) <= 5.0 + 6.0 * n   # between what each kind took
