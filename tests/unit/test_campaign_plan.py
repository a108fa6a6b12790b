"""The campaign's plan, without an engine: which candidates the quick campaign measures, the time each search
gets from the wall budget, which candidates the full campaign refines, and the probe verdict's throughput
target (the box keeping up with the arrivals)."""
from __future__ import annotations

import time
import types
from dataclasses import replace

import pytest

from homepd.advise.campaign.run import (FULL_SEARCH, PROBE_SHARE, AdviseSettings, Campaign, candidate_list)
from homepd.advise.campaign.capacity import CapacityCurve, Probe
from homepd.advise.campaign.probes import KEPT_UP, drain_allowance_s, probe_of
from homepd.advise.campaign.recommend import Evidence
from homepd.config import EngineConfig
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.modes import Mode
from homepd.measure.metrics import SLO
from homepd.measure.trace.model import TraceError
from homepd.measure.trace.sources import parse_duration_s

PLAN = types.SimpleNamespace(**{part: types.SimpleNamespace(feasible=True, reason="")
                                for part in ("colocated", "disaggregated", "replicas")})
BASE = EngineConfig(backend="fake", n_replicas=2, chunk=256)


def test_quick_measures_the_best_scheduler_of_colocated_and_disaggregated_and_full_every_candidate():
    quick = candidate_list(BASE, PLAN, AdviseSettings.quick_settings())
    assert [c.name for c in quick] == ["colocated-adaptive", "disaggregated-routed"]
    full = [c.name for c in candidate_list(BASE, PLAN, AdviseSettings())]
    assert full == ["colocated-unchunked", "colocated-chunk-256", "colocated-adaptive", "disaggregated",
                    "disaggregated-routed", "replicas-2"]
    # --candidates still picks any of them, quick or not
    only = candidate_list(BASE, PLAN, AdviseSettings.quick_settings(only=("replicas-2",)))
    assert [c.name for c in only] == ["replicas-2"]


def test_each_search_gets_its_share_of_the_time_left_and_its_probe_length_from_the_ttft_budget():
    campaign = Campaign(BASE, AdviseSettings())
    campaign._deadline, campaign._searches_left = time.monotonic() + 100.0, 4
    got = campaign._budgeted(FULL_SEARCH)
    assert 100 / 4 * PROBE_SHARE - 1 <= got.time_budget_s <= 100 / 4 * PROBE_SHARE
    assert got.probe_s == 22.0                        # 4 s over one 2^(1/4) grid step
    campaign._searches_left = 1                       # the last search: never more than its own budget
    assert campaign._budgeted(FULL_SEARCH).time_budget_s == FULL_SEARCH.time_budget_s
    campaign._deadline = None                         # no budget: the settings' own
    assert campaign._budgeted(FULL_SEARCH).time_budget_s == FULL_SEARCH.time_budget_s
    slow = Campaign(BASE, AdviseSettings(slo=SLO(ttft_ms=8000)))
    assert slow._budgeted(FULL_SEARCH).probe_s == 43.0
    # the refinement repeats on the answer's mix (or the one given mix), once elsewhere
    assert [campaign._repeats(m) for m in ("mixed", "short", "chat")] == [2, 1, 1]
    assert Campaign(BASE, AdviseSettings(mixes=("traffic",)))._repeats("traffic") == 2


def curve(name: str, mix: str, capacity: float | None) -> CapacityCurve:
    return CapacityCurve(name, mix, 0.9, 0.1, (), capacity, 0.2 if capacity else None, "x")


def test_the_refinement_takes_each_architectures_best_on_each_mix_and_never_an_unexercised_one():
    # the probes alone (--no-twin): the refinement measures each architecture's best finer
    campaign = Campaign(BASE, AdviseSettings(twin=False))
    cands = candidate_list(BASE, PLAN, AdviseSettings(twin=False))
    campaign.capacity = {
        ("colocated-chunk-256", "mixed"): curve("colocated-chunk-256", "mixed", 0.5),
        ("colocated-adaptive", "mixed"): curve("colocated-adaptive", "mixed", 0.71),
        ("disaggregated", "mixed"): curve("disaggregated", "mixed", 0.35),
        ("disaggregated-routed", "mixed"): curve("disaggregated-routed", "mixed", 1.0),
        ("replicas-2", "mixed"): curve("replicas-2", "mixed", None),
        ("colocated-chunk-256", "short"): curve("colocated-chunk-256", "short", 2.0),
        ("colocated-adaptive", "short"): curve("colocated-adaptive", "short", 1.41),
        ("disaggregated-routed", "short"): curve("disaggregated-routed", "short", 4.0),
        ("disaggregated", "short"): curve("disaggregated", "short", 1.0),
    }
    evidence = Evidence(cands, not_exercised={("disaggregated-routed", "short"): "no KV moved"})
    got = campaign._contenders(cands, evidence)
    assert got == {"colocated-adaptive": ("mixed",), "disaggregated-routed": ("mixed",), "replicas-2": ("mixed",),
                   "colocated-chunk-256": ("short",), "disaggregated": ("short",)}
    # nothing passed for any colocated candidate: the mode's best scheduler (listed last) is refined
    for name in ("colocated-chunk-256", "colocated-adaptive", "colocated-unchunked"):
        campaign.capacity[(name, "long")] = curve(name, "long", None)
    assert "long" in campaign._contenders(cands, evidence)["colocated-adaptive"]
    # with the twin, a mix it answered on many seeds and its checks confirmed is not refined
    twinned = Campaign(BASE, AdviseSettings())
    twinned.capacity = {key: replace(c, source="twin") for key, c in campaign.capacity.items()}
    assert twinned._contenders(cands, evidence) == {}
    # where a twin was not confirmed, its curve is its checks' own: refined where it leaves room above its
    # architecture's best answer (nothing passed: the room reaches its lowest failing rate, here none)
    twinned.capacity[("disaggregated", "mixed")] = curve("disaggregated", "mixed", None)
    twinned.capacity[("colocated-chunk-256", "mixed")] = curve("colocated-chunk-256", "mixed", 0.5)   # to 0.7
    assert twinned._contenders(cands, evidence) == {"disaggregated": ("mixed",)}
    twinned.capacity[("colocated-chunk-256", "mixed")] = curve("colocated-chunk-256", "mixed", 0.6)   # to 0.8
    assert twinned._contenders(cands, evidence) == {"colocated-chunk-256": ("mixed",), "disaggregated": ("mixed",)}


def lifecycle(i: int, arrived: float, ended: float, klass: str = "interactive", n_prompt: int = 40) -> Lifecycle:
    lc = Lifecycle(request_id=f"r{i}", arrived_s=arrived, request_class=klass, n_prompt_tokens=n_prompt)
    lc.first_token_s = arrived + 0.2
    lc.token_times_s = [arrived + 0.2 + 0.05 * k for k in range(10)]
    lc.ended_s = ended
    lc.state = RequestState.FINISHED
    return lc


def test_a_background_request_that_ends_past_the_drain_allowance_misses_the_throughput_target():
    slo = SLO()
    requests = [lifecycle(i, float(i), i + 0.7) for i in range(9)]
    speeds = (200.0, 50.0)
    allowance = drain_allowance_s(requests + [lifecycle(9, 2.0, 3.0, "background", 400)], slo, speeds)
    assert allowance == pytest.approx(4.0 + 400 / 200 + 10 * 0.05)   # TTFT budget + the longest one alone
    late = lifecycle(9, 2.0, 8.0 + allowance + 1.0, "background", 400)   # a backlog at the end of the probe
    record = types.SimpleNamespace(requests=tuple(requests + [late]), summary=types.SimpleNamespace(goodput_per_s=1))
    probe = probe_of(record, 1.0, 0, slo, speeds)
    assert probe.attainment == 0.9 and probe.misses == {KEPT_UP: 1} and probe.per_class["background"] == 0.0
    in_time = lifecycle(9, 2.0, 8.0 + allowance - 0.5, "background", 400)
    ok = types.SimpleNamespace(requests=tuple(requests + [in_time]), summary=types.SimpleNamespace(goodput_per_s=1))
    assert probe_of(ok, 1.0, 0, slo, speeds).attainment == 1.0
    # without calibrated speeds there is no allowance to check against
    assert probe_of(record, 1.0, 0, slo).attainment == 1.0
    assert probe.duration_s == pytest.approx(late.ended_s - 0.0)     # the probe as it ran


def test_budget_durations_are_read_with_units_and_bad_ones_named():
    assert [parse_duration_s(t) for t in ("30m", "90s", "1h", "45", "2.5m")] == [1800, 90, 3600, 45, 150]
    for bad in ("", "soon", "-5", "0", "inf", "3x"):
        with pytest.raises(TraceError, match="--budget"):
            parse_duration_s(bad, "--budget")


def test_a_refined_search_keeps_the_screens_records_and_reports_the_record_at_its_capacity():
    import asyncio

    from homepd.advise.campaign.run import SCREEN_SEARCH
    from homepd.advise.campaign.probes import search_capacity

    edge = 0.8  # every request meets the SLO up to 0.8 req/s, one in five misses its TTFT above
    ran: list[float] = []

    async def run_probe(rate, n, seed):
        ran.append(rate)
        reqs = []
        for i in range(n):
            lc = lifecycle(i, i / rate, i / rate + 0.7)
            if rate > edge and i % 5 == 0:
                lc.first_token_s = lc.arrived_s + 9.0   # over the 4 s TTFT
            reqs.append(lc)
        return types.SimpleNamespace(requests=tuple(reqs), summary=types.SimpleNamespace(goodput_per_s=rate))

    slo = SLO()
    coarse = replace(SCREEN_SEARCH, time_budget_s=40.0)        # a tight share of the wall budget
    screen = asyncio.run(search_capacity("c", "mixed", 1.0, coarse, 0, slo, run_probe))
    n_screen = len(ran)
    # 1.0 failed, one coarse step down 0.71 passed: adjacent on the x1.41 grid
    assert ran == pytest.approx([1.0, 2 ** -0.5]) and screen.curve.capacity_rps == pytest.approx(2 ** -0.5)
    fine = asyncio.run(search_capacity("c", "mixed", 1.0, FULL_SEARCH, 0, slo, run_probe,
                                       prior=screen.curve.probes, prior_records=screen.records))
    assert fine.curve.probes[:n_screen] == screen.curve.probes        # the screen's probes are its points
    assert ran[n_screen:] == pytest.approx([2 ** -0.25])               # bisects on: 0.84 fails
    assert fine.curve.capacity_rps == pytest.approx(2 ** -0.5) and fine.curve.spread_rps < 0.14
    assert fine.record_at_capacity is screen.records[ran[1]]           # the screen's record at 0.71, kept
    assert set(fine.records) == set(ran)                               # every probe's record, the screen's too


def test_a_probe_is_stopped_once_more_requests_missed_than_the_target_allows_and_the_unsent_count_as_misses():
    from homepd.advise.campaign.probes import decided_failing

    slo = SLO()
    stop = decided_failing(10, slo, 0.9)           # 9 of 10 must meet: one miss is allowed
    now = time.monotonic()
    good = [lifecycle(i, now - 5, now - 4) for i in range(3)]
    late = lifecycle(3, now - 20, now - 1)
    late.first_token_s = late.arrived_s + 9.0      # its TTFT missed
    assert not stop(good + [late], [])
    waiting = Lifecycle(request_id="w", arrived_s=now - 6.0)        # interactive, no first token after 6 s
    assert stop(good + [late], [waiting])
    stalled = lifecycle(5, now - 2, now)
    stalled.ended_s, stalled.state = None, RequestState.PREFILLING
    stalled.token_times_s = [now - 1.5, now - 1.3, now - 1.0]       # a 300 ms gap so far: it will miss
    assert stop(good + [late], [stalled])
    background = Lifecycle(request_id="b", arrived_s=now - 60.0, request_class="background")
    assert not stop(good + [late], [background])                    # 2 minutes to its first token
    # the probe's verdict counts what was never sent as missed
    record = types.SimpleNamespace(requests=tuple(good + [late]), summary=types.SimpleNamespace(goodput_per_s=1))
    probe = probe_of(record, 1.0, 0, slo, n_planned=10)
    assert probe.n_requests == 10 and probe.attainment == 0.3 and probe.misses == {"interactive TTFT <= 4 s": 1}
    # one cancelled by the stop: not met, and not named as any target's miss (the ones that decided it are)
    cut = lifecycle(4, now - 3, now)
    cut.state = RequestState.CANCELLED
    record = types.SimpleNamespace(requests=tuple(good + [late, cut]), summary=types.SimpleNamespace(goodput_per_s=1))
    probe = probe_of(record, 1.0, 0, slo, n_planned=10)
    assert probe.attainment == 0.3 and probe.misses == {"interactive TTFT <= 4 s": 1}


def test_the_eta_is_bounded_by_the_budget_left_and_past_it_is_the_pace_so_far():
    seen = []
    campaign = Campaign(BASE, AdviseSettings(wall_budget_s=100.0), on_progress=seen.append)
    now = time.monotonic()
    for elapsed, done, total in ((10.0, 1, 6), (90.0, 3, 6), (120.0, 5, 6)):
        campaign._t0, campaign._done, campaign._total = now - elapsed, done, total
        campaign._report("step")
    left = [p.eta_s for p in seen]
    assert left[0] == pytest.approx(50.0, abs=1.0)     # the pace so far: 10 s a step, 5 to go, within the budget
    assert left[1] == pytest.approx(10.0, abs=1.0)     # the budget left bounds it
    assert left[2] == pytest.approx(24.0, abs=1.0)     # past the budget, the last step still runs: not 0


def test_the_eta_counts_down_between_steps_and_never_under_the_steps_after_the_current_one(monkeypatch):
    import asyncio

    from homepd.advise.campaign import run as campaign_run

    seen = []
    campaign = Campaign(BASE, AdviseSettings(wall_budget_s=None), on_progress=seen.append)
    now = time.monotonic()
    campaign._t0, campaign._done, campaign._total = now - 20.0, 2, 6
    campaign._report("the twin", "colocated-adaptive")      # 10 s a step so far, 4 to go: 40 s
    said = seen[-1]
    assert said.eta_s == pytest.approx(40.0, abs=0.5)
    later = campaign.ticked(campaign._last_s + 5.0)
    assert later.eta_s == pytest.approx(35.0, abs=0.5) and later.elapsed_s == pytest.approx(said.elapsed_s + 5.0)
    assert later.current == "the twin" and later.candidate == "colocated-adaptive"
    assert (later.done, later.total) == (2, 6)
    stuck = campaign.ticked(campaign._last_s + 25.0)        # the stage overran: the 3 steps after it still take 30 s
    assert stuck.eta_s == pytest.approx(30.0, abs=0.5)
    campaign._done = campaign._total = 6
    campaign._report("recommendation")
    assert campaign.ticked(time.monotonic() + 5.0) is None  # nothing left to count down

    bounded = Campaign(BASE, AdviseSettings(wall_budget_s=50.0), on_progress=seen.append)
    bounded._t0, bounded._done, bounded._total = time.monotonic() - 20.0, 2, 6
    bounded._report("the twin")                              # 40 s at the pace so far, 30 s of budget left
    assert seen[-1].eta_s == pytest.approx(30.0, abs=0.5)
    assert bounded.ticked(bounded._last_s + 5.0).eta_s == pytest.approx(25.0, abs=0.5)   # the budget, counted down
    assert bounded.ticked(bounded._last_s + 40.0).eta_s == pytest.approx(30.0, abs=0.5)  # past it: the pace

    # the campaign's own ticker says it between the steps
    monkeypatch.setattr(campaign_run, "PROGRESS_TICK_S", 0.01)

    async def ticks() -> list:
        got, heard = [], asyncio.Event()

        def on_progress(p):
            got.append(p)
            if len(got) >= 3:
                heard.set()

        ticking = Campaign(BASE, AdviseSettings(wall_budget_s=None), on_progress=on_progress)
        ticking._t0, ticking._done, ticking._total = time.monotonic() - 20.0, 2, 6
        ticking._report("the twin")
        task = asyncio.ensure_future(ticking._tick())
        await asyncio.wait_for(heard.wait(), 5.0)
        task.cancel()
        return got

    got = asyncio.run(ticks())
    assert all(p.current == "the twin" for p in got)
    assert [p.eta_s for p in got[1:]] == sorted((p.eta_s for p in got[1:]), reverse=True)
    assert got[-1].eta_s < got[0].eta_s
