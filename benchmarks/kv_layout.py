"""Step cost of a running request against idle cached prefixes, unified KV cache vs per-sequence streams.

Prefix reuse keeps finished sequences' KV in the context.  With ``kv_unified=True`` (``--kv-layout unified``, and ``auto`` where a stream would be short) every
step attends over every cell in use, so idle cached cells may slow a running request; with
``kv_unified=False`` (``--kv-layout streams``) llama.cpp gives each of the ``n_seq_max`` sequences its own stream of
``n_ctx / n_seq_max`` cells, so a step attends only over its own sequences' streams — but no prompt can be
longer than one stream.  This measures, for each layout, a running sequence's decode step (one token) and a
prompt chunk, with 0.. ``n_seq_max - 1`` idle sequences each holding a cached prefix, and prints a table.

    python benchmarks/kv_layout.py [--model PATH] [--threads 1] [--n-ctx 4096] [--n-seq-max 8]

Figures go in the report, not in tests.
"""
from __future__ import annotations

import argparse
import statistics
import time

from homepd.llm import LlamaContext, LlamaModel
from homepd.models.resolve import models_dir

DEFAULT_MODEL = "smollm2-135m-instruct-q4_1.gguf"


def _fill(ctx: LlamaContext, seq_id: int, n_tokens: int, n_batch: int) -> None:
    tokens = [(7 * i + seq_id) % 1000 + 100 for i in range(n_tokens)]
    for start in range(0, n_tokens, n_batch):
        stop = min(n_tokens, start + n_batch)
        ctx.decode(tokens[start:stop], list(range(start, stop)), [seq_id] * (stop - start),
                   [False] * (stop - start - 1) + [True])


def _timed_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(model: LlamaModel, kv_unified: bool, n_ctx: int, n_seq_max: int, n_threads: int,
            n_running: int, n_idle_each: int, chunk: int, repeats: int) -> list[tuple[int, float, float]]:
    """(idle cached cells, decode step ms, prompt chunk ms) for 0..n_seq_max-1 idle sequences."""
    rows = []
    for n_idle in sorted({0, (n_seq_max - 1) // 2, n_seq_max - 1}):
        ctx = LlamaContext(model, n_ctx=n_ctx, n_batch=512, n_seq_max=n_seq_max, n_threads=n_threads,
                           kv_unified=kv_unified)
        try:
            for sid in range(1, 1 + n_idle):
                _fill(ctx, sid, n_idle_each, 512)
            _fill(ctx, 0, n_running, 512)
            pos = [n_running]

            def decode_one():
                ctx.decode([42], [pos[0]], [0], [True])
                pos[0] += 1

            decode_ms = _timed_ms(decode_one, repeats)
            ctx.seq_trim(0, n_running)
            pos[0] = n_running

            def prompt_chunk():
                ctx.decode([43] * chunk, list(range(pos[0], pos[0] + chunk)), [0] * chunk,
                           [False] * (chunk - 1) + [True])
                ctx.seq_trim(0, n_running)

            chunk_ms = _timed_ms(prompt_chunk, max(3, repeats // 6))
            rows.append((n_idle * n_idle_each, decode_ms, chunk_ms))
        finally:
            ctx.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF path (default: the default catalog model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-seq-max", type=int, default=8)
    ap.add_argument("--running", type=int, default=200, help="tokens the running sequence holds")
    ap.add_argument("--chunk", type=int, default=32, help="prompt chunk measured")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args(argv)
    path = args.model or str(models_dir() / DEFAULT_MODEL)
    model = LlamaModel(path)
    per_stream = args.n_ctx // args.n_seq_max
    n_idle_each = per_stream - 32  # what fits one stream of the split layout
    print(f"model {path}, threads {args.threads}, n_ctx {args.n_ctx}, n_seq_max {args.n_seq_max}: "
          f"running sequence {args.running} tokens, each idle one {n_idle_each}, chunk {args.chunk}")
    print(f"{'layout':<10} {'idle cells':>10} {'decode ms':>10} {'chunk ms':>10}")
    for kv_unified, name in ((True, "unified"), (False, "per-seq")):
        for idle, decode_ms, chunk_ms in measure(model, kv_unified, args.n_ctx, args.n_seq_max, args.threads,
                                                 args.running, n_idle_each, args.chunk, args.repeats):
            print(f"{name:<10} {idle:>10} {decode_ms:>10.2f} {chunk_ms:>10.1f}")
    print(f"per-seq: the longest prompt is {per_stream} tokens (one stream); unified: {args.n_ctx}")


if __name__ == "__main__":
    main()
