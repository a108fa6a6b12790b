"""Whether a decode step's cost follows the KV cells in use or the cache's used range (unified cache, no flash
attention).

llama.cpp sizes a step's attention by the highest used cell of the cache (``llama_kv_cache::get_n_kv``: the used
range, padded to 256), and masks the cells no query may see.  Three contexts, the same two running sequences of
``--cells`` cells each, one decode token each a step (undone after it, so every repeat sees the same cache):

- ``compact``: the two sequences alone, at the bottom of the cache;
- ``high range``: a ``--idle``-cell sequence filled first, then the two, then that one removed: the same cells in
  use as ``compact``, placed above the hole it left;
- ``idle kept``: the same, the idle sequence kept (what homepd's step model counts since it prices idle cached
  cells).

Medians of ``--repeats`` (p10..p90), interleaved.  Figures go in the report, not in tests.

    uv run python benchmarks/kv_range.py [--threads 2] [--cells 400] [--idle 2000] [--repeats 40]
"""
from __future__ import annotations

import argparse
import statistics
import time

from homepd.config import DEFAULT_MODEL_NAME
from homepd.llm import LlamaContext, LlamaModel
from homepd.models.resolve import resolve_model
from kv_layout import _fill  # the same filler: benchmarks/ is on sys.path when a script of it runs

CASES = ("compact", "high range", "idle kept")


def context(model: LlamaModel, case: str, args) -> LlamaContext:
    ctx = LlamaContext(model, n_ctx=args.n_ctx, n_batch=512, n_seq_max=4, n_threads=args.threads, kv_unified=True,
                       flash_attn=False)
    if case != "compact":
        _fill(ctx, 2, args.idle, 512)   # the bottom of the cache
    _fill(ctx, 0, args.cells, 512)
    _fill(ctx, 1, args.cells, 512)
    if case == "high range":
        ctx.seq_rm(2)                   # the two keep their cells above the hole
    return ctx


def step_ms(ctx: LlamaContext, cells: int) -> float:
    t0 = time.perf_counter()
    ctx.decode([42, 43], [cells, cells], [0, 1], [True, True])
    ms = (time.perf_counter() - t0) * 1e3
    ctx.seq_trim(0, cells)
    ctx.seq_trim(1, cells)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: homepd's embedded default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cells", type=int, default=400, help="each running sequence's cells")
    ap.add_argument("--idle", type=int, default=2000, help="the idle sequence's cells")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    if 2 * args.cells + args.idle + 2 > args.n_ctx:
        raise SystemExit(f"--n-ctx {args.n_ctx} cannot hold 2 x {args.cells} + {args.idle} cells")
    model = LlamaModel(str(args.model or resolve_model(DEFAULT_MODEL_NAME)))
    ctxs = {case: context(model, case, args) for case in CASES}
    times: dict[str, list[float]] = {case: [] for case in CASES}
    try:
        for _ in range(args.repeats):
            for case, ctx in ctxs.items():
                times[case].append(step_ms(ctx, args.cells))
    finally:
        for ctx in ctxs.values():
            ctx.close()
        model.close()
    print(f"threads {args.threads}: two decodes, {args.cells} cells each, beside {args.idle} idle cells; "
          f"step ms, median (p10..p90) of {args.repeats}, interleaved")
    in_use = {"compact": 2 * args.cells, "high range": 2 * args.cells, "idle kept": 2 * args.cells + args.idle}
    used_range = {"compact": 2 * args.cells, "high range": 2 * args.cells + args.idle,
                  "idle kept": 2 * args.cells + args.idle}
    for case, ts in times.items():
        ts = sorted(ts)
        print(f"  {case:11s} cells in use {in_use[case]:5d}, used range {used_range[case]:5d}: "
              f"{statistics.median(ts):6.1f} ({ts[len(ts) // 10]:.1f}..{ts[len(ts) * 9 // 10]:.1f})")


if __name__ == "__main__":
    main()
