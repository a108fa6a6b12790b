"""The advise result as text: the evidence table (candidates x prompt mixes x metrics), recovery, the answer."""
from __future__ import annotations

import statistics

from homepd.advise.campaign.run import AdviseResult
from homepd.advise.campaign.exercised import not_exercised_reason, splits_by_run
from homepd.advise.campaign.recommend import Recommendation
from homepd.advise.campaign.twinned import TWIN_SOURCE
from homepd.advise.report.pictures import run_projections
from homepd.advise.report.twobox import render_projection
from homepd.core.records import to_plain
from homepd.measure.memory import CATEGORIES, breakdown_mib
from homepd.measure.replay import RunRecord
from homepd.measure.report import fmt
from homepd.twin.calibration import STALL_RATIO

MIB = 2 ** 20


def _med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def evidence_rows(result: AdviseResult) -> list[dict]:
    """One row per candidate and mix: medians over repeats of the figures a reader compares."""
    colocated_pss = _med(r.total_pss_bytes for (name, _, _), r in result.records.items()
                         if name.startswith("colocated-"))
    splits = splits_by_run(result.records)
    rows = []
    for cand in result.candidates:
        if not cand.feasible:
            rows.append({"candidate": cand.name, "mix": "-", "infeasible": cand.reason})
            continue
        for mix in result.settings.mixes:
            recs: list[RunRecord] = [r for (name, m, _), r in result.records.items() if name == cand.name and m == mix]
            if not recs:
                continue
            s = [r.summary for r in recs]
            split = splits[(cand.name, mix)]
            pss = _med(r.total_pss_bytes for r in recs)
            energy = _med(sum(v for v in r.energy_j.values() if v is not None) / r.summary.n_output_tokens
                          if any(v is not None for v in r.energy_j.values()) and r.summary.n_output_tokens else None
                          for r in recs)
            curve = result.capacity.get((cand.name, mix))
            rows.append({
                "candidate": cand.name, "mix": mix, "repeats": len(recs),
                "capacity_rps": curve.capacity_rps if curve else None,
                "capacity_spread_rps": curve.spread_rps if curve else None,
                "capacity_interval_rps": list(curve.interval_rps) if curve and curve.interval_rps else None,
                "capacity_source": curve.source if curve else None,
                "twin": twin_row(result.twins.get(cand.name), mix),
                "capacity": to_plain(curve) if curve else None,
                "goodput_per_s": _med(x.goodput_per_s for x in s),
                "slo_attainment": _med(x.slo_attainment for x in s),
                "ttft_ms_p50": _med(x.ttft_ms.p50 for x in s), "ttft_ms_p99": _med(x.ttft_ms.p99 for x in s),
                "tpot_ms_p50": _med(x.tpot_ms.p50 for x in s), "itl_ms_p99": _med(x.itl_ms.p99 for x in s),
                "itl_ms_max": _med(x.itl_ms.max for x in s), "e2e_ms_p50": _med(x.e2e_ms.p50 for x in s),
                "queue_ms_p90": _med(x.queue_ms.p90 for x in s),
                "prompt_tok_s": _med(x.prompt_tok_s for x in s), "output_tok_s": _med(x.output_tok_s for x in s),
                "prompt_tokens_computed": _med(x.n_computed_prompt_tokens for x in s),
                "prompt_tokens_reused": _med(x.n_cached_prompt_tokens for x in s),
                "prompt_reused_share": _med(x.cached_prompt_share for x in s),
                "request_per_s": _med(x.request_per_s for x in s),
                "interference": _med(x.interference.slowdown for x in s),
                "interference_samples": sum(x.interference.mixed_steps for x in s),
                "kv_mb_mean": _med(x.kv.bytes_mean / 1e6 if x.kv else None for x in s),
                "kv_transfer_ms_p50": _med(x.kv.transfer_ms.p50 if x.kv else None for x in s),
                "total_pss_mib": pss / MIB if pss is not None else None,
                "memory_vs_colocated": pss / colocated_pss if pss is not None and colocated_pss else None,
                "energy_j_per_token": energy,
                "n_stalls": _med(len(r.stalls) for r in recs),
                # where its prompts were prefilled (every repeat), and whether that exercised its architecture
                "prefill_local_prompts": split.n_local_prompts, "prefill_local_tokens": split.n_local_tokens,
                "prefill_handoff_prompts": split.n_handoff_prompts,
                "prefill_handoff_tokens": split.n_handoff_tokens,
                "not_exercised": not_exercised_reason(cand, split),
                **{key: _med(breakdown_mib(r.memory_breakdown)[key] for r in recs)
                   for key in breakdown_mib(None)},
            })
    return rows


def twin_row(twin, mix: str) -> dict | None:
    """A candidate's twin on ``mix`` as the evidence row's ``twin`` object (None: no twin)."""
    if twin is None:
        return None
    cap = twin.capacity(mix)
    return {"trusted": twin.trusted, "why": twin.why, "attainment_error_points": twin.attainment_error_points,
            "capacity_rps": cap.capacity_rps if cap else None,
            "interval_rps": list(cap.interval_rps) if cap and cap.interval_rps else None,
            "seed_capacities_rps": list(cap.seed_capacities) if cap else [],
            "n_seeds": cap.n_seeds if cap else 0, "n_requests": cap.n_requests if cap else 0,
            "wall_s": cap.wall_s if cap else None, "speedup": cap.speedup if cap else None,
            "attainment_at_half": cap.attainment_at_half if cap else None,
            "noise_bound": cap.noise_bound if cap else False,
            "checks": [to_plain(c) for c in twin.checks]}


def render_memory(rows: list[dict]) -> str:
    """Memory by what holds it, per candidate (the first mix measured; MiB, each byte counted once)."""
    keys = list(breakdown_mib(None))
    out = [f"{'candidate':<26} " + " ".join(f"{key:>15}" for _, key, _ in CATEGORIES) + f" {'total':>7}"]
    seen = set()
    for row in rows:
        if "infeasible" in row or row["candidate"] in seen or row.get("mem_total_mib") is None:
            continue
        seen.add(row["candidate"])
        out.append(f"{row['candidate']:<26} " + " ".join(f"{fmt(row[k]):>15}" for k in keys[:-1])
                   + f" {fmt(row[keys[-1]]):>7}")
    return "\n".join(out) if seen else ""


COLUMNS = [("candidate", "candidate", 26, None), ("mix", "mix", 6, None), ("goodput_per_s", "good/s", 7, ".2f"),
           ("slo_attainment", "SLO%", 5, ".0%"), ("ttft_ms_p50", "TTFT50", 7, ".0f"), ("ttft_ms_p99", "TTFT99", 7, ".0f"),
           ("tpot_ms_p50", "TPOT50", 7, ".1f"), ("itl_ms_p99", "ITL99", 7, ".0f"), ("itl_ms_max", "ITLmax", 7, ".0f"),
           ("prompt_tok_s", "pr/s", 6, ".0f"), ("prompt_reused_share", "reuse", 5, ".0%"),
           ("output_tok_s", "out/s", 6, ".1f"),
           ("interference", "interf", 7, ".2f"), ("prefilled", "loc/hand", 8, None),
           ("kv_transfer_ms_p50", "KVms", 6, ".1f"),
           ("total_pss_mib", "PSSMiB", 7, ".0f"), ("memory_vs_colocated", "mem×", 5, ".2f"),
           ("energy_j_per_token", "J/tok", 6, ".2f")]


def render_table(rows: list[dict]) -> str:
    head = " ".join(f"{title:<{w}}" if i < 2 else f"{title:>{w}}" for i, (_, title, w, _) in enumerate(COLUMNS))
    out = [head, "-" * len(head)]
    for row in rows:
        if "infeasible" in row:
            out.append(f"{row['candidate']:<26} {'-':<6} infeasible: {row['infeasible']}")
            continue
        cells = []
        for i, (key, _, w, spec) in enumerate(COLUMNS):
            value = row.get(key)
            if key == "candidate" and row.get("not_exercised"):
                value = f"{value} (!)"  # not ranked: see the note under the table
            elif key == "prefilled":  # prompts prefilled where they decode / handed off with their KV
                value = f"{row.get('prefill_local_prompts', 0)}/{row.get('prefill_handoff_prompts', 0)}"
            text = str(value) if spec is None else fmt(value, spec)
            cells.append(f"{text:<{w}}" if i < 2 else f"{text:>{w}}")
        out.append(" ".join(cells))
    out += [f"(!) not ranked: {row['candidate']} on {row['mix']}: {row['not_exercised']}"
            for row in rows if row.get("not_exercised")]
    return "\n".join(out)


def capacity_cell(curve) -> str:
    """A capacity as the table shows it: a twin's ``1.09 [0.96-1.19]``; a search's ``0.71 ± 0.29``, ``>= 4.00``
    when nothing failed, ``< 0.25`` when nothing passed (the lowest failing rate)."""
    if curve is None:
        return "-"
    if curve.interval_rps is not None and curve.capacity_rps is not None:
        return f"{curve.capacity_rps:.2f} [{curve.interval_rps[0]:.2f}-{curve.interval_rps[1]:.2f}]"
    if curve.capacity_rps is None:
        failing = [p.rate_rps for p in curve.probes if p.attainment < curve.target_share]
        return f"< {min(failing):.2f}" if failing else "NA"
    if curve.spread_rps is None:
        return f">= {curve.capacity_rps:.2f}"
    return f"{curve.capacity_rps:.2f} ± {curve.spread_rps:.2f}"


def render_capacity(result: AdviseResult) -> str:
    """Capacity (req/s with at least the target share of requests within every SLO of their class) per
    candidate and mix, with its spread, and the SLO target that decided."""
    mixes = [m for m in result.settings.mixes if any(k[1] == m for k in result.capacity)]
    out = [f"{'candidate':<28}" + "".join(f"{m:>20}" for m in mixes) + "  from      decided by"]
    for cand in result.candidates:
        curves = [result.capacity.get((cand.name, m)) for m in mixes]
        if not any(curves):
            continue
        decided = next((c.decided_by for c in reversed(curves) if c is not None), "")
        source = next((c.source for c in curves if c is not None), "")
        out.append(f"{cand.name:<28}" + "".join(f"{capacity_cell(c):>20}" for c in curves) + f"  {source:<9} {decided}")
    return "\n".join(out)


def render_twins(result: AdviseResult) -> str:
    """Each candidate's twin: its capacity's interval and seeds, what it simulated and how fast, and every check
    (the twin's prediction beside the measured probe), with the verdict."""
    lines = []
    for name, twin in result.twins.items():
        lines.append(f"  {name}: {twin.why or 'no check'}")
        if twin.calibration.busy:
            lines.append(f"    warning: the box was busy during its calibration (other processes used "
                         f"{twin.calibration.other_cpu_cores:.1f} cores): its twin is a busy box's, slower than "
                         "this box quiet; run again with nothing else running")
        if twin.calibration.n_stalled:
            lines.append(f"    warning: the box stopped {twin.calibration.n_stalled} step(s) of its calibration for "
                         f"{STALL_RATIO:g}x their time or more (a page-fault storm, the VM's neighbour): they are left out of its "
                         "twin's step times (its check says whether the box stalls while serving), and later runs "
                         "do not pool this burst")
        cold = [f"{w.name} +{w.cost.cold_ms:.0f} ms ({w.cost.n_cold} steps)" for w in twin.calibration.workers
                if w.cost.cold_ms > 0]
        if cold:
            lines.append(f"    calibration: a step after its worker idled runs longer: {', '.join(cold)}")
        if twin.pooled_runs:
            lines.append(f"    calibration: this run's burst pooled with run(s) {', '.join(map(str, twin.pooled_runs))}"
                         " (this box, the same settings, within 24 h): each seed runs on one of them")
        for cap in twin.capacities:
            # a seed with no passing rate failed wherever it was searched: the twin stops searching one once it
            # lies below the interval (homepd.twin.capacity._seed_capacities), so it is counted, not shown as 0
            seeds = sorted(c for c in cap.seed_capacities if c)
            none = len(cap.seed_capacities) - len(seeds)
            lines.append(f"    {cap.mix}: {fmt(cap.capacity_rps, '.2f')} req/s, {cap.confidence:.0%} interval "
                         f"{_interval(cap.interval_rps)} (half-width {fmt(cap.half_width, '.0%')}); seeds "
                         f"{fmt(seeds[0] if seeds else None, '.2f')}-{fmt(seeds[-1] if seeds else None, '.2f')}"
                         f"{f' ({none} with no rate passed where searched)' if none else ''}; "
                         f"{cap.n_seeds} seeds x {cap.n_requests} requests, {cap.virtual_s:.0f} s simulated in "
                         f"{cap.wall_s:.1f} s ({cap.speedup:.0f}x real time a process)"
                         + _answered_by(result, name, cap.mix))
            if cap.attainment_at_half is not None:
                lines.append(f"    at half the capacity: {cap.attainment_at_half:.0%} meet the SLO" + (
                    " — its misses are the box's noise against the budget more than load: a flat curve, whose "
                    "capacity moves with each calibration" if cap.noise_bound else ""))
        for c in twin.checks:
            lines.append(f"    check at {c.rate_rps:.3g} req/s ({c.n_requests} requests): attainment "
                         f"{c.measured_attainment:.0%} measured / {c.predicted_attainment:.0%} twin; TTFT p50 "
                         f"{fmt(c.measured_ttft_ms_p50)}/{fmt(c.predicted_ttft_ms_p50)} ms, p90 "
                         f"{fmt(c.measured_ttft_ms_p90)}/{fmt(c.predicted_ttft_ms_p90)} ms; largest gap p90 "
                         f"{fmt(c.measured_gap_ms_p90)}/{fmt(c.predicted_gap_ms_p90)} ms"
                         + (f"; its steps ran {c.step_speed:.2f}x their calibrated time" if c.step_speed else ""))
    return "\n".join(lines)


def _answered_by(result: AdviseResult, name: str, mix: str) -> str:
    """Whose capacity the answer on ``mix`` is: the twin's where the checks on that mix confirmed it, else the
    measured probes'.  # why: the verdict above pools every mix's checks, and a full campaign's report read "not
    trusted" over a twin whose mixed capacity the rule used (its mixed checks had confirmed it)"""
    curve = result.capacity.get((name, mix))
    if curve is None:
        return ""
    if curve.source == TWIN_SOURCE:
        return "; the answer on this mix: the twin's (its checks here confirmed it)"
    return "; the answer on this mix: the measured probes' (its checks here did not confirm the twin)"


def _interval(interval) -> str:
    return "NA" if interval is None else f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def render_curves(result: AdviseResult) -> str:
    """Attainment against rate, every probe (the capacity curve), one line per candidate and mix."""
    lines = []
    for (name, mix), curve in result.capacity.items():
        probes = sorted(curve.probes, key=lambda p: (p.rate_rps, p.seed))
        lines.append(f"  {name} / {mix}: " + ", ".join(
            f"{p.rate_rps:.2f}/s {p.attainment:.0%} (n={p.n_requests})" for p in probes))
    return "\n".join(lines)


def render_recovery(result: AdviseResult) -> str:
    lines = []
    for mode, rec in result.recovery.items():
        died = [e for e in rec.worker_events if e.kind.value == "died"]
        back = [e for e in rec.worker_events if e.kind.value == "restarted"]
        s = rec.summary
        if not died:
            lines.append(f"  {mode}: the worker was not killed (the run ended first)")
            continue
        d = died[0]
        lines.append(f"  {mode}: {d.role} worker killed; back after {fmt(back[0].recovery_s if back else None, '.2f')} s;"
                     f" {len(d.resumed_from_extent)} resumed from their KV extent, {len(d.recomputed_requests)} by "
                     f"recompute, {len(d.failed_requests)} lost; {s.n_finished}/{s.n_requests} finished, "
                     f"TTFT p99 {fmt(s.ttft_ms.p99)} ms, ITL max {fmt(s.itl_ms.max)} ms")
    return "\n".join(lines)


def render_recommendation(rec: Recommendation) -> str:
    if rec.candidate is None:
        return f"recommendation: none — {rec.reason}"
    lines = [f"recommendation: {rec.candidate.name}  ({', '.join(f'{k}={v}' for k, v in rec.config.items())})",
             f"  rule: {rec.rule}", f"  why: {rec.reason}",
             f"  confidence: {rec.confidence} ({rec.confidence_why})"]
    if not rec.mixes_agree:
        lines.append("  per mix: " + ", ".join(f"{a.mix} -> {a.candidate}" for a in rec.per_mix))
    for name, reason in rec.infeasible:
        lines.append(f"  not measured: {name}: {reason}")
    return "\n".join(lines)


def render_result(result: AdviseResult) -> str:
    s = result.settings
    target = f"{s.search.target_share:.0%}"
    parts = [f"capacity, req/s with >= {target} of requests meeting the SLO ({s.slo.describe()}, and the box "
             f"keeps up: a probe's requests done within the drain allowance of its last arrival); "
             f"{campaign_shape(s)}",
             render_capacity(result), *_twins_part(result),
             "attainment against rate (every probe):", render_curves(result),
             "evidence at each candidate's capacity (where no probe passed, at its lowest probe; medians over repeats)",
             render_table(evidence_rows(result))]
    memory = render_memory(evidence_rows(result))
    if memory:
        parts += ["memory by what holds it (MiB, each byte once):", memory]
    if result.predicted_chunk is not None:
        parts.append(f"step-time model: chunk {result.predicted_chunk} keeps a decode step under "
                     f"{s.slo.itl_ms or 100:g} ms")
    if result.recovery:
        parts += ["recovery (a worker killed mid-run on the mixed trace):", render_recovery(result)]
    parts += _two_boxes(result)
    parts += ["", render_recommendation(result.recommendation),
              f"campaign wall time {result.wall_s:.0f} s" + (f"; stored as run {result.run_id}" if result.run_id else ""),
              "nothing was changed: `homepd advise apply` writes this configuration for `homepd serve`"]
    return "\n".join(parts)


def campaign_shape(s) -> str:
    """The campaign's size in words: its mixes, grids, repeats and time budget."""
    grid = lambda search: f"x{2 ** (1 / search.steps_per_octave):.2f}"  # noqa: E731
    text = f"{'quick' if s.quick else 'full'} campaign: {len(s.mixes)} prompt mix(es), grid {grid(s.search)}"
    if s.refine is None:  # why say it: seed to seed, the edge moves by more than one grid step on a small box
        text += ", one seed"
    if s.refine is not None:
        text += (f"; each architecture's best per mix refined on grid {grid(s.refine)}, "
                 f"{s.repeats} repeat(s) on {', '.join(s.repeat_mixes)}")
    if s.wall_budget_s is not None:
        text += f"; budget {s.wall_budget_s:.0f} s"
    return text


def _twins_part(result: AdviseResult) -> list[str]:
    text = render_twins(result)
    return ["the twins (capacity from each candidate's twin, checked against measured probes: measured / twin):",
            text] if text else []


def _two_boxes(result: AdviseResult) -> list[str]:
    text = render_projection(list(run_projections(result.run)))
    return [text] if text else []
