"""The controller: starts workers, admits and routes requests, streams tokens back.

Used by every face (service, dashboard, benchmarks).  Runs on an asyncio loop;
one reader thread per worker turns pipe messages into loop callbacks, so a
worker's death (pipe EOF) is noticed at once.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

from homepd.chat import render_chat
from homepd.config import EngineConfig
from homepd.errors import EngineError, RequestError
from homepd.messages import CancelRequest, RequestDone, StepRecord, StepReport, SubmitRequest, WorkerFatal, WorkerReady
from homepd.request import Lifecycle, RequestState
from homepd.sampling import SamplingParams
from homepd.workers import WorkerHandle

MAX_RECORDS = 10_000
MAX_STEP_LOG = 100_000
_ids = itertools.count(1)


@dataclass(frozen=True)
class Event:
    """One streamed event: a token, the end of the request, or an error (always last)."""
    kind: str  # "token" | "done" | "error"
    request_id: str
    t_s: float
    token_id: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    """Async iterator over a request's events; ends after its 'done' or 'error' event."""

    def __init__(self, request_id: str, lifecycle: Lifecycle):
        self.request_id = request_id
        self.lifecycle = lifecycle
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        event = await self.queue.get()
        self._ended = event.kind != "token"
        return event

    async def collect(self) -> tuple[list[Event], str]:
        """Drain the stream: (all events, concatenated text)."""
        events = [e async for e in self]
        return events, "".join(e.text for e in events)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config.validated()
        self.model_path: str | None = None
        self.tokenizer = None
        self.records: OrderedDict[str, Lifecycle] = OrderedDict()
        self.streams: dict[str, RequestStream] = {}
        self.step_log: deque[StepRecord] = deque(maxlen=MAX_STEP_LOG)
        self.worker_events: list[dict] = []  # deaths and restarts, for recovery metrics
        self.workers: dict[str, WorkerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # lifecycle of the engine -----------------------------------------------------
    async def start(self) -> None:
        from homepd.llm import LlamaModel
        from homepd.models import resolve_model

        self._loop = asyncio.get_running_loop()
        self.model_path = str(await asyncio.to_thread(resolve_model, self.config.model, self.config.models_dir))
        self.tokenizer = await asyncio.to_thread(LlamaModel, self.model_path, 0, True)
        roles = ["colocated"] if self.config.mode == "colocated" else ["prefill", "decode"]
        for role in roles:
            self.workers[role] = WorkerHandle(role, self._spec_for(role), self._loop, self._on_message,
                                              self._on_exit)
        await asyncio.gather(*(h.start() for h in self.workers.values()))

    def _spec_for(self, role: str):
        from homepd.worker import WorkerSpec
        c = self.config
        return WorkerSpec(role=role, model_path=self.model_path, n_ctx=c.n_ctx, n_seq_max=c.n_seq_max,
                          chunk=c.chunk, n_threads=c.effective_n_threads, cpu_cores=c.cpu_cores,
                          gpu_index=c.gpu_index, n_gpu_layers=c.n_gpu_layers, fault=c.fault)

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*(h.stop() for h in self.workers.values()))
        for rid in list(self.streams):
            self._end(rid, RequestState.FAILED, time.monotonic(), error="engine stopped")
        if self.tokenizer is not None:
            self.tokenizer.close()
            self.tokenizer = None

    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # requests ---------------------------------------------------------------------
    def prepare(self, prompt: str | None = None, messages: list | None = None) -> list[int]:
        """Render and tokenize a prompt or chat; raise RequestError if it cannot run."""
        if self.tokenizer is None:
            raise EngineError("the engine is not started")
        if (prompt is None) == (messages is None):
            raise RequestError("give exactly one of prompt or messages")
        if messages is not None:
            t = self.tokenizer
            prompt = render_chat(t.chat_template(), messages, t.token_text(t.bos_id), t.token_text(t.eos_id))
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string")
        ids = self.tokenizer.tokenize(prompt, add_special=True, parse_special=True)
        if not ids:
            raise RequestError("prompt is empty after tokenization")
        if len(ids) >= self.config.n_ctx:
            raise RequestError(f"prompt is {len(ids)} tokens; the context holds {self.config.n_ctx} "
                               f"(n_ctx) including at least one generated token — shorten it or raise n_ctx")
        return ids

    async def submit(self, prompt: str | None = None, *, messages: list | None = None,
                     params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        """Admit a request; returns its event stream.  Raises RequestError before any worker sees it."""
        params = (params or SamplingParams()).validated()
        ids = self.prepare(prompt, messages)
        room = self.config.n_ctx - len(ids) + 1
        if params.max_tokens > room:
            params = replace(params, max_tokens=room)  # ends with finish_reason 'length'
        rid = request_id or f"req-{os.getpid()}-{next(_ids)}"
        if rid in self.streams:
            raise RequestError(f"request id {rid!r} is already running")
        lifecycle = Lifecycle(request_id=rid, arrived_s=time.monotonic(), n_prompt_tokens=len(ids))
        self.records[rid] = lifecycle
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)
        stream = RequestStream(rid, lifecycle)
        self.streams[rid] = stream
        self._entry_worker().send_request(rid, SubmitRequest(rid, tuple(ids), params))
        return stream

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request; True if it was running."""
        if request_id not in self.streams:
            return False
        for handle in self.workers.values():
            if request_id in handle.in_flight:
                if handle.drop_backlog(request_id):
                    self._end(request_id, RequestState.CANCELLED, time.monotonic(), reason="cancelled")
                else:
                    handle.send(CancelRequest(request_id))
        return True

    def _entry_worker(self) -> WorkerHandle:
        return self.workers["colocated" if self.config.mode == "colocated" else "prefill"]

    # messages from workers (on the loop thread) -------------------------------------
    def _on_message(self, handle: WorkerHandle, msg) -> None:
        if isinstance(msg, StepReport):
            self._on_step(handle, msg)
        elif isinstance(msg, RequestDone):
            self._on_done(msg)
        elif isinstance(msg, WorkerReady):
            pass  # the handle keeps it
        elif isinstance(msg, WorkerFatal):
            handle.last_error = msg.error.splitlines()[0] if msg.error else "unknown error"

    def _on_step(self, handle: WorkerHandle, report: StepReport) -> None:
        step = report.step
        self.step_log.append(step)
        for rid in report.prefill_started:
            if rid in self.streams:
                self.records[rid].advance(RequestState.PREFILLING, step.t_start_s)
        for rid in report.prefill_ended:
            if rid in self.streams:
                self.records[rid].prefill_end_s = step.t_end_s
                self.records[rid].advance(RequestState.DECODING, step.t_end_s)
        for tok in report.tokens:
            stream = self.streams.get(tok.request_id)
            if stream is not None:
                stream.lifecycle.add_token(tok.t_s)
                stream.queue.put_nowait(Event("token", tok.request_id, tok.t_s, tok.token_id, tok.text))
        for done in report.done:
            self._on_done(done)

    def _on_done(self, done: RequestDone) -> None:
        state = {"cancelled": RequestState.CANCELLED, "error": RequestState.FAILED}.get(done.reason,
                                                                                      RequestState.FINISHED)
        self._end(done.request_id, state, done.t_s, reason=done.reason, text=done.text, error=done.error)

    def _end(self, rid: str, state: RequestState, t_s: float, reason: str | None = None, text: str = "",
             error: str | None = None) -> None:
        stream = self.streams.pop(rid, None)
        if stream is None:
            return
        for handle in self.workers.values():
            handle.in_flight.discard(rid)
        lc = stream.lifecycle
        lc.finish_reason, lc.error = reason, error
        lc.advance(state, t_s)
        if state is RequestState.FAILED:
            stream.queue.put_nowait(Event("error", rid, t_s, text=text, error=error or "failed"))
        else:
            stream.queue.put_nowait(Event("done", rid, t_s, text=text, finish_reason=reason))

    def _on_exit(self, handle: WorkerHandle, exitcode: int | None) -> None:
        """A worker process ended.  Fail what it held, then restart it (unless stopping)."""
        if self._stopping:
            return
        now = time.monotonic()
        cause = f"exit code {exitcode}" + (f": {handle.last_error}" if handle.last_error else "")
        lost = sorted(handle.in_flight)
        self.worker_events.append({"role": handle.role, "pid": handle.pid, "died_s": now,
                                   "exitcode": exitcode, "failed_requests": lost})
        for rid in lost:
            self._end(rid, RequestState.FAILED, now,
                      error=f"{handle.role} worker (pid {handle.pid}) died ({cause}); request failed — retry it")
        handle.last_error = None
        asyncio.ensure_future(self._restart(handle))

    async def _restart(self, handle: WorkerHandle) -> None:
        await handle.start()
        self.worker_events.append({"role": handle.role, "pid": handle.pid, "restarted_s": time.monotonic()})

    # state -----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """A plain-data picture of the engine: workers, queues, running requests."""
        by_state: dict[str, list[str]] = {}
        for rid, stream in self.streams.items():
            by_state.setdefault(stream.lifecycle.state.value, []).append(rid)
        return {
            "mode": self.config.mode,
            "model": self.model_path,
            "n_ctx": self.config.n_ctx,
            "chunk": self.config.chunk,
            "workers": [h.describe() for h in self.workers.values()],
            "requests": by_state,
            "n_steps": len(self.step_log),
            "worker_events": list(self.worker_events),
        }
