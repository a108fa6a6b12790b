"""Record an engine's step log on the mixed trace: the tests replay it through the step policy
(``tests/unit/test_recorded_steps.py``), ``benchmarks/recorded_steps.py`` prints what it measured.

    uv run python benchmarks/record_steps.py --chunk 32 -o tests/data/steps-chunk32.json
    uv run python benchmarks/record_steps.py --chunk 256 --adaptive-chunk -o tests/data/steps-adaptive.json

Runs the real model (SmolLM2 by default) in-process through the engine: the seeded mixed trace (24 requests,
every 4th a ~530-token document sent as background, 48 output tokens), at ``--rate``.  Writes every step
(shape, budget, KV cells, duration) and every request (class, prompt tokens, TTFT, token times).
"""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.engine.controller import Engine
from homepd.launch import prepare
from homepd.measure.replay import replay
from homepd.measure.trace import make_trace

MAX_TOKENS, LONG_TOKENS = 48, 470


async def record(args) -> dict:
    config = EngineConfig(model=args.model, mode=args.mode, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max,
                          n_threads=args.threads, chunk=args.chunk, adaptive_chunk=args.adaptive_chunk)
    trace = make_trace("mixed", args.requests, args.rate, max_tokens=MAX_TOKENS, long_tokens=LONG_TOKENS,
                       seed=args.seed)
    async with Engine(config, prepare(config, pull=True)) as engine:
        warm = await engine.submit("Hi", params=SamplingParams(max_tokens=4))
        await warm.collect()
        n0 = len(engine.steps_since())
        records = await replay(engine, trace)
        steps = engine.steps_since()[n0:]
    return {
        "config": {"mode": args.mode, "chunk": args.chunk, "adaptive_chunk": args.adaptive_chunk, "threads": args.threads,
                   "rate": args.rate, "model": args.model, "itl_budget_ms": config.itl_budget_ms,
                   # the trace, so that a replay can regenerate it (tests/unit/step_replay.py)
                   "requests": args.requests, "seed": args.seed, "max_tokens": MAX_TOKENS, "long_tokens": LONG_TOKENS},
        "steps": [{"role": s.worker_role, "t_start_s": round(s.t_start_s - steps[0].t_start_s, 6),
                   "duration_ms": round(s.duration_ms, 3), "decode": list(s.decode_request_ids),
                   "prefill": [list(p) for p in s.prefill], "budget": s.budget, "kv_in_use": s.kv_in_use}
                  for s in steps],
        "requests": [{"request_id": lc.request_id, "request_class": lc.request_class,
                      "n_prompt_tokens": lc.n_prompt_tokens, "ttft_s": lc.ttft_s,
                      "predicted_ttft_s": lc.predicted_ttft_s, "itl_max_s": max(lc.itl_s, default=None),
                      "state": lc.state.value} for lc in records],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated"))
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--adaptive-chunk", action="store_true")
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("--n-seq-max", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    data = asyncio.run(record(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, separators=(",", ":")))
    print(f"{args.output}: {len(data['steps'])} steps, {len(data['requests'])} requests")


if __name__ == "__main__":
    main()
