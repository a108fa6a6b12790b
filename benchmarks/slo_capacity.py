"""SLO capacity: homepd against llama-server, over HTTP, with one client, on this box.

A thin wrapper over ``homepd bench slo`` (``homepd.bench.slo``): it starts each server configuration itself
(llama-server or ``homepd serve``, one at a time, never together), waits for it, and hands it to the same
runner the command uses — warmed with one request, probed at fixed Poisson rates with a seeded mixed trace
(24 requests, every 4th a ~530-token document, 48 output tokens each, EOS ignored, a unique tag before each
user text so no server answers from an earlier probe's cached KV), timed by the client on the streamed
chunks, judged by advise's SLO (TTFT <= 4 s *and* every inter-token gap <= 100 ms, 90 % of requests).

Both servers run the same llama.cpp (llama-server is built from the llama.cpp that the installed
llama-cpp-python vendors, with homepd's CPU flags: ``benchmarks/build_llama_server.py``), the same model,
the same threads and the same number of parallel sequences; both get the same requests at the same
times through ``/v1/chat/completions`` with ``stream: true``.

    uv run python benchmarks/slo_capacity.py                       # every config, rates 0.3..0.75
    uv run python benchmarks/slo_capacity.py --only homepd-adaptive --rates 1.0 --repeats 3
    uv run python benchmarks/slo_capacity.py --classes             # long documents sent as background

Prints one row per (config, rate) and the capacity table of ``homepd bench slo``; ``-o FILE`` keeps the
results (JSON: each config's probes and figures); ``--db FILE`` also stores them as one bench-slo run
(``homepd history show``); ``slo_capacity.py merge FILE...`` prints the table over several such files.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from homepd.advise.report.slobench import render_table
from homepd.bench.slo import BenchSettings, Server as BenchServer, bench_server
from homepd.config import DEFAULT_MODEL_NAME
from homepd.measure.metrics import SLO
from homepd.models.resolve import resolve_model

TTFT_S, ITL_S, GOOD_FRACTION = 4.0, 0.100, 0.90
HERE = Path(__file__).resolve().parent


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


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """``NAME=ARGS`` (``g3=--gap-ceiling 3``): a homepd server named homepd-NAME, served with ARGS."""
    name, sep, extra = text.partition("=")
    if not sep or not name.strip() or not extra.split():
        raise argparse.ArgumentTypeError(f"--homepd-variant wants NAME=ARGS (e.g. g3=--gap-ceiling 3), got {text!r}")
    return name.strip(), tuple(extra.split())


def server_configs(threads: int, parallel: int, n_ctx: int,
                   homepd_variants: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> list[ServerConfig]:
    ls = ("-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", str(parallel), "--jinja")
    hp = ("--threads", str(threads), "--n-ctx", str(n_ctx), "--n-seq-max", str(parallel))
    return [
        ServerConfig("llama-server-default", "llama-server", ls),
        ServerConfig("homepd", "homepd", hp),  # homepd serve's defaults
        *(ServerConfig(f"llama-server-b{b}", "llama-server", (*ls, "-b", str(b), "-ub", str(b))) for b in (4, 8, 16, 32, 64)),
        ServerConfig("homepd-chunk16", "homepd", (*hp, "--chunk", "16")),
        ServerConfig("homepd-chunk32", "homepd", (*hp, "--chunk", "32")),
        ServerConfig("homepd-adaptive", "homepd", (*hp, "--chunk", "256", "--adaptive-chunk")),
        ServerConfig("homepd-adaptive-admission", "homepd", (*hp, "--chunk", "256", "--adaptive-chunk",
                                                             "--admission")),
        ServerConfig("homepd-disaggregated", "homepd", ("--mode", "disaggregated", "--n-ctx", str(n_ctx),
                                                        "--n-seq-max", str(parallel), "--chunk", "256",
                                                        "--adaptive-chunk")),
        *(ServerConfig(f"homepd-{name}", "homepd", (*hp, *extra)) for name, extra in homepd_variants),
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


async def served_model_id(client: httpx.AsyncClient, base: str) -> str:
    r = await client.get(base + "/v1/models")
    return r.json()["data"][0]["id"]


def settings_of(args, repeat: int) -> BenchSettings:
    """``homepd bench slo --rates R... --requests N --unique-prefix [--all-interactive]`` as this script's flags."""
    return BenchSettings(slo=SLO(ttft_ms=TTFT_S * 1e3, itl_ms=ITL_S * 1e3), mix="mixed", rates=tuple(args.rates),
                         n_requests=args.requests, max_tokens=args.max_tokens, long_tokens=args.long_tokens,
                         seed=args.seed + repeat, all_interactive=not args.classes, unique_prefix=True,
                         stop_below=args.stop_below, temperature=args.temperature, top_p=args.top_p)


def show_probe(name: str, fig: dict) -> None:
    print(f"{name:28s} rate {fig['rate_rps']:5.2f}/s  good {round(fig['attainment'] * fig['n_requests']):2d}/"
          f"{fig['n_requests']}  TTFT p50/p90 {_ms(fig['ttft_p50_ms'])}/{_ms(fig['ttft_p90_ms'])} ms  max-ITL "
          f"p50/p90 {_ms(fig['max_gap_p50_ms'])}/{_ms(fig['max_gap_p90_ms'])} ms  failed {fig['n_failed']}",
          flush=True)


def _ms(x):
    return "NA" if x is None else f"{x:.0f}"


async def bench_config(cfg: ServerConfig, args, log_dir: Path, store=None, run_id=None) -> list[dict]:
    server = Server(cfg, args.model, args.llama_server, log_dir)
    server.start()
    results = []
    try:
        async with httpx.AsyncClient() as client:
            await server.wait_ready(client)
        for repeat in range(args.repeats):
            name = cfg.name if args.repeats == 1 else f"{cfg.name}#{repeat}"
            results.append(await bench_server(BenchServer(name, server.base), settings_of(args, repeat), store,
                                              run_id, on_probe=show_probe))
    finally:
        server.stop()
    return results


def merge(paths: list[Path]) -> None:
    """The capacity table over several result files (e.g. interleaved invocations with different seeds)."""
    results = [r for path in paths for r in json.loads(path.read_text())["servers"]]
    print(render_table(results, SLO(ttft_ms=TTFT_S * 1e3, itl_ms=ITL_S * 1e3).describe()))


async def run_all(configs, args, log_dir: Path) -> list[dict]:
    if args.db is None:
        return [r for cfg in configs for r in await bench_config(cfg, args, log_dir)]
    from homepd.advise.report.slobench import KIND, headline
    from homepd.store import Store

    with Store.open(args.db) as store, store.recording(KIND, {"configs": [c.name for c in configs]},
                                                      trace=settings_of(args, 0).describe()) as run_id:
        results = [r for cfg in configs for r in await bench_config(cfg, args, log_dir, store, run_id)]
        store.add_recommendation(run_id, {"headline": headline(results), "servers": results,
                                          "slo": settings_of(args, 0).slo.describe()}, headline=headline(results))
    return results


def recipe_config(run: str, db: str | None) -> ServerConfig:
    """llama-server with the flags ``homepd advise export RUN --engine llama-server`` writes (one replica)."""
    import dataclasses

    from homepd.advise.export.plan import plan_from_run
    from homepd.advise.export.recipes import llama_server_args
    from homepd.store import Store

    with Store.open(db, create=False) as store:
        plan = plan_from_run(store.load_run(store.resolve_run(run), timelines=True))
    return ServerConfig("llama-server-recipe", "llama-server",
                        tuple(llama_server_args(dataclasses.replace(plan, n_replicas=None))))


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
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy; "
                                                                   "clients send 0.7)")
    ap.add_argument("--top-p", type=float, default=None, help="every request's top_p (clients send 0.9)")
    ap.add_argument("--stop-below", type=float, default=0.5,
                    help="skip a config's higher rates once a rate has fewer good requests than this fraction")
    ap.add_argument("--only", default=None, help="comma-separated config names (default: all)")
    ap.add_argument("--classes", action="store_true", help="send long documents as background (else all "
                                                           "interactive, as the capacity figure asks)")
    ap.add_argument("--db", default=None, help="also store the results as one bench-slo run in this database")
    ap.add_argument("--recipe-run", default=None, metavar="RUN",
                    help="also measure llama-server started with `homepd advise export RUN --engine llama-server`'s "
                         "flags (RUN in --recipe-db), as the config llama-server-recipe")
    ap.add_argument("--recipe-db", default=None, help="the database of --recipe-run (default: homepd's)")
    ap.add_argument("--homepd-variant", type=parse_variant, action="append", default=[], metavar="NAME=ARGS",
                    help="also homepd-NAME: homepd serve with these extra arguments (repeatable), e.g. "
                         "'g0=--gap-ceiling 0'")
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args()
    args.rates = [float(x) for x in args.rates.split(",")]
    if args.model is None:
        args.model = str(resolve_model(DEFAULT_MODEL_NAME))
    configs = server_configs(args.threads, args.parallel, args.n_ctx, tuple(args.homepd_variant))
    if args.recipe_run is not None:
        configs.append(recipe_config(args.recipe_run, args.recipe_db))
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in configs}
        if unknown:
            raise SystemExit(f"unknown config(s) {sorted(unknown)}; known: {[c.name for c in configs]}")
        configs = [c for c in configs if c.name in wanted]
    if any(c.kind == "llama-server" for c in configs) and not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} is missing: build it with uv run python benchmarks/build_llama_server.py")
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "homepd-slo-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run_all(configs, args, log_dir))
    print()
    print(render_table(results, settings_of(args, 0).slo.describe()))
    if args.output:
        args.output.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()}, "servers": results}, indent=1))


if __name__ == "__main__":
    main()
