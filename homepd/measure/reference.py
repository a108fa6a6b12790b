"""Reference computations with a bare single-sequence llama.cpp loop (no engine).

Used by the tests and ``homepd bench engine``:

* ``greedy_alone`` runs one request exactly as the engine schedules it when
  alone (prompt in ``chunk``-sized steps, then one decode token per step), so
  its tokens must equal the engine's token for token;
* ``teacher_forced_deficits`` re-evaluates prompt + generated tokens as one
  sequence alone and returns, per generated token, how far its logit is below
  the best logit there (0 where it is the argmax; under ``ignore_eos`` the best
  of the tokens it allows, every end-of-generation token banned).  Batch shape changes logits
  by a little; a scheduling bug (a token in the wrong place or sequence,
  dropped or duplicated) changes them a lot.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from homepd.llm import LlamaContext, LlamaModel


def engine_n_batch(chunk: int | None, n_seq_max: int, n_ctx: int) -> int:
    """The batch size the engine's worker uses for this configuration (see WorkerSpec.n_batch)."""
    return n_ctx if chunk is None else max(chunk, n_seq_max)


@dataclass
class AloneRun:
    tokens: list[int]
    prompt_s: float   # from the first prompt step to the first sampled token
    decode_s: float   # from the first to the last sampled token
    step_s: list[float]


def greedy_alone(model: LlamaModel, prompt_ids: list[int], max_tokens: int, chunk: int | None,
                 n_threads: int, n_ctx: int, n_seq_max: int = 1, stop_at_eog: bool = True) -> AloneRun:
    """Greedy-decode one request alone with the engine's schedule, on a context of its own (``stop_at_eog``
    False: as under ``ignore_eos``, end-of-generation tokens banned)."""
    n_batch = engine_n_batch(chunk, n_seq_max, n_ctx)
    ctx = LlamaContext(model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, n_threads=n_threads)
    try:
        return greedy_on(ctx, prompt_ids, max_tokens, chunk, stop_at_eog)
    finally:
        ctx.close()


def greedy_on(ctx: LlamaContext, prompt_ids: list[int], max_tokens: int, chunk: int | None,
              stop_at_eog: bool = True) -> AloneRun:
    """Greedy-decode one request as sequence 0 of ``ctx`` (prompt in ``chunk``-sized steps, then one
    token per step), then clear the sequence so the context can run the next one."""
    model = ctx.model
    step = ctx.n_batch if chunk is None else chunk
    steps: list[float] = []
    try:
        t0 = time.monotonic()
        for start in range(0, len(prompt_ids), step):
            stop = min(len(prompt_ids), start + step)
            ts = time.monotonic()
            ctx.decode(prompt_ids[start:stop], list(range(start, stop)), [0] * (stop - start),
                       [False] * (stop - start - 1) + [stop == len(prompt_ids)])
            steps.append(time.monotonic() - ts)
        row = len(prompt_ids) - 1 - (len(prompt_ids) - 1) // step * step
        banned = None if stop_at_eog else model.eog_ids

        def greedy(row: int) -> int:
            logits = ctx.logits(row)
            if banned is not None:
                logits[banned] = -np.inf
            return int(np.argmax(logits))

        out = [greedy(row)]
        t1 = time.monotonic()
        while len(out) < max_tokens and not (stop_at_eog and model.is_eog(out[-1])):
            ts = time.monotonic()
            ctx.decode([out[-1]], [len(prompt_ids) + len(out) - 1], [0], [True])
            out.append(greedy(0))
            steps.append(time.monotonic() - ts)
        t2 = time.monotonic()
        return AloneRun(tokens=out, prompt_s=t1 - t0, decode_s=t2 - t1, step_s=steps)
    finally:
        ctx.seq_rm(0)


def teacher_forced_deficits(model: LlamaModel, prompt_ids: list[int], generated_ids: list[int],
                            n_threads: int, n_batch: int = 512, ignore_eos: bool = False) -> list[float]:
    """Per generated token: max logit minus that token's logit, evaluating the sequence alone (``ignore_eos``:
    generated with every end-of-generation token banned, so the max is over the others)."""
    if not generated_ids:
        return []
    seq = list(prompt_ids) + list(generated_ids[:-1])
    n_ctx = max(64, len(seq) + 8)
    ctx = LlamaContext(model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=1, n_threads=n_threads)
    try:
        first_out = len(prompt_ids) - 1  # position whose logits predict generated_ids[0]
        deficits: list[float] = []
        for start in range(0, len(seq), n_batch):
            stop = min(len(seq), start + n_batch)
            wants = [p >= first_out for p in range(start, stop)]
            ctx.decode(seq[start:stop], list(range(start, stop)), [0] * (stop - start), wants)
            for row, pos in enumerate(range(start, stop)):
                if pos >= first_out:
                    logits = ctx.logits(row)
                    if ignore_eos:
                        logits[model.eog_ids] = -np.inf
                    deficits.append(float(logits.max() - logits[generated_ids[pos - first_out]]))
        return deficits
    finally:
        ctx.close()
