"""``homepd bench slo``'s runner: each server in turn (never two at once), warmed with one request, then its
capacity searched (``homepd.advise.campaign.capacity.CapacitySearch``) or a sweep of fixed rates, every probe an
open-loop replay (``homepd.measure.replay.replay``) of a seeded homepd trace through ``HttpTarget``, stored
like advise's probes (one result per probe, its rate in the mix) and summed up as one table."""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable

from homepd.advise.campaign.capacity import CapacitySearch, SearchSettings, curve_at_rates, probe_requests, start_rate_rps
from homepd.advise.report.slobench import KIND, client_record, headline, probe_figures, target_result
from homepd.bench.client import HttpTarget
from homepd.core.terms import RequestClass
from homepd.core.records import to_plain
from homepd.errors import ConfigError
from homepd.measure.metrics import SLO
from homepd.measure.replay import replay
from homepd.measure.trace import Trace, make_trace
from homepd.measure.trace.conversations import CHAT_TURNS
from homepd.measure.trace.model import estimate_tokens

# the searches: advise's full and quick campaigns' shapes, with a longer time budget by default (one
# server measured, not eight candidates)
FULL_SEARCH = SearchSettings(steps_per_octave=4, grow_steps=4, max_probes=6, time_budget_s=120.0, probe_s=12.0,
                             max_requests=24)
QUICK_SEARCH = SearchSettings(steps_per_octave=2, grow_steps=2, max_probes=3, time_budget_s=36.0, probe_s=6.0,
                              max_requests=12)


@dataclass(frozen=True)
class Server:
    """One server to measure: its name in the table and its base URL."""
    name: str
    url: str

    @classmethod
    def parse(cls, text: str) -> "Server":
        """``URL`` or ``NAME=URL``."""
        name, sep, url = text.partition("=")
        if not sep or "://" in name:
            name, url = "", text
        url = url.strip()
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url takes URL or NAME=URL with an http:// or https:// URL, got {text!r}")
        return cls(name.strip() or url.split("://", 1)[1].rstrip("/"), url)


@dataclass(frozen=True)
class BenchSettings:
    """What ``bench slo`` sends and how it searches.  ``source``: a trace source (``--trace-file``,
    ``--traffic``) instead of the built-in ``mix``; ``rates``: fixed rates instead of a search;
    ``n_requests``: a fixed-rate probe's length (default: the search's ``probe_requests``)."""
    slo: SLO
    mix: str = "mixed"
    source: object | None = None
    rates: tuple[float, ...] | None = None
    search: SearchSettings = FULL_SEARCH
    n_requests: int | None = None
    max_tokens: int = 32
    long_tokens: int = 400
    seed: int = 0
    start_rps: float | None = None
    all_interactive: bool = False
    unique_prefix: bool = False
    stop_below: float = 0.5
    model_name: str | None = None
    api_key: str | None = None
    temperature: float = 0.0          # what every request is sampled at (0: greedy)
    top_p: float | None = None

    @property
    def sampling(self) -> dict:
        """The sampling fields every request sends."""
        return {"temperature": self.temperature, **({"top_p": self.top_p} if self.top_p is not None else {})}

    @property
    def mix_name(self) -> str:
        return self.source.name if self.source is not None else self.mix

    def trace(self, rate_rps: float, n_requests: int, seed: int) -> Trace:
        """The probe's trace (advise's: chat counts conversations, ``ignore_eos`` on)."""
        if self.source is not None:
            trace = self.source.trace(rate_rps=rate_rps, n_requests=n_requests, seed=seed)
        else:
            rate = rate_rps / CHAT_TURNS if self.mix == "chat" else rate_rps
            trace = make_trace(self.mix, n_requests, rate, max_tokens=self.max_tokens, long_tokens=self.long_tokens,
                               ignore_eos=True, seed=seed, name=self.mix)
        if self.all_interactive:
            trace = dataclasses.replace(trace, requests=tuple(
                dataclasses.replace(r, request_class=RequestClass.INTERACTIVE) for r in trace.requests))
        return trace

    def describe(self) -> dict:
        """The run's trace description in the store."""
        return {"mix": self.mix_name, "given": self.source.describe() if self.source is not None else None,
                "rates": list(self.rates) if self.rates else "searched", "search": to_plain(self.search),
                "n_requests": self.n_requests, "max_tokens": self.max_tokens, "long_tokens": self.long_tokens,
                "seed": self.seed, "arrival": "poisson", "ignore_eos": True, "all_interactive": self.all_interactive,
                "unique_prefix": self.unique_prefix, "slo": self.slo.describe(), "sampling": self.sampling}


ProbeListener = Callable[[str, dict], None]


async def bench_server(server: Server, settings: BenchSettings, store=None, run_id: int | None = None,
                       on_probe: ProbeListener | None = None, clock=None, transport=None) -> dict:
    """Measure one server; return its ``target_result`` (each probe stored as a result when ``store``).
    ``clock`` (a replay ``Clock``) and ``transport`` (an httpx transport): tests run a server in process on
    virtual time; by default real time and the network."""
    s, mix = settings, settings.mix_name
    async with HttpTarget(server.url, api_key=s.api_key, clock=clock, transport=transport,
                          sampling=s.sampling) as http:
        http.model = s.model_name or await http.served_model()
        # why two, then the first: a recorded traffic's arrivals scale only from two requests up
        warm_trace = s.trace(1.0, 2, s.seed - 1)
        warm = await replay(http, dataclasses.replace(warm_trace, requests=warm_trace.requests[:1]), clock=clock)
        if warm[0].error:
            raise ConfigError(f"{server.name}: the warm-up request failed: {warm[0].error}")
        figures: list[dict] = []

        async def probe(rate_rps: float, n_requests: int, index: int):
            # why a seed per probe: a server that keeps each slot's KV (llama-server) would serve the same
            # documents again from its cache; every probe gets its own (the same for every server)
            seed = s.seed * 1000 + index
            http.unique_tag = f"{server.name} probe {index}" if s.unique_prefix else None
            lifecycles = await replay(http, s.trace(rate_rps, n_requests, seed), clock=clock)
            record = client_record(lifecycles, f"{mix}@{rate_rps:.3g}/s", s.slo,
                                   {"url": server.url, "model": http.model})
            if store is not None:
                store.add_result(run_id, server.name, f"{mix}@{rate_rps:.3g}/s", 0, record)
            p, fig = probe_figures(record, rate_rps, seed, s.slo)
            figures.append(fig)
            if on_probe:
                on_probe(server.name, fig)
            return p

        if s.rates:
            probes = []
            for index, rate in enumerate(s.rates):
                if any(p.rate_rps < rate and p.attainment < s.stop_below for p in probes):
                    continue  # a lower rate already failed badly: a higher one cannot pass
                probes.append(await probe(rate, s.n_requests or probe_requests(rate, s.search), index))
            curve = curve_at_rates(server.name, mix, probes, s.search.target_share)
        else:
            search = CapacitySearch(s.start_rps or _start_rate(warm[0], s), s.search)
            while (rate := search.next_rate()) is not None:
                search.record(await probe(rate, probe_requests(rate, s.search), len(search.probes)))
            curve = search.curve(server.name, mix)
    return target_result(server.name, server.url, http.model, curve, figures)


def _start_rate(warm, s: BenchSettings) -> float:
    """Where the search starts: advise's estimate, from the warm-up request's prefill speed (its prompt
    tokens over its TTFT) and decode step (its mean gap); 1 req/s when the server did not say its tokens."""
    sample = s.trace(1.0, 12, s.seed * 1000)
    prompt = sum(estimate_tokens(r.text) for r in sample) / len(sample)
    output = sum(r.max_tokens for r in sample) / len(sample)
    prefill_tok_s = warm.n_prompt_tokens / warm.ttft_s if warm.n_prompt_tokens and warm.ttft_s else None
    decode_ms = statistics.mean(warm.itl_s) * 1e3 if warm.itl_s else None
    return start_rate_rps(prefill_tok_s, decode_ms, prompt, output)


async def bench_servers(servers: list[Server], settings: BenchSettings, store=None,
                        on_probe: ProbeListener | None = None, **in_process) -> tuple[int | None, list[dict]]:
    """Every server one after another; with ``store``, one ``bench-slo`` run holding every probe and, as its
    recommendation, the table's data.  Returns (run id or None, the servers' results).  ``in_process``:
    ``bench_server``'s ``clock`` and ``transport`` (tests)."""
    config = {"servers": [dataclasses.asdict(sv) for sv in servers], "slo": to_plain(settings.slo),
              "model_name": settings.model_name}
    if store is None:
        return None, [await bench_server(sv, settings, on_probe=on_probe, **in_process) for sv in servers]
    with store.recording(KIND, config, trace=settings.describe()) as run_id:
        results = [await bench_server(sv, settings, store, run_id, on_probe, **in_process) for sv in servers]
        store.add_recommendation(run_id, {"headline": headline(results), "slo": settings.slo.describe(),
                                          "servers": results}, headline=headline(results))
    return run_id, results
