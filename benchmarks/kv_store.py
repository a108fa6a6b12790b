"""The KV store tier: restore a saved prefix vs recompute it, by prefix length, on one thread.

For each length, a sequence is prefilled (in chunks of ``--chunk``, as a worker would: the recompute time),
saved into a real store segment (``homepd.kv.store``: ``llama_state_seq_get_data`` straight into the shared
mapping — what an eviction costs the step loop), dropped, and restored from it (``llama_state_seq_set_data``
straight from the mapping).  Prints the median of ``--repeats`` runs, per token too; the worker itself
decides per request from its own measured restore cost and its step-time model
(``homepd.core.prefixreuse.store_is_faster``).

    python benchmarks/kv_store.py [--model PATH] [--threads 1] [--n-ctx 4096] [--repeats 3]
                                  [--flash-attn auto|on|off] [--interleave 3]

``--interleave K`` writes the prefix's second half one token per step beside ``K`` other streams, as a
conversation's answers are written: its cells are then scattered between theirs, as in a serving worker.
Without flash attention (homepd's default on a CPU) llama.cpp keeps the V cache transposed and copies a
state one row and one run of cells at a time, so such a save costs many times a contiguous one.

Figures go in the report, not in tests.
"""
from __future__ import annotations

import argparse
import statistics
import time

from homepd.config import FLASH_ATTN, flash_attn_of
from homepd.core.terms import ReuseMode
from homepd.core.protocol import StoreSaved
from homepd.kv.pool import extent_bytes_for
from homepd.kv.ring import PAGE_BYTES
from homepd.kv.store import MIN_SEGMENT_BYTES, StoreBook
from homepd.llm import LlamaContext, LlamaModel
from homepd.models.resolve import models_dir
from homepd.worker.storekv import ContextStore

DEFAULT_MODEL = "smollm2-135m-instruct-q4_1.gguf"
LENGTHS = (64, 128, 256, 512, 1024, 2048)
FINGERPRINT = "0" * 64


def prefill(ctx: LlamaContext, seq_id: int, tokens: list[int], chunk: int) -> None:
    for start in range(0, len(tokens), chunk):
        stop = min(len(tokens), start + chunk)
        ctx.decode(tokens[start:stop], list(range(start, stop)), [seq_id] * (stop - start),
                   [False] * (stop - start - 1) + [True])


def write(ctx: LlamaContext, tokens: list[int], chunk: int, interleave: int) -> None:
    """Sequence 0 holds ``tokens``: prefilled, or with ``interleave`` its second half one token per step
    beside that many other streams (sequences 2..), whose cells are then dropped (holes between its own)."""
    if not interleave:
        prefill(ctx, 0, tokens, chunk)
        return
    half = len(tokens) // 2
    prefill(ctx, 0, tokens[:half], chunk)
    others = list(range(2, 2 + interleave))
    for pos in range(half, len(tokens)):
        ctx.decode([tokens[pos]] * (1 + interleave), [pos] * (1 + interleave), [0, *others],
                   [False] * interleave + [True])
    for seq_id in others:
        ctx.seq_rm(seq_id)


def measure(ctx: LlamaContext, n_tokens: int, chunk: int, repeats: int,
            interleave: int = 0) -> tuple[float, float, float, float, int]:
    """(recompute ms, first save ms, save ms, restore ms, state bytes) for a prefix of ``n_tokens``, medians.
    The first save writes fresh store pages (page faults); later ones reuse them, as a full store does."""
    tokens = [(7 * i) % 1000 + 100 for i in range(n_tokens)]
    ctx.seq_rm(0)
    write(ctx, tokens, chunk, interleave)
    # room for one entry: every save wraps to the same extent, as saves into a full store reuse its pages
    book = StoreBook({"w": max(MIN_SEGMENT_BYTES, extent_bytes_for(ctx.state_size(0)) + PAGE_BYTES)})
    sent: list = []
    store = ContextStore(ctx, sent.append, FINGERPRINT, lambda: None)
    store.attach(book.attach_message("w"))
    recompute, save, restore = [], [], []
    try:
        for _ in range(repeats + 1):
            ctx.seq_rm(0)
            t0 = time.perf_counter()
            prefill(ctx, 0, tokens, chunk)
            recompute.append((time.perf_counter() - t0) * 1e3)
            if interleave:
                ctx.seq_rm(0)
                write(ctx, tokens, chunk, interleave)
            for entry in store.segment.index.entries():
                store.segment.drop(entry)
            t0 = time.perf_counter()
            store.save(0, tuple(tokens))
            save.append((time.perf_counter() - t0) * 1e3)
            assert store.n_entries == 1
            ctx.seq_rm(0)
            hit = store.lookup(tokens + [1], ReuseMode.PREFIX, n_tokens)
            t0 = time.perf_counter()
            n_pos = store.restore(hit, 1)
            restore.append((time.perf_counter() - t0) * 1e3)
            assert n_pos == n_tokens, (n_pos, n_tokens)
            ctx.seq_rm(1)
        n_bytes = next(m.payload_bytes for m in sent if isinstance(m, StoreSaved))
    finally:
        store.segment.close()
        book.close()
    return (statistics.median(recompute[1:]), save[0], statistics.median(save[1:]), statistics.median(restore[1:]),
            n_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(models_dir() / DEFAULT_MODEL))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto",
                        help="auto: as homepd's engine (off on a CPU)")
    parser.add_argument("--interleave", type=int, default=0,
                        help="write the second half one token per step beside this many streams")
    args = parser.parse_args()
    model = LlamaModel(args.model)
    ctx = LlamaContext(model, n_ctx=args.n_ctx, n_batch=512, n_seq_max=2 + args.interleave, n_threads=args.threads,
                       flash_attn=flash_attn_of(args.flash_attn))
    try:
        prefill(ctx, 0, [100, 101], 2)  # warm up
        print(f"model {args.model}, {args.threads} thread(s), n_ctx {args.n_ctx}, chunk {args.chunk}, "
              f"flash attention {args.flash_attn}, interleave {args.interleave}, median of {args.repeats}")
        print(f"{'tokens':>7} {'KV MiB':>7} {'recompute ms':>13} {'1st save ms':>12} {'save ms':>8} "
              f"{'restore ms':>11} {'save us/tok':>12} {'restore us/tok':>15} {'recompute/restore':>18}")
        for n in LENGTHS:
            if n * (1 + args.interleave) >= args.n_ctx:
                break
            rec, first, save, rest, n_bytes = measure(ctx, n, args.chunk, args.repeats, args.interleave)
            print(f"{n:>7} {n_bytes / 2**20:>7.1f} {rec:>13.1f} {first:>12.2f} {save:>8.2f} {rest:>11.2f} "
                  f"{save * 1e3 / n:>12.1f} "
                  f"{rest * 1e3 / n:>15.1f} {rec / rest:>17.0f}x")
    finally:
        ctx.close()
        model.close()


if __name__ == "__main__":
    main()
