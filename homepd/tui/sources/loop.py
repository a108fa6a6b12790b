"""An asyncio loop on a thread of its own, for the engine the app embeds.

The engine lives on one loop (it reads its workers' pipes there); keeping that
loop off the app's event loop means no engine bookkeeping, summary or store
write ever delays a key press.  Callers on other threads run coroutines on it
with ``call`` and wait for the result.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine


class LoopThread:
    def __init__(self, name: str = "homepd-engine-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> Future:
        """Schedule ``coro`` on the loop; the returned future's ``cancel`` cancels the task."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        return self.submit(coro).result(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop (after what it is running now) and join the thread.  Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        if not self.loop.is_closed():
            self.loop.close()
