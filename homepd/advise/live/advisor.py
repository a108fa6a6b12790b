"""The parts every live advisor wires: the traffic profile, each class's SLO, the evidence, and the verdict
through the hysteresis.  The service's (``homepd.serve.advice.LiveAdvisor``: store restore, events, metrics,
auto-apply) and the app's (``homepd.tui.liveadvice.LocalAdvisor``: the embedded engine) build on it.
"""
from __future__ import annotations

import time

from homepd.advise.live.advice import (AdviceEvent, AdviceTracker, LiveEvidence, LiveSettings, Verdict, judge,
                                       judge_replayed)
from homepd.core.terms import RequestClass
from homepd.measure.metrics import SLO
from homepd.measure.profile import FinishedRequest, TrafficProfile


class Advisor:
    def __init__(self, class_budgets, settings: LiveSettings, windows_s: tuple[float, ...] | None = None,
                 clock=time.time):
        """``windows_s``: the profile's windows (the first is judged; default: ``settings.window_s`` alone)."""
        self.settings, self.clock = settings, clock
        self.profile = TrafficProfile(windows_s or (settings.window_s,), since_unix_s=clock())
        self.slo = SLO.from_budgets(class_budgets)
        self.evidence: LiveEvidence | None = None
        self.tracker = AdviceTracker(None, settings.hysteresis_s)
        self.verdict: Verdict | None = None
        self.replays: list = []            # today's traffic in each candidate's twin (the latest replay)

    def arrived(self, request_class: RequestClass) -> None:
        """A request asked to be served (admitted or not): the live rate counts it now, not when it ends."""
        self.profile.arrive(self.clock(), request_class)

    def count(self, lc, now_unix_s: float | None = None, now_monotonic_s: float | None = None) -> bool:
        """Count a finished lifecycle in the profile; return whether it met its class's SLO."""
        met = self.slo.is_met_by(lc)
        self.profile.observe(FinishedRequest.of(lc, met, self.clock() if now_unix_s is None else now_unix_s,
                                                time.monotonic() if now_monotonic_s is None else now_monotonic_s))
        return met

    def judge_now(self, running: str | None, interference_slowdown: float | None = None
                  ) -> tuple[Verdict, AdviceEvent | None]:
        """The verdict on the judged window now, and the advice event it raised through the hysteresis."""
        now = self.clock()
        live = self.profile.window(self.settings.window_s, now, interference_slowdown)
        if self.replays and self.evidence is not None and self.evidence.twins and not self.evidence.foreign:
            self.verdict = judge_replayed(live, self.evidence, running, self.replays, self.settings)
        else:
            self.verdict = judge(live, self.evidence, running, self.settings)
        return self.verdict, self.tracker.update(self.verdict, now)
