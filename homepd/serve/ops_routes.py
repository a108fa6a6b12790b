"""Operations routes: ``/health`` (liveness), ``/ready``, ``/metrics`` (Prometheus), ``/status`` (JSON) and
``/events`` (SSE: engine snapshots and sampled steps every ``interval_s``, and each finished request, for the
dashboard)."""
from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health():
    """200 while the process serves HTTP (no API key needed)."""
    return {"status": "ok"}


@router.head("/health", include_in_schema=False)
async def health_head():
    """``/health`` for probes that send HEAD."""
    return Response()


@router.get("/ready", responses={503: {"description": "loading, draining, failed or a worker restarting"}})
async def ready(request: Request):
    """200 once the model is loaded and warmed and every worker is up; 503 (with the reason) otherwise."""
    service = request.app.state.service
    if service.is_ready:
        return {"status": "ready"}
    code, message = service.unavailable_reason() or ("not_ready", service.state)
    return JSONResponse({"status": code, "message": message}, status_code=503, headers={"Retry-After": "1"})


@router.get("/metrics", response_class=Response)
async def metrics(request: Request):
    """Prometheus text exposition (``homepd_*``)."""
    return Response(request.app.state.service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/status")
async def status(request: Request):
    """Service state, admission, the engine snapshot (workers, KV arena, requests by state) and recent requests."""
    return request.app.state.service.status()


@router.get("/events", responses={200: {"description": "an endless event stream", "content": {"text/event-stream": {}}}})
async def events(request: Request, interval_s: Annotated[float, Query(ge=0.1, le=60.0)] = 1.0):
    """Server-sent events: ``snapshot`` (``/status`` without recent requests) every ``interval_s``;
    ``request`` (a finished request's lifecycle, its largest token gap and its gaps over the ITL budget) as
    each ends; ``steps`` before each snapshot: the engine steps that ran since the previous one, at most 256
    of them (a sample, prompt-carrying steps first) with counts over all of them
    (``homepd.measure.stepstream.StepSample``); ``advice`` as live advice changes; ``missed`` (``{"events": N}``)
    before the next event a client gets after it read too slowly and N events were not kept for it."""
    service = request.app.state.service
    queue = service.subscribe()

    async def stream():
        loop = asyncio.get_running_loop()
        try:
            while not service.is_exiting:
                # why steps first: a client that has the first snapshot knows that steps are streamed (the first
                # sample is empty), and that a request it sees ends before the next sample covers it
                yield format_sse_event(event="steps", data_str=json.dumps(service.drain_steps(queue).to_dict()))
                snapshot = {k: v for k, v in service.status().items() if k != "recent_requests"}
                yield format_sse_event(event="snapshot", data_str=json.dumps(snapshot))
                deadline = loop.time() + interval_s
                while not service.is_exiting and (left := deadline - loop.time()) > 0:
                    event = await service.next_event(queue, left)
                    if event is not None:
                        yield format_sse_event(event=event[0], data_str=json.dumps(event[1]))
        finally:
            service.unsubscribe(queue)

    return EventSourceResponse(stream(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
