"""``homepd bench engine`` (engine vs a bare llama.cpp loop, KV handoff figures, the KV arena's peak use) and
``homepd bench slo`` (the SLO capacity of any OpenAI-compatible server, by the client's clock)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from homepd.advise.report.slobench import render_table
from homepd.config import DEFAULT_MODEL_NAME, EngineConfig, parse_chunk
from homepd.errors import ConfigError
from homepd.measure.bench import BUSY_BOX_WAIT_SHARE, ENGINE_FLOOR, bench_engine
from homepd.measure.llamabench import BUILD_HINT
from homepd.measure.report import add_slo_flags, slo_from_args
from homepd.measure.trace import MIXES


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks that print figures")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    e = sub.add_parser("engine", help="engine vs llama.cpp's own loop (llama-bench) and a bare Python loop: "
                                      "prompt and decode tok/s")
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
    e.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="llama-bench binary, the reference row (default: the one benchmarks/build_llama_server.py "
                        "builds into .cache/llama-server)")
    e.add_argument("--gpu", type=int, default=None, metavar="INDEX",
                   help="offload the engine's worker (and so the references) to this GPU (needs a CUDA build); "
                        "default: the CPU, every GPU hidden")
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.set_defaults(func=_run_engine)
    _register_slo(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _run_engine(args: argparse.Namespace) -> int:
    out = bench_engine(args.model, args.threads, args.prompt_tokens, args.gen_tokens, args.chunk, args.repeat,
                       kv_tokens=args.kv_tokens, arena_requests=args.arena_requests, llama_bench=args.llama_bench,
                       gpu_index=args.gpu)
    print(f"model {out['model']}  n_threads={out['n_threads']}  chunk={out['chunk']}  "
          f"prompt={out['n_prompt_tokens']} tok  gen={out['n_gen_tokens']} tok, decoded after the prompt "
          f"(median [min-max] of {out['repeat']} interleaved rounds, each run alone)")

    def row(name: str, prefix: str, phase: str) -> str:
        k = f"{prefix}_{phase}_tok_s"
        return f"{name} {out[k]:7.1f} [{out[k + '_min']:.1f}-{out[k + '_max']:.1f}]"

    for phase in ("prompt", "decode"):
        lb = "llama-bench: none" if out[phase + "_ratio"] is None else (
            f"{row('llama-bench', 'llama_bench', phase)}   engine/llama-bench {out[phase + '_ratio']:.3f}")
        print(f"  {phase:<6} {row('engine', 'engine', phase)}   {lb}  {out[phase + '_guard']} (>= {ENGINE_FLOOR})")
        print(f"  {'':<6} {row('python loop', 'raw', phase)}   engine/loop {out[phase + '_loop_ratio']:.3f} "
              "(a second row: no limit)")
    if out["llama_bench"] is None:
        print(f"  no llama-bench, so the verdicts are unchecked: {BUILD_HINT}")
    else:
        print(f"  llama-bench {out['llama_bench']}: n_threads {out['llama_bench_n_threads']} on cores "
              f"{out['llama_bench_cpu_affinity']}: {'checked' if out['llama_bench_checked'] else 'NOT as asked'}")
    print(f"  python loop: own process (pid {out['raw_pid']}), llama.cpp n_threads/n_threads_batch "
          f"{'/'.join(map(str, out['raw_llama_n_threads']))}, busy threads {out['raw_busy_threads']} "
          f"on cores {out['raw_cpu_affinity']}, {out['raw_idle_cpu_s']:.2f} s CPU while the engine ran: "
          f"{'checked' if out['raw_checked'] else 'NOT as asked'}")
    print(f"  engine worker: busy threads {out['engine_busy_threads']} on cores {out['engine_cpu_affinity']}; "
          f"waiting for a CPU up to {out['engine_wait_share_max']:.0%} (engine) and "
          f"{out['raw_wait_share_max']:.0%} (python loop) of a run: the box's other load, the figures' noise")
    print(f"  CPU per measured run: engine {out['engine_cpu_s']:.2f} s (worker + controller), python loop "
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


def _register_slo(sub) -> None:
    p = sub.add_parser("slo", help="SLO capacity of any OpenAI-compatible server (homepd, llama-server, vLLM, ...)",
                       description="Drives each --url in turn (never two at once; each warmed with one request) "
                                   "with a seeded homepd trace, open loop, timed by this client on the streamed "
                                   "chunks, and searches the highest rate at which 90%% of the requests meet "
                                   "every SLO of their class (advise's search and SLO); --rates sweeps fixed "
                                   "rates instead. Each probe is stored as a result of one bench-slo run "
                                   "(`homepd history show RUN`).")
    p.add_argument("--url", action="append", required=True, metavar="[NAME=]URL",
                   help="server base URL (http://HOST:PORT); repeat for several servers, measured one after another")
    p.add_argument("--model-name", default=None, help="the model field sent (default: the first of the server's "
                                                      "/v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("HOMEPD_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY, else $HOMEPD_API_KEY)")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--mix", choices=MIXES, default="mixed", help="built-in trace mix (default mixed)")
    given.add_argument("--trace-file", metavar="F", default=None, help="a homepd trace file instead of a mix")
    given.add_argument("--traffic", metavar="service[:SINCE]", default=None,
                       help="the traffic `homepd serve` recorded in --db (since SINCE: 30m, 2h, 1d or an ISO time)")
    p.add_argument("--rates", default=None, metavar="R[,R...]", help="probe these rates (req/s) instead of searching")
    p.add_argument("--quick", action="store_true", help="a coarse, short search (2 grid steps per octave, 3 probes)")
    p.add_argument("--resolution", type=int, default=None, metavar="STEPS",
                   help="grid steps per octave of the search (default 4: 19%% steps; quick 2)")
    p.add_argument("--max-probes", type=int, default=None, help="probes per search (default 6; quick 3)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="arrivals' span summed over a search's probes (default 120; quick 36)")
    p.add_argument("--start-rate", type=float, default=None, help="first rate of the search (default: estimated "
                                                                  "from the warm-up request)")
    p.add_argument("--requests", type=int, default=None, help="requests per fixed-rate probe (default: as the "
                                                              "search sizes a probe at that rate)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (EOS ignored)")
    p.add_argument("--long-tokens", type=int, default=400, help="estimated tokens of a long prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature sent (default 0: greedy; clients send 0.7 and top_p 0.9)")
    p.add_argument("--top-p", type=float, default=None, help="top_p sent (default: none sent)")
    p.add_argument("--all-interactive", action="store_true",
                   help="send every request as interactive (else as the trace classes them: long documents are "
                        "background in the mixed trace)")
    p.add_argument("--unique-prefix", action="store_true",
                   help="put a tag unique to the probe and request before each user text, so that no server "
                        "answers from an earlier probe's cached KV (single-turn mixes: it also splits a chat's "
                        "shared history)")
    p.add_argument("--stop-below", type=float, default=0.5,
                   help="with --rates: skip a higher rate once a lower one met the SLO for fewer than this share")
    p.add_argument("--db", default=None, help="run database (default: $HOMEPD_DB, else the XDG data dir)")
    p.add_argument("--no-store", dest="store", action="store_false", help="print only; store nothing")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_slo_flags(p)
    p.set_defaults(func=_run_slo)


def _slo_settings(args: argparse.Namespace):
    import dataclasses

    # why: httpx loads for `bench slo` only
    from homepd.bench.slo import FULL_SEARCH, QUICK_SEARCH, BenchSettings

    slo = slo_from_args(args, EngineConfig().class_budgets)
    search = QUICK_SEARCH if args.quick else FULL_SEARCH
    for flag, field, value in (("--resolution", "steps_per_octave", args.resolution),
                               ("--max-probes", "max_probes", args.max_probes)):
        if value is not None:
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
            search = dataclasses.replace(search, **{field: value})
    if args.resolution is not None:
        search = dataclasses.replace(search, grow_steps=args.resolution)
    if args.time_budget_s is not None:
        if not args.time_budget_s > 0:
            raise ConfigError(f"--time-budget-s must be positive, got {args.time_budget_s:g}")
        search = dataclasses.replace(search, time_budget_s=args.time_budget_s)
    rates = None
    if args.rates is not None:
        try:
            rates = tuple(float(x) for x in args.rates.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"--rates takes comma-separated requests per second (0.5,1,2), got {args.rates!r}") \
                from None
        if not rates or any(not r > 0 for r in rates):
            raise ConfigError(f"--rates needs positive rates, got {args.rates!r}")
        rates = tuple(sorted(set(rates)))
    for flag, value in (("--requests", args.requests), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not 0.0 <= args.temperature <= 2.0 or (args.top_p is not None and not 0.0 < args.top_p <= 1.0):
        raise ConfigError(f"--temperature takes 0..2 and --top-p (0, 1], got {args.temperature:g} and {args.top_p}")
    if args.start_rate is not None and not args.start_rate > 0:
        raise ConfigError(f"--start-rate must be positive, got {args.start_rate:g}")
    return BenchSettings(slo=slo, mix=args.mix, source=_source(args), rates=rates, search=search,
                         n_requests=args.requests, max_tokens=args.max_tokens, long_tokens=args.long_tokens,
                         seed=args.seed, start_rps=args.start_rate, all_interactive=args.all_interactive,
                         unique_prefix=args.unique_prefix, stop_below=args.stop_below, model_name=args.model_name,
                         api_key=args.api_key, temperature=args.temperature, top_p=args.top_p)


def _source(args: argparse.Namespace):
    from homepd.advise.campaign.traffic import file_source, traffic_source  # why: `homepd --help` does not load it

    if args.traffic is not None:
        return traffic_source(args.traffic, args.db)  # why no tokenizer: the server's model is not known here
    if args.trace_file is not None:
        return file_source(args.trace_file)
    return None


def _run_slo(args: argparse.Namespace) -> int:
    import asyncio

    # why: httpx and sqlite_utils (the store) load for `bench slo` only
    from homepd.bench.slo import Server, bench_servers
    from homepd.store import Store

    servers = [Server.parse(u) for u in args.url]
    settings = _slo_settings(args)

    def show(name: str, fig: dict) -> None:
        failed = f", {fig['n_failed']} failed" if fig["n_failed"] else ""
        print(f"{name}: {fig['rate_rps']:.3g} req/s x {fig['n_requests']}: {fig['attainment']:.0%} within the "
              f"SLO{failed}", file=sys.stderr, flush=True)

    if args.store:
        with Store.open(args.db) as store:
            run_id, results = asyncio.run(bench_servers(servers, settings, store, on_probe=show))
    else:
        run_id, results = asyncio.run(bench_servers(servers, settings, on_probe=show))
    if args.json:
        print(json.dumps({"run_id": run_id, "slo": settings.slo.describe(), "servers": results}))
    else:
        print(render_table(results, settings.slo.describe()))
        if run_id is not None:
            print(f"stored as run {run_id}: homepd history show {run_id}")
    return 0
