"""Where the twin's step prices miss: a candidate's burst, then probes on the mixed trace, and every step's measured
time over what the burst's calibration prices it at, by the kind of step.

``twin_fidelity.py`` says how far the twin's attainment, TTFT and gaps are from a probe's; this says which steps
carry the error.  A fit that is right for the burst's shapes and wrong for the probes' shows as ratios near 1 on
the burst and away from it on a kind of the probes' steps (the KV term that left idle cached cells out priced a
probe's decode steps 1.35x, docs/advise.md, "The KV term"); a box that ran a probe slower or faster shows as every
kind moved alike.  Kinds: ``decode`` (no prompt token), ``prompt<=16`` / ``prompt<=64`` / ``prompt>64`` (the
step's tokens), ``cold`` (the first step after its worker idled, priced with ``cold_ms``).  Per kind: steps, the
ratio's p50 and p90, the measured and priced ms p50, and the median shape (prompt tokens, decodes, KV cells).

    uv run python benchmarks/twin_step_pricing.py [--candidate colocated-adaptive] [--rate 1.3] [--probes 2]
                                                  [--requests 16] [--threads N] [-o steps.json]

``--rate`` in req/s; ``-o`` keeps every step with its price (JSON).  Figures go in the report, not in tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace

from homepd.advise.campaign.run import BURST_SEED, AdviseSettings
from homepd.core.sampling import SamplingParams
from homepd.engine.controller import Engine
from homepd.hw.monitor import Sampler
from homepd.launch import prepare
from homepd.measure.metrics import SLO
from homepd.measure.replay import run_trace
from homepd.measure.trace import make_trace
from homepd.measure.trace.model import tagged
from homepd.twin.burst import burst_trace, calibrate
from homepd.twin.calibration import priced_steps
from twin_fidelity import candidates_here  # benchmarks/ is on sys.path when a script of it runs

PROBE_SEED = 1000


def kind_of(step, cold: bool) -> str:
    if cold:
        return "cold"
    if not step.n_prompt_tokens:
        return "decode"
    n = step.n_prompt_tokens + step.n_decode_tokens
    return "prompt<=16" if n <= 16 else "prompt<=64" if n <= 64 else "prompt>64"


def priced(cal, steps) -> list[dict]:
    """Every step of a calibrated worker with its kind, its measured and priced ms."""
    return [{"kind": kind_of(s, cold), "worker": s.worker_role, "n_prompt": s.n_prompt_tokens,
             "n_decode": s.n_decode_tokens, "kv_in_use": s.kv_in_use, "measured_ms": s.duration_ms, "priced_ms": p}
            for s, p, cold in priced_steps(cal, steps) if s.duration_ms > 0 and p > 0]


def table(label: str, rows: list[dict]) -> str:
    lines = [label, f"  {'kind':<11} {'steps':>5} {'ratio p50':>9} {'p90':>5} {'measured p50':>12} {'priced p50':>10}"
                    f"  {'shape p50 (prompt+decodes @ KV)':>30}"]
    for kind in ("cold", "decode", "prompt<=16", "prompt<=64", "prompt>64"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        ratios = sorted(r["measured_ms"] / r["priced_ms"] for r in rs)
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        p90 = ratios[int(len(ratios) * .9)]
        lines.append(f"  {kind:<11} {len(rs):>5} {statistics.median(ratios):>9.2f} {p90:>5.2f}"
                     f" {med('measured_ms'):>10.0f} ms {med('priced_ms'):>7.0f} ms  "
                     f"{med('n_prompt'):>12.0f}+{med('n_decode'):.0f} @ {med('kv_in_use'):.0f}")
    all_r = [r["measured_ms"] / r["priced_ms"] for r in rows]
    if all_r:
        lines.append(f"  {'all':<11} {len(all_r):>5} {statistics.median(all_r):>9.2f}  (the probe's step_speed)")
    return "\n".join(lines)


async def main(args) -> dict:
    base, box, cands = candidates_here(args.threads)
    settings = AdviseSettings()
    if args.candidate not in cands or not cands[args.candidate].feasible:
        raise SystemExit(f"not a feasible candidate here: {args.candidate} (candidates: {', '.join(cands)})")
    config = replace(base, **cands[args.candidate].config_values())
    slo = SLO.from_budgets(config.class_budgets)
    out = {"candidate": args.candidate, "rate_rps": args.rate, "runs": []}
    sampler = Sampler()
    sampler.start()
    try:
        async with Engine(config, prepare(config, pull=False, box=box), sampler=sampler) as engine:
            warm = await engine.submit("Hello", params=SamplingParams(max_tokens=2))
            await warm.collect()
            burst = burst_trace(config, settings.burst_per_sequence, max_tokens=settings.max_tokens,
                                long_tokens=settings.long_tokens, seed=BURST_SEED)
            t0 = time.monotonic()
            cal, _ = await calibrate(engine, args.candidate, burst, slo, sampler)
            rows = priced(cal, engine.steps_since(t0))
            out["runs"].append({"label": "burst", "steps": rows})
            print(table(f"{args.candidate}: its burst ({cal.burst_s:.1f} s)", rows), flush=True)
            for k in range(args.probes):
                trace = tagged(make_trace("mixed", args.requests, args.rate, max_tokens=settings.max_tokens,
                                          long_tokens=settings.long_tokens, ignore_eos=True, seed=PROBE_SEED + k),
                               f"[pricing {k}] ")
                t1 = time.monotonic()
                record = await run_trace(engine, trace, trace_name="mixed", slo=slo, sampler=sampler)
                met = sum(slo.miss(lc) is None for lc in record.requests)
                rows = priced(cal, engine.steps_since(t1))
                out["runs"].append({"label": f"probe {k}", "met": met, "steps": rows})
                print(table(f"probe {k} at {args.rate} req/s ({met} of {len(record.requests)} met the SLO)", rows),
                      flush=True)
    finally:
        sampler.stop()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidate", default="colocated-adaptive")
    ap.add_argument("--rate", type=float, default=1.3, help="the probes' rate, req/s (default 1.3)")
    ap.add_argument("--probes", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16, help="requests a probe (default 16)")
    ap.add_argument("--threads", type=int, default=None, help="threads a worker (default: the engine's)")
    ap.add_argument("-o", "--output", help="keep every step with its price here (JSON)")
    args = ap.parse_args()
    result = asyncio.run(main(args))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
