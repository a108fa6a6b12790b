"""What one step costs on this box: a prompt chunk by the depth its own sequence is at, beside running decodes.

The step-time model (``homepd.core.stepmodel``) prices a prompt token as one constant plus attention over the
KV cells *in use* (every running sequence's).  llama.cpp's CPU flash attention skips the cells a token's mask
hides, so what a prompt token really attends over is its own sequence's depth: a document's later chunks cost
several times its first ones, and a chunk of a long document costs more than the same chunk of a short chat.
This measures it: for each depth of a "document" sequence, a step of ``chunk`` of its prompt tokens alone and
beside ``--decodes`` chat streams (each ``--stream-depth`` deep), and the decodes alone; every step is undone
afterwards (``seq_trim``), so each repeat sees the same cache.  Medians of ``--repeats`` (p10..p90).

    python benchmarks/step_cost.py [--model PATH] [--threads 1] [--decodes 3] [--stream-depth 300]
                                   [--depths 0,300,600,1200] [--chunks 4,32] [--repeats 10]

Figures go in the report, not in tests.
"""
from __future__ import annotations

import argparse
import statistics
import time

from homepd.config import DEFAULT_MODEL_NAME, FLASH_ATTN, flash_attn_of
from homepd.llm import LlamaContext, LlamaModel
from homepd.models.resolve import resolve_model
from kv_layout import _fill  # the same filler: benchmarks/ is on sys.path when a script of it runs

DOC = 0  # the document's sequence id; the streams take 1..decodes


def _step_ms(ctx: LlamaContext, n_decode: int, stream_depth: int, chunk: int, doc_depth: int) -> float:
    """One llama_decode of ``n_decode`` stream tokens and ``chunk`` document tokens, then undone."""
    tokens, positions, seqs, logits = [], [], [], []
    for s in range(1, n_decode + 1):
        tokens.append(123)
        positions.append(stream_depth)
        seqs.append(s)
        logits.append(True)
    for j in range(chunk):
        tokens.append(200 + j)
        positions.append(doc_depth + j)
        seqs.append(DOC)
        logits.append(j == chunk - 1)
    t0 = time.perf_counter()
    ctx.decode(tokens, positions, seqs, logits)
    elapsed = (time.perf_counter() - t0) * 1e3
    for s in range(1, n_decode + 1):
        ctx.seq_trim(s, stream_depth)
    if chunk:
        ctx.seq_trim(DOC, doc_depth)
    return elapsed


def _figure(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):7.1f} ({xs[len(xs) // 10]:.0f}..{xs[len(xs) * 9 // 10]:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: homepd's embedded default model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decodes", type=int, default=3, help="chat streams decoding beside the document")
    ap.add_argument("--stream-depth", type=int, default=300, help="each stream's KV cells")
    ap.add_argument("--depths", default="0,300,600,1200", help="the document's depth before its chunk")
    ap.add_argument("--chunks", default="4,32", help="prompt tokens of the document a step carries")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto")
    args = ap.parse_args()
    depths = [int(x) for x in args.depths.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    model = LlamaModel(str(args.model or resolve_model(DEFAULT_MODEL_NAME)))
    n_ctx = max(depths) + max(chunks) + (args.decodes + 1) * (args.stream_depth + 1) + 256
    ctx = LlamaContext(model, n_ctx=n_ctx, n_batch=512, n_seq_max=args.decodes + 1, n_threads=args.threads,
                       flash_attn=flash_attn_of(args.flash_attn))
    for s in range(1, args.decodes + 1):
        _fill(ctx, s, args.stream_depth, 256)
    print(f"threads {args.threads}; {args.decodes} streams {args.stream_depth} cells deep; step ms, median (p10..p90) "
          f"of {args.repeats}")
    print(f"{'document depth':>15s} {'chunk':>6s} {'chunk alone':>18s} {'beside the decodes':>20s} "
          f"{'decodes alone':>18s} {'ms per chunk token':>19s}")
    for depth in depths:
        ctx.seq_rm(DOC)
        if depth:
            _fill(ctx, DOC, depth, 256)
        for chunk in chunks:
            alone, beside, decodes = [], [], []
            for _ in range(args.repeats):  # interleaved, so that the box's drift hits all three alike
                alone.append(_step_ms(ctx, 0, args.stream_depth, chunk, depth))
                beside.append(_step_ms(ctx, args.decodes, args.stream_depth, chunk, depth))
                decodes.append(_step_ms(ctx, args.decodes, args.stream_depth, 0, depth))
            per = (statistics.median(beside) - statistics.median(decodes)) / chunk
            print(f"{depth:15d} {chunk:6d} {_figure(alone):>18s} {_figure(beside):>20s} {_figure(decodes):>18s} "
                  f"{per:19.2f}")
    ctx.close()
    model.close()


if __name__ == "__main__":
    main()
