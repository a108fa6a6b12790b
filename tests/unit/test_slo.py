"""The SLO table: per request class, read from the engine's class budgets; a stall fails an interactive
request by default, mean TPOT and p99 gap stay selectable, and a miss names the target it missed."""
from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from homepd.config import EngineConfig
from homepd.core.terms import RequestClass
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.errors import ConfigError
from homepd.measure.metrics import SLO, SLOTarget, TokenTarget, summarize
from homepd.measure.report import add_slo_flags, slo_from_args


def request(ttft_s: float, gaps_s: list[float], klass=RequestClass.INTERACTIVE, finished=True) -> Lifecycle:
    lc = Lifecycle("r", arrived_s=0.0, request_class=klass)
    lc.advance(RequestState.PREFILLING, 0.0)
    lc.advance(RequestState.DECODING, ttft_s)
    t = ttft_s
    lc.add_token(t)
    for g in gaps_s:
        t += g
        lc.add_token(t)
    if finished:
        lc.advance(RequestState.FINISHED, t)
    return lc


def test_the_default_slo_is_the_engines_class_budgets():
    slo = SLO.from_budgets(EngineConfig().class_budgets)
    assert (slo.ttft_ms, slo.itl_ms, slo.token_target, slo.background_ttft_ms) == (
        4000.0, 100.0, TokenTarget.EVERY_GAP, 120_000.0)
    assert slo == SLO()
    tight = SLO.from_budgets(replace(EngineConfig(), itl_budget_ms=80.0, background_ttft_ms=60_000.0).class_budgets)
    assert tight.itl_ms == 80.0 and tight.background_ttft_ms == 60_000.0


def test_one_stall_fails_an_interactive_request_that_a_mean_would_pass():
    stalled = request(0.5, [0.03] * 30 + [0.15])     # mean 33 ms, one gap of 150 ms
    assert SLO().miss(stalled) is SLOTarget.TOKEN
    assert SLO(token_target=TokenTarget.MEAN_TPOT).miss(stalled) is None
    assert SLO().target_text(SLOTarget.TOKEN) == "every gap <= 100 ms"


def test_the_p99_gap_tolerates_one_gap_in_a_hundred():
    one = request(0.5, [0.03] * 149 + [0.2])
    two = request(0.5, [0.03] * 148 + [0.2, 0.2])
    p99 = SLO(token_target=TokenTarget.P99_GAP)
    assert p99.miss(one) is None and p99.miss(two) is SLOTarget.TOKEN and SLO().miss(one) is SLOTarget.TOKEN


def test_each_class_is_held_to_its_own_budgets():
    slo = SLO()
    assert slo.miss(request(5.0, [0.03])) is SLOTarget.TTFT
    # background: a first token after a minute and long gaps are fine; after 2 minutes it is not
    assert slo.miss(request(60.0, [0.5, 0.5], klass=RequestClass.BACKGROUND)) is None
    assert slo.miss(request(130.0, [0.03], klass=RequestClass.BACKGROUND)) is SLOTarget.BACKGROUND_TTFT
    # and every request must finish
    assert slo.miss(request(0.1, [0.03], klass=RequestClass.BACKGROUND, finished=False)) is SLOTarget.FINISHED


def test_goodput_counts_the_requests_meeting_their_class_slo():
    records = [request(0.5, [0.03] * 10), request(0.5, [0.03, 0.3]), request(60.0, [0.5], RequestClass.BACKGROUND)]
    s = summarize(records, [], SLO())
    assert s.n_slo_met == 2 and s.slo_attainment == pytest.approx(2 / 3)


def parse(*argv):
    p = argparse.ArgumentParser()
    add_slo_flags(p)
    return p.parse_args(list(argv))


def test_the_slo_flags_select_the_targets_over_the_class_budgets():
    budgets = replace(EngineConfig(), ttft_budget_ms=2000.0).class_budgets
    assert slo_from_args(parse(), budgets) == SLO(ttft_ms=2000.0)
    assert slo_from_args(parse("--slo-tpot-ms", "50"), budgets).token_target is TokenTarget.MEAN_TPOT
    p99 = slo_from_args(parse("--slo-token", "p99", "--slo-itl-ms", "120"), budgets)
    assert (p99.token_target, p99.itl_ms) == (TokenTarget.P99_GAP, 120.0)
    with pytest.raises(ConfigError, match="--slo-tpot-ms"):
        slo_from_args(parse("--slo-tpot-ms", "50", "--slo-itl-ms", "80"), budgets)
    with pytest.raises(ConfigError, match="--slo-ttft-ms"):
        slo_from_args(parse("--slo-ttft-ms", "-1"), budgets)
