"""Helpers for tests that drive the real engine with real worker processes."""
from __future__ import annotations

import asyncio
import os

from homepd.config import EngineConfig
from homepd.engine.controller import Engine
from homepd.fakellm import FAKE_MODEL_PATH, FakeModel, next_token
from homepd.launch import prepare
from homepd.core.sampling import SamplingParams
from homepd.osutil import die_with_parent

# Four prompts of different lengths (5 to ~60 tokens with SmolLM2's tokenizer).
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea and the wind at night.",
    "List three uses of a paperclip in an office, and explain each one briefly in one sentence "
    "for a new employee who has never seen one.",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter "
    "and his three daughters. Every morning he would walk into the forest with his axe, and every "
    "evening he would return with a bundle of wood. One day, he did not return. The eldest daughter said",
]


# a colocated worker's threads: every core this test process may use (two here; one under the suite's xdist
# workers, each pinned to a core: tests/conftest.py, BoxShare — never two threads on one core)
N_THREADS = len(os.sched_getaffinity(0))


def coloc(path, **kw) -> EngineConfig:
    """A colocated engine on the model at ``path``: 2048 tokens of context, 4 sequences, a fixed chunk 64 (not the
    default adaptive one: these tests count steps per chunk), N_THREADS threads; ``kw`` overrides."""
    base = dict(model=str(path), mode="colocated", n_ctx=2048, n_seq_max=4, chunk=64, adaptive_chunk=False,
                n_threads=N_THREADS)
    return EngineConfig(**{**base, **kw})


def disagg(path, **kw) -> EngineConfig:
    """A disaggregated engine on the model at ``path``: 2048 tokens of context, 4 decode sequences,
    a fixed chunk 64, one thread per worker; ``kw`` overrides."""
    base = dict(model=str(path), mode="disaggregated", n_ctx=2048, n_seq_max=4, chunk=64, adaptive_chunk=False,
                prefill_threads=1, decode_threads=1)
    return EngineConfig(**{**base, **kw})


def fake_coloc(**kw) -> EngineConfig:
    """``coloc`` on the fake backend (real worker processes, no model: homepd.fakellm), with 16384 tokens
    of context so that a stream can outlast what a test does to it; ``kw`` overrides."""
    return coloc(FAKE_MODEL_PATH, **{"backend": "fake", "n_ctx": 16384, **kw})


def fake_disagg(**kw) -> EngineConfig:
    """``disagg`` on the fake backend, 16384 tokens of context on both workers (a prompt long enough to keep
    the fake's prefill worker busy for a while still fits it); ``kw`` overrides."""
    return disagg(FAKE_MODEL_PATH, **{"backend": "fake", "n_ctx": 16384, "prefill_n_ctx": 16384, **kw})


def fake_text(prompt: str, n: int) -> str:
    """What the fake backend generates greedily for ``prompt`` (raw text, no chat template) in ``n`` tokens."""
    model = FakeModel()
    ids = model.tokenize(prompt)
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(ids + out))
    return model.detokenize(out)


def make_engine(config: EngineConfig, **kw) -> Engine:
    """An engine on ``config`` with its model resolved (never pulled) and its workers placed."""
    return Engine(config, prepare(config, pull=False), **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=240))


async def generate_all(config: EngineConfig, prompts: list[str], params: SamplingParams):
    """Submit all prompts at once; return (token ids per prompt, engine step log, records)."""
    async with make_engine(config) as engine:
        streams = [await engine.submit(p, params=params) for p in prompts]
        results = await asyncio.gather(*(s.collect() for s in streams))
        tokens = [[e.token_id for e in events if e.kind == "token"] for events, _ in results]
        for events, _ in results:
            assert events[-1].kind == "done", events[-1]
        return tokens, engine.steps_since(), [s.lifecycle for s in streams]


def start_controller_and_kill_it(script: str, *args: str, before_kill=None) -> tuple[list[str], list]:
    """Run ``script`` (a controller that prints its worker pids and names, then idles) in a child
    process, kill -9 it once it printed (after ``before_kill(words)``), and return
    (printed words, psutil workers still alive 10 s later)."""
    import subprocess
    import sys

    import psutil

    ctl = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    try:
        words = ctl.stdout.readline().split()
        workers = [psutil.Process(int(w)) for w in words if w.isdigit()]
        assert workers, words
        if before_kill is not None:
            before_kill(words)
        ctl.kill()
        ctl.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        return words, alive
    finally:
        ctl.kill()
