"""SLO capacity: homepd against llama-server, over HTTP, with one client, on this box.

The highest Poisson arrival rate at which at least 90% of the requests of a seeded mixed trace (24 requests,
every 4th a ~530-token document, 48 output tokens each, EOS ignored) meet TTFT ≤ 4 s *and* every
inter-token gap ≤ 100 ms, measured by the client's clock on the streamed chunks.

Both servers run the same llama.cpp (llama-server is built from the llama.cpp that the installed
llama-cpp-python vendors, with homepd's CPU flags: ``benchmarks/build_llama_server.py``), the same model,
the same threads and the same number of parallel sequences; both get the same requests at the same
times through ``/v1/chat/completions`` with ``stream: true``.  Servers run one after another, never
together; each is warmed with one request first.

    uv run python benchmarks/slo_capacity.py                       # every config, rates 0.5..1.25
    uv run python benchmarks/slo_capacity.py --only homepd-adaptive --rates 1.0 --repeats 3
    uv run python benchmarks/slo_capacity.py --classes             # long documents sent as background

Prints one row per (config, rate) and a capacity table; ``-o FILE`` keeps every request's figures (JSON);
``slo_capacity.py merge FILE...`` prints the table over several such files (interleaved invocations).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from homepd.measure.trace import make_trace
from homepd.config import DEFAULT_MODEL_NAME
from homepd.core.stats import percentile
from homepd.models.resolve import resolve_model

TTFT_S, ITL_S, GOOD_FRACTION = 4.0, 0.100, 0.90
HERE = Path(__file__).resolve().parent


@dataclass
class Outcome:
    index: int
    kind: str
    request_class: str
    arrival_s: float
    status: int = 0
    ttft_s: float | None = None
    max_itl_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    n_chunks: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def good(self) -> bool:
        return (self.status == 200 and self.error is None and self.ttft_s is not None and self.ttft_s <= TTFT_S
                and (self.max_itl_s or 0.0) <= ITL_S)


@dataclass
class RunResult:
    config: str
    rate: float
    repeat: int
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def n_good(self) -> int:
        return sum(o.good for o in self.outcomes)

    def summary(self) -> dict:
        ttfts = sorted(o.ttft_s for o in self.outcomes if o.ttft_s is not None)
        itls = sorted(o.max_itl_s for o in self.outcomes if o.max_itl_s is not None)
        by_kind = {}
        for kind in ("short", "long"):
            rows = [o for o in self.outcomes if o.kind == kind]
            by_kind[kind] = f"{sum(o.good for o in rows)}/{len(rows)}"
        gaps = sorted(g for o in self.outcomes if o.request_class == "interactive" for g in o.itls_s)
        background = [o for o in self.outcomes if o.request_class == "background"]
        return {"good": self.n_good, "interactive_itl_p99_ms": _ms(percentile(gaps, 99)),
                "background_done": f"{sum(o.n_chunks > 0 and o.error is None for o in background)}/{len(background)}", "n": len(self.outcomes), **{f"good_{k}": v for k, v in by_kind.items()},
                "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p90_ms": _ms(percentile(ttfts, 90)),
                "max_itl_p50_ms": _ms(percentile(itls, 50)), "max_itl_p90_ms": _ms(percentile(itls, 90)),
                "rejected": sum(o.status == 503 for o in self.outcomes),
                "errors": sum(o.status not in (200, 503) or o.error is not None for o in self.outcomes)}


def _ms(x):
    return None if x is None else round(x * 1e3)


# servers ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerConfig:
    name: str
    kind: str                 # "llama-server" | "homepd"
    args: tuple[str, ...]


def server_configs(threads: int, parallel: int, n_ctx: int) -> list[ServerConfig]:
    ls = ("-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", str(parallel), "--jinja")
    hp = ("--threads", str(threads), "--n-ctx", str(n_ctx), "--n-seq-max", str(parallel))
    return [
        ServerConfig("llama-server-default", "llama-server", ls),
        *(ServerConfig(f"llama-server-b{b}", "llama-server", (*ls, "-b", str(b), "-ub", str(b))) for b in (4, 8, 16, 32, 64)),
        ServerConfig("homepd-chunk16", "homepd", (*hp, "--chunk", "16")),
        ServerConfig("homepd-chunk32", "homepd", (*hp, "--chunk", "32")),
        ServerConfig("homepd-adaptive", "homepd", (*hp, "--chunk", "256", "--adaptive-chunk")),
        ServerConfig("homepd-adaptive-admission", "homepd", (*hp, "--chunk", "256", "--adaptive-chunk",
                                                             "--admission")),
        ServerConfig("homepd-disaggregated", "homepd", ("--mode", "disaggregated", "--n-ctx", str(n_ctx),
                                                        "--n-seq-max", str(parallel), "--chunk", "256",
                                                        "--adaptive-chunk")),
    ]


class Server:
    def __init__(self, config: ServerConfig, model: str, llama_server: Path, log_dir: Path):
        self.config, self.model, self.llama_server = config, model, llama_server
        self.port = free_port()
        self.log = open(log_dir / f"{config.name}.log", "w")
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.config.kind == "llama-server":
            cmd = [str(self.llama_server), "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                   *self.config.args]
        else:
            cmd = [sys.executable, "-m", "homepd.main", "serve", "--model", self.model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--max-queue", "64", *self.config.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_ready(self, client: httpx.AsyncClient, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.config.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                # homepd: /ready (model loaded and warmed); llama-server: /health (503 while loading)
                r = await client.get(self.base + ("/ready" if self.config.kind == "homepd" else "/health"),
                                     timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        raise SystemExit(f"{self.config.name} not ready in {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# the client ----------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, base: str, body: dict, headers: dict, out: Outcome) -> None:
    t0 = time.monotonic()
    last = None
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers,
                                 timeout=httpx.Timeout(600.0)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:200]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"].get("prompt_tokens")
                choices = chunk.get("choices") or []
                if not choices or not (choices[0].get("delta") or {}).get("content"):
                    continue
                now = time.monotonic()
                if last is None:
                    out.ttft_s = now - t0
                else:
                    gap = now - last
                    out.itls_s.append(gap)
                    out.max_itl_s = gap if out.max_itl_s is None else max(out.max_itl_s, gap)
                last = now
                out.n_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def run_trace(client: httpx.AsyncClient, base: str, model_id: str, trace, classes: bool, name: str,
                    rate: float, repeat: int) -> RunResult:
    result = RunResult(name, rate, repeat)
    tasks = []
    start = time.monotonic()
    for i, req in enumerate(trace):
        delay = start + req.arrival_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        klass = req.request_class if classes else "interactive"
        out = Outcome(i, req.kind, klass, req.arrival_s)
        result.outcomes.append(out)
        # a tag unique to this run and request at the start of the user's text: prompts repeat in the corpus, and
        # llama-server would serve a repeated one from a slot's KV (homepd has no prefix cache); the chat
        # template's own prefix stays shared, as it would be
        tag = f"[run {rate:g}/{repeat} request {i}] "
        messages = [dict(m, content=tag + m["content"]) if m["role"] == "user" else dict(m) for m in req.messages]
        body = {"model": model_id, "messages": messages, "max_tokens": req.max_tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        headers = {"X-Homepd-Class": klass}
        tasks.append(asyncio.create_task(one_request(client, base, body, headers, out)))
    await asyncio.gather(*tasks)
    return result


async def served_model_id(client: httpx.AsyncClient, base: str) -> str:
    r = await client.get(base + "/v1/models")
    return r.json()["data"][0]["id"]


async def bench_server(cfg: ServerConfig, args, traces: dict, log_dir: Path) -> list[RunResult]:
    server = Server(cfg, args.model, args.llama_server, log_dir)
    results = []
    server.start()
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
            await server.wait_ready(client)
            model_id = await served_model_id(client, server.base)
            warm = Outcome(-1, "short", "interactive", 0.0)
            await one_request(client, server.base, {"model": model_id, "messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 8, "stream": True, "ignore_eos": True}, {}, warm)
            for repeat in range(args.repeats):
                for rate in args.rates:
                    worse = [r for r in results if r.rate < rate and r.n_good < args.stop_below * len(r.outcomes)]
                    if worse:  # a lower rate already failed badly: higher ones cannot pass
                        continue
                    res = await run_trace(client, server.base, model_id, traces[rate, repeat], args.classes, cfg.name,
                                          rate, repeat)
                    results.append(res)
                    s = res.summary()
                    print(f"{cfg.name:28s} rate {rate:5.2f}/s  rep {repeat}  good {s['good']:2d}/{s['n']} "
                          f"(short {s['good_short']}, long {s['good_long']})  TTFT p50/p90 {s['ttft_p50_ms']}/"
                          f"{s['ttft_p90_ms']} ms  max-ITL p50/p90 {s['max_itl_p50_ms']}/{s['max_itl_p90_ms']} ms  "
                          f"interactive ITL p99 {s['interactive_itl_p99_ms']} ms  background done "
                          f"{s['background_done']}  rejected {s['rejected']}  errors {s['errors']}", flush=True)
            if cfg.kind == "homepd":
                r = await client.get(server.base + "/metrics")
                keep = [ln for ln in r.text.splitlines() if ln.startswith(("homepd_ttft_prediction",
                        "homepd_admission_decisions", "homepd_routed_prompts"))]
                print("   " + "\n   ".join(keep), flush=True)
    finally:
        server.stop()
    return results


def capacity(results: list[RunResult], name: str, rates: list[float]) -> tuple[float | None, dict]:
    """Highest rate r such that at r and every lower rate the median fraction of good requests is ≥ 90%."""
    medians = {}
    for rate in rates:
        runs = [r for r in results if r.config == name and r.rate == rate]
        if runs:
            medians[rate] = statistics.median(r.n_good / len(r.outcomes) for r in runs)
    best = None
    for rate in sorted(medians):
        if medians[rate] < GOOD_FRACTION:
            break
        best = rate
    return best, medians


def print_table(results: list[RunResult], names: list[str], rates: list[float], n_requests: int) -> dict:
    print(f"\nSLO capacity: highest rate with >= {GOOD_FRACTION:.0%} of requests at TTFT <= {TTFT_S:g} s and every "
          f"ITL <= {ITL_S * 1e3:g} ms (per rate: the median of good requests over the runs, then each run)")
    print(f"{'config':28s} {'capacity':>9s}  " + "  ".join(f"{r:>14g}/s" for r in rates))
    caps = {}
    for name in names:
        cap, medians = capacity(results, name, rates)
        caps[name] = cap
        cells = []
        for r in rates:
            runs = [x.n_good for x in results if x.config == name and x.rate == r]
            cells.append(f"{round(medians[r] * n_requests):>2d} ({','.join(map(str, runs))})" if r in medians
                         else "-")
        print(f"{name:28s} {('%g/s' % cap) if cap else '< min':>9s}  " + "  ".join(f"{c:>16s}" for c in cells))
    ls_best = max((c for n, c in caps.items() if n.startswith("llama-server") and c), default=None)
    hp_best = max((c for n, c in caps.items() if n.startswith("homepd") and c), default=None)
    if ls_best and hp_best:
        print(f"\nhomepd best {hp_best:g}/s vs llama-server best {ls_best:g}/s: {hp_best / ls_best:.2f}x")
    return caps


def merge(paths: list[Path]) -> None:
    """The capacity table over several result files (e.g. interleaved invocations with different seeds)."""
    results, names, rates, n = [], [], set(), 24
    for path in paths:
        data = json.loads(path.read_text())
        n = data["args"]["requests"]
        for run in data["runs"]:
            res = RunResult(run["config"], run["rate"], run["repeat"],
                            [Outcome(**{k: v for k, v in o.items()}) for o in run["outcomes"]])
            results.append(res)
            rates.add(res.rate)
            if res.config not in names:
                names.append(res.config)
    print_table(results, names, sorted(rates), n)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "merge":
        return merge([Path(p) for p in sys.argv[2:]])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: homepd's embedded default model)")
    ap.add_argument("--llama-server", type=Path, default=HERE.parent / ".cache/llama-server/build/bin/llama-server")
    ap.add_argument("--rates", default="0.3,0.4,0.5,0.6,0.75", help="arrival rates (requests/s), comma-separated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--long-tokens", type=int, default=470, help="estimated tokens of a long prompt's text")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4, help="llama-server -np and homepd --n-seq-max")
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-below", type=float, default=0.5,
                    help="skip a config's higher rates once a rate has fewer good requests than this fraction")
    ap.add_argument("--only", default=None, help="comma-separated config names (default: all)")
    ap.add_argument("--classes", action="store_true", help="send long documents as background (else all "
                                                           "interactive, as the capacity figure asks)")
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args()
    args.rates = [float(x) for x in args.rates.split(",")]
    if args.model is None:
        args.model = str(resolve_model(DEFAULT_MODEL_NAME))
    configs = server_configs(args.threads, args.parallel, args.n_ctx)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in configs}
        if unknown:
            raise SystemExit(f"unknown config(s) {sorted(unknown)}; known: {[c.name for c in configs]}")
        configs = [c for c in configs if c.name in wanted]
    if any(c.kind == "llama-server" for c in configs) and not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} is missing: build it with uv run python benchmarks/build_llama_server.py")
    # why a seed per (rate, repeat): llama-server keeps each slot's KV and reuses a matching prefix, so the same
    # documents again would be served from its cache; every run gets its own documents (the same for every server)
    traces = {(rate, rep): make_trace("mixed", args.requests, rate, max_tokens=args.max_tokens,
                                      long_tokens=args.long_tokens, seed=args.seed + 1000 * rep + i)
              for rep in range(args.repeats) for i, rate in enumerate(args.rates)}
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "homepd-slo-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    for cfg in configs:
        results += asyncio.run(bench_server(cfg, args, traces, log_dir))
    caps = print_table(results, [c.name for c in configs], args.rates, args.requests)
    if args.output:
        args.output.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
                                           "runs": [{**asdict(r), "summary": r.summary()} for r in results],
                                           "capacity": caps}, indent=1))


if __name__ == "__main__":
    main()
