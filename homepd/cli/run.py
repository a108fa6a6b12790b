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
import time

from homepd.config import add_config_flags, config_from_args
from homepd.measure.metrics import summarize
from homepd.measure.replay import memory_and_energy, replay
from homepd.core.sampling import SamplingParams
from homepd.measure.trace import PRESETS, make_trace


async def _run(args: argparse.Namespace) -> int:
    from homepd.hw.monitor import Sampler

    with Sampler(period_s=0.5) as sampler:
        return await _run_sampled(args, sampler)


async def _run_sampled(args: argparse.Namespace, sampler) -> int:
    from homepd.engine.controller import Engine
    from homepd.launch import prepare

    config = config_from_args(args)
    setup = await asyncio.to_thread(prepare, config)
    print(f"homepd: starting {config.mode} engine on {config.model} (chunk={config.chunk}, "
          f"n_ctx={config.n_ctx}) ...", file=sys.stderr)
    async with Engine(config, setup, sampler=sampler) as engine:
        for w in engine.snapshot()["workers"]:
            where = f"GPU {w['cuda_visible_devices']}" if w["cuda_visible_devices"] else "CPU"
            print(f"  {w['role']} worker pid {w['pid']}: {where}, cores {w['cpu_cores'] or 'all'}, "
                  f"n_threads={w['n_threads']}", file=sys.stderr)
        if args.prompt is not None:
            stream = await engine.submit(args.prompt, params=SamplingParams(max_tokens=args.max_tokens))
            async for event in stream:
                sys.stdout.write(event.text)
                sys.stdout.flush()
                if event.kind == "error":
                    print(f"\nhomepd: error: {event.error}", file=sys.stderr)
                    return 1
            lc = stream.lifecycle
            print(f"\n[{lc.n_prompt_tokens} prompt tokens, {len(lc.token_times_s)} generated, "
                  f"TTFT {_fmt(lc.ttft_s and lc.ttft_s * 1e3)} ms, TPOT {_fmt(lc.tpot_s and lc.tpot_s * 1e3, '.1f')} ms, "
                  f"{lc.finish_reason}]",
                  file=sys.stderr)
            return 0
        trace = make_trace(args.trace, n_requests=args.requests, rate_per_s=args.rate,
                           max_tokens=args.max_tokens, seed=args.seed)
        done = 0

        def progress(stream):
            nonlocal done
            done += 1
            print(f"\r  {done}/{len(trace)} requests done", end="", file=sys.stderr, flush=True)

        t0 = time.monotonic()
        records = await replay(engine, trace, progress)
        sampler.sample_once()
        hardware = memory_and_energy(sampler, t0, time.monotonic())
        slots = engine.snapshot()["kv_slots"]
        hardware["kv_slot_bytes"] = slots["n_slots"] * slots["capacity_bytes"] if slots else 0
        print(file=sys.stderr)
        steps = list(engine.step_log)
    summary = summarize(records, steps)
    if args.json:
        print(json.dumps({"config": {"mode": config.mode, "model": config.model, "chunk": config.chunk,
                                     "n_ctx": config.n_ctx, "n_threads": config.effective_n_threads,
                                     "trace": args.trace},
                          "summary": summary, "hardware": hardware,
                          "requests": [r.to_dict() for r in records]}))
        return 0 if summary["n_failed"] == 0 else 1
    _print_report(trace, records, summary)
    _print_hardware(hardware)
    return 0 if summary["n_failed"] == 0 else 1


def _fmt(x, spec=".0f") -> str:
    return "NA" if x is None else format(x, spec)


def _print_report(trace, records, summary) -> None:
    print(f"{'request':<14}{'kind':<7}{'prompt':>7}{'out':>5}{'queue ms':>10}{'TTFT ms':>9}{'TPOT ms':>9}  finish")
    for req, r in zip(trace, records):
        qw = None if r.queue_wait_s is None else r.queue_wait_s * 1e3
        print(f"{r.request_id[-14:]:<14}{req.kind:<7}{r.n_prompt_tokens:>7}{len(r.token_times_s):>5}"
              f"{_fmt(qw):>10}{_fmt(r.ttft_s and r.ttft_s * 1e3):>9}{_fmt(r.tpot_s and r.tpot_s * 1e3, '.1f'):>9}"
              f"  {r.finish_reason or r.state.value}{' ' + r.error if r.error else ''}")
    s = summary
    print(f"\n{s['n_finished']}/{s['n_requests']} finished in {s['span_s']:.1f} s; "
          f"prompt {_fmt(s['prompt_tok_s'], '.0f')} tok/s, output {_fmt(s['output_tok_s'], '.1f')} tok/s")
    print(f"TTFT p50/p95 {_fmt(s['ttft_ms_p50'])}/{_fmt(s['ttft_ms_p95'])} ms   "
          f"TPOT p50/p95 {_fmt(s['tpot_ms_p50'], '.1f')}/{_fmt(s['tpot_ms_p95'], '.1f')} ms   "
          f"ITL p95/max {_fmt(s['itl_ms_p95'], '.1f')}/{_fmt(s['itl_ms_max'], '.1f')} ms")
    print(f"steps {s['n_steps']}, at most {s['max_prompt_tokens_per_step']} prompt tokens in one step; "
          f"interference: decode step alone {_fmt(s['interference_decode_only_ms'], '.1f')} ms, "
          f"{'beside a prefill step' if s['interference_kind'] == 'concurrent' else 'with prompt tokens'} "
          f"{_fmt(s['interference_mixed_ms'], '.1f')} ms (x{_fmt(s['interference_slowdown'], '.2f')} "
          f"at equal batch size)")
    if s["kv_bytes_mean"]:
        print(f"KV handoff: {s['kv_bytes_mean'] / 1e6:.1f} MB per request on average; transfer (prompt done -> "
              f"imported) p50/p95 {_fmt(s['kv_transfer_ms_p50'], '.1f')}/{_fmt(s['kv_transfer_ms_p95'], '.1f')} ms; "
              f"export {_fmt(s['kv_export_ms_p50'], '.2f')} ms, import {_fmt(s['kv_import_ms_p50'], '.2f')} ms, "
              f"slot wait p95 {_fmt(s['kv_slot_wait_ms_p95'], '.1f')} ms")


def _print_hardware(hardware: dict) -> None:
    mb = lambda b: "NA" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    for role, w in hardware["workers"].items():
        print(f"{role} worker memory (peak MiB): RSS {mb(w['rss_bytes'])}, PSS {mb(w['pss_bytes'])}, "
              f"USS {mb(w['uss_bytes'])} (USS = not shared: what a second copy costs)")
    if hardware.get("kv_slot_bytes"):
        print(f"KV slots: {mb(hardware['kv_slot_bytes'])} MiB of pre-faulted shared memory "
              f"(mapped by both workers: counted in their RSS, split in their PSS)")
    energy = {k: v for k, v in hardware["energy_j"].items() if v is not None}
    print("energy: " + (", ".join(f"{k} {v:.1f} J" for k, v in energy.items()) if energy
                        else "NA (no RAPL counters or GPU energy readable on this box)"))


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="serve an arrival trace (or one --prompt) and report latencies")
    add_config_flags(p)
    p.add_argument("--trace", choices=PRESETS, default="mixed", help="arrival trace preset")
    p.add_argument("--requests", type=int, default=8, help="requests in the trace")
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default=None, help="run this one prompt instead, streaming its text")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=lambda args: asyncio.run(_run(args)))
