"""Live advice in the app: what the dashboard's banner and the evidence screen show.

``advice_view`` reads the standing advice as ``GET /advice`` (its ``advice``) and the ``advice`` event carry
it; ``LocalAdvisor`` computes the same for the embedded engine (the service's profile, rule and hysteresis,
``homepd.advise.live.advice``), fed with the requests each tick finished.  No Textual here: the source's worker
thread calls it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from homepd.advise.live.advisor import Advisor
from homepd.advise.live.advice import EvidenceRow, LiveSettings, Verdict, running_candidate
from homepd.core.records import from_stored

BANNER_KINDS = ("switch", "at-capacity", "unmeasured")   # the kinds the dashboard raises a banner for
SWITCH_APPLIED = "switch-applied"                        # the event of an applied switch (serve.switch): not advice


@dataclass(frozen=True)
class AdviceView:
    kind: str
    candidate: str | None
    running: str | None
    mix: str | None
    reason: str
    confidence: str
    margin_rps: float | None
    evidence: tuple[str, ...]        # one line per evidence row
    live: str                        # the live figures in one line
    offer: str | None

    @property
    def has_banner(self) -> bool:
        return self.kind in BANNER_KINDS

    @property
    def banner(self) -> str:
        if self.kind == "switch":
            head = f"advice: {self.candidate} would serve this traffic better than {self.running}"
        elif self.kind == "at-capacity":
            head = f"advice: {self.running} is at its capacity for this traffic"
        else:
            head = "advice: this traffic lies outside the measured evidence" + (f" (try {self.offer})"
                                                                                  if self.offer else "")
        return f"{head} ({self.confidence} confidence) — press e for the evidence"


def _row_line(r: EvidenceRow) -> str:
    cap = "no passing rate" if r.capacity_rps is None else f"{r.capacity_rps:.2f} req/s"
    spread = (" or more" if r.capacity_rps is not None else "") if r.spread_rps is None \
        else f" ± {r.spread_rps:.2f}"
    return f"run {r.run_id} · {r.candidate} on {r.mix}: {cap}{spread}"


def view_of(verdict: Verdict) -> AdviceView:
    """What the banner and the evidence screen show of a standing advice."""
    live = verdict.live
    live_line = (f"{live.rate_rps:.2f} req/s over {live.window_s:g} s, {live.n_requests} requests, long prompts "
                 f"{(live.long_share or 0.0):.0%}") if live is not None else "no live figures"
    return AdviceView(verdict.kind.value, verdict.candidate, verdict.running, verdict.mix, verdict.reason,
                      verdict.confidence, verdict.margin_rps, tuple(_row_line(r) for r in verdict.evidence),
                      live_line, verdict.offer)


def advice_view(data: dict | None) -> AdviceView | None:
    """The view of a standing advice as the service sends it (``GET /advice``'s ``advice``, an ``advice``
    event), decoded once into its ``Verdict``; None for none and for an applied switch (not advice).  A reply
    of another shape raises ``RecordShapeError`` naming the field (a field it lacks that has a default, as from
    an older service, takes the default)."""
    if not data or "kind" not in data or data["kind"] == SWITCH_APPLIED:
        return None
    return view_of(from_stored(Verdict, data, "advice"))


class LocalAdvisor(Advisor):
    """Live advice for an engine the app owns (``EmbeddedSource``): ``load`` (blocking: the store), ``observe``
    each tick's finished lifecycles, ``evaluate`` -> the standing advice's view or None."""

    def __init__(self, config, db: str | None, settings: LiveSettings = LiveSettings(), clock=time.time,
                 box=None):
        super().__init__(config.class_budgets, settings, clock=clock)
        self.config, self.db = config, db
        self.box = box  # homepd.hw.probe.BoxIdentity of this box: evidence measured elsewhere does not hold

    def load(self, config=None) -> None:
        """Read the latest advise run of the model (none: no advice); ``config``: a new one (switched)."""
        # why: sqlite_utils (the store) loads with the first reading of the evidence
        from homepd.advise.live.evidence import load_live_evidence
        from homepd.store import Store

        self.config = config or self.config
        try:
            with Store.open(self.db, create=False) as store:
                self.evidence = load_live_evidence(store, self.config.model, box=self.box)
        except Exception:  # why: no store, or an unreadable one: the app runs without advice
            self.evidence = None
        self.tracker.reset(running_candidate(self.config, self.evidence))

    def observe(self, lifecycles) -> None:
        now_unix, now_mono = self.clock(), time.monotonic()
        for lc in lifecycles:
            self.count(lc, now_unix, now_mono)

    def evaluate(self) -> AdviceView | None:
        if self.evidence is None:
            return None
        self.judge_now(running_candidate(self.config, self.evidence))
        current = self.tracker.current
        return view_of(current.verdict) if current is not None else None
