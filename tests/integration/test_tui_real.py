"""The app on real engines: a chat round-trip on the real model, the architecture switch and a clean quit on
real worker processes, and the remote source attached to a real ``homepd serve``."""
from __future__ import annotations

import asyncio
import contextlib
import os

import psutil
import pytest

from homepd.config import EngineConfig
from homepd.tui.app import HomepdApp
from homepd.tui.screens.chat import ChatScreen
from homepd.tui.sources.embedded import EmbeddedSource
from homepd.tui.sources.remote import RemoteSource

from pilot_helpers import settle, type_text

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


@contextlib.asynccontextmanager
async def stopped_at_end(source):
    """Stop the source even when an assertion fails inside the app (quitting with q does it otherwise)."""
    try:
        yield
    finally:
        await asyncio.to_thread(source.stop)


def children() -> list[psutil.Process]:
    return psutil.Process(os.getpid()).children(recursive=True)


async def test_a_chat_round_trip_on_the_real_model_shows_ttft_and_tpot_under_the_reply(default_model_path, tmp_path):
    config = EngineConfig(model=str(default_model_path), n_ctx=512, n_seq_max=2)
    source = EmbeddedSource(config, db=str(tmp_path / "runs.db"))
    app = HomepdApp(source, tick_interval_s=None, chat_max_tokens=12)
    async with app.run_test(size=(120, 40)) as pilot, stopped_at_end(source):
        await settle(app, pilot)
        assert app.state.is_ready, app.state.error
        await pilot.press("c")
        await type_text(pilot, "What is the capital of France?")
        await pilot.press("enter")
        await settle(app, pilot)
        turn = app.state.turns[0]
        assert turn.error is None and turn.reply.strip()
        assert turn.stats.ttft_ms > 0 and turn.stats.tpot_ms > 0 and turn.stats.mode == "colocated"
        shown = str(app.screen.query("#chat-log Static").first().render())
        assert isinstance(app.screen, ChatScreen) and turn.reply.strip()[:10] in shown
        assert (f"TTFT {turn.stats.ttft_ms:.0f} ms (0/{turn.stats.n_prompt_tokens} prompt tok cached) · "
                f"TPOT {turn.stats.tpot_ms:.1f} ms · colocated") in shown
        # later turns resend the conversation: the worker reuses what it kept of the earlier turns
        for question in ("And of Spain?", "And of Italy?"):
            await type_text(pilot, question)
            await pilot.press("enter")
            await settle(app, pilot)
        later = app.state.turns[2].stats
        assert app.state.turns[2].error is None and later.n_prompt_tokens > turn.stats.n_prompt_tokens
        assert later.n_cached_tokens >= turn.stats.n_prompt_tokens
        shown = "\n".join(str(s.render()) for s in app.screen.query("#chat-log Static"))
        assert f"({later.n_cached_tokens}/{later.n_prompt_tokens} prompt tok cached)" in shown
        app.request_tick()
        await settle(app, pilot)
        assert app.state.tick.architecture.workers[0].role == "colocated"
        assert app.state.tick.requests[-1].n_output_tokens == later.n_output_tokens
        await pilot.press("escape", "q")
        await settle(app, pilot)
    assert app.return_code == 0 and children() == []


@pytest.mark.whole_box  # switches to disaggregated
async def test_the_architecture_switch_restarts_real_workers_and_quit_leaves_none(tmp_path):
    source = EmbeddedSource(EngineConfig(backend="fake", n_ctx=1024), db=str(tmp_path / "runs.db"))
    app = HomepdApp(source, tick_interval_s=None, chat_max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot, stopped_at_end(source):
        await settle(app, pilot)
        first = {p.pid for p in children()}
        await pilot.press("c", "ctrl+t")
        await settle(app, pilot)
        assert app.state.description.startswith("embedded engine: disaggregated")
        assert not first & {p.pid for p in children()}            # the colocated worker is gone
        await pilot.press(*"hello", "enter")
        await settle(app, pilot)
        stats = app.state.turns[0].stats
        assert stats.mode == "disaggregated" and stats.kv_bytes > 0 and stats.kv_transfer_ms is not None
        await pilot.press("ctrl+b")                                # the long prompt, sized to fit n_ctx
        await settle(app, pilot)
        assert app.state.last_background.error is None and app.state.last_background.n_prompt_tokens > 256
        app.request_tick()
        await settle(app, pilot)
        arch = app.state.tick.architecture
        assert [w.role for w in arch.workers] == ["prefill", "decode"] and arch.kv_arena.capacity_bytes > 0
        assert arch.kv_arena.max_extents == source.config.n_extents and arch.kv_arena.n_extents == 0  # all done
        await pilot.press("ctrl+q")
        await settle(app, pilot)
    assert app.return_code == 0 and children() == []


def test_the_remote_source_follows_a_running_service(default_model_path, tmp_path):
    from test_serve_harness import ServeProcess

    serve = ServeProcess(tmp_path, "--model", str(default_model_path), "--n-ctx", "512").wait_ready()
    source = RemoteSource(serve.url, EngineConfig(), api_key=serve.api_key, sample_hardware=False)
    try:
        source.start(lambda message: None)
        assert source.wait_live(30)
        pieces: list[str] = []
        stats = source.chat([{"role": "user", "content": "Say hello."}], pieces.append, max_tokens=6)
        assert "".join(p.text for p in pieces) and stats.ttft_ms > 0 and stats.n_output_tokens >= 1
        assert stats.mode == "colocated" and stats.finish_reason in ("stop", "length")
        tick = source.tick()
        assert tick.architecture.mode == "colocated" and tick.architecture.workers[0].alive
    finally:
        source.stop()
        assert serve.terminate() == 0
