"""The remote data source: a ``homepd serve`` already running on this box, over HTTP (docs/serve.md).

``GET /status`` when connecting; ``GET /events`` (server-sent events: an
engine ``snapshot`` every half second, each finished ``request`` with its
token gaps, and the ``steps`` of each half second, sampled and bounded) read
on a thread of its own, which keeps the newest snapshot and buffers the rest
for the next ``tick``; chat through ``POST /v1/chat/completions`` with
``stream: true`` (each chunk's delta split into reasoning, content and tool-call
fragments; the last chunk carries homepd's timings).  The API key, when
set, goes in ``Authorization: Bearer``.  This is the app's HTTP edge: each
body is decoded here, once, into typed records (``ServiceStatus`` with its
``EngineSnapshot``, ``RequestTimings``); a body of another shape is an error
that names the field, never a dashboard of zeros.  The hardware panel comes
from a local sampler: the service runs on this box.  The step samples feed the
same ``StepWindow`` as the embedded engine's steps (ITL max, the interference
index, stall attribution); a finished request waits for the sample that covers
its end, so the steps that stalled it are there when its row is made.  An older
service that sends no steps shows requests at once, without those figures.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import httpx

from homepd.config import EngineConfig, read_config_file
from homepd.core.lifecycle import RequestTimings
from homepd.config.origin import ConfigOrigin
from homepd.core.records import EngineSnapshot, RecordShapeError
from homepd.errors import HomepdError
from homepd.hw.monitor import Sampler
from homepd.hw.probe import probe
from homepd.measure.stepstream import StepSample, TokenGaps
from homepd.tui import derive
from homepd.tui.liveadvice import advice_view
from homepd.tui.records import ChatStats, ModelRow, Tick
from homepd.tui.sources.base import CHAT_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P, DataSource, Emit, OnDelta
from homepd.tui.sources.chatrequest import chunk_deltas, openai_tool_fields
from homepd.tui.stepwindow import StepWindow

# why not imported: the app must not import homepd.serve; this is homepd.serve.settings.DEFAULT_PORT
DEFAULT_PORT = 8439
EVENTS_INTERVAL_S = 0.5
RECONNECT_S = 1.0
MAX_BUFFERED_REQUESTS = 500
MAX_BUFFERED_SAMPLES = 240   # two minutes of step samples between ticks (a tick normally takes one or two)


def service_address() -> tuple[str, int, str | None]:
    """(host, port, API key) of the local service as ``homepd serve`` reads them: ``HOMEPD_HOST`` /
    ``HOMEPD_PORT`` / ``HOMEPD_API_KEY``, else the config file's ``[serve]`` table, else the defaults."""
    table = read_config_file().get("serve", {})
    host = os.environ.get("HOMEPD_HOST") or str(table.get("host", "127.0.0.1"))
    port = int(os.environ.get("HOMEPD_PORT") or table.get("port", DEFAULT_PORT))
    key = os.environ.get("HOMEPD_API_KEY") or table.get("api_key")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # listening everywhere: reach it on loopback
    return host, port, key or None


@dataclass(frozen=True)
class ServiceStatus:
    """What the app reads of ``GET /status`` and of each ``snapshot`` event on ``/events``."""
    state: str
    models: tuple[str, ...]
    in_flight: int
    capacity: int
    engine: EngineSnapshot | None      # None until the engine is up
    origin: ConfigOrigin | None = None  # the configuration it serves with and why (None: an older service)
    served: tuple[ModelRow, ...] = ()   # its models by their Ollama names, with their state (older: none)

    @classmethod
    def from_json(cls, body: dict) -> "ServiceStatus":
        try:
            admission, engine, origin = body["admission"], body["engine"], body.get("configuration")
            served = tuple(ModelRow(str(m["name"]), str(m["role"]), str(m["state"]))
                           for m in body.get("served_models") or ())
            return cls(str(body["state"]), tuple(body["models"]), int(admission["in_flight"]),
                       int(admission["capacity"]), None if engine is None else EngineSnapshot.from_dict(engine),
                       None if origin is None else ConfigOrigin.from_dict(origin), served)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordShapeError(f"/status: missing or mistyped field {exc}") from None


def served_timings(homepd: dict) -> tuple[str, RequestTimings]:
    """(mode, figures) from the ``homepd`` object of a reply."""
    body = dict(homepd)
    mode = body.pop("mode", None)
    if not isinstance(mode, str):
        raise RecordShapeError(f"the reply's homepd object: missing or mistyped field 'mode' ({mode!r})")
    return mode, RequestTimings.from_dict(body)


def find_service(url: str, timeout_s: float = 0.5) -> bool:
    """Whether a homepd service answers ``/health`` at ``url``."""
    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
        return response.status_code == 200 and response.json().get("status") == "ok"
    except (httpx.HTTPError, ValueError):
        return False


def iter_sse(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """Server-sent events from text lines: (event name, data); the name is 'message' when unnamed."""
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield event, "\n".join(data)


def _error_text(response: httpx.Response) -> str:
    try:
        body = json.loads(response.read())
        return body.get("error", {}).get("message") or str(body)
    except (ValueError, AttributeError):
        return f"HTTP {response.status_code}"


class RemoteSource(DataSource):
    def __init__(self, url: str, config: EngineConfig, *, api_key: str | None = None, db: str | None = None,
                 config_file: str | None = None, transport: httpx.BaseTransport | None = None,
                 sample_hardware: bool = True):
        super().__init__(config, db=db, config_file=config_file)
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, transport=transport,
                                    timeout=httpx.Timeout(10.0, read=60.0))
        self._sample_hardware = sample_hardware
        self._status: ServiceStatus | None = None
        # finished requests (their figures, token gaps and end on the service's clock), oldest first
        self._requests: deque[tuple[RequestTimings, TokenGaps | None, float]] = deque(maxlen=MAX_BUFFERED_REQUESTS)
        self._samples: deque[StepSample] = deque(maxlen=MAX_BUFFERED_SAMPLES)
        self._steps_t_s: float | None = None  # the newest step sample's time (service clock); None: no steps
        self.steps = StepWindow()             # the service's last minute of steps, as sampled
        self._lock = threading.Condition()    # the reader thread's buffers; notified on each event
        self._stopping = threading.Event()
        self._live = threading.Event()      # set once the first snapshot arrived on /events
        self._reader: threading.Thread | None = None
        self._connection = "connecting"
        self._n_missed = 0                    # events the service could not keep for this app ('missed' events)
        self._last_t = time.monotonic()
        self.sampler = self._box = None
        self.model = ""

    def start(self, emit: Emit) -> str:
        response = self._client.get("/status")
        if response.status_code != 200:
            raise HomepdError(f"{self.url}/status: {_error_text(response)}")
        status = ServiceStatus.from_json(response.json())
        self._status = status
        self.model = (status.models or ("default",))[0]
        if self._sample_hardware:
            self._box = probe()
            self.sampler = Sampler(period_s=0.5).start()
        self._reader = threading.Thread(target=self._read_events, name="homepd-events", daemon=True)
        self._reader.start()
        return self.description

    def wait_live(self, timeout_s: float) -> bool:
        """Whether the event stream delivered a snapshot within ``timeout_s``."""
        return self._live.wait(timeout_s)

    @property
    def description(self) -> str:
        with self._lock:
            state = self._status.state if self._status is not None else "?"
            origin = self._status.origin if self._status is not None else None
            missed = f", {self._n_missed} events missed" if self._n_missed else ""
        running = f": {origin.configuration} — {origin.why}" if origin is not None else ""
        return f"remote: homepd serve at {self.url} ({state}, {self._connection}{missed}){running}"

    def stop(self) -> None:
        self.cancel_advise(wait=True)
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(timeout=2 * RECONNECT_S + EVENTS_INTERVAL_S)
        self._client.close()
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None

    def advice(self):
        """The service's standing live advice (``GET /advice``), None when there is none, live advice is off
        (404) or the service cannot be reached."""
        try:
            response = self._client.get("/advice", timeout=2.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return advice_view(response.json().get("advice"))

    def apply_advice(self, candidate: str) -> str:
        """``POST /advice/apply``: the service drains, restarts its workers as ``candidate`` and resumes."""
        try:
            response = self._client.post("/advice/apply", json={"candidate": candidate}, timeout=None)
        except httpx.HTTPError as exc:
            raise HomepdError(f"the service did not answer the switch: {exc}") from None
        if response.status_code != 200:
            raise HomepdError(_error_text(response))
        record = response.json()
        return (f"{record.get('candidate', candidate)}: {(record.get('configuration') or {}).get('line', '')} "
                f"(switched in {record.get('took_s', 0):g} s)")

    # the event stream (its own thread) ---------------------------------------------------------
    def _read_events(self) -> None:
        while not self._stopping.is_set():
            try:
                with self._client.stream("GET", "/events", params={"interval_s": EVENTS_INTERVAL_S}) as response:
                    if response.status_code != 200:
                        raise HomepdError(_error_text(response))
                    self._connection = "live"
                    for event, data in iter_sse(response.iter_lines()):
                        self._on_event(event, data)
                        if self._stopping.is_set():
                            return
            except (httpx.HTTPError, HomepdError, ValueError, RuntimeError) as exc:
                self._connection = f"disconnected: {exc}" if not self._stopping.is_set() else "closed"
            self._stopping.wait(RECONNECT_S)  # why: a service that restarts comes back; do not spin meanwhile

    def _on_event(self, event: str, data: str) -> None:
        if event == "snapshot":
            status = ServiceStatus.from_json(json.loads(data))
            with self._lock:
                self._status = status
            self._live.set()
            snap = status.engine  # the service's engine, as its snapshot
            if self.sampler is not None and snap is not None:
                for w in snap.workers:
                    if w.pid:
                        self.sampler.register_process(w.pid, w.role)
        elif event == "request":
            body = json.loads(data)
            finished = RequestTimings.from_lifecycle_dict(body)
            gaps = TokenGaps.from_dict(finished.request_id, body) if "gaps_over" in body else None
            ended_s = body.get("ended_s")
            with self._lock:
                self._requests.append((finished, gaps, float("-inf") if ended_s is None else float(ended_s)))
                self._lock.notify_all()
        elif event == "missed":  # this app read too slowly: the service dropped events for it (rows are missing)
            with self._lock:
                self._n_missed += int(json.loads(data).get("events", 0))
        elif event == "steps":
            sample = StepSample.from_dict(json.loads(data))
            with self._lock:
                self._samples.append(sample)
                self._steps_t_s = sample.t_s if self._steps_t_s is None else max(self._steps_t_s, sample.t_s)
                self._lock.notify_all()

    def _is_covered(self, ended_s: float) -> bool:
        """Whether the steps up to a request's end have arrived (always, from a service that sends none)."""
        return self._steps_t_s is None or ended_s <= self._steps_t_s

    def wait_finished(self, request_ids, timeout_s: float) -> bool:
        """Whether every one of ``request_ids`` finished and the steps up to its end arrived within ``timeout_s``
        (its row is then in the next ``tick``)."""
        wanted = set(request_ids)
        with self._lock:
            return self._lock.wait_for(lambda: wanted <= {t.request_id for t, _, end in self._requests
                                                          if self._is_covered(end)}, timeout_s)

    # the dashboard ----------------------------------------------------------------------------
    def tick(self) -> Tick:
        now = time.monotonic()
        with self._lock:
            status, samples = self._status, list(self._samples)
            self._samples.clear()
            finished = [(t, gaps) for t, gaps, end in self._requests if self._is_covered(end)]
            kept = [r for r in self._requests if not self._is_covered(r[2])]
            self._requests.clear()
            self._requests.extend(kept)
        interval_s, self._last_t = max(1e-3, now - self._last_t), now
        timings = [t for t, _ in finished]
        arch = None
        if status is not None and status.engine is not None:
            # why not "admitted": the class lines count admissions since start; this is what is in flight now
            note = f"service {status.state}; {status.in_flight} in flight of at most {status.capacity}"
            arch = derive.architecture_view(status.engine, derive.kv_mb_s(timings, interval_s), note)
        hardware = derive.hardware_view(self.sampler.latest(), self._box) if self.sampler is not None else None
        rows, point = self.steps.tick(now, interval_s, finished, samples)
        return Tick(hardware, arch, rows, point, self.description, status.served if status is not None else ())

    # chat -------------------------------------------------------------------------------------
    def chat(self, messages: list[dict], on_delta: OnDelta, *, max_tokens: int = CHAT_MAX_TOKENS,
             offer_tool: bool = False) -> ChatStats:
        body = {"model": self.chat_model or self.model, "messages": messages, "stream": True, "max_tokens": max_tokens,
                "temperature": CHAT_TEMPERATURE, "top_p": CHAT_TOP_P, **(openai_tool_fields() if offer_tool else {})}
        served: tuple[str, RequestTimings] | None = None
        finish = error = None
        started: set[int] = set()
        with self._client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise HomepdError(f"the service refused the request: {_error_text(response)}")
            for _, data in iter_sse(response.iter_lines()):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"].get("message", "failed")
                    continue
                for choice in chunk.get("choices") or ():
                    for delta in chunk_deltas(choice.get("delta") or {}, started):
                        on_delta(delta)
                    finish = choice.get("finish_reason") or finish
                if "homepd" in chunk:
                    served = served_timings(chunk["homepd"])
        if served is not None:
            return derive.chat_stats(served[1], served[0], finish, error)
        engine = self._status.engine if self._status is not None else None
        return derive.chat_stats(None, engine.mode if engine is not None else "?", finish, error)
