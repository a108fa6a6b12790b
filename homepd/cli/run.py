"""``homepd run``: serve an arrival trace (or one prompt) on the engine and report.

The main job on a fresh clone: pulls the default model if needed, starts the
engine, replays a short/long/mixed trace with real arrival times, streams
nothing but a progress line, then prints per-request latencies, run figures
and the live prefill->decode interference measured on the step log.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

from homepd.config import add_config_flags, config_from_args, kv_layout_text
from homepd.core.sampling import SamplingParams
from homepd.engine.streams import EventKind
from homepd.hw.monitor import Sampler
from homepd.launch import prepare
from homepd.measure.replay import run_trace
from homepd.measure.report import add_slo_flags, fmt, render_run, slo_from_args
from homepd.measure.trace import PRESETS, make_trace, read_trace


async def _run(args: argparse.Namespace) -> int:
    with Sampler(period_s=0.5) as sampler:
        return await _run_sampled(args, sampler)


async def _run_sampled(args: argparse.Namespace, sampler) -> int:
    # why: jinja2 (the engine's chat templates) loads only when the engine runs
    from homepd.engine.controller import Engine

    config = config_from_args(args)
    slo = slo_from_args(args, config.class_budgets)  # bad --slo-* flags fail before the engine starts
    trace = None if args.prompt is not None else _trace_from_args(args)  # a bad trace file: before any engine
    setup = await asyncio.to_thread(prepare, config)
    print(f"homepd: starting {config.mode} engine on {config.model} (chunk={config.chunk}, "
          f"n_ctx={config.n_ctx}{kv_layout_text(config)}) ...", file=sys.stderr)
    async with Engine(config, setup, sampler=sampler) as engine:
        for w in engine.snapshot().workers:
            where = f"GPU {w.cuda_visible_devices}" if w.cuda_visible_devices else "CPU"
            print(f"  {w.role} worker pid {w.pid}: {where}, cores {list(w.cpu_cores) if w.cpu_cores else 'all'}, "
                  f"n_threads={w.n_threads}", file=sys.stderr)
        if args.prompt is not None:
            return await _one_prompt(engine, args)
        done = 0

        def progress(stream):
            nonlocal done
            done += 1
            print(f"\r  {done}/{len(trace)} requests done", end="", file=sys.stderr, flush=True)

        record = await run_trace(engine, trace, trace_name=trace.name, sampler=sampler, on_done=progress,
                                 slo=slo)
        print(file=sys.stderr)
    if args.json:
        print(json.dumps(record.to_dict()))
    else:
        print(render_run(record, kinds=[r.kind for r in trace]))
    return 0 if record.summary.n_failed == 0 else 1


def _trace_from_args(args: argparse.Namespace):
    if args.trace_file:
        return read_trace(args.trace_file)
    return make_trace(args.trace, n_requests=args.requests, rate_per_s=args.rate, max_tokens=args.max_tokens,
                      seed=args.seed)


async def _one_prompt(engine, args) -> int:
    stream = await engine.submit(args.prompt, params=SamplingParams(max_tokens=args.max_tokens))
    async for event in stream:
        sys.stdout.write(event.text)
        sys.stdout.flush()
        if event.kind is EventKind.ERROR:
            print(f"\nhomepd: error: {event.error}", file=sys.stderr)
            return 1
    lc = stream.lifecycle
    print(f"\n[{lc.n_prompt_tokens} prompt tokens, {len(lc.token_times_s)} generated, "
          f"TTFT {fmt(lc.ttft_s and lc.ttft_s * 1e3)} ms, TPOT {fmt(lc.tpot_s and lc.tpot_s * 1e3, '.1f')} ms, "
          f"{lc.finish_reason}]", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="serve an arrival trace (or one --prompt) and report latencies")
    add_config_flags(p)
    p.add_argument("--trace", choices=PRESETS, default="mixed", help="arrival trace preset")
    p.add_argument("--requests", type=int, default=8, help="requests in the trace")
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-file", default=None, metavar="PATH",
                   help="replay this homepd JSONL trace (homepd trace make/convert) instead of --trace, "
                        "--requests, --rate, --max-tokens and --seed")
    p.add_argument("--prompt", default=None, help="run this one prompt instead, streaming its text")
    add_slo_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=lambda args: asyncio.run(_run(args)))
