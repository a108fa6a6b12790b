"""Two boxes on paper: disaggregation across two machines, projected from this box's measured KV handoffs.

Projected, not measured.  On one box the prefill worker hands a prompt's KV to the decode worker through
shared memory; on two boxes the same bytes cross Ethernet.  The model, per prompt of ``n`` tokens:

    kv_bytes   = kv_bytes_per_token * n           (kv_bytes_per_token: the median measured ratio of the
                                                   disaggregated runs' handed-off bytes to their prompt tokens)
    wire_s     = kv_bytes * 8 / (link_bit_s * PAYLOAD_EFFICIENCY) + PER_HANDOFF_LATENCY_S
    ttft_s     = the request's measured TTFT on this box + wire_s

What it assumes: every prompt crosses the wire (the prefill box prefills them all); the link is idle (one
handoff at a time, no other traffic); the export, the import and the arena copy measured here stay (the wire
adds to them, it replaces none); compute runs as fast as measured here (two boxes would not share cores,
which this does not credit).  It judges the TTFT budget only: the decode box's gaps do not depend on the
link once the KV has arrived.  Pure: samples in, a ``TwoBoxProjection`` out.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from homepd.stats import percentile

LINKS_GBIT_S = (1.0, 2.5, 10.0)
# why: TCP over IPv4 on Ethernet at MTU 1500 carries 1448 payload bytes per 1538 on the wire (preamble, frame
# header, FCS, inter-frame gap, IP and TCP headers with timestamps): 94 % of the line rate
PAYLOAD_EFFICIENCY = 1448 / 1538
# why: a switched home LAN's round trip is 0.1-0.5 ms; a handoff needs one (the decode box's acknowledgement
# before it imports), plus two system calls a side: rounded up to 1 ms
PER_HANDOFF_LATENCY_S = 1e-3
PROJECTED_NOTE = "projected, not measured"


@dataclass(frozen=True)
class HandoffSample:
    """One finished request of a disaggregated run, as the projection reads it."""
    n_prompt_tokens: int
    kv_bytes: int | None        # bytes handed off on this box (None: prefilled on the decode worker)
    ttft_s: float | None        # measured here (None: no first token; counts as missing the budget)
    is_interactive: bool = True


@dataclass(frozen=True)
class LinkProjection:
    """One link speed: the handoff time of the mix's prompts over it and the TTFT it would give."""
    link_gbit_s: float
    handoff_ms_p50: float
    handoff_ms_max: float
    ttft_ms_p99: float | None       # measured TTFT + handoff, interactive requests
    ttft_attainment: float | None   # share of interactive requests within the TTFT budget
    keeps_ttft_budget: bool | None  # attainment >= the target share (None: no interactive request)


@dataclass(frozen=True)
class TwoBoxProjection:
    """Disaggregation across two machines for one candidate and mix (projected, not measured)."""
    candidate: str
    mix: str
    kv_bytes_per_token: float | None    # None: no run here moved KV, nothing to project from
    n_prompts: int
    prompt_tokens_p50: float | None
    prompt_tokens_max: int | None
    measured_handoff_ms_p50: float | None   # this box's shared-memory handoff (prompt done -> imported)
    measured_ttft_ms_p99: float | None
    ttft_budget_ms: float
    target_share: float
    links: tuple[LinkProjection, ...]
    per_handoff_latency_ms: float = PER_HANDOFF_LATENCY_S * 1e3
    payload_efficiency: float = PAYLOAD_EFFICIENCY
    note: str = PROJECTED_NOTE
    reason: str | None = None           # why there is no projection


def wire_s(n_bytes: float, link_gbit_s: float) -> float:
    """Seconds to hand ``n_bytes`` of KV over a ``link_gbit_s`` Gbit/s Ethernet link (the model above)."""
    if link_gbit_s <= 0:
        raise ValueError(f"link speed must be > 0 Gbit/s, got {link_gbit_s}")
    return n_bytes * 8 / (link_gbit_s * 1e9 * PAYLOAD_EFFICIENCY) + PER_HANDOFF_LATENCY_S


def kv_bytes_per_token(samples: list[HandoffSample]) -> float | None:
    """The median KV bytes per prompt token of the requests that were handed off (None if none was)."""
    ratios = [s.kv_bytes / s.n_prompt_tokens for s in samples if s.kv_bytes and s.n_prompt_tokens > 0]
    return statistics.median(ratios) if ratios else None


def project(candidate: str, mix: str, samples: list[HandoffSample], *, ttft_budget_ms: float,
            target_share: float = 0.9, links_gbit_s: tuple[float, ...] = LINKS_GBIT_S,
            measured_handoff_ms: list[float] | None = None) -> TwoBoxProjection:
    """The two-box row for ``candidate`` on ``mix`` from its finished requests' ``samples`` (every repeat)."""
    per_token = kv_bytes_per_token(samples)
    prompts = [s.n_prompt_tokens for s in samples]
    interactive = [s for s in samples if s.is_interactive]
    measured_ttft = [s.ttft_s * 1e3 for s in interactive if s.ttft_s is not None]
    common = dict(candidate=candidate, mix=mix, kv_bytes_per_token=per_token, n_prompts=len(samples),
                  prompt_tokens_p50=statistics.median(prompts) if prompts else None,
                  prompt_tokens_max=max(prompts) if prompts else None,
                  measured_handoff_ms_p50=statistics.median(measured_handoff_ms) if measured_handoff_ms else None,
                  measured_ttft_ms_p99=percentile(measured_ttft, 99), ttft_budget_ms=ttft_budget_ms,
                  target_share=target_share)
    if per_token is None:
        return TwoBoxProjection(**common, links=(), reason="no KV was handed off in these runs: nothing to "
                                                           "project the wire from")
    links = []
    for gbit in links_gbit_s:
        handoff_ms = [wire_s(per_token * n, gbit) * 1e3 for n in prompts]
        ttft_ms = [None if s.ttft_s is None else s.ttft_s * 1e3 + wire_s(per_token * s.n_prompt_tokens, gbit) * 1e3
                   for s in interactive]
        within = [t is not None and t <= ttft_budget_ms for t in ttft_ms]
        attainment = sum(within) / len(within) if within else None
        links.append(LinkProjection(
            link_gbit_s=gbit, handoff_ms_p50=statistics.median(handoff_ms), handoff_ms_max=max(handoff_ms),
            ttft_ms_p99=percentile([t for t in ttft_ms if t is not None], 99), ttft_attainment=attainment,
            keeps_ttft_budget=None if attainment is None else attainment >= target_share))
    return TwoBoxProjection(**common, links=tuple(links))


def render_projection(projections: list[TwoBoxProjection]) -> str:
    """The two-box rows as text (one line per candidate, mix and link), marked projected."""
    if not projections:
        return ""
    out = [f"two boxes on paper ({PROJECTED_NOTE}): the KV handoff over Ethernet, "
           f"bytes / (link x {PAYLOAD_EFFICIENCY:.0%}) + {PER_HANDOFF_LATENCY_S * 1e3:g} ms a handoff, "
           "added to each measured TTFT",
           f"  {'candidate':<26} {'mix':<6} {'KV B/tok':>8} {'link':>9} {'handoff p50':>11} {'max':>8} "
           f"{'TTFT p99':>9} {'in budget':>9}  verdict"]
    for p in projections:
        head = f"  {p.candidate[:26]:<26} {p.mix[:6]:<6}"
        if not p.links:
            out.append(f"{head} {'NA':>8}  {p.reason}")
            continue
        for link in p.links:
            verdict = "no interactive request to judge" if link.keeps_ttft_budget is None else (
                f"keeps the {p.ttft_budget_ms:g} ms TTFT budget" if link.keeps_ttft_budget
                else f"misses the {p.ttft_budget_ms:g} ms TTFT budget")
            out.append(f"{head} {p.kv_bytes_per_token:>8.0f} {link.link_gbit_s:>5g} Gb/s "
                       f"{link.handoff_ms_p50:>8.1f} ms {link.handoff_ms_max:>5.1f} ms "
                       f"{_ms(link.ttft_ms_p99):>9} {_share(link.ttft_attainment):>9}  {verdict}")
        if p.measured_handoff_ms_p50 is not None:
            ttft = "" if p.measured_ttft_ms_p99 is None else f", TTFT p99 {_ms(p.measured_ttft_ms_p99)} ms"
            out.append(f"  {'':<33} (this box, shared memory: handoff p50 {p.measured_handoff_ms_p50:.1f} ms{ttft}: "
                       "measured)")
    return "\n".join(out)


def _ms(x: float | None) -> str:
    return "NA" if x is None else f"{x:.0f}"


def _share(x: float | None) -> str:
    return "NA" if x is None else f"{x:.0%}"
