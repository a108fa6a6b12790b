"""The app attached to a running ``homepd serve`` shows what the embedded app shows: the service's step stream
(``steps`` on ``/events``) gives the dashboard each request's ITL max, the interference index and stall
attribution (fake backend, real worker, real HTTP, the app driven by Pilot)."""
from __future__ import annotations

import asyncio
import json

import pytest

from homepd.config import EngineConfig
from homepd.tui.app import HomepdApp
from homepd.tui.sources.remote import RemoteSource

from pilot_helpers import settle
from test_serve_harness import ServeProcess

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
# 32,000 prompt tokens on the fake backend (a byte each), prefilled in one step: the longest of a's gaps but
# for a few hiccups of a loaded box (tens of ms), and the largest 16 of them are what a request event carries
DOCUMENT = "word " * 6400


def stream_with_a_prompt_beside_it(proc: ServeProcess) -> tuple[str, str]:
    """Stream a (long), and once it streams send b, whose prompt is prefilled in one of a's steps; a is
    cancelled (its connection closed) once b is done.  (a's id, b's id)."""
    with proc.client() as client:
        model = client.get("/status").json()["models"][0]
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60_000, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=chat) as a:
            lines = a.iter_lines()  # why kept referenced: a dropped iterator closes the stream when collected
            a_id = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])["id"]
            b = client.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": DOCUMENT}], "max_tokens": 4})
            assert b.status_code == 200, b.text
            running = client.get("/status").json()["engine"]["requests"]
            assert a_id in running.get("decoding", ()), f"a ended before b was served: {running}"
        # leaving the block closes a's connection mid-stream: the service cancels it
    return a_id, b.json()["id"]


async def test_the_attached_app_shows_the_service_s_itl_max_interference_and_stalls(tmp_path):
    # an ITL budget of 1 µs makes every gap a stall the dashboard attributes
    # one pool: b's 32,000-token prompt is longer than a stream of 65,536 / 8 (--kv-layout auto's here)
    proc = ServeProcess(tmp_path, "--backend", "fake", "--n-ctx", "65536", "--max-tokens", "60000", "--kv-layout",
                        "unified", "--no-adaptive-chunk", "--chunk", "32768", "--itl-budget", "0.001").wait_ready()
    source = RemoteSource(proc.url, EngineConfig(), api_key=proc.api_key, sample_hardware=False)
    app = HomepdApp(source, tick_interval_s=None)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(app, pilot)
            assert app.state.is_ready, app.state.error
            assert await asyncio.to_thread(source.wait_live, 30.0)   # its first steps event came before it
            a_id, b_id = await asyncio.to_thread(stream_with_a_prompt_beside_it, proc)
            assert await asyncio.to_thread(source.wait_finished, (a_id, b_id), 30.0)  # and their steps arrived
            app.request_tick()
            await settle(app, pilot)
            rows = {row.request_id: row for row in app.state.requests}
            for rid in (a_id, b_id):
                assert rows[rid].itl_max_ms is not None and rows[rid].itl_max_ms > 0
                assert rows[rid].stall.split(" ms")[0].isdigit(), rows[rid].stall   # "N ms ← prompt" or "N ms gap"
            # b's prompt shared a step of a: the step carrying it reached the app, the index compares it with
            # a's lone steps, and one of a's largest gaps (the ones a request event carries) is b's
            assert any(dict(step.prefill).get(b_id, 0) >= 32000 for step in source.steps.steps)
            assert any(s.request_id == a_id and s.worst is not None and s.worst.request_id == b_id
                       for s in source.steps.stalls), source.steps.stalls
            point = app.state.points[-1]
            assert point.interference is not None and point.itl_ms is not None and point.tok_s > 0
            await pilot.press("q")
            await settle(app, pilot)
    finally:
        await asyncio.to_thread(source.stop)
        assert proc.terminate() == 0
