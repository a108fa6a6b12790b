"""The two-queue mechanism replayed on recorded runs: the real scheduler and step policy plan every step of
the recorded trace, each step costing what it cost the recorded box (``step_replay``).  What the recordings
themselves measured (their over-budget shares, worst gaps, TTFT prediction errors) is printed by
``benchmarks/recorded_steps.py``, not tested.
"""
from __future__ import annotations

import pytest

import homepd.core.steppolicy as steppolicy
from homepd.core.stepmodel import OnlineStepModel

from step_replay import RecordedCost, load, simulate, step_shape

RECORDINGS = ("steps-chunk32.json", "steps-adaptive.json")


@pytest.fixture(scope="module", params=RECORDINGS)
def recording(request):
    """A recording and its box's step cost (each recording fits its own: the box was busier on one)."""
    rec = load(request.param)
    return rec, RecordedCost.from_recording(rec)


def test_adaptive_budget_keeps_interactive_steps_within_the_itl_budget_where_chunk_32_does_not(recording):
    rec, cost = recording
    budget_ms = rec["config"]["itl_budget_ms"]
    fixed = simulate(rec, cost, chunk=32, adaptive=False)
    adaptive = simulate(rec, cost, chunk=256, adaptive=True)
    assert fixed.over_budget_share() > 0.02 and fixed.worst_gap_ms() > 1.5 * budget_ms
    assert adaptive.over_budget_share() <= 0.005 and adaptive.worst_gap_ms() <= budget_ms


def test_adaptive_budget_shrinks_beside_interactive_decodes_and_opens_without_them(recording):
    rec, cost = recording
    run = simulate(rec, cost, chunk=256, adaptive=True)
    ids = run.interactive_ids()
    beside = [s for s in run.steps if s.prefill and ids.intersection(s.decode)]
    alone = [s for s in run.steps if s.prefill and not ids.intersection(s.decode)]
    assert beside and alone
    assert all(sum(n for _, n in s.prefill) <= s.budget for s in run.steps)
    assert max(s.budget for s in beside) < 256 // 4          # what the ITL allows, far below the chunk
    assert max(s.budget for s in alone) >= 256 - 8           # nobody waits on a token: the whole chunk
    by_decodes: dict[int, list[int]] = {}                     # more decodes leave fewer prompt tokens
    for s in beside:
        by_decodes.setdefault(len(s.decode), []).append(s.budget)
    counts = sorted(k for k, v in by_decodes.items() if len(v) >= 5)
    assert len(counts) >= 2
    fewer, more = by_decodes[counts[0]], by_decodes[counts[-1]]
    # the most the budget gave (these recordings' box priced a prompt token at ~5 ms: most budgets sit at the
    # floor of 4 tokens whatever the decodes, and their means differ by the noise's draws)
    assert max(fewer) > max(more)


@pytest.mark.parametrize("chunk,adaptive", [(32, False), (256, True)])
def test_interactive_prompts_are_served_before_background_ones_and_everything_completes(recording, chunk, adaptive):
    rec, cost = recording
    run = simulate(rec, cost, chunk=chunk, adaptive=adaptive)
    assert not run.class_order_violations()
    interactive = [r for r in run.requests.values() if r.request_id in run.interactive_ids()]
    assert max(r.ttft_s for r in interactive) < 1.5  # the budget is 4 s
    assert all(len(r.token_times_s) == r.max_tokens == 48 for r in run.requests.values())  # documents too


def test_the_replay_sees_a_broken_policy(recording, monkeypatch):
    """The checks above can fail: a full chunk beside interactive decodes breaks the ITL budget, and
    serving prompts in arrival order puts documents ahead of waiting interactive prompts."""
    rec, cost = recording
    full_chunk = simulate(rec, cost, chunk=256, adaptive=False)
    assert full_chunk.worst_gap_ms() > 5 * rec["config"]["itl_budget_ms"]
    monkeypatch.setattr(steppolicy, "prompt_order", lambda prompts, *args, **kwargs: list(prompts))
    arrival_order = simulate(rec, cost, chunk=256, adaptive=True)
    assert len(arrival_order.class_order_violations()) >= 10
    assert max(r.ttft_s for r in arrival_order.requests.values() if r.request_id in arrival_order.interactive_ids()) > 2.0


def test_online_model_predicts_the_recorded_steps():
    """Fed the adaptive recording one step at a time, each step is predicted before it is seen."""
    rec = load("steps-adaptive.json")
    model = OnlineStepModel()
    errors, durations = [], []
    for s in rec["steps"]:
        est = model.estimate()
        if est is not None:
            errors.append(abs(est.predict_ms(*step_shape(s)) - s["duration_ms"]))
            durations.append(s["duration_ms"])
        model.observe(*step_shape(s), s["duration_ms"])
    errors.sort()
    assert errors[len(errors) // 2] < 0.25 * sum(durations) / len(durations)
    final = model.estimate()
    assert final.ms_per_prompt_token > 0.5 and final.ms_per_kv_ktoken > 0  # attention over the cells in use costs
