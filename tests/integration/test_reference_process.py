"""The bench's reference (the bare llama.cpp loop) runs in its own process, as the engine worker's spec says."""
from __future__ import annotations

import os

import pytest

from homepd.core.protocol import WorkerSpec
from homepd.llm import LlamaModel
from homepd.measure.reference import greedy_alone
from homepd.measure.refproc import ReferenceProcess

N_THREADS = 2


@pytest.mark.whole_box  # two threads, a core each
def test_the_reference_runs_in_its_own_process_on_the_specs_cores_with_the_asked_threads(default_model_path):
    # why: its own core per thread, so two threads never spin on one core waiting for each other
    cores = tuple(sorted(os.sched_getaffinity(0)))[-N_THREADS:]
    spec = WorkerSpec(role="colocated", model_path=str(default_model_path), n_ctx=256, n_seq_max=4, chunk=8,
                      n_threads=N_THREADS, cpu_cores=cores)
    model = LlamaModel(default_model_path)
    try:
        prompt_ids = model.tokenize("The history of computing is a story of people, ideas and machines.")
        in_process = greedy_alone(model, prompt_ids, 6, chunk=8, n_threads=N_THREADS, n_ctx=256, n_seq_max=4,
                                  stop_at_eog=False)
    finally:
        model.close()
    with ReferenceProcess(spec) as ref:
        assert ref.pid != os.getpid() and ref.ready.pid == ref.pid
        assert ref.ready.cpu_affinity == cores
        assert ref.ready.n_threads == (N_THREADS, N_THREADS)   # as llama.cpp reports the context's
        result = ref.run(prompt_ids, 6)
        assert result.use.n_busy_threads == N_THREADS
        assert ref.pid in result.use.busy_tids                  # its main thread is one of them
        assert result.run.tokens == in_process.tokens           # the same schedule, the same greedy tokens
    assert ref.process.returncode == 0
