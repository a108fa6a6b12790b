"""What sampling one token costs: homepd's numpy sampler against llama.cpp's sampler chain, per vocabulary size.

For each vocabulary (SmolLM2's 49,152, a Qwen-sized 152,064, Gemma 3's 262,144)
and each setting (greedy; temperature 0.7 / top_p 0.9, what most clients send;
the same with llama-server's defaults top_k 40 / min_p 0.05; with presence and
frequency penalties; under a JSON grammar), the milliseconds per token of

* ``numpy``: ``homepd.fakellm.ReferenceSampler``, the same semantics as
  the numpy sampler homepd used before the chain (a sort over the vocabulary);
* ``chain``: ``homepd.llm.sampler.LlamaSampler`` over a real context's logits
  (``llama_sampler_sample``; 49k and 262k, the real models) or, for the
  152k vocabulary no shipped model has, the same chain applied to a
  candidate array (``llama_sampler_apply``) of logits cut from Gemma's.

The logits are a real decode's (the row is refreshed before every token, so the
penalties do not compound).  Then the stop strings' cost per token
(``TextStream`` with 0, 8 and 32 stop strings).

    uv run python benchmarks/sampling_cost.py [--tokens 300]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

import llama_cpp as C

from homepd.core.sampling import Grammar, SamplingParams
from homepd.fakellm import ReferenceSampler
from homepd.chat.textstream import TextStream
from homepd.llm import LlamaContext, LlamaModel
from homepd.llm.sampler import CandidateBuffer, _chain
from homepd.models.resolve import resolve_model

CLIENT = dict(temperature=0.7, top_p=0.9)
SETTINGS = {
    "greedy": SamplingParams(),
    "T0.7 top_p0.9": SamplingParams(**CLIENT),
    "  + top_k40 min_p0.05": SamplingParams(**CLIENT, top_k=40, min_p=0.05),
    "  + penalties": SamplingParams(**CLIENT, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5),
}
PROMPT = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"


def real_logits(path: str, n_gen: int = 8) -> tuple[LlamaModel, LlamaContext, int]:
    model = LlamaModel(path)
    ctx = LlamaContext(model, n_ctx=512, n_batch=128, n_seq_max=1, n_threads=1)
    ids = model.tokenize(PROMPT)
    ctx.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * (len(ids) - 1) + [True])
    return model, ctx, len(ids) - 1


def per_token_ms(fn, n: int) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_context(name: str, model, ctx, row: int, n: int) -> None:
    saved = ctx.logits(row).copy()
    history = list(np.random.default_rng(0).integers(0, model.n_vocab, 48))

    def refresh():
        ctx.logits(row)[:] = saved

    for label, params in SETTINGS.items():
        ref = ReferenceSampler(params, tuple(history))
        chain = ctx.new_sampler(params, tuple(history))
        numpy_ms = per_token_ms(lambda i: ref.sample(saved), max(20, n // 10))
        chain_ms = per_token_ms(lambda i: (refresh(), chain.sample(row)), n)
        print(f"{name:>8}  {label:<24} numpy {numpy_ms:7.3f} ms   chain {chain_ms:7.3f} ms   x{numpy_ms / chain_ms:6.1f}")
    from llama_cpp.llama_grammar import JSON_GBNF
    params = SamplingParams(**CLIENT, top_k=40, min_p=0.05, grammar=Grammar(JSON_GBNF, "json_object"))
    sampler = ctx.new_sampler(params)
    ms = per_token_ms(lambda i: (refresh(), sampler.sample(row)), min(n, 40))
    print(f"{name:>8}  {'  + JSON grammar':<24} {'':19} chain {ms:7.3f} ms   (one token: the grammar's first)")


def bench_apply(name: str, logits: np.ndarray, n: int) -> None:
    """The chain over a candidate array (no model of this vocabulary size is shipped)."""
    buf = CandidateBuffer(logits.size)
    for label, params in SETTINGS.items():
        if params.has_penalties or params.is_plain_greedy:
            continue  # why: penalties run in numpy on the few repeated tokens; plain greedy is a numpy argmax
        ref = ReferenceSampler(params)
        chain = _chain(params, 0)
        numpy_ms = per_token_ms(lambda i: ref.sample(logits), max(20, n // 10))

        def one(i):
            C.llama_sampler_apply(chain, buf.fill(logits))
            return buf.selected()
        chain_ms = per_token_ms(one, n)
        print(f"{name:>8}  {label:<24} numpy {numpy_ms:7.3f} ms   chain {chain_ms:7.3f} ms   x{numpy_ms / chain_ms:6.1f}"
              "   (apply on an array)")
        C.llama_sampler_free(chain)


def bench_stops(n: int) -> None:
    pieces = [w.encode() for w in ("The", " keeper", " climbed", " the", " stairs", ",", " slowly", ".")] * 50
    for k in (0, 8, 32):
        stops = tuple(f"STOP{i}-never" for i in range(k))

        def run(_):
            ts = TextStream(stops)
            for p in pieces:
                ts.feed(p)
        ms = per_token_ms(run, 20) / len(pieces)
        print(f"stop strings {k:>2}: {ms * 1e3:6.2f} us per token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args()
    print("per token, median; 1 thread for the decode that made the logits\n")
    smol = resolve_model("smollm2-135m-instruct-q4_1")
    model, ctx, row = real_logits(str(smol))
    bench_context("49,152", model, ctx, row, args.tokens)
    gemma_path = resolve_model("gemma3-270m-q4_k_m")
    gm, gctx, grow = real_logits(str(gemma_path))
    gemma_logits = gctx.logits(grow).copy()
    bench_apply("152,064", np.ascontiguousarray(gemma_logits[:152_064]), args.tokens)
    bench_context("262,144", gm, gctx, grow, args.tokens)
    print()
    bench_stops(args.tokens)


if __name__ == "__main__":
    main()
