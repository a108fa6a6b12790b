"""The bare llama.cpp loop in a process of its own, placed exactly like an engine worker.

``homepd bench engine`` bounds the engine by this loop, so it has to be the
real limit: the worker's ``WorkerSpec`` decides its CPU affinity, its GPU
visibility, its thread count and its context (n_ctx, n_batch, n_seq_max), the
same code paths the worker takes (``homepd.worker.loop.worker_main``).  It holds one warm
context, as a worker does, and runs ``greedy_on`` on it per request.  The parent
checks each run from the outside: which threads of the process burned CPU
(``homepd.hw.threads``), and the affinity and n_threads it reported.

``python -m homepd.measure.refproc FD``: FD is one end of a socketpair; the
spec comes first, then ``RefRun`` messages, each answered by a ``RefDone``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from homepd.core.protocol import WorkerSpec
from homepd.engine.handles import spawn_worker
from homepd.hw.threads import ThreadUse, read_tasks, thread_use
from homepd.llm import LlamaContext, LlamaModel
from homepd.measure.reference import AloneRun, greedy_on


@dataclass(frozen=True)
class RefReady:
    pid: int
    cpu_affinity: tuple[int, ...]
    n_threads: tuple[int, int]   # (n_threads, n_threads_batch) as llama.cpp reports them


@dataclass(frozen=True)
class RefRun:
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class RefDone:
    run: AloneRun


@dataclass(frozen=True)
class RefResult:
    """One measured run of the bare loop and what its process did meanwhile."""
    run: AloneRun
    use: ThreadUse


class ReferenceProcess:
    """Spawn, run requests on, and stop the bare-loop process (a context manager)."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.process, self.conn = spawn_worker(spec, module="homepd.measure.refproc")  # as the engine's workers
        try:
            self.ready: RefReady = self.conn.recv()
        except EOFError:
            self.process.wait()
            raise RuntimeError(f"the reference process exited while loading (exit code {self.process.returncode})")

    @property
    def pid(self) -> int:
        return self.process.pid

    def run(self, prompt_ids: list[int], max_tokens: int) -> RefResult:
        """One greedy run of ``prompt_ids`` (the engine's schedule), with the process's thread use over it."""
        before, t0 = read_tasks(self.pid), time.monotonic()
        self.conn.send(RefRun(tuple(prompt_ids), max_tokens))
        done: RefDone = self.conn.recv()
        wall_s = time.monotonic() - t0
        return RefResult(done.run, thread_use(before, read_tasks(self.pid), wall_s))

    def close(self) -> None:
        if self.process.poll() is None:
            self.conn.close()  # the child reads EOF and exits
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "ReferenceProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reference_main(spec: WorkerSpec, conn: Connection) -> None:
    """The child: place itself and build its context as ``worker_main`` does, then serve ``RefRun``s."""
    if spec.cpu_cores:
        os.sched_setaffinity(0, spec.cpu_cores)
    model = LlamaModel(spec.model_path, n_gpu_layers=spec.offload_layers)
    ctx = LlamaContext(model, n_ctx=spec.n_ctx, n_batch=spec.n_batch, n_seq_max=spec.n_seq_max,
                       n_threads=spec.n_threads, flash_attn=spec.flash_attn)
    conn.send(RefReady(os.getpid(), tuple(sorted(os.sched_getaffinity(0))), ctx.n_threads))
    try:
        while True:
            try:
                msg: RefRun = conn.recv()
            except EOFError:
                return
            # why: no stop at end-of-generation, like the bench's engine requests (ignore_eos)
            conn.send(RefDone(greedy_on(ctx, list(msg.prompt_ids), msg.max_tokens, spec.chunk, stop_at_eog=False)))
    finally:
        ctx.close()
        model.close()


if __name__ == "__main__":
    # why: run the copy imported under its own name, so the messages it pickles are
    # homepd.measure.refproc.RefReady (the parent's class), not __main__.RefReady
    from homepd.measure.refproc import reference_main as _reference_main

    _conn = Connection(int(sys.argv[1]))
    try:
        _spec = _conn.recv()
    except EOFError:
        raise SystemExit(0)
    _reference_main(_spec, _conn)
