"""The step log as a bounded stream (``homepd.measure.stepstream``): the sampler's bound, what it keeps first,
the counts over every step, and the compact JSON of ``/events``."""
from __future__ import annotations

import json

import pytest

from homepd.core.lifecycle import Lifecycle
from homepd.core.protocol import StepRecord
from homepd.core.records import RecordShapeError
from homepd.measure.stalls import attribute_gaps, attribute_stalls
from homepd.measure.stepstream import StepSample, StepSampler, TokenGaps, gaps_by_request


def decode_step(i: int, ms: float = 1.0) -> StepRecord:
    return StepRecord("colocated", i, i * 0.01, i * 0.01 + ms / 1e3, ("a", "b"), ())


def prompt_step(i: int) -> StepRecord:
    return StepRecord("colocated", i, i * 0.01, i * 0.01 + 0.005, ("a",), ((f"p{i}", 32),))


def test_a_burst_over_the_bound_yields_the_bound_and_counts_the_rest():
    sampler = StepSampler(max_steps=8)
    for i in range(100):
        sampler.add(decode_step(i, ms=1.0 + (i == 37) * 99))   # one slow step, likely not in the sample
    sample = sampler.drain(t_s=5.0)
    assert (len(sample.steps), sample.n_dropped, sample.n_steps) == (8, 92, 100)
    assert sample.n_decode_tokens == 200 and sample.max_decode_step_ms == pytest.approx(100.0)  # over all 100
    assert [s.t_start_s for s in sample.steps] == sorted(s.t_start_s for s in sample.steps)
    assert len({s.index for s in sample.steps}) == 8 and sample.t_s == 5.0
    empty = sampler.drain(t_s=5.5)                               # the next interval starts empty
    assert (empty.steps, empty.n_steps, empty.n_decode_tokens, empty.max_decode_step_ms) == ((), 0, 0, None)


def test_steps_with_prompt_tokens_are_kept_first_and_decode_only_ones_keep_a_share():
    sampler = StepSampler(max_steps=8)
    for i in range(100):
        sampler.add(decode_step(i))
    for i in range(100, 103):
        sampler.add(prompt_step(i))
    sample = sampler.drain(t_s=1.0)
    assert len(sample.steps) == 8 and {s.index for s in sample.steps if s.prefill} == {100, 101, 102}
    for i in range(200):                                          # both kinds over the bound: half each
        sampler.add(prompt_step(i) if i % 2 else decode_step(i))
    sample = sampler.drain(t_s=2.0)
    assert sum(1 for s in sample.steps if s.prefill) == 4 and len(sample.steps) == 8 and sample.n_dropped == 192


def test_under_the_bound_every_step_is_sent():
    sampler = StepSampler(max_steps=8)
    steps = [decode_step(0), prompt_step(1), decode_step(2)]
    for s in steps:
        sampler.add(s)
    assert sampler.drain(t_s=1.0) == StepSample.of(steps, 1.0)


def test_a_sample_survives_its_json_and_a_mistyped_one_is_refused_by_name():
    steps = [StepRecord("prefill", 3, 1.5, 1.75, (), (("r1", 64), ("r2", 8))),
             StepRecord("decode", 9, 1.5, 1.52, ("r0", "r3"), ()),
             StepRecord("colocated", 4, 1.6, 1.77, ("r0",), (("doc", 40),), granted_to="doc", grant_lost=True,
                        store_ms=152.5)]
    sample = StepSample.of(steps, 2.0)
    assert StepSample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample
    # an older service's step (no grant, no store time) reads as neither
    old = sample.to_dict()
    old["steps"] = [s[:6] for s in old["steps"]]
    assert [(s.granted_to, s.grant_lost, s.store_ms) for s in StepSample.from_dict(old).steps] == [(None, False, 0.0)] * 3
    body = sample.to_dict()
    body["steps"][0][4] = [7]                                       # a decode id that is not a string
    with pytest.raises(RecordShapeError, match="steps event"):
        StepSample.from_dict(body)
    with pytest.raises(RecordShapeError, match="n_decode_tokens"):
        StepSample.from_dict({k: v for k, v in sample.to_dict().items() if k != "n_decode_tokens"})


def test_token_gaps_keep_the_largest_gaps_over_the_target_and_count_them_all():
    times = [0.0, 0.05, 0.30, 0.35, 0.55, 0.60, 0.75]                 # gaps 50, 250, 50, 200, 50, 150 ms
    gaps = TokenGaps.of("r", times, itl_target_ms=100.0, limit=2)
    assert gaps.itl_max_ms == pytest.approx(250.0) and gaps.n_over == 3
    assert [(g.token_index, round(g.gap_ms)) for g in gaps.over_target] == [(2, 250), (4, 200)]
    assert TokenGaps.from_dict("r", json.loads(json.dumps(gaps.to_dict()))) == gaps
    assert TokenGaps.of("r", [1.0], 100.0).itl_max_ms is None
    with pytest.raises(RecordShapeError, match="request r: missing or mistyped field 'gaps_over'"):
        TokenGaps.from_dict("r", {"itl_max_ms": 1.0, "n_gaps_over": 0})


def test_gaps_attributed_from_the_stream_name_the_prompts_the_whole_record_would():
    lc = Lifecycle("a", 0.0)
    for t in (0.01, 0.02, 0.25, 0.26):                              # the 230 ms gap held by p's 256-token chunk
        lc.add_token(t)
    steps = [StepRecord("colocated", 0, 0.0, 0.01, ("a",), ()), StepRecord("colocated", 1, 0.01, 0.02, ("a",), ()),
             StepRecord("colocated", 2, 0.02, 0.25, ("a",), (("p", 256),)),
             StepRecord("colocated", 3, 0.25, 0.26, ("a", "p"), ())]
    whole = attribute_stalls([lc], steps, 100.0)
    streamed = attribute_gaps(gaps_by_request([TokenGaps.of("a", lc.token_times_s, 100.0)]), steps)
    assert streamed == whole and [(c.request_id, c.n_prompt_tokens) for c in whole[0].culprits] == [("p", 256)]
