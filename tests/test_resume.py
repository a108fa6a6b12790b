"""Resume after kill -9: every request completes, and what it generated stays a consistent continuation."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from homepd.config import EngineConfig
from homepd.engine import Engine
from homepd.llm import LlamaModel
from homepd.reference import teacher_forced_deficits
from homepd.sampling import SamplingParams

from engine_helpers import PROMPTS, run
from test_engine_correctness import MARGIN_LOGITS

N_OUT = 40


@pytest.mark.parametrize("mode,victim", [("colocated", "colocated"), ("disaggregated", "decode"),
                                         ("disaggregated", "prefill")])
def test_kill_9_with_resume_completes_every_request_within_5_s(default_model_path, mode, victim):
    cfg = EngineConfig(model=str(default_model_path), mode=mode, n_ctx=2048, n_seq_max=4, chunk=64, n_threads=2,
                       prefill_threads=1, decode_threads=1)

    async def scenario():
        async with Engine(cfg) as engine:
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=N_OUT, ignore_eos=True))
                       for p in PROMPTS[:3]]
            for s in streams:  # two tokens each: in disaggregated mode the second comes from the decode worker
                await s.__anext__()
                await s.__anext__()
            if victim == "prefill":  # give the prefill worker something to lose
                streams.append(await engine.submit(PROMPTS[3], params=SamplingParams(max_tokens=N_OUT,
                                                                                     ignore_eos=True)))
            pid = engine.workers[victim].pid
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            ends = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), timeout=5)
            return streams, ends, killed, engine.snapshot()

    streams, ends, killed, snap = run(scenario())
    died = [e for e in snap["worker_events"] if "died_s" in e]
    assert died and died[0]["role"] == victim and not died[0]["failed_requests"]
    resumed = set(died[0]["resumed_requests"]) | set(died[0]["recomputed_requests"])
    assert resumed  # the dead worker held something, and it came back
    model = LlamaModel(default_model_path)
    for prompt, s, (events, _) in zip(PROMPTS, streams, ends):
        assert events[-1].kind == "done" and events[-1].t_s - killed < 5
        assert len(s.token_ids) == N_OUT
        if s.request_id in resumed:
            assert s.lifecycle.n_resumes == 1
        deficits = teacher_forced_deficits(model, model.tokenize(prompt), s.token_ids, n_threads=2)
        assert max(deficits) <= MARGIN_LOGITS, (s.lifecycle.resumed_by, deficits)
    model.close()
