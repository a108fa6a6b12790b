"""Live advice in the service: the traffic profile, the stored evidence, the verdict every few seconds.

Each finished request is judged against its class's SLO and counted in the ``TrafficProfile`` (a few
dictionary updates on the loop: nothing blocks).  At start the profile is rebuilt from the store's traffic
table (the last window's worth, with each request's SLO verdict), so a restart keeps it, and the evidence is
the latest advise run of the served model (``load_live_evidence``, re-read every ``EVIDENCE_REFRESH_S``), both
read off the loop.  Every ``advice_period_s`` (or on ``POST /advice/evaluate``) the verdict is judged
(``homepd.advise.live.advice.judge``) and, through the hysteresis, raised as advice: an ``advice`` event on
``/events``, a log line, ``/metrics`` and ``GET /advice``.  With ``--auto-apply INTERVAL`` a raised switch is
applied (``homepd.serve.switch``) at most once per interval.

When the evidence's run calibrated its candidates (the twin), every ``TWIN_PERIOD_S`` the judged window's
recorded requests are replayed in each candidate's twin (``homepd.advise.live.twinned``), in a child process at
the lowest CPU priority (the twin is pure Python: in this process it would hold the event loop's GIL, and on a
small box it must not take cores from serving), and the verdict is each candidate's projected attainment on
today's traffic instead of the nearest measured mix's capacity.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from homepd.advise.live.advisor import Advisor
from homepd.advise.live.advice import AdviceKind, LiveSettings, Verdict, running_candidate
from homepd.advise.campaign.traffic import traffic_source, units_of
from homepd.advise.live.twinned import replay_window
from homepd.config.origin import ConfigSource
from homepd.core.records import to_plain
from homepd.errors import ConfigError
from homepd.measure.metrics import interference
from homepd.measure.profile import FinishedRequest
from homepd.models.resolve import resolve_model
from homepd.twin.traces import of_trace

log = logging.getLogger("homepd.serve")
EVIDENCE_REFRESH_S = 60.0
INTERFERENCE_STEPS = 2000
TWIN_PERIOD_S = 60.0      # the window is replayed in the twins this often at most
TWIN_MAX_REQUESTS = 400   # the window's newest requests replayed at most (a busy window would take minutes)


class LiveAdvisor(Advisor):
    def __init__(self, service, clock=time.time):
        s = service.settings
        super().__init__(service.config.class_budgets,
                         LiveSettings(window_s=s.advice_windows_s[0], hysteresis_s=s.advice_hysteresis_s,
                                      min_requests=s.advice_min_requests), s.advice_windows_s, clock)
        self.service = service
        self.evidence_error: str | None = None
        self._evidence_at_s = -float("inf")
        self.n_restored = 0
        self.n_events: dict[str, int] = {}
        self.switches: deque[dict] = deque(maxlen=20)
        self.last_switch_unix_s: float | None = None
        self._identity = None
        self._replayed_at_s = -float("inf")
        self._tokenizer = None
        self._units = None
        self._pool = None
        self.replay_error: str | None = None

    # the store, off the loop ------------------------------------------------------------------------
    def _box(self):
        """This box, as the evidence must have been measured on it (probed once; blocking)."""
        if self._identity is None:
            # why: psutil (the probe) loads when the box is first needed
            from homepd.hw.probe import identity, probe

            self._identity = identity(probe())
        return self._identity

    def load(self, restore: bool = True) -> None:
        """Read the evidence (and, at start, the recorded traffic of the longest window).  Blocking."""
        # why: sqlite_utils (the store) loads with the first reading of the evidence
        from homepd.advise.live.evidence import load_live_evidence
        from homepd.store import Store, StoreError
        from homepd.store.traffic import traffic_since

        self._evidence_at_s = time.monotonic()
        try:
            with Store.open(self.service.settings.db, create=False) as store:
                self.evidence = load_live_evidence(store, self.service.config.model, self.evidence, self._box())
                if restore:
                    now = self.clock()
                    rows = traffic_since(store, now - max(self.profile.windows_s), now)
                    for r in rows:
                        self.profile.observe(FinishedRequest(r.arrived_unix_s, r.request_class, r.n_prompt_tokens,
                                                             r.n_output_tokens, r.n_cached_tokens, r.slo_met))
                    self.n_restored = len(rows)
            self.evidence_error = None
        except Exception as exc:  # why: advice must never keep the service from serving (a store it cannot read)
            error = str(exc) if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
            if error != self.evidence_error:
                log.warning("homepd: live advice has no evidence: %s", error)
            self.evidence_error = error
        if self.tracker.standing[1] is None:
            self.tracker.reset(self.running())

    # the loop's side ----------------------------------------------------------------------------------
    def observe(self, lc) -> bool:
        """Count a finished request; return whether it met its class's SLO."""
        return self.count(lc)

    def running(self) -> str | None:
        """The candidate the service runs: the applied one, else the evidence's whose values match."""
        origin = self.service.origin
        applied = origin.candidate if origin.source is ConfigSource.ADVICE else None
        return running_candidate(self.service.config, self.evidence, applied)

    def evaluate(self) -> Verdict:
        """Judge the traffic now; raise advice through the hysteresis (event, log line, counters)."""
        engine = self.service.engine
        slowdown = interference(engine.last_steps(INTERFERENCE_STEPS)).slowdown if engine is not None else None
        verdict, event = self.judge_now(self.running(), slowdown)
        if event is not None:
            kind = event.verdict.kind.value
            self.n_events[kind] = self.n_events.get(kind, 0) + 1
            log.info("homepd: advice (%s): %s", kind, event.verdict.reason)
            self.service.publish("advice", event.to_dict())
            if self._may_auto_apply(event.verdict, event.raised_unix_s):
                self.service.spawn_switch(event.verdict.candidate, "auto-apply")
        return verdict

    def _may_auto_apply(self, verdict: Verdict, now: float) -> bool:
        interval = self.service.settings.auto_apply_interval_s
        return (interval is not None and verdict.kind is AdviceKind.SWITCH and verdict.candidate is not None
                and (self.last_switch_unix_s is None or now - self.last_switch_unix_s >= interval))

    async def run(self) -> None:
        """Evaluate every ``advice_period_s``; re-read the evidence every ``EVIDENCE_REFRESH_S``; replay the window
        in the twins every ``TWIN_PERIOD_S``."""
        while True:
            await asyncio.sleep(self.service.settings.advice_period_s)
            if time.monotonic() - self._evidence_at_s >= EVIDENCE_REFRESH_S:
                await asyncio.to_thread(self.load, False)
            if self.service.state == "ready" and time.monotonic() - self._replayed_at_s >= TWIN_PERIOD_S:
                await self.replay()
            if self.service.state == "ready":
                try:
                    self.evaluate()
                except Exception:  # why: a bug in the advice must not end it for good, nor touch serving
                    log.exception("homepd: live advice: evaluation failed")

    async def replay(self) -> None:
        """Replay the judged window's recorded requests in each calibrated candidate's twin (``self.replays``)."""
        self._replayed_at_s = time.monotonic()
        twins = list(self.evidence.twins) if self.evidence is not None and not self.evidence.foreign else []
        if not twins:
            self.replays = []
            return
        try:
            window = await asyncio.to_thread(self._window)
            if window is None:
                self.replays = []
                return
            requests, rate = window
            loop = asyncio.get_running_loop()
            self.replays = await loop.run_in_executor(self._twin_pool(), replay_window, requests, twins, self.slo,
                                                      rate)
            self.replay_error = None
        except Exception as exc:  # why: a replay that fails keeps the advice on the measured mixes, never the service
            error = f"{type(exc).__name__}: {exc}"
            if error != self.replay_error:
                log.warning("homepd: live advice: replaying the window in the twins failed: %s", error)
            self.replay_error, self.replays = error, []

    def _window(self):
        """The judged window's recorded requests, tokenized as the engine does (blocking: the store, the model's
        vocabulary); None when the window holds too few."""
        # why: jinja2 (the tokenizer's chat templates) loads with the first replay, not with the service
        from homepd.engine.tokenizer import PromptTokenizer

        config = self.service.config
        if self._tokenizer is None:
            model_path = str(resolve_model(config.model, pull=False, progress=False))
            self._units = units_of(config.backend, model_path)
            self._tokenizer = PromptTokenizer(config, model_path)
        try:
            source = traffic_source(f"{self.settings.window_s:g}s", self.service.settings.db, self._units)
        except ConfigError:
            return None  # nothing recorded in the window
        trace = source.trace()
        requests = list(trace)[-TWIN_MAX_REQUESTS:]
        if len(requests) < self.settings.min_requests:
            return None
        t0 = requests[0].arrival_s
        shifted = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in requests]
        span = max(1e-3, shifted[-1].arrival_s)
        return of_trace(shifted, [tuple(self._tokenizer(r)) for r in shifted]), len(shifted) / span

    def _twin_pool(self):
        if self._pool is None:
            # why a spawned process: the twin is pure Python (here it would hold the GIL the event loop needs),
            # and at the lowest priority it takes no core that serving wants
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=os.nice, initargs=(19,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._tokenizer is not None:
            self._tokenizer.close()
            self._tokenizer = None

    def switched(self, record: dict) -> None:
        """A switch happened (``homepd.serve.switch``): keep it, and judge afresh from the new configuration."""
        self.last_switch_unix_s = self.clock()
        self.switches.append(record)
        self.n_events["switch-applied"] = self.n_events.get("switch-applied", 0) + 1
        self.tracker.reset(self.running())

    # what /advice and /metrics show ------------------------------------------------------------------
    def to_dict(self) -> dict:
        ev = self.evidence
        return {
            "enabled": True, "running": self.running(),
            "current": self.verdict.to_dict() if self.verdict else None,
            "advice": self.tracker.current.to_dict() if self.tracker.current else None,
            "history": [e.to_dict() for e in self.tracker.history],
            "evidence": None if ev is None else {
                "run_id": ev.run_id, "model": ev.model, "measured_on": ev.measured_on, "foreign": ev.foreign,
                "rows": [r.to_dict() for r in ev.rows],
                "shapes": {m: to_plain(s) for m, s in ev.shapes.items()}, "candidates": sorted(ev.configs)},
            "evidence_error": self.evidence_error,
            "profile": [w.to_dict() for w in self.profile.windows(self.clock())],
            "n_restored": self.n_restored, "events": dict(self.n_events),
            "settings": {"window_s": self.settings.window_s, "hysteresis_s": self.settings.hysteresis_s,
                         "min_requests": self.settings.min_requests,
                         "period_s": self.service.settings.advice_period_s,
                         "auto_apply_interval_s": self.service.settings.auto_apply_interval_s},
            "switches": list(self.switches),
            "twins": {"candidates": [t.candidate for t in (ev.twins if ev else ())],
                      "replayed": [r.to_dict() for r in self.replays], "error": self.replay_error,
                      "period_s": TWIN_PERIOD_S},
        }


class AdviceCollector:
    """``/metrics``: ``homepd_advice{candidate,kind}`` (1 for the standing advice), headroom and capacity per
    candidate on the matched mix, the live rate, and the advice events by kind."""

    def __init__(self, advisor: LiveAdvisor):
        self.advisor = advisor

    def collect(self):
        a = self.advisor
        kind, candidate = a.tracker.standing
        standing = GaugeMetricFamily("homepd_advice", "1 for the standing advice: its kind and candidate",
                                     labels=["candidate", "kind"])
        standing.add_metric([candidate or "", kind.value], 1.0)
        yield standing
        v = a.verdict
        if v is not None:
            yield GaugeMetricFamily("homepd_advice_live_rate_rps", "Arrival rate in the advice's window",
                                    value=v.live.rate_rps if v.live else 0.0)
            head = GaugeMetricFamily("homepd_advice_headroom_ratio", "Capacity on the matched mix / the live rate",
                                     labels=["candidate", "mix"])
            cap = GaugeMetricFamily("homepd_advice_capacity_rps", "Measured capacity on the matched mix",
                                    labels=["candidate", "mix"])
            for h in v.headroom:
                if h.headroom is not None:
                    head.add_metric([h.candidate, v.mix or ""], h.headroom)
                if h.capacity_rps is not None:
                    cap.add_metric([h.candidate, v.mix or ""], h.capacity_rps)
            yield head
            yield cap
        events = CounterMetricFamily("homepd_advice_events", "Advice raised (and switches applied), by kind",
                                     labels=["kind"])
        for k, n in sorted(a.n_events.items()):
            events.add_metric([k], n)
        yield events
