"""``homepd bench slo``'s client, search driving and table, against an in-process OpenAI-compatible server
(an httpx transport) on virtual time: every figure is exact, nothing waits in real time."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from homepd.advise.campaign.capacity import Probe
from homepd.advise.campaign.capacity import curve_at_rates
from homepd.advise.report.slobench import render_table
from homepd.bench.client import HttpTarget
from homepd.bench.slo import BenchSettings, Server, bench_server, bench_servers
from homepd.cli.history import render_run
from homepd.core.lifecycle import RequestState
from homepd.core.records import FinishReason
from homepd.core.sampling import SamplingParams
from homepd.errors import ConfigError
from homepd.main import main
from homepd.measure.metrics import SLO
from homepd.store import Store

from test_trace import FakeClock


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def text_chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


class VirtualServer:
    """An OpenAI-compatible server on ``clock``: the first chunk ``ttft_s`` after the request, then one
    chunk per output token, ``gap_per_stream_s`` times the streams in flight apart (a shared decoder)."""

    def __init__(self, clock: FakeClock, ttft_s: float = 0.05, gap_per_stream_s: float = 0.03, script=None):
        self.clock, self.ttft_s, self.gap_per_stream_s, self.script = clock, ttft_s, gap_per_stream_s, script
        self.in_flight, self.requests = 0, []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "virtual-model"}]})
        body = json.loads(request.content)
        self.requests.append((request.url.path, body, request.headers))
        if self.script is not None:
            return self.script(body)
        return httpx.Response(200, content=self.stream(body), headers={"content-type": "text/event-stream"})

    async def stream(self, body):
        n = body["max_tokens"]
        self.in_flight += 1
        await self.clock.sleep_until(self.clock.now() + self.ttft_s)
        for i in range(n):
            if i:
                await self.clock.sleep_until(self.clock.now() + self.gap_per_stream_s * self.in_flight)
            if i == n - 1:
                # why before the last yield: the client stops reading at [DONE], so code after it may never run
                self.in_flight -= 1
            yield sse(text_chunk("x", "length" if i == n - 1 else None))
        yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
        yield b"data: [DONE]\n\n"


def on(clock: FakeClock, coro):
    return asyncio.run(clock.run(coro))


async def one_chat(target: HttpTarget, **kw):
    async with target:
        stream = await target.submit(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                                     params=SamplingParams(max_tokens=3, ignore_eos=True), **kw)
        return await stream.collect()


def test_the_client_times_the_first_text_chunk_as_ttft_and_the_gaps_between_text_chunks():
    clock = FakeClock()

    async def body():
        for at_s, obj in ((0.3, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),  # no text: no token
                          (0.5, text_chunk("a")), (0.55, text_chunk("b")), (0.75, text_chunk("c", "length")),
                          (0.75, {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3,
                                                           "prompt_tokens_details": {"cached_tokens": 4}}})):
            await clock.sleep_until(at_s)
            yield sse(obj)
        yield b"data: [DONE]\n\n"

    server = VirtualServer(clock, script=lambda _body: httpx.Response(200, content=body()))
    target = HttpTarget("http://box:8000/v1/", model="m", clock=clock, transport=server.transport())
    lc = on(clock, one_chat(target, request_class="background"))
    assert target.base_url == "http://box:8000"  # a trailing /v1 is dropped
    assert lc.state is RequestState.FINISHED and lc.error is None
    assert lc.ttft_s == pytest.approx(0.5) and lc.itl_s == pytest.approx([0.05, 0.2])
    assert (lc.n_prompt_tokens, lc.n_cached_tokens, lc.finish_reason) == (11, 4, FinishReason.LENGTH)
    path, body_sent, headers = server.requests[0]
    assert path == "/v1/chat/completions" and headers["x-homepd-class"] == "background"
    assert body_sent["stream"] is True and body_sent["stream_options"] == {"include_usage": True}
    assert (body_sent["model"], body_sent["max_tokens"], body_sent["ignore_eos"]) == ("m", 3, True)


@pytest.mark.parametrize("answer, words", [
    (lambda _b: httpx.Response(503, text="server busy: queue full"), "HTTP 503: server busy: queue full"),
    (lambda _b: httpx.Response(200, content=sse(text_chunk("a")) + sse({"error": {"message": "worker died"}})),
     "worker died"),
    (lambda _b: httpx.Response(200, content=b"data: [DONE]\n\n"), "without any text"),
    (lambda _b: httpx.Response(200, content=b"data: {not json\n\n"), "JSONDecodeError"),
])
def test_a_refused_request_or_a_broken_stream_is_a_failed_request_with_the_server_s_words(answer, words):
    clock = FakeClock()
    target = HttpTarget("http://box:8000", model="m", clock=clock,
                        transport=VirtualServer(clock, script=answer).transport())
    lc = on(clock, one_chat(target))
    assert lc.state is RequestState.FAILED and words in lc.error


def test_a_raw_prompt_goes_to_completions_and_a_unique_tag_precedes_every_user_text():
    clock = FakeClock()
    server = VirtualServer(clock, script=lambda _b: httpx.Response(
        200, content=sse({"choices": [{"index": 0, "text": "t", "finish_reason": "stop"}]}) + b"data: [DONE]\n\n"))

    async def run():
        async with HttpTarget("http://box", model="m", clock=clock, transport=server.transport(),
                              unique_tag="probe 2") as target:
            first = await (await target.submit("raw text", params=SamplingParams(max_tokens=1))).collect()
            await (await target.submit(messages=[{"role": "system", "content": "s"},
                                                 {"role": "user", "content": "q"}])).collect()
            return first

    lc = on(clock, run())
    assert lc.state is RequestState.FINISHED and lc.finish_reason is FinishReason.STOP
    (p1, b1, _), (p2, b2, _) = server.requests
    assert (p1, b1["prompt"]) == ("/v1/completions", "[probe 2 request 0] raw text")
    assert p2 == "/v1/chat/completions"
    assert b2["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "[probe 2 request 1] q"}]


def test_the_model_name_is_the_first_of_v1_models_and_a_server_without_one_is_a_clear_error():
    clock = FakeClock()

    async def ask(transport):
        async with HttpTarget("http://box", transport=transport) as target:
            return await target.served_model()

    assert asyncio.run(ask(VirtualServer(clock).transport())) == "virtual-model"
    with pytest.raises(ConfigError, match="pass --model-name"):
        asyncio.run(ask(httpx.MockTransport(lambda r: httpx.Response(404, text="no"))))


SETTINGS = dict(slo=SLO(ttft_ms=4000, itl_ms=100), mix="short", max_tokens=8, all_interactive=True)


def test_the_search_brackets_then_bisects_to_where_the_shared_decoder_s_gaps_pass_100_ms(tmp_path):
    clock = FakeClock()
    server = VirtualServer(clock, gap_per_stream_s=0.03)  # 4 streams at once: every gap 120 ms
    settings = BenchSettings(**SETTINGS, start_rps=4.0)
    with Store.open(tmp_path / "runs.db") as store:
        run_id = store.begin_run("bench-slo", {})
        result = on(clock, bench_server(Server("virtual", "http://box"), settings, store, run_id, clock=clock,
                                        transport=server.transport()))
        store.finish_run(run_id)
        run = store.get_run(run_id, timelines=False)
    probes = result["probes"]
    passing = [p["rate_rps"] for p in probes if p["attainment"] >= 0.9]
    failing = [p["rate_rps"] for p in probes if p["attainment"] < 0.9]
    assert passing and failing and result["model"] == "virtual-model"
    assert result["capacity_rps"] == max(r for r in passing if r < min(failing))
    assert result["capacity_rps"] + result["spread_rps"] == min(failing)
    assert result["spread_rps"] <= result["capacity_rps"] * (2 ** 0.25 - 1) + 1e-9  # bisected to one grid step
    assert result["decided_by"] == "every gap <= 100 ms"
    assert result["at"]["rate_rps"] == result["capacity_rps"] and result["at"]["ttft_p50_ms"] == pytest.approx(50)
    # one stored result per probe, its rate in the mix, as advise stores its probes
    assert {r["candidate"] for r in run["results"]} == {"virtual"}
    assert sorted(r["mix"] for r in run["results"]) == sorted(f"short@{p['rate_rps']:.3g}/s" for p in probes)
    assert {r["mode"] for r in run["results"]} == {"http-client"}


def test_fixed_rates_are_stored_as_one_run_and_history_show_prints_the_table_and_curve(tmp_path):
    clock = FakeClock()
    server = VirtualServer(clock, gap_per_stream_s=0.03)
    settings = BenchSettings(**SETTINGS, rates=(0.5, 64.0, 128.0), n_requests=10, stop_below=0.5)
    with Store.open(tmp_path / "runs.db") as store:
        run_id, results = on(clock, bench_servers([Server("virtual", "http://box")], settings, store, clock=clock,
                                                  transport=server.transport()))
        stored = store.get_run(run_id, timelines=False)
    (result,) = results
    rates = [p["rate_rps"] for p in result["probes"]]
    assert rates == [0.5, 64.0]  # 128/s skipped: 64/s met the SLO for under half of its requests
    assert result["capacity_rps"] == 0.5 and result["spread_rps"] == 63.5
    assert stored["kind"] == "bench-slo" and stored["status"] == "complete"
    assert [r["mix"] for r in stored["results"]] == ["short@0.5/s", "short@64/s"]
    text = render_run(stored)
    assert "SLO capacity" in text and "0.5 req/s" in text and "0.5 .. 64" in text
    assert "attainment per rate: 0.5/s 100%  64/s " in text and "every gap <= 100 ms" in text


def test_the_capacity_of_fixed_rates_is_the_highest_pass_below_the_lowest_failure():
    def probe(rate, attainment, misses=None):
        return Probe(rate, 10, attainment, None, 0, 10 / rate, {}, misses or {})

    curve = curve_at_rates("s", "mixed", [probe(0.5, 1.0), probe(1.0, 0.8, {"interactive TTFT <= 4 s": 2}),
                                            probe(2.0, 0.9), probe(4.0, 0.2, {"every gap <= 100 ms": 8})], 0.9)
    assert (curve.capacity_rps, curve.spread_rps) == (0.5, 0.5)  # the pass at 2/s above a failure does not count
    assert curve.decided_by == "every gap <= 100 ms"
    none_failed = curve_at_rates("s", "mixed", [probe(1.0, 1.0), probe(2.0, 0.95)], 0.9)
    assert (none_failed.capacity_rps, none_failed.spread_rps) == (2.0, None)
    assert "nothing failed up to 2" in none_failed.decided_by
    all_failed = curve_at_rates("s", "mixed", [probe(1.0, 0.5, {"every request finishes": 5})], 0.9)
    assert all_failed.capacity_rps is None and all_failed.decided_by == "every request finishes"
    assert "< lowest rate" in render_table([{"name": "s", "url": "u", "model": "m", "mix": "mixed",
                                              "target_share": 0.9, "capacity_rps": None, "spread_rps": None,
                                              "decided_by": "every request finishes", "probes": [], "at": None}])


@pytest.mark.parametrize("argv, words", [
    (["--url", "ftp://box"], "http:// or https://"),
    (["--url", "http://box", "--rates", "0,1"], "--rates needs positive rates"),
    (["--url", "http://box", "--rates", "one"], "comma-separated"),
    (["--url", "http://box", "--max-probes", "0"], "--max-probes must be >= 1"),
])
def test_bad_bench_slo_flags_are_refused_naming_the_flag(argv, words, capsys):
    assert main(["bench", "slo", "--no-store", *argv]) == 1
    assert words in capsys.readouterr().err


def test_a_trace_file_is_replayed_at_the_probe_s_rate_with_the_server_s_own_prompts(tmp_path):
    from homepd.advise.campaign.traffic import file_source
    from homepd.measure.trace import make_trace, write_trace

    write_trace(make_trace("rag", 3, 1.0, max_tokens=4, seed=3), tmp_path / "t.jsonl")
    clock = FakeClock()
    server = VirtualServer(clock, gap_per_stream_s=0.001)
    settings = BenchSettings(slo=SLO(), source=file_source(tmp_path / "t.jsonl"), rates=(8.0,), n_requests=10)
    result = on(clock, bench_server(Server("virtual", "http://box"), settings, clock=clock,
                                    transport=server.transport()))
    (probe,) = result["probes"]
    assert (result["mix"], probe["n_requests"], probe["attainment"]) == ("trace", 10, 1.0)
    # the warm-up and the ten requests: the file's three requests repeated, each with its max_tokens
    assert len(server.requests) == 11 and {b["max_tokens"] for _, b, _ in server.requests} == {4}
