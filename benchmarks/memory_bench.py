"""Memory of colocated vs disaggregated serving on the default mixed trace, in one run, by what holds it.

    uv run python benchmarks/memory_bench.py [--model NAME ...] [--requests 8] [--json]

For each model: replays the trace ``homepd run`` replays by default (mixed, 8
requests at 2/s, 32 output tokens, seed 0) on a colocated engine, then on a
disaggregated one, both with the default configuration (n_ctx 4096, chunk
256; disaggregated: the placement plan's prefill context and KV arena).
Prints the peak PSS summed over every homepd process (controller, workers;
the arena split between the processes that map it), the breakdown by what
holds the memory at the end of each run (each byte counted once), the ratio
disaggregated ÷ colocated, and the arena's peak use next to the KV bytes in
transit at that moment.  Memory figures do not depend on the load of the box;
timings would, and are not printed.  Each run has a fresh controller process
(this script again, ``--one MODEL MODE``), as two ``homepd run`` would.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

from homepd.config import EngineConfig
from homepd.engine.controller import Engine
from homepd.hw.monitor import Sampler
from homepd.launch import prepare
from homepd.measure.memory import render_breakdown
from homepd.measure.replay import run_trace
from homepd.measure.trace import make_trace

MIB = 2 ** 20
MODELS = ("smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m")


async def one_run(model: str, mode: str, n_requests: int) -> dict:
    config = EngineConfig(model=model, mode=mode).validated()
    trace = make_trace("mixed", n_requests=n_requests, rate_per_s=2.0, max_tokens=32, seed=0)
    with Sampler(period_s=0.25) as sampler:
        async with Engine(config, await asyncio.to_thread(prepare, config, pull=False), sampler=sampler) as engine:
            prefill_n_ctx = engine.kv.prefill_n_ctx if engine.kv is not None else None
            record = await run_trace(engine, trace, trace_name="mixed", sampler=sampler)
    b = record.memory_breakdown
    return {"model": model, "mode": mode, "n_finished": record.summary.n_finished,
            "total_pss_bytes": record.total_pss_bytes, "breakdown_total_bytes": b.total_bytes,
            "breakdown": b.to_dict(), "breakdown_lines": render_breakdown(b),
            "peak_pss_by_process": {m.role: m.pss_bytes for m in record.memory},
            "arena_bytes": record.kv_arena_bytes, "prefill_n_ctx": prefill_n_ctx,
            "arena_peak_bytes": record.arena_peak_bytes, "arena_peak_kv_bytes": record.arena_peak_kv_bytes,
            "n_handoffs": record.summary.kv.n_moved if record.summary.kv else 0}


def report(runs: list[dict]) -> None:
    by = {(r["model"], r["mode"]): r for r in runs}
    for model in dict.fromkeys(r["model"] for r in runs):
        col, dis = by[(model, "colocated")], by[(model, "disaggregated")]
        print(f"\n{model}  (mixed trace, {col['n_finished']}/{dis['n_finished']} finished)")
        for r in (col, dis):
            peaks = ", ".join(f"{role} {pss / MIB:.0f}" for role, pss in r["peak_pss_by_process"].items())
            print(f"  {r['mode']:<13} peak PSS total {r['total_pss_bytes'] / MIB:6.0f} MiB ({peaks}); "
                  f"by what holds it {r['breakdown_total_bytes'] / MIB:.0f} MiB")
            for line in r["breakdown_lines"]:
                print(f"    {line}")
        print(f"  disaggregated ÷ colocated: peak PSS {dis['total_pss_bytes'] / col['total_pss_bytes']:.2f}, "
              f"by what holds it {dis['breakdown_total_bytes'] / col['breakdown_total_bytes']:.2f}")
        kv = dis["arena_peak_kv_bytes"]
        ratio = f"{dis['arena_peak_bytes'] / kv:.2f}" if kv else "NA"
        print(f"  KV arena {dis['arena_bytes'] / MIB:.1f} MiB (prefill n_ctx {dis['prefill_n_ctx']}): peak use "
              f"{dis['arena_peak_bytes'] / MIB:.2f} MiB with {kv / MIB:.2f} MiB of KV in transit then "
              f"(x{ratio}); {dis['n_handoffs']} handoffs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=list(MODELS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the runs as one JSON object at the end")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(one_run(*args.one, args.requests))))
        return
    runs = []
    for model in args.model:
        for mode in ("colocated", "disaggregated"):
            out = subprocess.run([sys.executable, __file__, "--one", model, mode, "--requests", str(args.requests)],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.splitlines()[-1]))
    report(runs)
    if args.json:
        print(json.dumps({"runs": [{k: v for k, v in r.items() if k != "breakdown_lines"} for r in runs]}))


if __name__ == "__main__":
    main()
