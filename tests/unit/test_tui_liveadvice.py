"""The app's own live advice (``homepd.tui.liveadvice``): the embedded engine's finished requests judged
against the stored evidence like the service's, and the banner's view of a standing advice."""
from __future__ import annotations

import time

from homepd.advise.live.advice import LiveSettings
from homepd.config import EngineConfig
from homepd.core.terms import RequestClass
from homepd.tui.liveadvice import LocalAdvisor, advice_view

from live_evidence import CO, DI, record, store_evidence

I, B = RequestClass.INTERACTIVE, RequestClass.BACKGROUND


def test_the_embedded_app_raises_switch_advice_from_its_own_requests(tmp_path):
    db = tmp_path / "runs.db"
    run = store_evidence(db, {"short": (54, I, 8), "long": (625, B, 8)},
                         {(CO, "short"): (64.0, 8.0), (DI, "short"): (16.0, 4.0), (CO, "long"): (4.0, 1.0),
                          (DI, "long"): (32.0, 8.0)})
    advisor = LocalAdvisor(EngineConfig(backend="fake"), str(db), LiveSettings(window_s=60.0, hysteresis_s=0.0,
                                                                               min_requests=4))
    advisor.load()
    assert advisor.evaluate() is None                       # nothing served yet: nothing stands
    t0 = time.monotonic() - 20.0
    advisor.observe(record("short", 54, I, 8, t0_s=t0).requests)
    assert advisor.evaluate() is None                       # chats: keep the running one, nothing to raise
    advisor.observe(record("long", 625, B, 8, n_requests=40, t0_s=t0 - 30.0).requests)
    view = advisor.evaluate()
    assert (view.kind, view.candidate, view.running, view.mix) == ("switch", DI, CO, "long")
    assert view.has_banner and f"run {run} · {DI} on long: 32.00 req/s ± 8.00" in view.evidence


def test_no_store_means_no_advice_and_applied_switches_are_not_advice(tmp_path):
    advisor = LocalAdvisor(EngineConfig(backend="fake"), str(tmp_path / "missing.db"))
    advisor.load()
    assert advisor.evaluate() is None
    assert advice_view({"kind": "switch-applied", "candidate": DI}) is None and advice_view(None) is None


def test_an_advice_reply_is_decoded_once_into_its_verdict_and_a_bad_one_is_named():
    import pytest

    from homepd.advise.live.advice import AdviceKind, EvidenceRow, Verdict
    from homepd.core.records import RecordShapeError

    verdict = Verdict(AdviceKind.AT_CAPACITY, CO, CO, "short", "predicted to miss its SLO", confidence="medium",
                      evidence=(EvidenceRow(3, CO, "short", 1.5, None, 2.0), EvidenceRow(3, DI, "short", None, None, 2.0)))
    wire = {**verdict.to_dict(), "raised_unix_s": 1.0, "held_since_unix_s": 0.5, "seq": 4}  # an advice event
    view = advice_view(wire)
    assert (view.kind, view.running, view.confidence, view.live) == ("at-capacity", CO, "medium", "no live figures")
    assert view.evidence == (f"run 3 · {CO} on short: 1.50 req/s or more", f"run 3 · {DI} on short: no passing rate")
    older = {k: v for k, v in wire.items() if k not in ("offer", "headroom")}  # fields with defaults: taken
    assert advice_view(older) == view
    wire["evidence"][0]["capacity_rps"] = "fast"
    with pytest.raises(RecordShapeError, match=r"advice\.evidence\[0\]\.capacity_rps"):
        advice_view(wire)
