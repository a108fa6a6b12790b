"""A chat trace replayed on a real engine (fake backend): each turn waits for the previous answer and its
think time, conversations run side by side, and the run's figures count the reused prompt tokens."""
from __future__ import annotations

from engine_helpers import make_engine, run
from homepd.config import EngineConfig
from homepd.measure.replay import run_trace
from homepd.measure.trace import make_trace


def test_a_chat_turn_is_sent_its_think_time_after_the_previous_turn_ended():
    trace = make_trace("chat", 6, rate_per_s=20.0, turns=3, think_s=0.2, max_tokens=8, seed=5)

    async def go():
        async with make_engine(EngineConfig(backend="fake", n_ctx=4096, fault="claim_prefix_hits")) as engine:
            return await run_trace(engine, trace, trace_name="chat")

    record = run(go())
    lifecycles = record.requests
    by_conv: dict[int, list] = {}
    for req, lc in zip(trace, lifecycles):
        by_conv.setdefault(req.conversation, []).append((req, lc))
    assert len(by_conv) == 2
    for turns in by_conv.values():
        for (_, prev), (req, lc) in zip(turns, turns[1:]):
            # closed within the conversation: sent once the previous answer is complete, and its think time later
            assert lc.arrived_s >= prev.ended_s + req.think_s - 0.005
            assert lc.n_prompt_tokens > prev.n_prompt_tokens  # the history grew
    # open across conversations: the second (offset 7.5 ms) starts before the first has ended (two think times)
    assert by_conv[1][0][1].arrived_s < by_conv[0][-1][1].ended_s
    assert by_conv[1][0][1].arrived_s - by_conv[0][0][1].arrived_s < 0.25
    s = record.summary
    assert s.n_finished == 6 and s.n_cached_prompt_tokens == sum(lc.n_prompt_tokens // 2 for lc in lifecycles)
