"""Conversations and shared documents: homepd against llama-server over HTTP, one client, one server at a time.

Real home-lab traffic resends the whole conversation every turn (a chat client) or asks several questions about
one document (a RAG front-end).  This replays both on each server and reports what prefix reuse buys:

- **chat**: ``--conversations`` conversations of ``--turns`` turns; conversation *i* starts at a Poisson arrival
  (open loop across conversations), each later turn is sent ``--think-s`` after the previous answer ended
  (closed within a conversation), with the whole history: the system prompt, every earlier question and the
  answer the server actually gave (as a chat client does; ``ignore_eos`` keeps every answer at its trace length).
- **rag**: ``--documents`` documents of about ``--doc-tokens`` tokens, ``--questions`` questions each, one
  after the other per document, documents open loop.

Per turn it records TTFT (client clock, first content chunk), every inter-token gap, ``usage.prompt_tokens`` and
the cached prompt tokens the server reports (``usage.prompt_tokens_details.cached_tokens``; llama-server also
gives ``timings.cache_n``).  It prints, per server, TTFT mean and p90, the p90 of each turn's largest gap, a document's first question's
TTFT, later turns' TTFT p50, prompt tokens computed (prompt - cached), and the turns meeting TTFT <= 4 s with every
gap <= 100 ms and <= 200 ms.  ``--kind mix`` runs the chats and the documents at once (``--doc-after-s``: the
documents join the running chats that much later).  Greedy by default; ``--temperature 0.7 --top-p 0.9`` samples as
chat clients do.  Servers run one after another, interleaved over ``--repeats``; medians over repeats, with the
spread (min..max).

    uv run python benchmarks/build_llama_server.py
    uv run python benchmarks/chat_bench.py --threads 1 --repeats 3
    uv run python benchmarks/chat_bench.py --only homepd,homepd-no-cache --kind chat
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slo_capacity import HERE, ITL_S, TTFT_S, Server, ServerConfig, parse_variant, served_model_id  # noqa: E402

from homepd.config import DEFAULT_MODEL_NAME  # noqa: E402
from homepd.stats import percentile  # noqa: E402
from homepd.measure.trace.corpus import chat_questions, passage  # noqa: E402
from homepd.models.resolve import resolve_model  # noqa: E402

SYSTEM = ("You are a helpful assistant running on a small home server. Answer briefly and precisely, "
          "and say so when you are not sure.")


@dataclass
class Turn:
    conversation: int
    turn: int
    kind: str                  # "chat" | "rag"
    new_text: str              # what this turn adds (a question; the document with the first rag question)
    max_tokens: int
    status: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    answer: str = ""
    error: str | None = None
    retried: bool = False      # the server closed the connection before answering; sent once more (TTFT counts both)

    @property
    def good(self) -> bool:
        return self.within(TTFT_S, ITL_S)

    def within(self, ttft_s: float, itl_s: float) -> bool:
        """Answered, its first token within ``ttft_s`` and every gap within ``itl_s``."""
        return (self.status == 200 and self.error is None and self.ttft_s is not None and self.ttft_s <= ttft_s
                and all(g <= itl_s for g in self.gaps_s))

    @property
    def max_gap_s(self) -> float | None:
        return max(self.gaps_s) if self.gaps_s else None

    @property
    def computed_tokens(self) -> int | None:
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens - (self.cached_tokens or 0)


@dataclass(frozen=True)
class Conversation:
    index: int
    kind: str
    start_s: float
    first_user: str            # the first turn's user message (for rag: the document and a question)
    questions: tuple[str, ...]  # the later turns' user messages
    max_tokens: int


def conversations(kind: str, n: int, turns: int, rate: float, doc_tokens: int, max_tokens: int,
                  seed: int, salt: str = "") -> list[Conversation]:
    """Seeded conversations: the same for every server.  A tag per conversation keeps two of them from sharing
    more than the system prompt (the corpus repeats questions); ``salt`` makes another set of the same kind (the
    mix's, which runs on a server that may have served the chat and rag sets already)."""
    rng = random.Random(f"{seed}/{salt}{kind}")
    qs = chat_questions()
    out, t = [], 0.0
    for i in range(n):
        tag = f"[{salt}{kind} {seed}/{i}] "
        asked = [tag + rng.choice(qs) for _ in range(turns)]
        if kind == "rag":
            doc = passage(rng, int(doc_tokens * 4.7), head="{title}\n\n")
            first = f"{tag}Read this document, then answer the questions about it.\n\n{doc}\n\nQuestion: {asked[0]}"
            later = tuple(f"Question: {q}" for q in asked[1:])
        else:
            first, later = asked[0], tuple(asked[1:])
        out.append(Conversation(i, kind, t, first, later, max_tokens))
        t += rng.expovariate(rate)
    return out


def workload_of(kind: str, args, seed: int, salt: str = "") -> list[Conversation]:
    """The conversations of ``kind``: chat, rag, or mix (the chats and the documents at once, both starting
    open loop at ``--rate`` each, numbered apart; the documents ``--doc-after-s`` after the chats).  The mix's are
    its own (``salt``), not the chat and rag sets': a server keeps those cached when it runs them first, and a
    mix of them would measure its cache hits (a document's first question in 0.2 s)."""
    if kind == "chat":
        return conversations("chat", args.conversations, args.turns, args.rate, args.doc_tokens, args.max_tokens,
                             seed, salt)
    if kind == "rag":
        return conversations("rag", args.documents, args.questions, args.rate, args.doc_tokens, args.max_tokens,
                             seed, salt)
    if kind == "mix":
        chats = workload_of("chat", args, seed, "mix-")
        docs = [replace(c, index=len(chats) + c.index, start_s=c.start_s + args.doc_after_s)
                for c in workload_of("rag", args, seed, "mix-")]
        return chats + docs
    raise SystemExit(f"--kind: unknown kind {kind!r}; known: chat, rag, mix")


async def one_turn(client: httpx.AsyncClient, base: str, model_id: str, messages: list[dict], out: Turn,
                   sampling: dict | None = None) -> None:
    body = {"model": model_id, "messages": messages, "max_tokens": out.max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}, **(sampling or {})}
    # (llama-server's cache_prompt is on by default; homepd refuses fields it does not implement)
    t0 = time.monotonic()
    pieces: list[str] = []
    try:
        try:
            await _stream_turn(client, base, body, out, t0, pieces)
        except httpx.RemoteProtocolError:
            # why once more: llama-server (default and -b 256; 3 of 102 workload runs in one day, none on homepd)
            # sometimes closed a kept-alive connection without answering a conversation's first request; nothing
            # was streamed, so it is sent again on a new connection and its TTFT counts from the first send
            if out.status or pieces:
                raise
            out.retried = True
            await _stream_turn(client, base, body, out, t0, pieces)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.answer = "".join(pieces)


async def _stream_turn(client: httpx.AsyncClient, base: str, body: dict, out: Turn, t0: float,
                       pieces: list[str]) -> None:
    """One send of a turn: its status, TTFT (from ``t0``), gaps, usage and text pieces into ``out``."""
    last = t0
    async with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=httpx.Timeout(600.0)) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode(errors="replace")[:200]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line[6:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    out.cached_tokens = details["cached_tokens"]
            timings = chunk.get("timings")
            if timings and out.cached_tokens is None and timings.get("cache_n") is not None:
                out.cached_tokens = timings["cache_n"]
            choices = chunk.get("choices") or []
            content = (choices[0].get("delta") or {}).get("content") if choices else None
            if not content:
                continue
            now = time.monotonic()
            if out.ttft_s is None:
                out.ttft_s = now - t0
            else:
                out.gaps_s.append(now - last)
            last = now
            pieces.append(content)


async def run_conversation(client, base, model_id, conv: Conversation, think_s: float, t_start: float,
                           turns: list[Turn], sampling: dict | None = None) -> None:
    delay = t_start + conv.start_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    messages = [{"role": "system", "content": SYSTEM}]
    for j, text in enumerate((conv.first_user, *conv.questions)):
        if j:
            await asyncio.sleep(think_s)
        messages.append({"role": "user", "content": text})
        turn = Turn(conv.index, j, conv.kind, text, conv.max_tokens)
        turns.append(turn)
        await one_turn(client, base, model_id, messages, turn, sampling)
        if turn.error:
            return
        messages.append({"role": "assistant", "content": turn.answer})


async def bench_server(cfg: ServerConfig, args, workload: dict[str, list[Conversation]], repeat: int,
                       log_dir: Path) -> dict[str, list[Turn]]:
    server = Server(cfg, args.model, args.llama_server, log_dir)
    server.start()
    results: dict[str, list[Turn]] = {}
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
            await server.wait_ready(client)
            model_id = await served_model_id(client, server.base)
            await one_turn(client, server.base, model_id, [{"role": "user", "content": "Hi"}],
                           Turn(-1, -1, "warm", "Hi", 8))
            for kind, convs in workload.items():
                turns: list[Turn] = []
                t0 = time.monotonic()
                await asyncio.gather(*(run_conversation(client, server.base, model_id, c, args.think_s, t0, turns,
                                                        sampling_of(args)) for c in convs))
                results[kind] = turns
                s = summarize(turns)
                print(f"{cfg.name:22s} rep {repeat} {kind:4s}  TTFT mean/p90 {s['ttft_mean_ms']}/{s['ttft_p90_ms']} ms"
                      f"  max-gap p90 {s['max_gap_p90_ms']} ms  a document's first question {s['doc_first_ms']} ms  "
                      f"first TTFT p50/p90 {s['first_p50_ms']}/{s['first_p90_ms']} ms  later p50/p90 "
                      f"{s['later_p50_ms']}/{s['later_p90_ms']} ms  prompt tok {s['prompt_tokens']} computed "
                      f"{s['computed_tokens']}  within 4 s and 100/200 ms {s['within_100']}/{s['within_200']} of "
                      f"{s['n_turns']}  errors {s['errors']}  sent twice {s['retried']}", flush=True)
    finally:
        server.stop()
    return results


def sampling_of(args) -> dict:
    """The sampling fields every turn sends: greedy by default; ``--temperature 0.7 --top-p 0.9`` is what chat
    clients send (the answers then differ between servers, and so do the histories resent after them)."""
    out = {"temperature": args.temperature}
    if args.top_p is not None:
        out["top_p"] = args.top_p
    return out


def _ms(x):
    return None if x is None else round(x * 1e3)


def summarize(turns: list[Turn]) -> dict:
    ttfts = sorted(t.ttft_s for t in turns if t.ttft_s is not None)
    max_gaps = sorted(t.max_gap_s for t in turns if t.max_gap_s is not None)
    doc_first = sorted(t.ttft_s for t in turns if t.kind == "rag" and t.turn == 0 and t.ttft_s is not None)
    first = sorted(t.ttft_s for t in turns if t.turn == 0 and t.ttft_s is not None)
    later = sorted(t.ttft_s for t in turns if t.turn > 0 and t.ttft_s is not None)
    p50f, p50l = percentile(first, 50), percentile(later, 50)
    computed = [t.computed_tokens for t in turns if t.computed_tokens is not None]
    return {"first_p50_ms": _ms(p50f), "first_p90_ms": _ms(percentile(first, 90)),
            "later_p50_ms": _ms(p50l), "later_p90_ms": _ms(percentile(later, 90)),
            "later_over_first": round(p50l / p50f, 2) if p50f and p50l else None,
            "prompt_tokens": sum(t.prompt_tokens or 0 for t in turns),
            "computed_tokens": sum(computed) if computed else None,
            "good": f"{sum(t.good for t in turns)}/{len(turns)}",
            "ttft_mean_ms": _ms(statistics.fmean(ttfts)) if ttfts else None, "ttft_p90_ms": _ms(percentile(ttfts, 90)),
            "max_gap_p90_ms": _ms(percentile(max_gaps, 90)),
            "doc_first_ms": _ms(statistics.median(doc_first)) if doc_first else None,
            "within_100": sum(t.within(TTFT_S, 0.100) for t in turns),
            "within_200": sum(t.within(TTFT_S, 0.200) for t in turns), "n_turns": len(turns),
            "errors": sum(t.error is not None for t in turns), "retried": sum(t.retried for t in turns)}


def server_configs(threads: int, parallel: int, n_ctx: int, llama_batches: tuple[int, ...] = (),
                   homepd_variants: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> list[ServerConfig]:
    """llama-server with its defaults, and with each of ``llama_batches`` as its -b and -ub (a smaller batch
    shortens the steps a prompt shares with running decodes); homepd with and without prefix reuse, and with
    each of ``homepd_variants`` (name, extra ``homepd serve`` arguments)."""
    ls = ("-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", str(parallel), "--jinja")
    hp = ("--threads", str(threads), "--n-ctx", str(n_ctx), "--n-seq-max", str(parallel))
    return [ServerConfig("llama-server", "llama-server", ls),
            *(ServerConfig(f"llama-server-b{b}", "llama-server", (*ls, "-b", str(b), "-ub", str(b)))
              for b in llama_batches),
            ServerConfig("homepd", "homepd", hp),
            ServerConfig("homepd-no-cache", "homepd", (*hp, "--no-prefix-cache")),
            *(ServerConfig(f"homepd-{name}", "homepd", (*hp, *extra)) for name, extra in homepd_variants)]


def print_table(per_repeat: dict[str, list[dict[str, list[Turn]]]], kinds: list[str]) -> None:
    print("\nmedians over repeats (min..max); TTFT and gaps in ms; computed = prompt tokens - cached; "
          "within = turns with TTFT <= 4 s and every gap <= 100 / 200 ms")
    print(f"{'server':22s} {'kind':4s} {'TTFT mean':>16s} {'TTFT p90':>16s} {'max-gap p90':>14s} "
          f"{'doc 1st':>16s} {'later p50':>14s} {'computed/prompt':>16s} {'within 100':>11s} {'within 200':>11s}")
    for name, reps in per_repeat.items():
        for kind in kinds:
            rows = [summarize(r[kind]) for r in reps if kind in r]
            if not rows:
                continue

            def cell(key, rows=rows):
                xs = [r[key] for r in rows if r[key] is not None]
                if not xs:
                    return "-"
                return f"{statistics.median(xs):g} ({min(xs):g}..{max(xs):g})" if len(xs) > 1 else f"{xs[0]:g}"
            comp = statistics.median(r["computed_tokens"] or 0 for r in rows)
            prompt = statistics.median(r["prompt_tokens"] for r in rows)
            n = rows[0]["n_turns"]
            print(f"{name:22s} {kind:4s} {cell('ttft_mean_ms'):>16s} {cell('ttft_p90_ms'):>16s} "
                  f"{cell('max_gap_p90_ms'):>14s} {cell('doc_first_ms'):>16s} {cell('later_p50_ms'):>14s} "
                  f"{f'{comp:g}/{prompt:g}':>16s} {cell('within_100') + f'/{n}':>11s} "
                  f"{cell('within_200') + f'/{n}':>11s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: homepd's embedded default model)")
    ap.add_argument("--llama-server", type=Path, default=HERE.parent / ".cache/llama-server/build/bin/llama-server")
    ap.add_argument("--kind", default="chat,rag", help="chat, rag, or mix (the chats and the documents at once); "
                                                       "comma-separated, each run as its own workload")
    ap.add_argument("--llama-batches", default="", help="also llama-server with each of these -b/-ub, e.g. 64,128")
    ap.add_argument("--homepd-variant", type=parse_variant, action="append", default=[], metavar="NAME=ARGS",
                    help="also homepd-NAME: homepd serve with these extra arguments (repeatable), e.g. "
                         "'g3=--gap-ceiling 3'")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--documents", type=int, default=2)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=600)
    ap.add_argument("--doc-after-s", type=float, default=0.0,
                    help="mix: the documents start this long after the chats (with --documents 1: a lone document "
                         "arriving beside running chats)")
    ap.add_argument("--rate", type=float, default=0.5, help="conversations (documents) starting per second")
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every turn (0: greedy)")
    ap.add_argument("--top-p", type=float, default=None, help="top_p of every turn (default: not sent)")
    ap.add_argument("--parallel", type=int, default=4, help="llama-server -np and homepd --n-seq-max")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated server names (default: all)")
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        args.model = str(resolve_model(DEFAULT_MODEL_NAME))
    configs = server_configs(args.threads, args.parallel, args.n_ctx,
                             tuple(int(b) for b in args.llama_batches.split(",") if b), tuple(args.homepd_variant))
    if args.only:
        wanted = set(args.only.split(","))
        if wanted - {c.name for c in configs}:
            raise SystemExit(f"unknown server(s) {sorted(wanted - {c.name for c in configs})}; "
                             f"known: {[c.name for c in configs]}")
        configs = [c for c in configs if c.name in wanted]
    if any(c.kind == "llama-server" for c in configs) and not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} is missing: build it with uv run python benchmarks/build_llama_server.py")
    kinds = [k for k in args.kind.split(",") if k]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "homepd-chat-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    per_repeat: dict[str, list[dict[str, list[Turn]]]] = {c.name: [] for c in configs}
    for rep in range(args.repeats):
        # why a seed per repeat: a server that kept an earlier repeat's prefixes would be served from its cache
        workload = {k: workload_of(k, args, args.seed + 1000 * rep) for k in kinds}
        order = configs if rep % 2 == 0 else list(reversed(configs))  # interleaved: no server always first
        for cfg in order:
            per_repeat[cfg.name].append(asyncio.run(bench_server(cfg, args, workload, rep, log_dir)))
    print_table(per_repeat, kinds)
    if args.output:
        args.output.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "runs": {name: [{k: [asdict(t) for t in ts] for k, ts in rep.items()} for rep in reps]
                     for name, reps in per_repeat.items()}}, indent=1))


if __name__ == "__main__":
    main()
