"""A chat question behind a document on a fresh worker: the steps before the step-time model is fitted.

A fresh engine (after a start, a worker restart or a switch) has seen only its warm-up, one or two steps, and
its step-time model wants ``MIN_STEPS`` before the adaptive chunk can price a step.  Until then a step that no
interactive stream waits on carried the whole chunk (256 tokens: 2-3 s on this CPU), and a chat question
arriving meanwhile waited for it and then shared its own step with the rest of the document.  Now such a step
carries ``COLD_IDLE_CHUNK`` tokens.  This starts an engine, runs the service's warm-up ("Hello", one token),
sends a ~600-token background document, and 0.3 s later a short chat question; it prints the question's TTFT,
the document's, and the prompt tokens of each step, per repeat and their medians.

    python benchmarks/cold_start.py [--model PATH] [--threads 1] [--repeats 3]

Figures go in the report, not in tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.engine.controller import Engine
from homepd.launch import prepare

DOCUMENT = " ".join(["The history of computing is a story of people, ideas and machines."] * 40)  # ~600 tokens
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def once(config: EngineConfig) -> dict:
    async with Engine(config, prepare(config, pull=False, progress=False)) as engine:
        warm = await engine.submit("Hello", params=SamplingParams(max_tokens=1))
        await warm.collect()
        doc = await engine.submit(DOCUMENT, params=SamplingParams(max_tokens=8, ignore_eos=True),
                                  request_class="background")
        await asyncio.sleep(0.3)  # the workload's shape: the question arrives while the document prefills
        question = await engine.submit(messages=QUESTION, params=SamplingParams(max_tokens=8, ignore_eos=True))
        await asyncio.gather(doc.collect(), question.collect())
        return {"question_ttft_ms": round(question.lifecycle.ttft_s * 1e3),
                "document_ttft_ms": round(doc.lifecycle.ttft_s * 1e3),
                "prompt_tokens_per_step": [s.n_prompt_tokens for s in engine.steps_since() if s.n_prompt_tokens]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    config = EngineConfig(model=args.model, n_ctx=4096, n_threads=args.threads)
    runs = [asyncio.run(once(config)) for _ in range(args.repeats)]
    for run in runs:
        print(json.dumps(run))
    for key in ("question_ttft_ms", "document_ttft_ms"):
        values = [r[key] for r in runs]
        print(f"{key}: median {statistics.median(values):.0f} (min {min(values)}, max {max(values)}) "
              f"over {len(values)} repeats, --threads {args.threads}")


if __name__ == "__main__":
    main()
