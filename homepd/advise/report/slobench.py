"""``homepd bench slo``'s figures, pure: a probe's client-side record, the curve of fixed rates, and the one
table (printed by the command and by ``homepd history show`` for a stored ``bench-slo`` run).

A probe is one seeded trace replayed on a server at one rate; its requests' lifecycles come from the client's
clock (``homepd.bench.client``).  The attainment and the target that failed are ``probe_of``'s, with the SLO
of advise (``homepd.measure.metrics.SLO``), so a server outside homepd is judged exactly as advise judges a
candidate.  Everything stored is plain data (``target_result``), so the history renders it without the face.
"""
from __future__ import annotations

from homepd.advise.campaign.capacity import CapacityCurve, Probe
from homepd.advise.campaign.probes import probe_of
from homepd.core.lifecycle import Lifecycle
from homepd.stats import percentile
from homepd.measure.metrics import SLO, summarize
from homepd.measure.replay import RunRecord

KIND = "bench-slo"                      # the store's run kind
CLIENT_MODE = "http-client"             # RunRecord.mode of a probe measured over HTTP


def client_record(lifecycles: list[Lifecycle], trace_name: str, slo: SLO, config: dict) -> RunRecord:
    """A probe's run record from client-side lifecycles: no step log, no worker events, no memory (the
    server is a black box), every latency figure of ``summarize``."""
    return RunRecord(mode=CLIENT_MODE, config=config, trace_name=trace_name, summary=summarize(lifecycles, [], slo),
                     stalls=(), worker_events=(), memory=(), kv_arena_bytes=0, energy_j={},
                     requests=tuple(lifecycles))


def probe_figures(record: RunRecord, rate_rps: float, seed: int, slo: SLO) -> tuple[Probe, dict]:
    """The search's ``Probe`` of a record, and the figures the table shows of it (ms): TTFT p50/p90 and the
    p50/p90 over requests of each request's largest gap, failed requests and the first error text."""
    probe = probe_of(record, rate_rps, seed, slo)
    ttfts = [lc.ttft_s * 1e3 for lc in record.requests if lc.ttft_s is not None]
    ttfas = [lc.ttfa_s * 1e3 for lc in record.requests if lc.ttfa_s is not None]
    max_gaps = [max(lc.itl_s) * 1e3 for lc in record.requests if lc.itl_s]
    errors = [lc.error for lc in record.requests if lc.error]
    return probe, {
        "rate_rps": rate_rps, "n_requests": probe.n_requests, "attainment": probe.attainment,
        "per_class": probe.per_class, "misses": probe.misses, "seed": seed,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
        "ttfa_p50_ms": percentile(ttfas, 50), "ttfa_p90_ms": percentile(ttfas, 90),
        "max_gap_p50_ms": percentile(max_gaps, 50), "max_gap_p90_ms": percentile(max_gaps, 90),
        "n_failed": record.summary.n_failed, "first_error": errors[0] if errors else None}


def target_result(name: str, url: str, model: str, curve: CapacityCurve, figures: list[dict]) -> dict:
    """One server's stored answer (plain data): its capacity, bracket, decision and every probe's figures in
    rate order; ``at`` the figures of the probe at the capacity (the lowest rate's when none passed)."""
    by_rate = sorted(figures, key=lambda f: f["rate_rps"])
    at_rate = curve.capacity_rps if curve.capacity_rps is not None else (by_rate[0]["rate_rps"] if by_rate else None)
    at = next((f for f in by_rate if f["rate_rps"] == at_rate), None)
    return {"name": name, "url": url, "model": model, "mix": curve.mix, "target_share": curve.target_share,
            "capacity_rps": curve.capacity_rps, "spread_rps": curve.spread_rps, "decided_by": curve.decided_by,
            "probes": by_rate, "at": at}


def headline(results: list[dict]) -> str:
    """The one line the history lists: each server's capacity."""
    return "; ".join(f"{r['name']} {_rps(r['capacity_rps'])}" for r in results)


def _rps(x: float | None) -> str:
    return "< lowest rate" if x is None else f"{x:.3g} req/s"


def _ms(x: float | None) -> str:
    return "NA" if x is None else f"{x:.0f}"


def render_table(results: list[dict], slo_text: str = "") -> str:
    """The table: per server, capacity, bracket, attainment per probed rate, TTFT and max-gap p50/p90 at
    the capacity (ms), and the SLO target that failed most."""
    share = results[0]["target_share"] if results else 0.9
    lines = [f"SLO capacity: the highest rate with >= {share:.0%} of requests within every SLO of their class"
             + (f" ({slo_text})" if slo_text else "") + ", by the client's clock"]
    name_w = max([len("server"), *(len(r["name"]) for r in results)]) + 2
    head = (f"{'server':<{name_w}}{'capacity':>13}  {'bracket':<19}{'TTFT p50/p90':>14}{'TTFA p50/p90':>14}"
            f"{'max-gap p50/p90':>17}  decided by")
    lines += [head, "-" * len(head)]
    for r in results:
        cap, spread = r["capacity_rps"], r["spread_rps"]
        if cap is None:
            bracket = "-"
        elif spread is None:
            bracket = f">= {cap:.3g} (no failure)"
        else:
            bracket = f"{cap:.3g} .. {cap + spread:.3g} (+{spread:.2g})"
        at = r.get("at") or {}
        lines.append(f"{r['name']:<{name_w}}{_rps(cap):>13}  {bracket:<19}"
                     f"{_ms(at.get('ttft_p50_ms')) + '/' + _ms(at.get('ttft_p90_ms')):>14}"
                     f"{_ms(at.get('ttfa_p50_ms')) + '/' + _ms(at.get('ttfa_p90_ms')):>14}"
                     f"{_ms(at.get('max_gap_p50_ms')) + '/' + _ms(at.get('max_gap_p90_ms')):>17}  {r['decided_by']}")
        curve = "  ".join(f"{p['rate_rps']:.3g}/s {p['attainment']:.0%}" + (f" ({p['n_failed']} failed)"
                                                                            if p["n_failed"] else "")
                          for p in r["probes"])
        lines.append(f"{'':<{name_w}}attainment per rate: {curve or 'none'}")
        errors = next((p["first_error"] for p in r["probes"] if p.get("first_error")), None)
        if errors:
            lines.append(f"{'':<{name_w}}first error: {errors[:120]}")
    lines.append("(TTFT, TTFA (the first answer token, past any reasoning) and max gap in ms, at the capacity's probe, or the lowest rate's when none passed; "
                 f"model: {', '.join(sorted({r['model'] for r in results})) or '-'})")
    return "\n".join(lines)
