"""The KV store tier (homepd.kv.store) end to end with real worker processes: a conversation's prefix evicted
from the context is saved to the store and the next turn restores it instead of recomputing it; a worker
killed with conversations in the store comes back and the next turn hits the store; nothing is left in
/dev/shm after the engine stops.  The fake backend first (its KV state is its tokens, so a wrong restore
changes what it generates), then the real model, checked by the teacher-forced agreement."""
from __future__ import annotations

import asyncio
import os
import signal

from homepd.core.sampling import SamplingParams
from homepd.kv.segment import STORE_PREFIX

from engine_helpers import fake_coloc, fake_text, make_engine, run

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
