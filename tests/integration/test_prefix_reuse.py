"""Prefix reuse inside a worker (homepd.core.prefixreuse) on the real model: a request that starts from a
cached prefix computes only the rest of its prompt, and what it generates agrees with a fresh prefill by
the teacher-forced check of tests/integration/test_engine_correctness.py (same bound), which an off-by-one
injected into the reuse (``fault="reuse_off_by_one"``) fails."""
from __future__ import annotations

import pytest

from homepd.core.sampling import SamplingParams
from homepd.errors import PromptTooLongError
from homepd.llm import LlamaModel
from homepd.measure.reference import teacher_forced_deficits
from homepd.core.terms import ReuseMode

from engine_helpers import N_THREADS, PROMPTS, coloc, make_engine, run
from test_engine_correctness import MARGIN_LOGITS

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
DOCUMENT = PROMPTS[3] + " " + PROMPTS[2]  # ~90 tokens shared by two questions
QUESTIONS = (" Question: who walked into the forest? Answer:", " Question: what did the eldest daughter do? Answer:")
# why: the two prompts part at the one token the answer hangs on, so an off-by-one there changes the answer
FACTS = (" By the way, the capital of France is", " By the way, the capital of Italy is")


async def exchange(engine, prompt: str, params: SamplingParams = GREEDY) -> tuple:
    """One request to its end: (prompt ids, generated ids, cached prompt tokens, text, request id)."""
    stream = await engine.submit(prompt, params=params)
    events, text = await stream.collect()
    assert events[-1].kind == "done", events[-1]
    return (list(stream.prompt_ids), [e.token_id for e in events if e.kind == "token"],
            stream.lifecycle.n_cached_tokens, text, stream.request_id)


@pytest.fixture(scope="module")
def model(default_model_path):
    m = LlamaModel(default_model_path)
    yield m
    m.close()


def test_shared_document_and_next_turn_compute_only_new_tokens_and_agree_with_a_fresh_prefill(
        default_model_path, model):
    first = DOCUMENT + QUESTIONS[0]

    async def scenario():
        async with make_engine(coloc(default_model_path)) as engine:
            results = []
            prompts = [first, DOCUMENT + QUESTIONS[1], None]
            for i, prompt in enumerate(prompts):
                if prompt is None:  # the conversation's next turn: the first exchange, then a follow-up
                    prompt = first + results[0][3] + " Question: and then?"
                results.append(await exchange(engine, prompt))
            return results, engine.steps_since(), engine.cache_stats()

    results, steps, stats = run(scenario())
    doc_ids = model.tokenize(DOCUMENT)
    (p0, g0, c0, _, r0), (p1, g1, c1, _, r1), (p2, g2, c2, _, r2) = results
    assert c0 == 0
    # the second question reuses the document (all but where the questions part), the next turn the whole first
    # exchange but the last generated token (which never entered the KV)
    assert len(doc_ids) - 2 <= c1 < len(p1) - 1
    # the next turn: as far as its tokens agree with the first exchange's KV (prompt + all but the last
    # generated token; the answer's text retokenizes differently where it held control tokens)
    kept = p0 + g0[:-1]
    common = next((i for i, (a, b) in enumerate(zip(p2, kept)) if a != b), min(len(p2), len(kept)))
    assert c2 == min(common, len(p2) - 1) and c2 > len(p0)
    for rid, prompt_ids, cached in ((r0, p0, c0), (r1, p1, c1), (r2, p2, c2)):
        prefilled = sum(n for s in steps for q, n in s.prefill if q == rid)
        assert prefilled == len(prompt_ids) - cached  # only the new tokens are computed
    assert stats["colocated"].n_hits == 2 and stats["colocated"].n_hit_tokens == c1 + c2
    for prompt_ids, generated in ((p1, g1), (p2, g2)):
        deficits = teacher_forced_deficits(model, prompt_ids, generated, n_threads=N_THREADS, ignore_eos=True)
        assert max(deficits) <= MARGIN_LOGITS, deficits


def test_teacher_forced_check_catches_an_off_by_one_in_the_reuse(default_model_path, model):
    async def scenario():
        async with make_engine(coloc(default_model_path, fault="reuse_off_by_one")) as engine:
            results = []
            for question in FACTS:
                stream = await engine.submit(DOCUMENT + question, params=GREEDY)
                events, _ = await stream.collect()
                results.append((list(stream.prompt_ids), [e.token_id for e in events if e.kind == "token"],
                                stream.lifecycle.n_cached_tokens))
            return results

    (_, _, c0), (p1, g1, c1) = run(scenario())
    assert c0 == 0 and c1 > 0  # the second question did reuse (one cell too many)
    deficits = teacher_forced_deficits(model, p1, g1, n_threads=N_THREADS, ignore_eos=True)
    # the check fails: the first answer token is chosen after the wrong country (measured: 4.3 logits short
    # of the argmax; a correct reuse stays within MARGIN_LOGITS, test above); later tokens follow the answer
    assert deficits[0] > 2 * MARGIN_LOGITS, deficits


def test_gemma_sliding_window_cache_reuses_only_a_whole_kept_sequence(gemma_model_path):
    """Gemma 3 has sliding-window layers: a kept sequence cannot drop its tail (the window moved past its
    head), so only a prompt that continues a whole kept sequence reuses it (mode 'exact'), and what the
    continuation generates agrees with a fresh prefill."""
    first = DOCUMENT + FACTS[0]
    params = SamplingParams(max_tokens=8)

    async def scenario():
        async with make_engine(coloc(gemma_model_path)) as engine:
            out = []
            for prompt in (first, DOCUMENT + FACTS[1], None):
                if prompt is None:
                    prompt = first + out[0][3] + " And the capital of Spain is"
                out.append(await exchange(engine, prompt, params))
            return out, engine.cache_stats()

    results, stats = run(scenario())
    (p0, g0, _, _, _), (_, _, c1, _, _), (p2, g2, c2, _, _) = results
    assert stats["colocated"].mode is ReuseMode.EXACT
    assert c1 == 0  # the second question shares the document only: not a whole kept sequence
    kept = p0 + g0[:-1]
    assert c2 == (len(kept) if p2[:len(kept)] == kept else 0)
    assert c2 > 0, "the next turn's tokens did not continue the first exchange (retokenized differently)"
    gemma = LlamaModel(gemma_model_path)
    try:
        deficits = teacher_forced_deficits(gemma, p2, g2, n_threads=N_THREADS, ignore_eos=True)
    finally:
        gemma.close()
    assert max(deficits) <= MARGIN_LOGITS, deficits


def test_with_streams_a_conversation_continues_in_its_own_stream_and_a_prompt_longer_than_one_is_refused(
        default_model_path, model):
    """``--kv-layout streams``: each of the 4 ids has its own stream of 2048 / 4 = 512 cells.  The next turn of a
    conversation takes its own entry (its stream) and computes only what it adds, and agrees with a fresh prefill;
    a prompt that fits the context but not one stream is refused by name before any worker sees it."""
    first = DOCUMENT + QUESTIONS[0]

    async def scenario():
        async with make_engine(coloc(default_model_path, kv_layout="streams")) as engine:
            results = []
            for prompt in (first, None):
                if prompt is None:
                    prompt = first + results[0][3] + " Question: and then?"
                results.append(await exchange(engine, prompt))
            with pytest.raises(PromptTooLongError, match="a request's stream holds 512"):
                await engine.submit(" ".join([PROMPTS[3]] * 12), params=GREEDY)  # ~600 tokens
            return results, engine.steps_since(), engine.snapshot()

    results, steps, snap = run(scenario())
    (p0, g0, c0, _, r0), (p2, g2, c2, _, r2) = results
    assert snap.kv_stream_cells == 512 and c0 == 0
    kept = p0 + g0[:-1]
    common = next((i for i, (a, b) in enumerate(zip(p2, kept)) if a != b), min(len(p2), len(kept)))
    assert c2 == min(common, len(p2) - 1) and c2 > len(p0)
    assert sum(n for s in steps for q, n in s.prefill if q == r2) == len(p2) - c2
    deficits = teacher_forced_deficits(model, p2, g2, n_threads=N_THREADS, ignore_eos=True)
    assert max(deficits) <= MARGIN_LOGITS, deficits
