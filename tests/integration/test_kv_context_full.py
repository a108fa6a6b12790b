"""KV is reserved as requests grow, and a context that fills ends requests by the stated policy
(``homepd.core.kvpolicy``): real worker processes on the fake backend, over the engine and over HTTP."""
from __future__ import annotations

import asyncio
import json
import threading
import time

from engine_helpers import make_engine, run
from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.core.terms import RequestClass
from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"
NO_MAX_TOKENS = SamplingParams(max_tokens=2048)  # what the service gives a chat that sends no max_tokens


def test_eight_chats_without_max_tokens_decode_together():
    """With the default context (4096) and 8 sequences, reserving each chat's worst case (prompt + 2,048)
    would run them one at a time; reserved as they grow, one step decodes all eight."""
    async def scenario():
        async with make_engine(EngineConfig(backend="fake", n_ctx=4096, n_seq_max=8)) as engine:
            streams = [await engine.submit(messages=[{"role": "user", "content": f"hello {i}"}],
                                           params=NO_MAX_TOKENS) for i in range(8)]

            async def first_tokens(stream, n=24):
                got = 0
                while got < n:
                    event = await stream.queue.get()
                    assert event.kind == "token", event
                    got += 1

            await asyncio.gather(*(first_tokens(s) for s in streams))
            for s in streams:
                engine.cancel(s.request_id)
            await asyncio.gather(*(s.collect() for s in streams))
            return max(step.n_decode_tokens for step in engine.steps_since())

    assert run(scenario()) == 8


def test_a_full_context_preempts_background_first_and_every_request_still_gets_its_tokens():
    """Two chats and two background jobs that cannot all fit n_ctx 256: the background jobs are preempted first,
    then the newest chat, and each is recomputed on its worker — the same tokens as alone, nothing lost; the
    oldest chat keeps its cells; no request fails or is cut short."""
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    config = EngineConfig(backend="fake", n_ctx=256, n_seq_max=4, chunk=16)
    requests = (("chat one", "interactive"), ("batch one", "background"), ("batch two", "background"),
                ("chat two", "interactive"))

    async def scenario():
        async with make_engine(config) as engine:
            alone = []
            for prompt, _ in requests:
                events, _ = await (await engine.submit(prompt, params=long)).collect()
                alone.append([e.token_id for e in events if e.kind == "token"])
            streams = [await engine.submit(prompt, params=long, request_class=RequestClass(klass))
                       for prompt, klass in requests]
            results = await asyncio.gather(*(s.collect() for s in streams))
            return alone, [events for events, _ in results], [s.lifecycle for s in streams]

    alone, events, lcs = run(scenario())
    assert [evs[-1].kind for evs in events] == ["done"] * 4  # no error event: nothing failed
    assert [[e.token_id for e in evs if e.kind == "token"] for evs in events] == alone  # recomputed exactly
    assert [lc.finish_reason for lc in lcs] == ["length"] * 4 and not any(lc.ended_by_kv_full for lc in lcs)
    chat_one, batch_one, batch_two, chat_two = lcs
    assert batch_one.n_kv_preemptions + batch_two.n_kv_preemptions >= 1 and chat_one.n_kv_preemptions == 0


def test_over_http_chats_without_max_tokens_start_together_and_a_full_context_shows_in_metrics(tmp_path):
    """Eight streamed chats without max_tokens at once (the service gives them 300; n_ctx 1024): every one has
    its first token before any ends; the context fills, every stream still ends with a finish_reason (none
    fails), and /metrics counts what the full context did as each response's homepd figures say."""
    proc = ServeProcess(tmp_path, "--backend", "fake", "--n-ctx", "1024", "--n-seq-max", "8", "--max-tokens", "300",
                        "--no-warmup")
    proc.wait_ready()
    first_s, last_s, reasons, figures, errors = {}, {}, {}, {}, []

    def chat(i: int) -> None:
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"tell me a story {i}"}]}
        try:
            with proc.client(timeout=120.0) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[len("data: "):])
                    if "homepd" in data:  # homepd's figures, on the final chunk
                        figures[i] = data["homepd"]
                    if not data["choices"]:
                        continue
                    choice = data["choices"][0]
                    if choice["delta"].get("content"):
                        first_s.setdefault(i, time.monotonic())
                    if choice["finish_reason"] is not None:
                        reasons[i], last_s[i] = choice["finish_reason"], time.monotonic()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=chat, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        # a request is counted once its response has ended on the server's side, just after the client's end
        status = proc.wait_until(lambda status: len(status["recent_requests"]) == 8, what="8 finished requests counted")
        with proc.client() as client:
            metrics = client.get("/metrics").text
    finally:
        assert proc.terminate() == 0, proc.log()
    # the stream that keeps its cells may meet a stop string of the chat template in the fake's text
    assert sorted(reasons) == list(range(8)) and set(reasons.values()) <= {"length", "stop"}
    assert len(first_s) == 8
    # all eight ran together: each was admitted as it arrived (the server's clock), never held back until another
    # ended, as reserving each chat's worst case (prompt + 300 of 1024 cells) would hold five of them.  Not
    # "every first token before any end": the fake writes 300 tokens in ~0.1 s, less than the client threads'
    # arrival spread on a loaded box (one suite run: 0.13 s)
    lcs = status["recent_requests"]
    assert max(lc["queue_wait_s"] for lc in lcs) < min(lc["e2e_s"] - lc["queue_wait_s"] for lc in lcs), lcs
    assert len(figures) == 8
    counted = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("homepd_kv_context_full_total{")}
    preempted = sum(f["n_kv_preemptions"] for f in figures.values())
    ended = sum(f["ended_by_kv_full"] for f in figures.values())
    assert preempted >= 1
    assert counted.get('action="preempt",request_class="interactive"', 0) == preempted
    assert counted.get('action="finish_length",request_class="interactive"', 0) == ended
    assert all(reasons[i] == "length" for i, f in figures.items() if f["ended_by_kv_full"])
