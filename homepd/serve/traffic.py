"""Recording the shape of the traffic the service serves into the store, off the event loop.

The loop only enqueues (``put_nowait``: it never waits on the recorder); one
recorder thread computes each prompt's share seen before (``PrefixTracker``,
in arrival order, from the token ids: independent of the engine's prefix
cache), builds each request's row when it ends, and writes the rows in
batches (every ``FLUSH_PERIOD_S`` or ``FLUSH_ROWS`` rows, one transaction
each), pruning the table to its retention after each batch.  A write that
fails (a full disk, a locked or read-only database) is logged, counted and its
rows dropped: the service carries on.  No text is kept unless ``record_text``.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client.core import CounterMetricFamily

from homepd.core.terms import RequestClass
from homepd.core.lifecycle import Lifecycle
from homepd.core.records import FinishReason
from homepd.measure.trace.prefixes import PrefixTracker
from homepd.measure.trace.traffic import RecordedRequest, Route

log = logging.getLogger("homepd.serve")
FLUSH_PERIOD_S = 1.0
FLUSH_ROWS = 256
MAX_PENDING = 10_000     # events queued, and requests arrived but not ended; more are dropped and counted


@dataclass(frozen=True)
class _Arrived:
    request_id: str
    prompt_ids: tuple[int, ...]
    arrived_unix_s: float
    route: Route
    request_class: RequestClass
    max_tokens: int
    text: str | None


@dataclass(frozen=True)
class _Ended:
    request_id: str
    n_output_tokens: int
    finish_reason: FinishReason | None
    n_cached_tokens: int
    ttft_ms: float | None
    e2e_ms: float | None
    slo_met: bool | None = None


class TrafficRecorder:
    """``start``, then ``arrived``/``ended`` from the event loop, then ``stop`` (flushes; blocks: call it
    off the loop).  ``open_store``: opens the store in the recorder thread (tests inject one)."""

    def __init__(self, open_store: Callable, *, record_text: bool = False, max_rows: int = 100_000,
                 max_age_days: float = 30.0, service_id: str | None = None):
        self.open_store, self.record_text = open_store, record_text
        self.max_rows, self.max_age_days = max_rows, max_age_days
        self.service_id = service_id or f"{os.getpid()}@{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        self.n_recorded = self.n_write_errors = self.n_dropped = 0
        self.last_error: str | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self._thread = threading.Thread(target=self._run, name="homepd-traffic", daemon=True)
        self._tracker = PrefixTracker()
        self._arrived: dict[str, tuple[_Arrived, int, str | None]] = {}
        self._store = None

    # the event loop's side: never blocks ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def arrived(self, request_id: str, prompt_ids: tuple[int, ...], arrived_unix_s: float, route: Route,
                request_class: RequestClass, max_tokens: int, text: str | None = None) -> None:
        self._put(_Arrived(request_id, tuple(prompt_ids), arrived_unix_s, route, request_class, max_tokens,
                           text if self.record_text else None))

    def ended(self, request_id: str, lc: Lifecycle, slo_met: bool | None = None) -> None:
        ms = (lambda s: None if s is None else s * 1e3)
        self._put(_Ended(request_id, len(lc.token_times_s), lc.finish_reason, lc.n_cached_tokens, ms(lc.ttft_s),
                         None if lc.ended_s is None else ms(lc.ended_s - lc.arrived_s), slo_met))

    def _put(self, event) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.n_dropped += 1

    def status(self) -> dict:
        return {"recording": True, "text": self.record_text, "recorded": self.n_recorded,
                "write_errors": self.n_write_errors, "dropped": self.n_dropped, "last_error": self.last_error,
                "retention": {"max_rows": self.max_rows, "max_age_days": self.max_age_days}}

    def stop(self, timeout_s: float = 10.0) -> None:
        """Write what is pending and end the thread (blocking)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    # the recorder thread ------------------------------------------------------------------------
    def _run(self) -> None:
        batch: list[RecordedRequest] = []
        next_flush = time.monotonic() + FLUSH_PERIOD_S
        while True:
            try:
                event = self._queue.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                event = ()
            if event is None:
                break
            if isinstance(event, _Arrived):
                self._on_arrived(event)
            elif isinstance(event, _Ended):
                row = self._on_ended(event)
                if row is not None:
                    batch.append(row)
            if batch and (len(batch) >= FLUSH_ROWS or time.monotonic() >= next_flush):
                self._flush(batch)
                batch = []
            if time.monotonic() >= next_flush:
                next_flush = time.monotonic() + FLUSH_PERIOD_S
        self._flush(batch)
        if self._store is not None:
            self._store.close()

    def _on_arrived(self, a: _Arrived) -> None:
        match = self._tracker.observe(a.request_id, a.prompt_ids)
        if len(self._arrived) >= MAX_PENDING:
            self.n_dropped += 1
            return
        self._arrived[a.request_id] = (a, match.n_tokens, match.parent_id)

    def _on_ended(self, e: _Ended) -> RecordedRequest | None:
        held = self._arrived.pop(e.request_id, None)
        if held is None:
            return None
        a, n_prefix, parent = held
        return RecordedRequest(
            request_id=a.request_id, arrived_unix_s=a.arrived_unix_s, n_prompt_tokens=len(a.prompt_ids),
            n_output_tokens=e.n_output_tokens, request_class=a.request_class, route=a.route,
            finish_reason=e.finish_reason, max_tokens=a.max_tokens, n_prefix_tokens=n_prefix, prefix_parent=parent,
            n_cached_tokens=e.n_cached_tokens, ttft_ms=e.ttft_ms, e2e_ms=e.e2e_ms, service_id=self.service_id,
            arrived_at=datetime.datetime.fromtimestamp(a.arrived_unix_s, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"), prompt_text=a.text, slo_met=e.slo_met)

    def _flush(self, batch: list[RecordedRequest]) -> None:
        if not batch:
            return
        # why: sqlite_utils (the store) loads with the first batch written
        from homepd.store.traffic import add_traffic, prune_traffic

        try:
            if self._store is None:
                self._store = self.open_store()
            add_traffic(self._store, batch)
            self.n_recorded += len(batch)
            prune_traffic(self._store, self.max_rows, self.max_age_days)
        except Exception as exc:  # why: recording must never take the service down (disk full, locked, ...)
            self.n_write_errors += 1
            self.n_dropped += len(batch)
            self.last_error = f"{type(exc).__name__}: {exc}"
            if self.n_write_errors == 1 or self.n_write_errors % 100 == 0:
                log.warning("homepd: traffic recording: %d request(s) not written (%s); serving carries on "
                            "(%d write errors so far)", len(batch), self.last_error, self.n_write_errors)


class TrafficCollector:
    """``/metrics``: the recorder's counters."""

    def __init__(self, recorder: TrafficRecorder):
        self.recorder = recorder

    def collect(self):
        r = self.recorder
        for name, doc, value in (
                ("homepd_traffic_recorded", "Requests whose shape was written to the store", r.n_recorded),
                ("homepd_traffic_record_errors", "Failed writes of the traffic recording (each drops its batch)",
                 r.n_write_errors),
                ("homepd_traffic_dropped", "Requests not recorded (failed writes, a full queue)", r.n_dropped)):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


def prompt_text(prompt: str | None, messages: list | None) -> str:
    """What ``--record-text`` keeps: the raw prompt, or the chat's messages as JSON."""
    return prompt if prompt is not None else json.dumps(messages, ensure_ascii=False)
