"""Two models alternating on one ``homepd serve``: load time, time to first token after a swap, evictions.

Starts ``homepd serve`` with SmolLM2-135M and Gemma 3 270M (``--model`` twice) and a memory budget that holds
the larger one alone (its estimate, as the service plans a first load, plus 16 MiB), or, with ``--room``, both.
Then a two-model alternating trace: ``--rounds`` times A then B, one short streamed chat each (temperature 0,
``--max-tokens`` tokens) behind the same ~300-token system prompt, then a second one on the model just loaded,
one after the other.  The ``cached`` column is the prompt tokens served from a reused prefix: after a swap back,
those the model's kept KV store restored (its prefixes saved there when it was evicted).  Meanwhile a thread asks ``/health`` and ``/v1/models`` every
20 ms, to show that they answer during the loads.  It prints per request the model, whether it swapped, its
TTFT as the client saw it (request sent -> first content token) and the load it waited for; per model its loads,
evictions, load seconds and footprint measured against estimated; and the listings' latency during loads.

    uv run python benchmarks/models_swap.py [--rounds 3] [--threads 2] [--room] [--json]

Not run against llama-swap or Ollama: neither is installed on this box, and the box has no network to fetch
them; the figures they would be compared with are the same three (load, TTFT after a swap, evictions).
Figures go in the report (docs/serve.md, "Several models"), not in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from homepd.config import EngineConfig
from homepd.launch import prepare
from homepd.models.resolve import resolve_model
from homepd.serve.footprints import estimate_for
from homepd.serve.loader import MULTI_MODEL_KV_STORE_BYTES

MODELS = ("smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m")
# a home assistant's context, as Home Assistant sends before every question (about 300 tokens): after a swap back
# it is restored from the model's kept KV store instead of prefilled again
CONTEXT = ("You are a voice assistant for a home. Devices: " + ", ".join(
    f"{room} light (on), {room} thermostat (20 C), {room} window (closed)"
    for room in ("kitchen", "living room", "bedroom", "bathroom", "office", "hall", "garage", "garden")) + ".")
QUESTION = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Name one colour of the rainbow."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def estimate(name: str, n_ctx: int) -> int:
    config = EngineConfig(model=str(resolve_model(name, progress=False)), n_ctx=n_ctx,
                          kv_store_bytes=MULTI_MODEL_KV_STORE_BYTES).validated()
    return estimate_for(config, prepare(config, pull=False, progress=False))


def ttft_of(client: httpx.Client, model: str, max_tokens: int) -> tuple[float, str, int]:
    """Seconds from sending the request to its first content token, the text, and the prompt tokens served
    from a reused prefix (the context's, or the KV store's)."""
    t0, first, text, cached = time.monotonic(), None, [], 0
    body = {"model": model, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            choices = chunk.get("choices") or [{}]
            piece = (choices[0].get("delta") or {}).get("content")
            if piece:
                first = first or time.monotonic()
                text.append(piece)
    return (first or time.monotonic()) - t0, "".join(text), cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--room", action="store_true", help="a budget that holds both: the no-swap baseline")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    estimates = {m: estimate(m, args.n_ctx) for m in MODELS}
    budget = sum(estimates.values()) + (64 << 20) if args.room else max(estimates.values()) + (16 << 20)
    tmp = tempfile.mkdtemp(prefix="homepd-swap-")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEPD_")}
    env.update(HOMEPD_DB=os.path.join(tmp, "homepd.db"), XDG_CONFIG_HOME=os.path.join(tmp, "xdg"))
    cmd = [sys.executable, "-m", "homepd", "serve", "--port", str(port), "--no-advice", "--no-record-traffic",
           "--n-ctx", str(args.n_ctx), "--threads", str(args.threads), "--memory-budget", str(budget),
           *sum((["--model", m] for m in MODELS), [])]
    log = open(os.path.join(tmp, "serve.log"), "wb")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    listing_ms: list[tuple[bool, float]] = []   # (a load under way, ms) for /health and /v1/models
    stop = threading.Event()
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=300.0) as client:
            t0 = time.monotonic()
            while client_get(client, "/ready") != 200:
                if server.poll() is not None or time.monotonic() - t0 > 300:
                    raise SystemExit(f"homepd serve did not start; see {log.name}")
                time.sleep(0.1)

            def watch() -> None:
                with httpx.Client(base_url=url, timeout=10.0) as c:
                    while not stop.is_set():
                        t = time.monotonic()
                        r = c.get("/v1/models")
                        models_ms = (time.monotonic() - t) * 1e3
                        loading = any(m["meta"]["state"] == "loading" for m in r.json()["data"])
                        t = time.monotonic()
                        c.get("/health")
                        listing_ms.extend([(loading, models_ms), (loading, (time.monotonic() - t) * 1e3)])
                        time.sleep(0.02)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            rows, previous = [], MODELS[0]   # the first model is loaded at start
            for _ in range(args.rounds):
                for model in MODELS:
                    for turn in (0, 1):  # the first request after the swap, then one on the loaded model
                        before = {m["name"]: m["loads"] for m in client.get("/status").json()["served_models"]}
                        ttft_s, text, cached = ttft_of(client, model, args.max_tokens)
                        after = {m["name"]: m["loads"] for m in client.get("/status").json()["served_models"]}
                        loaded = after[f"{model}:latest"] > before[f"{model}:latest"]
                        rows.append({"model": model, "swapped": model != previous, "loaded": loaded,
                                     "ttft_s": round(ttft_s, 3), "cached_tokens": cached, "text": text[:32]})
                        previous = model
            stop.set()
            watcher.join()
            status = client.get("/status").json()
    finally:
        stop.set()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    report(args, budget, estimates, rows, status, listing_ms)
    return 0


def client_get(client: httpx.Client, route: str) -> int:
    try:
        return client.get(route).status_code
    except httpx.TransportError:
        return 0


def report(args, budget: int, estimates: dict, rows: list[dict], status: dict, listing_ms: list) -> None:
    models = {m["name"].removesuffix(":latest"): m for m in status["served_models"]}
    during = [ms for loading, ms in listing_ms if loading]
    figures = {"budget_bytes": budget, "requests": rows, "models": {
        name: {k: models[name][k] for k in ("loads", "evictions", "load_seconds_total", "footprint_bytes",
                                             "footprint_source")} | {"estimate_bytes": estimates[name]}
        for name in MODELS}, "loads": status["memory"]["recent_loads"],
        "listing_ms_during_loads": {"n": len(during), "max": max(during, default=None),
                                    "p50": statistics.median(during) if during else None},
        "listing_ms_all": {"n": len(listing_ms), "max": max((ms for _, ms in listing_ms), default=None)}}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"budget {budget / 1e6:,.0f} MB ({'room for both' if args.room else 'the larger model alone'}), "
          f"n_ctx {args.n_ctx}, {args.threads} threads")
    print(f"{'model':30} {'swap':>5} {'load':>5} {'TTFT s':>7} {'cached':>7}  text")
    for r in rows:
        print(f"{r['model']:30} {'yes' if r['swapped'] else '':>5} {'yes' if r['loaded'] else '':>5} "
              f"{r['ttft_s']:7.2f} {r['cached_tokens']:7d}  {r['text']!r}")
    swap = [r["ttft_s"] for r in rows if r["loaded"]]
    warm = [r["ttft_s"] for r in rows if not r["loaded"]]
    if swap:
        print(f"TTFT after a load: median {statistics.median(swap):.2f} s over {len(swap)}")
    if warm:
        print(f"TTFT on a loaded model: median {statistics.median(warm):.2f} s over {len(warm)}")
    for name, m in figures["models"].items():
        print(f"{name}: {m['loads']} loads, {m['evictions']} evictions, {m['load_seconds_total']:.2f} s loading; "
              f"footprint {m['footprint_bytes'] / 1e6:,.0f} MB {m['footprint_source']} against "
              f"{m['estimate_bytes'] / 1e6:,.0f} MB estimated")
    for e in figures["loads"]:
        print(f"  load {e['model']}: {e['load_s']:.2f} s ({e['reason']})")
    d = figures["listing_ms_during_loads"]
    if d["n"]:
        print(f"/health and /v1/models during loads: {d['n']} answers, median {d['p50']:.1f} ms, max {d['max']:.1f} ms")
    if figures["listing_ms_all"]["n"]:
        print(f"/health and /v1/models overall: {figures['listing_ms_all']['n']} answers, max "
              f"{figures['listing_ms_all']['max']:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
