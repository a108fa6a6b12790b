"""The twin (homepd.twin) on constructed step models: it is a queue with homepd's own policy inside.

* a one-sequence, unchunked server with fixed step times is an M/D/1 queue, and the twin's mean wait is
  Pollaczek-Khinchine's;
* a smaller chunk lowers the largest gap and raises the TTFT, as it does in the engine;
* the same seed gives the same run;
* a change to a policy object changes the twin's output, with no change in the twin's code.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from homepd.config import EngineConfig
from homepd.core import steppolicy
from homepd.core.modes import Mode, Role
from homepd.core.protocol import WorkerSpec
from homepd.core.terms import RequestClass, ReuseMode
from homepd.engine.specs import gap_ceiling_ms, idle_step_ms, itl_budget_ms
from homepd.twin.calibration import (KNOTS, Calibration, StepCost, WorkerCalibration, at_speed, step_speed,
                                     with_own_speed)
from homepd.twin.sim import SimRequest, simulate

N_FEATURES = 4 + len(KNOTS)


def fixed_cost(base_ms: float, per_token_ms: float, per_decode_ms: float = 0.0) -> StepCost:
    """A step that takes exactly base + per_token × its tokens (+ per_decode × its decodes): no noise, no loop."""
    coef = [base_ms, per_token_ms] + [0.0] * len(KNOTS) + [per_decode_ms, 0.0]
    assert len(coef) == N_FEATURES
    return StepCost(tuple(coef), (), 0.0, 0.0, (), 100)


def one_worker(config: EngineConfig, cost: StepCost, prepare_ms: float = 0.0) -> Calibration:
    spec = WorkerSpec(role=Role.COLOCATED, model_path="m", n_ctx=config.n_ctx, n_seq_max=config.n_seq_max,
                      chunk=config.chunk, n_threads=1, itl_budget_ms=itl_budget_ms(config, Role.COLOCATED),
                      idle_step_ms=idle_step_ms(config, Role.COLOCATED),
                      gap_ceiling_ms=gap_ceiling_ms(config, Role.COLOCATED))
    return Calibration("constructed", (WorkerCalibration("colocated", spec, cost),), prepare_base_ms=prepare_ms)


def poisson(n: int, rate: float, seed: int, n_prompt: int, max_tokens: int, long_every: int = 0,
            long_prompt: int = 0) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        is_long = long_every and i % long_every == 1
        size = long_prompt if is_long else n_prompt
        prompt = tuple(range(1000 * i, 1000 * i + size))  # nothing shared: no prefix to reuse
        out.append(SimRequest(t, prompt, max_tokens,
                              RequestClass.BACKGROUND if is_long else RequestClass.INTERACTIVE))
    return out


def test_a_one_sequence_unchunked_server_with_fixed_steps_waits_as_md1():
    """Every request: a 20-token prompt in one step of exactly 100 ms, its only token at the step's end.  At
    utilisation 0.6 an M/D/1 queue waits rho * D / (2 (1 - rho)) = 75 ms on average before its step starts."""
    config = EngineConfig(backend="fake", n_ctx=4096, n_seq_max=1, chunk=None, adaptive_chunk=False,
                          prefix_cache=False)
    service_ms, rate = 100.0, 6.0
    cal = one_worker(config, fixed_cost(base_ms=service_ms - 20 * 2.0, per_token_ms=2.0))
    run = simulate(config, cal, poisson(20000, rate, seed=1, n_prompt=20, max_tokens=1), seed=1)
    waits_ms = [lc.ttft_s * 1e3 - service_ms for lc in run.requests]
    rho = rate * service_ms / 1e3
    expected_ms = rho * service_ms / (2 * (1 - rho))
    assert min(waits_ms) >= -1e-6
    assert statistics.mean(waits_ms) == pytest.approx(expected_ms, rel=0.05)


def chunk_run(chunk: int, seed: int = 3):
    config = EngineConfig(backend="fake", n_ctx=8192, n_seq_max=4, chunk=chunk, adaptive_chunk=False,
                          prefix_cache=False)
    cal = one_worker(config, fixed_cost(base_ms=5.0, per_token_ms=1.0, per_decode_ms=4.0))
    run = simulate(config, cal, poisson(300, 2.0, seed, n_prompt=40, max_tokens=24, long_every=4,
                                        long_prompt=800), seed=seed)
    interactive = [lc for lc in run.requests if lc.request_class is RequestClass.INTERACTIVE]
    ttft = statistics.mean(lc.ttft_s for lc in run.requests)
    gaps = sorted(max(lc.itl_s) for lc in interactive)
    return ttft, gaps[int(0.9 * len(gaps))]


def test_a_smaller_chunk_lowers_the_largest_gap_and_raises_the_ttft():
    ttft_small, gap_small = chunk_run(16)
    ttft_large, gap_large = chunk_run(256)
    assert gap_small < gap_large * 0.5
    assert ttft_small > ttft_large


def adaptive_run(seed: int):
    config = EngineConfig(backend="fake", n_ctx=8192, n_seq_max=4, chunk=256, adaptive_chunk=True,
                          prefix_cache=False)
    cost = StepCost(fixed_cost(8.0, 1.5, 6.0).coef, (-0.1, 0.0, 0.15), 0.9, 0.1, (0.5, 1.0, 2.0), 100)
    cal = one_worker(config, cost, prepare_ms=1.0)
    return simulate(config, cal, poisson(120, 1.5, seed, n_prompt=40, max_tokens=32, long_every=4,
                                         long_prompt=400), seed=seed, keep_steps=True)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    a, b, c = adaptive_run(5), adaptive_run(5), adaptive_run(6)
    assert [lc.token_times_s for lc in a.requests] == [lc.token_times_s for lc in b.requests]
    assert [lc.token_times_s for lc in a.requests] != [lc.token_times_s for lc in c.requests]


def test_a_change_to_a_policy_object_changes_the_twin(monkeypatch):
    """The twin runs the step policy's own code: a step aiming at 40 % of the ITL budget instead of 85 % cuts
    smaller prompt slices, which the twin's steps then show, with nothing of the twin changed."""
    before = adaptive_run(5)
    monkeypatch.setattr(steppolicy, "STEP_SHARE_OF_ITL", 0.4)
    after = adaptive_run(5)

    def prompt_per_mixed_step(run):
        return statistics.mean(sum(n for _, n in s.prefill) for s in run.steps if s.prefill and s.decode_request_ids)

    assert [lc.token_times_s for lc in before.requests] != [lc.token_times_s for lc in after.requests]
    assert prompt_per_mixed_step(after) < prompt_per_mixed_step(before) * 0.8


def test_a_mode_s_routing_is_the_topology_s_own():
    """Replicas: the twin asks the replicas topology where each request goes; two replicas share the work."""
    config = EngineConfig(backend="fake", mode=Mode.REPLICAS, n_replicas=2, n_ctx=4096, n_seq_max=2, chunk=64,
                          adaptive_chunk=False, prefix_cache=False)
    base = one_worker(config, fixed_cost(5.0, 1.0, 4.0))
    w = base.workers[0]
    cal = Calibration("replicas", tuple(WorkerCalibration(f"replica-{i}", w.spec, w.cost) for i in range(2)))
    run = simulate(config, cal, poisson(60, 3.0, 2, n_prompt=30, max_tokens=8), seed=2)
    routed = {lc.routed_to for lc in run.requests}
    assert routed == {"replica-0", "replica-1"}
    assert all(lc.ended_s is not None for lc in run.requests)


def replicas_with_prefix_caches() -> tuple[EngineConfig, Calibration]:
    """Two replicas whose caches keep finished prefixes (reused by any later prompt that shares them)."""
    config = EngineConfig(backend="fake", mode=Mode.REPLICAS, n_replicas=2, n_ctx=4096, n_seq_max=2, chunk=64,
                          adaptive_chunk=False, prefix_cache=True)
    w = one_worker(config, fixed_cost(5.0, 1.0, 4.0)).workers[0]
    spec = replace(w.spec, max_cached_cells=2048, n_cached_ids=2)
    reuse = replace(w.reuse, mode=ReuseMode.PREFIX.value)
    return config, Calibration("replicas", tuple(WorkerCalibration(f"replica-{i}", spec, w.cost, reuse)
                                                 for i in range(2)))


def test_the_twin_routes_by_what_each_worker_holds_as_the_controller_does():
    """Replicas with a prefix cache: a document's later questions go where its first one was prefilled (the
    controller's ``PrefixAffinity``, fed as the engine feeds it), and reuse it there; prompts that share nothing
    go by load."""
    config, cal = replicas_with_prefix_caches()
    document = tuple(range(5000, 5300))
    requests = [SimRequest(1.0 * i, (document if i % 2 == 0 else (9000 + i,) * 50)
                           + tuple(range(100 * i, 100 * i + 8)), 4) for i in range(24)]
    run = simulate(config, cal, requests, seed=4)
    first = run.requests[0].routed_to
    later = run.requests[2::2]
    assert all(lc.routed_to == first and lc.route_reason == "prefix_hit" for lc in later)
    assert all(lc.route_cached_tokens >= len(document) and lc.n_cached_tokens >= len(document) for lc in later)


def test_a_prompt_arriving_at_an_idle_worker_pays_its_measured_cold_step():
    """Requests 5 s apart (the worker idles between them): with ``StepCost.cold_ms`` 45 each one's first step, its
    TTFT, takes 45 ms longer; the decode steps that follow it straight away do not."""
    config = EngineConfig(backend="fake", mode="colocated", n_ctx=4096, n_seq_max=2, chunk=None,
                          adaptive_chunk=False, prefix_cache=False)
    warm = fixed_cost(5.0, 1.0, 4.0)
    requests = [SimRequest(5.0 * i, tuple(range(1000 * i, 1000 * i + 40)), 4) for i in range(6)]
    runs = [simulate(config, one_worker(config, cost), requests, seed=1)
            for cost in (warm, replace(warm, cold_ms=45.0))]
    for quiet, cold in zip(*(run.requests for run in runs)):
        assert cold.ttft_s == pytest.approx(quiet.ttft_s + 0.045, rel=0.01)
        decoding = [lc.token_times_s[-1] - lc.first_token_s for lc in (quiet, cold)]
        assert decoding[1] == pytest.approx(decoding[0], rel=0.01)


def test_a_head_every_prompt_shares_is_held_by_every_worker_as_after_the_burst():
    """Every prompt starts with the same 30 tokens (the chat template's head): the controller a probe runs on has
    seen them on both replicas in its burst, so they decide nothing and requests spread by load (started empty,
    the twin had sent all of them to the first replica to hold the head)."""
    config, cal = replicas_with_prefix_caches()
    head = tuple(range(7000, 7030))
    requests = [SimRequest(0.2 * i, head + tuple(range(100 * i, 100 * i + 60)), 16) for i in range(40)]
    run = simulate(config, cal, requests, seed=5)
    share = sum(lc.routed_to == "replica-1" for lc in run.requests) / len(run.requests)
    assert 0.3 <= share <= 0.7
    assert all(lc.route_reason != "prefix_hit" for lc in run.requests)


def test_a_run_s_step_speed_says_how_much_slower_the_box_ran_than_calibrated():
    config = EngineConfig(backend="fake", n_ctx=8192, n_seq_max=4, chunk=256, adaptive_chunk=True,
                          prefix_cache=False)
    cost = StepCost(fixed_cost(8.0, 1.5, 6.0).coef, (-0.05, 0.0, 0.05), 0.0, 0.0, (0.5,), 100)
    cal = one_worker(config, cost)
    slower = one_worker(config, replace(cost, coef=tuple(c * 1.3 for c in cost.coef)))
    trace = poisson(40, 1.5, 3, n_prompt=40, max_tokens=16, long_every=4, long_prompt=300)
    as_calibrated = simulate(config, cal, trace, seed=3, keep_steps=True).steps
    on_a_slower_box = simulate(config, slower, trace, seed=3, keep_steps=True).steps
    assert step_speed(cal, as_calibrated) == pytest.approx(1.0, abs=0.03)
    assert step_speed(cal, on_a_slower_box) == pytest.approx(1.3, abs=0.05)
    assert step_speed(cal, []) is None
    # the same calibration re-priced at the speed measured: the slower box's run, step for step
    rescaled = simulate(config, at_speed(cal, 1.3), trace, seed=3, keep_steps=True).steps
    assert [s.duration_ms for s in rescaled] == pytest.approx([s.duration_ms for s in on_a_slower_box])
    assert step_speed(cal, rescaled) == pytest.approx(1.3, abs=0.05)
    with pytest.raises(ValueError, match="step speed must be positive"):
        at_speed(cal, 0.0)


def test_step_speed_is_read_against_the_burst_s_own_steps_not_the_fit_s_mean():
    """The fit follows the mean of a right-skewed spread, and the twin draws that spread back: a run on the box as
    calibrated has its median step under its price.  Read against the burst's own steps (``own_speed``), it is 1."""
    config = EngineConfig(backend="fake", n_ctx=8192, n_seq_max=4, chunk=256, adaptive_chunk=True,
                          prefix_cache=False)
    skewed = StepCost(fixed_cost(8.0, 1.5, 6.0).coef, (-0.2, -0.2, -0.2, -0.2, 0.8), 0.0, 0.0, (0.5,), 100)
    cal = one_worker(config, skewed)
    trace = poisson(40, 1.5, 3, n_prompt=40, max_tokens=16, long_every=4, long_prompt=300)
    burst = simulate(config, cal, trace, seed=3, keep_steps=True).steps
    again = simulate(config, cal, trace, seed=4, keep_steps=True).steps
    assert step_speed(cal, again) == pytest.approx(0.8, abs=0.03)   # against the fit: "a box 20 % faster"
    read = with_own_speed(cal, burst)
    assert read.workers[0].own_speed == pytest.approx(0.8, abs=0.03)
    assert step_speed(read, again) == pytest.approx(1.0, abs=0.03)  # the same box
    slower = simulate(config, at_speed(cal, 1.3), trace, seed=4, keep_steps=True).steps
    assert step_speed(read, slower) == pytest.approx(1.3, abs=0.05)
