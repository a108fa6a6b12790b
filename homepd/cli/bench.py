"""``homepd bench engine``: engine vs a bare llama.cpp loop, KV handoff figures, the KV arena's peak use."""
from __future__ import annotations

import argparse
import json

from homepd.config import DEFAULT_MODEL_NAME, parse_chunk
from homepd.measure.bench import BUSY_BOX_WAIT_SHARE, ENGINE_FLOOR, bench_engine


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
    e.add_argument("--kv-tokens", type=int, default=2048,
                   help="prompt length for the KV handoff figures (0 = skip them)")
    e.add_argument("--arena-requests", type=int, default=8,
                   help="requests of the mixed trace replayed disaggregated for the KV arena's peak use (0 = skip)")
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.set_defaults(func=_run_engine)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _run_engine(args: argparse.Namespace) -> int:
    out = bench_engine(args.model, args.threads, args.prompt_tokens, args.gen_tokens, args.chunk, args.repeat,
                       kv_tokens=args.kv_tokens, arena_requests=args.arena_requests)
    print(f"model {out['model']}  n_threads={out['n_threads']}  chunk={out['chunk']}  "
          f"prompt={out['n_prompt_tokens']} tok  gen={out['n_gen_tokens']} tok  "
          f"(median [min-max] of {out['repeat']} interleaved rounds, each run alone)")
    for phase in ("prompt", "decode"):
        e, r = f"engine_{phase}_tok_s", f"raw_{phase}_tok_s"
        print(f"  {phase}  engine {out[e]:7.1f} [{out[e + '_min']:.1f}-{out[e + '_max']:.1f}] tok/s   "
              f"reference {out[r]:7.1f} [{out[r + '_min']:.1f}-{out[r + '_max']:.1f}] tok/s   "
              f"ratio {out[phase + '_ratio']:.3f}  {out[phase + '_guard']} (>= {ENGINE_FLOOR})")
    print(f"  reference: own process (pid {out['raw_pid']}), llama.cpp n_threads/n_threads_batch "
          f"{'/'.join(map(str, out['raw_llama_n_threads']))}, busy threads {out['raw_busy_threads']} "
          f"on cores {out['raw_cpu_affinity']}, {out['raw_idle_cpu_s']:.2f} s CPU while the engine ran: "
          f"{'checked' if out['raw_checked'] else 'NOT as asked, so the guard is unchecked'}")
    print(f"  engine worker: busy threads {out['engine_busy_threads']} on cores {out['engine_cpu_affinity']}; "
          f"waiting for a CPU up to {out['engine_wait_share_max']:.0%} (engine) and "
          f"{out['raw_wait_share_max']:.0%} (reference) of a run: the box's other load, the figures' noise")
    print(f"  CPU per measured run: engine {out['engine_cpu_s']:.2f} s (worker + controller), reference "
          f"{out['raw_cpu_s']:.2f} s: on a busy box each gets a share of a CPU, so the costlier one is slower")
    if out["box_busy"]:
        print(f"  the box was busy (runs waited over {BUSY_BOX_WAIT_SHARE:.0%} of their time for a CPU): "
              "the verdicts measure its load as much as the engine; rerun on a quiet box before trusting them")
    if "kv_bytes" in out:
        print(f"  KV handoff of {out['kv_tokens']} tokens = {out['kv_bytes'] / 1e6:.1f} MB through the KV arena "
              f"(an extent of {out['kv_extent_bytes'] / 1e6:.2f} MB with its header):")
        print(f"    export {out['kv_export_ms']:.2f} ms ({out['kv_export_gb_s']:.2f} GB/s)   "
              f"import {out['kv_import_ms']:.2f} ms ({out['kv_import_gb_s']:.2f} GB/s)   "
              f"memcpy {out['memcpy_ms']:.2f} ms ({out['memcpy_gb_s']:.2f} GB/s)")
        print(f"    memcpy / (export + import) = {out['kv_handoff_ratio']:.2f} (0.5 ideal); with header "
              f"checks (publish {out['kv_publish_ms']:.2f} ms, open {out['kv_open_ms']:.2f} ms): "
              f"{out['kv_handoff_ratio_with_checks']:.2f}")
    if "arena_bytes" in out:
        mib = 2 ** 20
        ratio = "NA" if out["arena_peak_ratio"] is None else f"{out['arena_peak_ratio']:.2f}"
        print(f"  KV arena on the mixed trace ({args.arena_requests} requests, disaggregated, prefill n_ctx "
              f"{out['arena_prefill_n_ctx']}): {out['arena_bytes'] / mib:.1f} MiB; peak use "
              f"{out['arena_peak_bytes'] / mib:.2f} MiB with {out['arena_peak_kv_bytes'] / mib:.2f} MiB of KV in "
              f"transit then (x{ratio}); {out['arena_handoffs']} handoffs")
    if args.json:
        print(json.dumps(out))
    return 0
