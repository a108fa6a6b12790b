"""``homepd trace``: write benchmark traces to files and convert them to and from other tools' formats.

``homepd trace make`` writes a seeded trace (``homepd run --trace-file`` and
``homepd advise`` replay it); ``homepd trace convert`` moves one between the
homepd, Mooncake, vLLM (``bench serve --dataset-name custom``) and SGLang
(``bench_serving --dataset-name openai``) formats, so the same workload runs
on a bigger engine.  Without ``-o`` the trace goes to stdout; a one-line
summary (and, for a foreign format, how to replay it there) goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

from homepd.measure.trace.conversations import CHAT_THINK_S, CHAT_TURNS, RAG_DOCUMENTS
from homepd.measure.trace import (ARRIVALS, DEFAULT_LONG_TOKENS, FORMATS, MIXES, Trace, estimate_tokens,
                                  export_lines, export_trace, import_trace, make_trace, replay_hint)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or 'inf'), got {text}")
    return value


def add_arrival_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=_rate, default=1.0, help="mean arrivals per second ('inf': all at once)")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="arrival process")
    p.add_argument("--burstiness", type=_rate, default=1.0,
                   help="gamma shape: 1 is Poisson, below 1 burstier (vLLM's convention)")
    p.add_argument("--concurrency", type=_positive_int, default=None,
                   help="closed loop: keep N requests in flight, ignoring arrival times")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="requests generate exactly their max tokens (default: yes; a homepd file keeps its own)")
    p.add_argument("--seed", type=int, default=0)


def summary(trace: Trace) -> str:
    """One line: requests, kinds (and conversations), span, mean rate, estimated prompt and output tokens."""
    kinds = Counter(r.kind for r in trace)
    n_conversations = len({r.conversation for r in trace if r.conversation is not None})
    span = max(r.arrival_s for r in trace)
    load = (f"closed loop of {trace.concurrency}" if trace.concurrency
            else f"over {span:.1f} s ({(len(trace) - 1) / span:.2f} req/s)" if span > 0 else "all at once")
    mix = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    if n_conversations:
        mix += f" turns in {n_conversations} conversations"
    return (f"{len(trace)} requests ({mix}) {load}; "
            f"~{sum(estimate_tokens(r.text) for r in trace)} prompt tokens (estimated), "
            f"{sum(r.max_tokens for r in trace)} max output tokens")


def _write(trace: Trace, out: str | None, fmt: str) -> None:
    if out is None:
        for line in export_lines(trace, fmt):
            print(line)
    else:
        export_trace(trace, out, fmt)
    print(f"homepd: {summary(trace)}", file=sys.stderr)
    if fmt != "homepd":
        print(f"replay with: {replay_hint(trace, fmt, out or 'FILE')}", file=sys.stderr)


def _make(args: argparse.Namespace) -> int:
    trace = make_trace(args.mix, args.requests, args.rate, arrival=args.arrival, burstiness=args.burstiness,
                       concurrency=args.concurrency, max_tokens=args.max_tokens, long_tokens=args.long_tokens,
                       ignore_eos=args.ignore_eos, seed=args.seed, name=args.name, turns=args.turns,
                       think_s=args.think_s, documents=args.documents)
    _write(trace, args.output, args.to)
    return 0


def _convert(args: argparse.Namespace) -> int:
    if args.output and os.path.abspath(args.output) == os.path.abspath(args.input):
        print("homepd: error: the output would overwrite the input", file=sys.stderr)
        return 1
    trace = import_trace(args.input, args.src_format, rate_per_s=args.rate, arrival=args.arrival,
                         burstiness=args.burstiness, concurrency=args.concurrency, ignore_eos=args.ignore_eos,
                         seed=args.seed)
    _write(trace, args.output, args.to)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="write benchmark traces (JSONL) and convert them for vLLM/SGLang")
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)

    make = sub.add_parser("make", help="write a seeded trace: a prompt mix on an arrival process")
    make.add_argument("--mix", "--kind", dest="mix", choices=MIXES, default="mixed",
                      help="short: chat questions; long: documents to summarise; mixed: every 4th long; chat: "
                           "multi-turn conversations (--rate: conversations per second); rag: several questions "
                           "about each of a few documents")
    make.add_argument("--turns", type=_positive_int, default=CHAT_TURNS, help="chat: turns per conversation")
    make.add_argument("--think-s", type=_seconds, default=CHAT_THINK_S,
                      help="chat: mean think time between an answer and the next turn (exponential)")
    make.add_argument("--documents", type=_positive_int, default=RAG_DOCUMENTS,
                      help="rag: documents asked about (each about --long-tokens)")
    make.add_argument("--requests", type=_positive_int, default=24)
    add_arrival_flags(make)
    make.add_argument("--max-tokens", type=_positive_int, default=None,
                      help="every request's output tokens (default: 32-128 short, 64-160 long, seeded)")
    make.add_argument("--long-tokens", type=_positive_int, default=DEFAULT_LONG_TOKENS,
                      help=f"estimated tokens of a long prompt (default {DEFAULT_LONG_TOKENS})")
    make.add_argument("--name", default=None, help="the trace's name (default: the mix)")
    make.add_argument("--to", choices=FORMATS, default="homepd", help="file format (default homepd)")
    make.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    make.set_defaults(func=_make)

    conv = sub.add_parser("convert", help="convert a trace between homepd, mooncake, vllm and sglang JSONL",
                          description="Convert a trace.  vllm and sglang files carry no arrival times: importing "
                                      "one draws them with --rate/--arrival/--burstiness/--seed (or --concurrency).")
    conv.add_argument("input", help="the trace file to read")
    conv.add_argument("--from", dest="src_format", choices=FORMATS, default="homepd")
    conv.add_argument("--to", choices=FORMATS, default="homepd")
    add_arrival_flags(conv)
    conv.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    conv.set_defaults(func=_convert)
