"""``homepd bench engine``: engine overhead against a bare llama.cpp loop.

A benchmark, not a test: it prints figures.  On one model and thread count it
measures single-stream prompt tok/s and decode tok/s through the engine
(separate worker process, pipes, controller) and through a bare loop over the
same llama.cpp calls in this process, with the same chunk and thread count.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from homepd.config import DEFAULT_MODEL_NAME, EngineConfig, parse_chunk
from homepd.sampling import SamplingParams

FILLER = ("The history of computing is a story of people, ideas and machines. Early mechanical "
          "calculators gave way to electronic computers, and those to the personal machines of today. ")


def make_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A natural-text prompt of exactly n_tokens tokens (BOS included if the model adds one)."""
    text = FILLER
    while len(tokenizer.tokenize(text)) < n_tokens:
        text += FILLER
    ids = tokenizer.tokenize(text)[:n_tokens]
    return ids


async def _interleaved_runs(config: EngineConfig, model, prompt_ids: list[int], n_gen: int,
                            repeat: int) -> tuple[list[dict], list[dict]]:
    """Alternate engine and raw runs (one warm-up each) so drift on the box hits both alike."""
    from homepd.engine import Engine
    from homepd.reference import greedy_alone

    prompt_text = model.detokenize(prompt_ids[1:] if model.add_bos else prompt_ids)
    engine_runs, raw_runs = [], []
    async with Engine(config) as engine:
        for i in range(repeat + 1):
            t_submit = time.monotonic()
            stream = await engine.submit(prompt_text, params=SamplingParams(max_tokens=n_gen, ignore_eos=True))
            received = []
            async for event in stream:
                if event.kind == "token":
                    received.append(time.monotonic())
            n_prompt = stream.lifecycle.n_prompt_tokens
            raw = greedy_alone(model, prompt_ids, n_gen, chunk=config.chunk, n_threads=config.effective_n_threads,
                               n_ctx=config.n_ctx, n_seq_max=config.n_seq_max, stop_at_eog=False)
            if i == 0:
                continue  # warm-up
            engine_runs.append({"prompt_tok_s": n_prompt / (received[0] - t_submit),
                                "decode_tok_s": (len(received) - 1) / (received[-1] - received[0]),
                                "n_prompt": n_prompt})
            raw_runs.append({"prompt_tok_s": len(prompt_ids) / raw.prompt_s,
                             "decode_tok_s": (len(raw.tokens) - 1) / raw.decode_s})
    return engine_runs, raw_runs


def bench_engine(model: str, n_threads: int | None, n_prompt: int, n_gen: int, chunk: int | None,
                 repeat: int, n_ctx: int = 2048) -> dict:
    """Run the engine-vs-raw benchmark; return a flat dict of figures (medians over ``repeat``)."""
    from homepd.llm import LlamaModel
    from homepd.models import resolve_model

    path = str(resolve_model(model))
    config = EngineConfig(model=path, n_ctx=n_ctx, n_seq_max=4, chunk=chunk, n_threads=n_threads).validated()
    llm = LlamaModel(path)
    try:
        prompt_ids = make_prompt(llm, n_prompt)
        engine, raw = asyncio.run(_interleaved_runs(config, llm, prompt_ids, n_gen, repeat))
    finally:
        llm.close()
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    out = {
        "model": path, "n_threads": config.effective_n_threads, "chunk": chunk, "repeat": repeat,
        "n_prompt_tokens": engine[0]["n_prompt"], "n_gen_tokens": n_gen,
        "engine_prompt_tok_s": med(engine, "prompt_tok_s"), "raw_prompt_tok_s": med(raw, "prompt_tok_s"),
        "engine_decode_tok_s": med(engine, "decode_tok_s"), "raw_decode_tok_s": med(raw, "decode_tok_s"),
    }
    out["prompt_ratio"] = out["engine_prompt_tok_s"] / out["raw_prompt_tok_s"]
    out["decode_ratio"] = out["engine_decode_tok_s"] / out["raw_decode_tok_s"]
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks that print figures")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    e = sub.add_parser("engine", help="engine vs bare llama.cpp loop: prompt and decode tok/s")
    e.add_argument("--model", default=DEFAULT_MODEL_NAME, help="catalog name or GGUF path")
    e.add_argument("--threads", type=int, default=None, help="n_threads (default: all usable cores)")
    e.add_argument("--prompt-tokens", type=int, default=256)
    e.add_argument("--gen-tokens", type=int, default=128)
    e.add_argument("--chunk", type=parse_chunk, default=512, help="prefill chunk, or 'none'")
    e.add_argument("--repeat", type=int, default=3)
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.set_defaults(func=_run_engine)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _run_engine(args: argparse.Namespace) -> int:
    out = bench_engine(args.model, args.threads, args.prompt_tokens, args.gen_tokens, args.chunk, args.repeat)
    print(f"model {out['model']}  n_threads={out['n_threads']}  chunk={out['chunk']}  "
          f"prompt={out['n_prompt_tokens']} tok  gen={out['n_gen_tokens']} tok  (median of {out['repeat']})")
    print(f"  prompt  engine {out['engine_prompt_tok_s']:8.1f} tok/s   raw {out['raw_prompt_tok_s']:8.1f} tok/s"
          f"   ratio {out['prompt_ratio']:.3f}")
    print(f"  decode  engine {out['engine_decode_tok_s']:8.1f} tok/s   raw {out['raw_decode_tok_s']:8.1f} tok/s"
          f"   ratio {out['decode_ratio']:.3f}")
    if args.json:
        print(json.dumps(out))
    return 0
