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
from homepd.advise.live.advice import LiveSettings, running_candidate

BANNER_KINDS = ("switch", "at-capacity", "unmeasured")   # the kinds the dashboard raises a banner for


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


def _row_line(r: dict) -> str:
    cap = "no passing rate" if r.get("capacity_rps") is None else f"{r['capacity_rps']:.2f} req/s"
    spread = (" or more" if r.get("capacity_rps") is not None else "") if r.get("spread_rps") is None \
        else f" ± {r['spread_rps']:.2f}"
    return f"run {r.get('run_id')} · {r.get('candidate')} on {r.get('mix')}: {cap}{spread}"


def advice_view(data: dict | None) -> AdviceView | None:
    """The view of a standing advice (``GET /advice``'s ``advice``, an ``advice`` event); None for none."""
    if not data or "kind" not in data or data["kind"] == "switch-applied":
        return None
    live = data.get("live") or {}
    live_line = (f"{live.get('rate_rps', 0.0):.2f} req/s over {live.get('window_s', 0):g} s, "
                 f"{live.get('n_requests', 0)} requests, long prompts "
                 f"{(live.get('long_share') or 0.0):.0%}") if live else "no live figures"
    return AdviceView(str(data["kind"]), data.get("candidate"), data.get("running"), data.get("mix"),
                      str(data.get("reason", "")), str(data.get("confidence", "low")), data.get("margin_rps"),
                      tuple(_row_line(r) for r in data.get("evidence") or ()), live_line, data.get("offer"))


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
        return advice_view(current.to_dict()) if current is not None else None
