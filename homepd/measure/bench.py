"""Engine overhead against a bare llama.cpp loop, and the KV arena.

A benchmark, not a test: it prints figures.  On one model and thread count it
measures single-stream prompt tok/s and decode tok/s through the engine
(separate worker process, pipes, controller) and through a bare loop over the
same llama.cpp calls in this process, with the same chunk and thread count;
the KV handoff through the arena against a memcpy; and the arena's peak use
on the default mixed trace, disaggregated.
"""
from __future__ import annotations

import asyncio
import statistics
import time

from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams

FILLER = ("The history of computing is a story of people, ideas and machines. Early mechanical "
          "calculators gave way to electronic computers, and those to the personal machines of today. ")


def make_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A natural-text prompt of exactly n_tokens tokens (BOS included if the model adds one)."""
    text = FILLER
    while len(tokenizer.tokenize(text)) < n_tokens:
        text += FILLER
    return tokenizer.tokenize(text)[:n_tokens]


async def _interleaved_runs(config: EngineConfig, model, prompt_ids: list[int], n_gen: int,
                            repeat: int) -> tuple[list[dict], list[dict]]:
    """Alternate engine and raw runs (one warm-up each) so drift on the box hits both alike."""
    from homepd.engine.controller import Engine
    from homepd.launch import prepare
    from homepd.measure.reference import greedy_alone

    prompt_text = model.detokenize(prompt_ids[1:] if model.add_bos else prompt_ids)
    engine_runs, raw_runs = [], []
    async with Engine(config, prepare(config, pull=False)) as engine:
        for i in range(repeat + 1):
            t_submit = time.monotonic()
            stream = await engine.submit(prompt_text, params=SamplingParams(max_tokens=n_gen, ignore_eos=True))
            received = []
            async for event in stream:
                if event.kind == "token":
                    received.append(time.monotonic())
            n_prompt = stream.lifecycle.n_prompt_tokens
            raw = greedy_alone(model, prompt_ids, n_gen, chunk=config.chunk, n_threads=config.effective_n_threads,
                               n_ctx=config.n_ctx, n_seq_max=config.n_seq_max, stop_at_eog=False)
            if i == 0:
                continue  # warm-up
            engine_runs.append({"prompt_tok_s": n_prompt / (received[0] - t_submit),
                                "decode_tok_s": (len(received) - 1) / (received[-1] - received[0]),
                                "n_prompt": n_prompt})
            raw_runs.append({"prompt_tok_s": len(prompt_ids) / raw.prompt_s,
                             "decode_tok_s": (len(raw.tokens) - 1) / raw.decode_s})
    return engine_runs, raw_runs


def bench_handoff(model, n_tokens: int, n_threads: int, repeat: int) -> dict:
    """KV handoff through the pre-faulted KV arena vs a plain memcpy of the same bytes.

    Prefills ``n_tokens`` into sequence 0, then per repeat: allocate an extent of
    exactly ``llama_state_seq_get_size`` bytes plus its header (a ring over an
    arena of two such extents, so the rounds alternate and wrap), export
    (``state_get`` into the extent's payload), publish (header + sampled
    checksum), open (header checks), import into sequence 1 (``state_set``), and
    ``np.copyto`` of the same bytes between two warm buffers.  Best of ``repeat``.
    """
    import numpy as np

    from homepd.kv.header import SlotExpectation, SlotHeader
    from homepd.kv.pool import KVArena, extent_bytes_for
    from homepd.kv.ring import RingAllocator
    from homepd.llm import LlamaContext

    # why: room for the source sequence and its imported copy side by side
    ctx = LlamaContext(model, n_ctx=2 * n_tokens + 64, n_batch=512, n_seq_max=2, n_threads=n_threads)
    try:
        ids = make_prompt(model, n_tokens)
        for start in range(0, len(ids), 512):
            stop = min(len(ids), start + 512)
            ctx.decode(ids[start:stop], list(range(start, stop)), [0] * (stop - start), [False] * (stop - start))
        n_bytes = ctx.state_size(0)
        extent = extent_bytes_for(n_bytes)
        fp = "0" * 64
        times = {"export": [], "import": [], "memcpy": [], "publish": [], "open": []}
        with KVArena.create(2 * extent) as arena:
            ring = RingAllocator(arena.capacity_bytes)
            warm = np.empty(n_bytes, dtype=np.uint8)
            warm[:] = 1  # touch every page: a warm destination, like the pre-faulted arena
            for _ in range(repeat + 1):
                offset = ring.alloc(extent)
                arena.begin(offset, extent)
                t0 = time.perf_counter()
                ctx.state_get(0, arena.payload(offset, n_bytes, "bench"))
                t1 = time.perf_counter()
                arena.publish(offset, SlotHeader("bench", fp, ctx.n_ctx, n_tokens, n_bytes))
                t2 = time.perf_counter()
                _, view = arena.open_ready(offset, SlotExpectation("bench", fp, ctx.n_ctx), extent)
                t3 = time.perf_counter()
                ctx.state_set(1, view, n_bytes)
                t4 = time.perf_counter()
                np.copyto(warm, np.frombuffer(view, dtype=np.uint8, count=n_bytes))
                t5 = time.perf_counter()
                del view
                arena.release(offset)
                ring.free(offset)
                ctx.seq_rm(1)
                for key, dt in (("export", t1 - t0), ("publish", t2 - t1), ("open", t3 - t2),
                                ("import", t4 - t3), ("memcpy", t5 - t4)):
                    times[key].append(dt)
    finally:
        ctx.close()
    best = {k: min(v[1:]) for k, v in times.items()}  # the first round warms the context's own buffers
    return {
        "kv_tokens": n_tokens, "kv_bytes": n_bytes, "kv_extent_bytes": extent,
        "kv_export_ms": best["export"] * 1e3, "kv_import_ms": best["import"] * 1e3,
        "kv_publish_ms": best["publish"] * 1e3, "kv_open_ms": best["open"] * 1e3,
        "memcpy_ms": best["memcpy"] * 1e3,
        "kv_export_gb_s": n_bytes / best["export"] / 1e9, "kv_import_gb_s": n_bytes / best["import"] / 1e9,
        "memcpy_gb_s": n_bytes / best["memcpy"] / 1e9,
        # one memcpy of the bytes / (export + import): 0.5 is the two-copy ideal
        "kv_handoff_ratio": best["memcpy"] / (best["export"] + best["import"]),
        "kv_handoff_ratio_with_checks": best["memcpy"] / sum(best[k] for k in ("export", "publish", "open", "import")),
    }


def bench_arena_trace(model_path: str, n_requests: int, n_ctx: int = 4096, seed: int = 0) -> dict:
    """The KV arena on the default mixed trace (``n_requests`` requests), disaggregated with the default
    chunk and arena: its size, its peak use, and the KV payload bytes in transit at that peak."""
    from homepd.measure.replay import run_trace
    from homepd.measure.trace import make_trace

    config = EngineConfig(model=model_path, mode="disaggregated", n_ctx=n_ctx).validated()

    async def replay() -> dict:
        from homepd.engine.controller import Engine
        from homepd.launch import prepare

        async with Engine(config, prepare(config, pull=False)) as engine:
            record = await run_trace(engine, make_trace("mixed", n_requests=n_requests, seed=seed), trace_name="mixed")
            return {"arena_bytes": record.kv_slot_bytes, "arena_prefill_n_ctx": engine.kv.prefill_n_ctx,
                    "arena_peak_bytes": record.arena_peak_bytes, "arena_peak_kv_bytes": record.arena_peak_kv_bytes,
                    "arena_handoffs": record.summary.kv.n_moved if record.summary.kv else 0}

    out = asyncio.run(replay())
    kv = out["arena_peak_kv_bytes"]
    out["arena_peak_ratio"] = out["arena_peak_bytes"] / kv if kv else None
    return out


def bench_engine(model: str, n_threads: int | None, n_prompt: int, n_gen: int, chunk: int | None,
                 repeat: int, n_ctx: int = 2048, kv_tokens: int = 0, arena_requests: int = 0) -> dict:
    """Run the engine-vs-raw benchmark; return a flat dict of figures (medians over ``repeat``)."""
    from homepd.llm import LlamaModel
    from homepd.models.resolve import resolve_model

    path = str(resolve_model(model))
    config = EngineConfig(model=path, n_ctx=n_ctx, n_seq_max=4, chunk=chunk, n_threads=n_threads).validated()
    llm = LlamaModel(path)
    try:
        prompt_ids = make_prompt(llm, n_prompt)
        engine, raw = asyncio.run(_interleaved_runs(config, llm, prompt_ids, n_gen, repeat))
        handoff = bench_handoff(llm, kv_tokens, config.effective_n_threads, repeat) if kv_tokens else {}
    finally:
        llm.close()
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    out = {
        "model": path, "n_threads": config.effective_n_threads, "chunk": chunk, "repeat": repeat,
        "n_prompt_tokens": engine[0]["n_prompt"], "n_gen_tokens": n_gen,
        "engine_prompt_tok_s": med(engine, "prompt_tok_s"), "raw_prompt_tok_s": med(raw, "prompt_tok_s"),
        "engine_decode_tok_s": med(engine, "decode_tok_s"), "raw_decode_tok_s": med(raw, "decode_tok_s"),
    }
    out["prompt_ratio"] = out["engine_prompt_tok_s"] / out["raw_prompt_tok_s"]
    out["decode_ratio"] = out["engine_decode_tok_s"] / out["raw_decode_tok_s"]
    out.update(handoff)
    if arena_requests:
        out.update(bench_arena_trace(path, arena_requests))
    return out
