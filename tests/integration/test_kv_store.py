"""The KV store tier (homepd.kv.store) end to end with real worker processes: a conversation's prefix evicted
from the context is saved to the store and the next turn restores it instead of recomputing it; a worker
killed with conversations in the store comes back and the next turn hits the store; nothing is left in
/dev/shm after the engine stops.  The fake backend first (its KV state is its tokens, so a wrong restore
changes what it generates), then the real model, checked by the teacher-forced agreement."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from homepd.core.sampling import SamplingParams
from homepd.kv.segment import STORE_PREFIX
from homepd.llm import LlamaModel
from homepd.measure.reference import teacher_forced_deficits
from homepd.core.terms import RequestClass, ReuseMode

from engine_helpers import PROMPTS, coloc, fake_coloc, fake_text, make_engine, run
from test_engine_correctness import MARGIN_LOGITS
from test_prefix_reuse import DOCUMENT, FACTS, QUESTIONS

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
CHAT = "You are a helpful assistant. Tell me a story about a lighthouse keeper and the sea, please."  # 94 tokens
OTHER = "Summarise the following report about the quarterly sales figures of a small bakery in town."


def store_segments(owner_pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{STORE_PREFIX}{owner_pid}-")]


async def turn(engine, prompt: str):
    stream = await engine.submit(prompt, params=GREEDY)
    events, text = await stream.collect()
    assert events[-1].kind == "done", events[-1]
    return stream, text


async def replaced(engine, name: str, old_pid: int) -> None:
    """Return once worker ``name`` is a new, ready process (its old one was killed)."""
    handle = engine.workers[name]
    while handle.pid == old_pid or handle.ready is None:
        await asyncio.sleep(0.01)
    await engine.wait_restarts()


def test_evicted_conversation_is_restored_from_the_store_and_survives_a_worker_kill():
    # room in the context for one conversation's cached prefix: the second evicts the first (to the store)
    cfg = fake_coloc(kv_store_bytes=4 << 20, prefix_cache_cells=150)

    async def scenario():
        async with make_engine(cfg) as engine:
            first, answer = await turn(engine, CHAT)
            await turn(engine, OTHER)  # CHAT's prefix leaves the context, saved to the store
            second_prompt = CHAT + answer + " And then?"
            second, second_text = await turn(engine, second_prompt)
            stats = engine.cache_stats()["colocated"]
            memory = engine.measure_memory()
            pid = engine.workers["colocated"].pid
            os.kill(pid, signal.SIGKILL)
            await replaced(engine, "colocated", pid)
            third_prompt = second_prompt + second_text + " Why?"
            third, third_text = await turn(engine, third_prompt)
            after = engine.cache_stats()["colocated"]
            segments = store_segments(os.getpid())
        return (first, second, second_text, stats, memory, third, third_text, after, segments, second_prompt,
                third_prompt)

    (first, second, second_text, stats, memory, third, third_text, after, segments, second_prompt,
     third_prompt) = run(scenario())
    n_saved = len(first.prompt_ids) + GREEDY.max_tokens - 1  # the prompt and all but the last output
    assert second.lifecycle.n_cached_tokens == n_saved  # restored, not recomputed
    assert stats.n_store_hits == 1 and stats.n_store_hit_tokens == n_saved
    assert stats.n_store_entries >= 1 and stats.store_bytes > 0 and memory.kv_store_bytes > 0
    assert second_text == fake_text(second_prompt, GREEDY.max_tokens)  # the restored KV is the conversation's
    # the replacement worker found the store: the next turn restores the conversation instead of prefilling it
    assert after.n_store_hits == 1 and third.lifecycle.n_cached_tokens >= n_saved
    assert third_text == fake_text(third_prompt, GREEDY.max_tokens)
    assert len(segments) == 1  # one worker, one segment, owned by this (the controller's) process
    assert store_segments(os.getpid()) == []  # unlinked when the engine stopped


# the real model ------------------------------------------------------------------------------------------
REAL_GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def real_config(path, **kw):
    """One thread; the context's cache holds one conversation's prefix at most (the next one evicts it)."""
    return coloc(path, n_threads=1, kv_store_bytes=64 << 20, prefix_cache_cells=120, **kw)


async def real_turn(engine, prompt: str):
    stream = await engine.submit(prompt, params=REAL_GREEDY)
    events, text = await stream.collect()
    assert events[-1].kind == "done", events[-1]
    return list(stream.prompt_ids), [e.token_id for e in events if e.kind == "token"], \
        stream.lifecycle.n_cached_tokens, text


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("which", ["smollm2", "gemma3", "smollm2-streams"])
def test_real_model_conversation_restored_from_the_store_agrees_with_a_fresh_prefill(
        which, default_model_path, request):
    """SmolLM2 (plain cache, mode 'prefix'): the store restores the longest matching prefix of an entry;
    Gemma 3 (sliding-window layers, mode 'exact'): ``llama_state_seq_get_data`` saves what its caches hold
    (the full layers' cells and the window's), so a whole saved sequence the prompt continues is restored,
    as the context's own reuse allows.  After a kill -9 (SmolLM2) the replacement worker restores it too.
    ``smollm2-streams``: the same with ``--kv-layout streams``, where a save and a restore are one stream's."""
    path = request.getfixturevalue("gemma_model_path") if which == "gemma3" else default_model_path
    first = DOCUMENT + QUESTIONS[0]
    layout = "streams" if which.endswith("streams") else "unified"

    async def scenario():
        async with make_engine(real_config(path, kv_layout=layout)) as engine:
            t1 = await real_turn(engine, first)
            await real_turn(engine, PROMPTS[2] + " " + PROMPTS[1])  # the first exchange leaves for the store
            t2 = await real_turn(engine, first + t1[3] + " Question: and then?")
            stats = engine.cache_stats()["colocated"]
            t3 = after = None
            if which.startswith("smollm2"):
                pid = engine.workers["colocated"].pid
                os.kill(pid, signal.SIGKILL)
                await replaced(engine, "colocated", pid)
                t3 = await real_turn(engine, first + t1[3] + " Question: who came back?")
                after = engine.cache_stats()["colocated"]
        return t1, t2, stats, t3, after

    t1, t2, stats, t3, after = run(scenario())
    kept = t1[0] + t1[1][:-1]  # what the first exchange's KV holds
    assert stats.n_store_hits == 1
    if which == "gemma3":
        assert stats.mode is ReuseMode.EXACT and t2[2] == (len(kept) if t2[0][:len(kept)] == kept else 0) > 0
    else:
        assert stats.mode is ReuseMode.PREFIX and t2[2] == min(common_prefix(t2[0], kept), len(t2[0]) - 1) > len(t1[0])
    model = LlamaModel(path)
    try:
        checks = [t2] if t3 is None else [t2, t3]
        for prompt_ids, generated, _, _ in checks:
            deficits = teacher_forced_deficits(model, prompt_ids, generated, n_threads=1, ignore_eos=True)
            assert max(deficits) <= MARGIN_LOGITS, deficits
    finally:
        model.close()
    if t3 is not None:  # the replacement found the conversation in the store: the longest saved exchange
        # (the second turn went to the store too: it outgrew the context's cache as it finished)
        longest = max(common_prefix(t3[0], kept), common_prefix(t3[0], t2[0] + t2[1][:-1]))
        assert after.n_store_hits == 1 and t3[2] == min(longest, len(t3[0]) - 1) > len(t1[0])


def test_teacher_forced_check_catches_an_off_by_one_in_a_store_restore(default_model_path):
    """The check above can fail: with ``fault="store_off_by_one"`` a restored entry keeps one cell past the
    match, so the second question's prompt holds the first one's country where the two part."""
    async def scenario():
        async with make_engine(real_config(default_model_path, fault="store_off_by_one")) as engine:
            await real_turn(engine, DOCUMENT + FACTS[0])
            await real_turn(engine, PROMPTS[2] + " " + PROMPTS[1])  # the first exchange leaves for the store
            second = await real_turn(engine, DOCUMENT + FACTS[1])
            return second, engine.cache_stats()["colocated"]

    (prompt_ids, generated, n_cached, _), stats = run(scenario())
    assert stats.n_store_hits == 1 and n_cached > 0  # the document came back from the store (one cell too many)
    model = LlamaModel(default_model_path)
    try:
        deficits = teacher_forced_deficits(model, prompt_ids, generated, n_threads=1, ignore_eos=True)
    finally:
        model.close()
    # the first answer token is chosen after the wrong country; a correct restore stays within MARGIN_LOGITS
    assert deficits[0] > 2 * MARGIN_LOGITS, deficits


@pytest.mark.parametrize("cached_seqs", [0, 2], ids=["through-the-store", "in-the-context"])
def test_real_model_prefill_paused_for_an_interactive_turn_resumes_without_recompute(default_model_path,
                                                                                      cached_seqs):
    """Two running sequences: a chat decodes and a background document prefills in chunks; an interactive
    turn arrives while both run, so the document's prefill pauses (its KV kept as a cached prefix) and
    resumes once one ends: every document token is computed once, and its answer agrees with a fresh prefill
    of the whole prompt (teacher-forced).  With no ids beyond the running ones (``--cached-seqs 0``, the
    default) the turn takes the document's id, so its KV goes to the store and comes back from there; with
    them (``--cached-seqs 2``) it stays in the context and the store is never written."""
    document = DOCUMENT + " " + PROMPTS[3] + " " + PROMPTS[2] + QUESTIONS[0]  # ~190 tokens
    # (no id beyond the two for the turn to start under, --prefill-seqs 0: it needs the document's)
    cfg = coloc(default_model_path, n_threads=1, kv_store_bytes=64 << 20, n_seq_max=2, chunk=16,
                cached_seqs=cached_seqs, prefill_seqs=0)

    async def scenario():
        async with make_engine(cfg) as engine:
            chat = await engine.submit(PROMPTS[1], params=SamplingParams(max_tokens=48, ignore_eos=True))
            doc = await engine.submit(document, params=REAL_GREEDY, request_class=RequestClass.BACKGROUND)
            while doc.lifecycle.n_prefilled < 80:  # part-way through its prefill, both ids held
                await asyncio.sleep(0.01)
            turn = await engine.submit(PROMPTS[0], params=REAL_GREEDY)
            results = await asyncio.gather(chat.collect(), doc.collect(), turn.collect())
            steps = engine.steps_since()
            return chat, doc, turn, results[1][0], steps, engine.cache_stats()["colocated"]

    chat, doc, turn, doc_events, steps, stats = run(scenario())
    assert doc_events[-1].kind == "done", doc_events[-1]
    doc_steps = [i for i, s in enumerate(steps) if any(rid == doc.request_id for rid, _ in s.prefill)]
    turn_steps = [i for i, s in enumerate(steps) if any(rid == turn.request_id for rid, _ in s.prefill)]
    chat_steps = [i for i, s in enumerate(steps) if chat.request_id in s.decode_request_ids]
    # the turn prefilled while the chat still decoded and the document was part-way: it had the document's id
    assert doc_steps[0] < turn_steps[0] < min(doc_steps[-1], chat_steps[-1])
    computed = sum(n for s in steps for rid, n in s.prefill if rid == doc.request_id)
    assert computed == len(doc.prompt_ids)  # nothing recomputed: the paused part came back from the store
    # counted as a pause and its resume (not as a store hit: no prompt was served from another's KV)
    assert stats.n_pauses >= 1 and stats.n_pause_resumed_tokens >= 80
    assert (stats.n_store_entries > 0) == (cached_seqs == 0)
    model = LlamaModel(default_model_path)
    try:
        generated = [e.token_id for e in doc_events if e.kind == "token"]
        deficits = teacher_forced_deficits(model, list(doc.prompt_ids), generated, n_threads=1, ignore_eos=True)
        assert max(deficits) <= MARGIN_LOGITS, deficits
    finally:
        model.close()
