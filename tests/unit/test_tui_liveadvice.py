"""The app's own live advice (``homepd.tui.liveadvice``): the embedded engine's finished requests judged
against the stored evidence like the service's, and the banner's view of a standing advice."""
from __future__ import annotations

import time

from homepd.advise.live.advice import LiveSettings
from homepd.config import EngineConfig
from homepd.core.admission import RequestClass
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
