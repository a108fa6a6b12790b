"""Cache-aware routing with real worker processes on the fake backend (the routing does not depend on
llama.cpp's numerics): a conversation's next turn goes to the replica that served it, not the least loaded
one, and goes elsewhere when that replica's queue would break its TTFT budget; in disaggregated mode a
short follow-up of a conversation handed off to the decode worker is prefilled there."""
from __future__ import annotations

import asyncio

import pytest

from engine_helpers import fake_disagg, make_engine, run
from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.core.terms import StepEstimate

pytestmark = pytest.mark.whole_box  # replicas and disaggregated (tests/conftest.py, BoxShare)

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)  # a stream that runs until cancelled
ANSWER = SamplingParams(max_tokens=20, ignore_eos=True)
QUESTION = "Tell me about the river that runs through the old town, and the bridges over it. " * 3
DOCUMENT = "doc " * 1000
# why pinned: the fake backend's steps take microseconds and the online fit of them is noise (0.004 ms to
# 10 ms a step on a loaded box), so the replicas' speeds are pinned to a known estimate for the gate: 10 ms
# a step plus 2 ms a prompt token, 222 prompt tokens/s at chunk 4.  The 4 s budget then holds for a turn's
# 30-token remainder (~0.2 s) and for a whole 300-token turn (~2 s), not behind the 4,000-token document (18 s)
PINNED = StepEstimate(base_ms=10.0, ms_per_prompt_token=2.0, ms_per_decode_token=5.0, ms_per_kv_ktoken=0.0,
                      n_steps=100, error_ms=0.0, n_prompt_steps=100)


def test_a_conversations_next_turn_goes_to_the_replica_that_served_it_unless_its_queue_breaks_the_budget():
    async def scenario():
        # one pool: the 4,000-token document would not fit a stream of 2,048 (--kv-layout auto's here)
        config = EngineConfig(mode="replicas", backend="fake", n_ctx=8192, chunk=4, n_seq_max=4, kv_layout="unified")
        async with make_engine(config) as engine:
            engine.gate.estimate = lambda worker: PINNED
            a = await engine.submit("a", params=LONG)                  # replica-0 (both idle: the first)
            turn1_msgs = [{"role": "user", "content": QUESTION}]
            turn1 = await engine.submit(messages=turn1_msgs, params=ANSWER)  # replica-1: the least loaded
            _, answer = await turn1.collect()
            b = await engine.submit("b", params=LONG)                  # replica-1: now one stream on each
            history = turn1_msgs + [{"role": "assistant", "content": answer}]
            turn2 = await engine.submit(messages=history + [{"role": "user", "content": "And the mill?"}],
                                        params=ANSWER)
            await turn2.collect()
            engine.cancel(b.request_id)
            await b.collect()
            doc = await engine.submit(DOCUMENT, params=LONG)          # replica-1: the least loaded again
            # a short turn of the conversation now: its replica's queue breaks the budget, the other one takes it
            turn3 = await engine.submit(messages=history + [{"role": "user", "content": "And the church?"}],
                                        params=ANSWER)
            await turn3.collect()
            for s in (a, doc):
                engine.cancel(s.request_id)
            await asyncio.gather(*(s.collect() for s in (a, doc)))
            return [s.lifecycle for s in (a, turn1, b, turn2, doc, turn3)], engine.snapshot().admission

    (a, turn1, b, turn2, doc, turn3), adm = run(scenario())
    assert (a.routed_to, turn1.routed_to, b.routed_to) == ("replica-0", "replica-1", "replica-1")
    # turn 2: both replicas hold one stream (the tie would go to replica-0); it goes where turn 1 was served
    assert (turn2.routed_to, turn2.route_reason) == ("replica-1", "prefix_hit")
    assert turn2.route_cached_tokens >= turn1.n_prompt_tokens          # its whole first turn, and the answer
    assert (doc.routed_to, doc.route_reason) == ("replica-1", "least_loaded")
    assert (turn3.routed_to, turn3.route_reason) == ("replica-0", "ttft_budget")
    assert turn3.state.value == "finished" and turn3.to_dict()["route_reason"] == "ttft_budget"
    assert adm.routed_by_reason["prefix_hit"] == 1 and adm.routed_by_reason["ttft_budget"] == 1


def test_disaggregated_a_short_followup_of_a_handed_off_conversation_is_prefilled_on_the_decode_worker():
    async def scenario():
        async with make_engine(fake_disagg(chunk=64)) as engine:  # one step carries the follow-up's ~30 new tokens
            while engine.gate.estimate("prefill") is None:  # measure the prefill worker
                stream = await engine.submit("word " * 40, params=SamplingParams(max_tokens=2))
                await stream.collect()
            # and the decode worker's prompt steps (tiny prompts stay local): until it is measured, the gate lets
            # it prefill only the smallest chunk beside its decodes
            for _ in range(100):
                if engine.gate.estimate("decode") is not None:
                    break
                stream = await engine.submit("hi", params=SamplingParams(max_tokens=2))
                await stream.collect()
            assert engine.gate.estimate("decode") is not None
            msgs = [{"role": "user", "content": "doc " * 300}]
            # why a long answer: the prefill worker holds the prompt but not the answer, the decode worker both
            turn1 = await engine.submit(messages=msgs, params=SamplingParams(max_tokens=80, ignore_eos=True))
            _, answer = await turn1.collect()
            turn2 = await engine.submit(messages=msgs + [{"role": "assistant", "content": answer},
                                                         {"role": "user", "content": "Why?"}], params=ANSWER)
            await turn2.collect()
            return turn1.lifecycle, turn2.lifecycle

    turn1, turn2 = run(scenario())
    assert turn1.routed_to == "prefill" and turn1.kv_bytes            # prefilled there, then handed off
    assert (turn2.routed_to, turn2.route_reason) == ("decode", "prefix_hit")
    assert turn2.kv_bytes is None and turn2.state.value == "finished"
    assert turn2.route_cached_tokens >= turn1.n_prompt_tokens         # the decode worker holds the history
