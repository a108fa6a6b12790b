"""Eight chats that send no max_tokens, at once: wall time, decode batch and what the full context did.

    PYTHONPATH=. python benchmarks/lazy_kv_bench.py [--model NAME|PATH] [--threads 1] [--repeat 3]

A chat client that sends no ``max_tokens`` gets the service's default (``homepd serve --max-tokens``,
2,048).  Reserving each request's worst case (prompt + 2,048 cells) in the default context (4,096 cells,
8 sequences) runs such chats one at a time; reserving KV as it grows (``homepd.core.kvpolicy``) runs them
together.  Greedy, the engine's defaults otherwise (colocated, n_ctx 4096, n_seq_max 8); the engine is
started once per repeat and only the requests are timed.  Prints one line per repeat and the median.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.engine.controller import Engine
from homepd.launch import prepare

# short chat turns that SmolLM2-135M answers and ends by itself (3-66 tokens each, greedy)
QUESTIONS = ["How many legs has a spider?", "Give me a synonym for happy.", "What is 12 times 12?",
             "Which planet is closest to the sun?", "Hi!", "Hello, how are you?", "What is 2+2?", "Thank you!"]
SERVE_DEFAULT_MAX_TOKENS = 2048  # homepd serve's --max-tokens: what a request without max_tokens gets


async def one_run(config: EngineConfig) -> dict:
    async with Engine(config, prepare(config, pull=False)) as engine:
        params = SamplingParams(max_tokens=SERVE_DEFAULT_MAX_TOKENS)
        t0 = time.monotonic()
        streams = [await engine.submit(messages=[{"role": "user", "content": q}], params=params) for q in QUESTIONS]
        await asyncio.gather(*(s.collect() for s in streams))
        wall_s = time.monotonic() - t0
        lcs = [s.lifecycle for s in streams]
        steps = engine.steps_since()
        return {"wall_s": wall_s, "max_decode_batch": max(st.n_decode_tokens for st in steps),
                "n_steps": len(steps), "step_s": sum(st.duration_ms for st in steps) / 1e3,
                "n_output_tokens": sum(len(lc.token_times_s) for lc in lcs),
                "ttft_s": sorted(lc.first_token_s - t0 for lc in lcs if lc.first_token_s is not None),
                "finish_reasons": sorted(str(lc.finish_reason) for lc in lcs),
                "kv_preemptions": sum(getattr(lc, "n_kv_preemptions", 0) for lc in lcs),
                "ended_by_kv_full": sum(getattr(lc, "ended_by_kv_full", False) for lc in lcs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="catalog name or GGUF path (default: the catalog default)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    config = EngineConfig(**({"model": args.model} if args.model else {}), n_threads=args.threads)
    walls = []
    for i in range(args.repeat):
        r = asyncio.run(one_run(config))
        walls.append(r["wall_s"])
        print(f"run {i + 1}: {r['wall_s']:.2f} s ({r['n_steps']} steps, {r['step_s']:.2f} s in them), "
              f"max decode batch {r['max_decode_batch']}, TTFT median {statistics.median(r['ttft_s']):.2f} s "
              f"max {r['ttft_s'][-1]:.2f} s, "
              f"{r['n_output_tokens']} tokens, finish {r['finish_reasons']}, "
              f"kv preemptions {r['kv_preemptions']}, ended by a full context {r['ended_by_kv_full']}")
    print(f"median wall time of 8 chats without max_tokens (threads {args.threads}): {statistics.median(walls):.2f} s")


if __name__ == "__main__":
    main()
