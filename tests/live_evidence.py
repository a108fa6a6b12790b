"""Constructed advise evidence for live advice's tests (this module holds helpers, no test): an advise run as
the campaign stores it — every candidate of a box where everything is feasible, one measured result per mix
whose requests have the given shape, and capacity curves with the given capacities and spreads."""
from __future__ import annotations

import types

from homepd.advise.campaign.capacity import CapacityCurve, Probe
from homepd.config import EngineConfig
from homepd.core.terms import RequestClass
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.modes import Mode
from homepd.core.records import to_plain
from homepd.engine.topology import topology_for
from homepd.measure.metrics import summarize
from homepd.measure.replay import RunRecord
from homepd.store import Store

CO, DI = "colocated-adaptive", "disaggregated-routed"


def candidates():
    plan = types.SimpleNamespace(**{part: types.SimpleNamespace(feasible=True, reason="")
                                    for part in ("colocated", "disaggregated", "replicas")})
    return [c for m in Mode for c in topology_for(m).advise_candidates(EngineConfig(), plan, (None, 64))]


def curve(candidate: str, mix: str, capacity_rps: float, spread_rps: float) -> CapacityCurve:
    """A curve that passed at the capacity and failed at capacity + spread."""
    probes = (Probe(capacity_rps, 10, 1.0, capacity_rps, 0, 5.0, {}),
              Probe(capacity_rps + spread_rps, 10, 0.5, None, 0, 5.0, {}, {"every gap <= 100 ms": 5}))
    return CapacityCurve(candidate, mix, 0.9, spread_rps, probes, capacity_rps, spread_rps, "every gap <= 100 ms")


def record(mix: str, n_prompt_tokens: int, request_class: RequestClass, n_output_tokens: int,
           n_requests: int = 10, t0_s: float = 100.0) -> RunRecord:
    """A run of ``n_requests`` finished requests of one shape, a second apart from ``t0_s`` (monotonic)."""
    requests = []
    for i in range(n_requests):
        t0 = t0_s + i
        lc = Lifecycle(f"{mix}-{i}", arrived_s=t0, n_prompt_tokens=n_prompt_tokens, request_class=request_class)
        lc.advance(RequestState.PREFILLING, t0 + 0.01)
        lc.advance(RequestState.DECODING, t0 + 0.05)
        for k in range(n_output_tokens):
            lc.add_token(t0 + 0.05 + 0.01 * k)
        lc.finish_reason = "length"
        lc.advance(RequestState.FINISHED, lc.token_times_s[-1])
        requests.append(lc)
    return RunRecord(mode="colocated", config={}, trace_name=mix, summary=summarize(requests, []), stalls=(),
                     worker_events=(), memory=(), kv_arena_bytes=0, energy_j={}, requests=tuple(requests))


def store_evidence(db, shapes: dict[str, tuple[int, RequestClass, int]],
                   capacities: dict[tuple[str, str], tuple[float, float]], model: str | None = None,
                   hardware: dict | None = None) -> int:
    """Store an advise run of ``model`` (default: the default model): per mix in ``shapes`` (prompt tokens,
    class, output tokens) one measured result, and a curve per (candidate, mix) in ``capacities``
    (capacity, spread); ``hardware``: the probe it stores (as ``homepd.hw.probe.to_dict``).  Returns its id."""
    cands = candidates()
    best = next(c for c in cands if c.name == CO)
    base = EngineConfig(backend="fake") if model is None else EngineConfig(backend="fake", model=model)
    with Store.open(db) as store:
        run = store.begin_run("advise", {"base": to_plain(base)}, hardware=hardware)
        for mix, (n_prompt, klass, n_output) in shapes.items():
            store.add_result(run, CO, f"{mix}@1/s", 0, record(mix, n_prompt, klass, n_output))
        store.add_recommendation(run, {
            "candidate": to_plain(best), "config": to_plain(best.config_values()), "reason": "constructed",
            "candidates": to_plain(cands),
            "capacity": [to_plain(curve(c, m, cap, spread)) for (c, m), (cap, spread) in capacities.items()]})
        store.finish_run(run)
    return run
