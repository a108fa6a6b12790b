"""Workers are really placed: pinned cores, thread counts and GPU visibility reach the processes."""
from __future__ import annotations

import os

import psutil
import pytest

from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams

from engine_helpers import make_engine, PROMPTS, run


@pytest.mark.whole_box  # pins workers to cores apart (tests/conftest.py, BoxShare)
def test_disaggregated_workers_are_pinned_to_split_cores(default_model_path):
    async def scenario():
        cfg = EngineConfig(model=str(default_model_path), mode="disaggregated", n_ctx=512)
        async with make_engine(cfg) as engine:
            snap = engine.snapshot()
            affinity = {w.role: psutil.Process(w.pid).cpu_affinity() for w in snap.workers}
            env = {w.role: psutil.Process(w.pid).environ() for w in snap.workers}
            stream = await engine.submit(PROMPTS[0], params=SamplingParams(max_tokens=3))
            events, _ = await stream.collect()
            return snap, affinity, env, events

    snap, affinity, env, events = run(scenario())
    usable = sorted(os.sched_getaffinity(0))
    by_role = {w.role: w for w in snap.workers}
    assert affinity["prefill"] == list(by_role["prefill"].cpu_cores)
    assert affinity["decode"] == list(by_role["decode"].cpu_cores)
    assert not set(affinity["prefill"]) & set(affinity["decode"])  # split, not shared
    assert sorted(affinity["prefill"] + affinity["decode"]) == usable
    assert by_role["prefill"].n_threads == len(affinity["prefill"])
    assert {role: e.get("CUDA_VISIBLE_DEVICES") for role, e in env.items()} == {"prefill": "", "decode": ""}  # no GPU
    # numpy's BLAS on one thread unless this process set it (homepd.osutil.single_thread_blas)
    assert {e.get("OPENBLAS_NUM_THREADS") for e in env.values()} == {os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    assert events[-1].kind == "done"


def test_gpu_placement_sets_visible_device_and_offload(default_model_path):
    """On this CPU-only build llama.cpp ignores the offload; the worker still gets the GPU's env."""
    core = min(os.sched_getaffinity(0))  # one core this test may use (under the suite's workers, its own)

    async def scenario():
        cfg = EngineConfig(model=str(default_model_path), n_ctx=256, gpu_index=1, n_gpu_layers=-1,
                           cpu_cores=(core,), n_threads=1)
        async with make_engine(cfg) as engine:
            (w,) = engine.snapshot().workers
            proc = psutil.Process(w.pid)
            stream = await engine.submit(PROMPTS[0], params=SamplingParams(max_tokens=2))
            events, _ = await stream.collect()
            return w, proc.environ().get("CUDA_VISIBLE_DEVICES"), proc.cpu_affinity(), events

    w, visible, affinity, events = run(scenario())
    assert visible == "1" and w.cuda_visible_devices == "1"
    assert w.n_gpu_layers == 999  # -1 = every layer
    assert affinity == [core] and w.n_threads == 1
    assert events[-1].kind == "done"
