"""What the engine does when a worker process dies.

Noticed at once (the pipe closes).  The requests the worker held are resumed
when ``config.resume`` allows — from their KV slot if it is intact (no second
prefill), else by recompute: prompt plus the tokens already streamed are
prefilled again on the (restarted) entry worker, with the text stream rebuilt —
or else end with an error naming the dead worker.  The worker is restarted with
back-off; one that cannot come back, or dies in a loop, is marked failed and
the engine refuses new work with a clear error.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from homepd.core.protocol import SlotFreed, SubmitRequest
from homepd.core.lifecycle import RequestState
from homepd.engine.handles import WorkerHandle

RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 0.5
MAX_RESUMES = 2             # a request whose worker died this often is failed, not resumed again
CRASH_LOOP_DEATHS = 5       # this many deaths of one worker within CRASH_LOOP_WINDOW_S: stop restarting it
CRASH_LOOP_WINDOW_S = 60.0


class Recovery:
    """Mixed into ``Engine``: uses its streams, workers, kv router, config and ``_end``."""

    def _on_exit(self, handle: WorkerHandle, exitcode: int | None) -> None:
        """A worker process ended.  Resume, cancel or fail what it held, then restart it (unless stopping)."""
        if self._stopping:
            return
        now, pid = time.monotonic(), handle.pid
        cause = f"exit code {exitcode}" + (f": {handle.last_error}" if handle.last_error else "")
        handle.deaths.append(now)
        crash_loop = sum(1 for t in handle.deaths if now - t <= CRASH_LOOP_WINDOW_S) >= CRASH_LOOP_DEATHS
        held = set(handle.in_flight)
        handle.in_flight.clear()
        handle.backlog.clear()
        for rid in sorted(held & self.cancelling):  # the cancel died with the worker: honour it
            self._end(rid, RequestState.CANCELLED, now, reason="cancelled")
        wanted = {rid for rid in held if rid in self.streams}
        resume = self.config.resume and not crash_loop
        if self.kv is not None:
            from_slot = self.kv.recover(handle.role, pid, wanted if resume else set())
            from_slot = [rid for rid in from_slot if self._resumable(rid, handle)]
            self.workers["prefill"].send(SlotFreed(-1))  # recovery may have freed slots
        else:
            from_slot = []
        recomputed = [rid for rid in sorted(wanted - set(from_slot))
                      if resume and self._resumable(rid, self._entry_worker())]
        lost = sorted(wanted - set(from_slot) - set(recomputed))
        self.worker_events.append({"role": handle.role, "pid": pid, "died_s": now, "exitcode": exitcode,
                                   "failed_requests": lost, "resumed_requests": from_slot,
                                   "recomputed_requests": recomputed, "crash_loop": crash_loop, "cause": cause})
        for rid in lost:
            times = self.streams[rid].lifecycle.n_resumes
            why = f"; it was already resumed {times} times" if times >= MAX_RESUMES else ""
            self._end(rid, RequestState.FAILED, now,
                      error=f"{handle.role} worker (pid {pid}) died ({cause}){why}; request failed — retry it")
        handle.last_error = None
        if self.sampler is not None:
            self.sampler.unregister_process(pid)
        if crash_loop:
            handle.failed = f"it died {CRASH_LOOP_DEATHS} times within {CRASH_LOOP_WINDOW_S:.0f} s ({cause})"
            return
        for rid in from_slot:  # KV intact in its slot: the restarted decode worker imports it, no new prefill
            self._note_resume(rid, "slot")
            handle.send_request(rid, self.kv.in_slot[rid])
        for rid in recomputed:  # KV lost: prefill prompt + output again on the (restarted) entry worker
            self._note_resume(rid, "recompute")
            self._entry_worker().send_request(rid, self._recompute_request(rid))
        self._spawn_task(self._restart(handle))

    def _resumable(self, rid: str, target: WorkerHandle) -> bool:
        """Can rid be resumed onto ``target``: not too often, the worker usable, room left in the context."""
        stream = self.streams[rid]
        return stream.lifecycle.n_resumes < MAX_RESUMES and not target.failed \
            and len(stream.prompt_ids) + len(stream.token_ids) <= self.config.n_ctx \
            and len(stream.token_ids) < stream.params.max_tokens

    def _note_resume(self, rid: str, how: str) -> None:
        lc = self.streams[rid].lifecycle
        lc.n_resumes += 1
        lc.resumed_by.append(how)

    def _recompute_request(self, rid: str) -> SubmitRequest:
        """The request again, its output so far appended to the prompt, with the text stream rebuilt."""
        from homepd.core.textstream import TextStream

        stream = self.streams[rid]
        text = TextStream(stream.params.stop)
        for token in stream.token_ids:
            text.feed(self.tokenizer.token_to_piece(token))
        params = replace(stream.params, max_tokens=stream.params.max_tokens - len(stream.token_ids))
        if self.kv is not None:
            self.kv.drop(rid)  # a stale slot entry must not be imported later
        return SubmitRequest(rid, stream.prompt_ids + tuple(stream.token_ids), params, stream=text)

    async def _restart(self, handle: WorkerHandle) -> None:
        error = None
        for attempt in range(RESTART_ATTEMPTS):
            try:
                await handle.start()
                break
            except Exception as exc:
                error = exc
                await asyncio.sleep(RESTART_BACKOFF_S * 2 ** attempt)
        else:  # could not come back: fail what waits for it, refuse new work
            handle.failed = f"{error}"
            for rid in sorted(handle.in_flight):
                self._end(rid, RequestState.FAILED, time.monotonic(),
                          error=f"{handle.role} worker could not be restarted: {error}")
            return
        self._register(handle)
        if self.kv is not None:
            handle.send(self.kv.attach_message())
            if handle.role == "prefill":
                handle.send(SlotFreed(-1))  # wake it: slots may have freed while it was down
        self.worker_events.append({"role": handle.role, "pid": handle.pid, "restarted_s": time.monotonic()})

    async def _watch_for_hangs(self) -> None:
        """Every second: kill a worker that holds requests but has said nothing for hang_timeout_s."""
        timeout_s = self.config.hang_timeout_s
        while not self._stopping:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for handle in self.workers.values():
                if handle.is_hung(now, timeout_s):
                    handle.kill_hung(now - handle.last_heard_s)
