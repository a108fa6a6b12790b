"""Where a client's largest gap comes from: the worker's steps, or the way the tokens travel to the client.

Starts ``homepd serve`` at ``slo_capacity.py``'s settings (one server, nothing else running), replays the mixed
trace at ``--rate`` over HTTP with the benchmarks' client (``homepd.bench.client``, timing each streamed chunk), and
reads the service's ``/events`` beside it: each finished request's ``request`` event carries its largest gap
between the token times its worker stamped at each step's end.  Requests are matched by their first token (the
client's comes after the worker's).  Per request it prints the client's largest gap beside the worker's, and how
long the first token took to reach the client; then their medians and how many requests each side has within the
gap budget.  Equal largest gaps: the gaps are the worker's steps; a client's larger by more than a few ms: the
pipe, the controller, the HTTP server or the OS added them.

    uv run python benchmarks/gap_split.py --rate 0.5 --seed 0
    uv run python benchmarks/gap_split.py --rate 0.75 --seed 1 --threads 1

docs/scheduling.md ("Where a client's largest gap comes from") has the figures of 2026-12-07.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from homepd.bench.client import HttpTarget
from homepd.config import DEFAULT_MODEL_NAME
from homepd.core.sampling import SamplingParams
from homepd.measure.trace import make_trace
from homepd.models.resolve import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slo_capacity import Server, ServerConfig, served_model_id  # noqa: E402

GAP_BUDGET_MS = 100.0


async def measure(args) -> tuple[list, list[dict]]:
    """(the client's lifecycles, the service's ``request`` events) of one replay."""
    cfg = ServerConfig("homepd", "homepd", ("--threads", str(args.threads), "--n-ctx", str(args.n_ctx),
                                            "--n-seq-max", str(args.parallel)))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    server = Server(cfg, str(resolve_model(DEFAULT_MODEL_NAME, progress=False)), Path("/nonexistent"), log_dir)
    server.start()
    events: list[dict] = []
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            await server.wait_ready(client)

            async def listen() -> None:
                async with client.stream("GET", server.base + "/events") as r:
                    kind = None
                    async for line in r.aiter_lines():
                        if line.startswith("event:"):
                            kind = line[6:].strip()
                        elif line.startswith("data:") and kind == "request":
                            events.append(json.loads(line[5:]))

            listener = asyncio.create_task(listen())
            model = await served_model_id(client, server.base)
            async with HttpTarget(server.base, model=model, unique_tag=f"gap{args.seed}-{time.time():.0f}") as target:
                await (await target.submit("Hello", params=SamplingParams(max_tokens=4))).collect()  # warm
                trace = make_trace("mixed", args.requests, args.rate, max_tokens=args.max_tokens,
                                   long_tokens=args.long_tokens, ignore_eos=True, seed=args.seed)
                t0 = time.monotonic()

                async def one(req):
                    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
                    stream = await target.submit(req.prompt, messages=list(req.messages) if req.messages else None,
                                                 params=SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
                                                 request_class=req.request_class)
                    return await stream.collect()

                lifecycles = await asyncio.gather(*(one(r) for r in trace))
            while len(events) < len(lifecycles) + 1 and time.monotonic() - t0 < 600:  # the last ones' events
                await asyncio.sleep(0.1)   # polling a list another task fills
            listener.cancel()
    finally:
        server.stop()
    return lifecycles, events


def split(lifecycles, events: list[dict]) -> list[dict]:
    rows = []
    for lc in lifecycles:
        if lc.first_token_s is None or len(lc.token_times_s) < 2:
            continue
        before = [e for e in events if e.get("first_token_s") and e["first_token_s"] <= lc.first_token_s + 1e-4]
        if not before:
            continue
        worker = max(before, key=lambda e: e["first_token_s"])
        times = lc.token_times_s
        rows.append({"n_prompt": lc.n_prompt_tokens, "ttft_ms": (lc.first_token_s - lc.arrived_s) * 1e3,
                     "first_token_delivery_ms": (lc.first_token_s - worker["first_token_s"]) * 1e3,
                     "client_max_gap_ms": max(b - a for a, b in zip(times, times[1:])) * 1e3,
                     "worker_max_gap_ms": worker["itl_max_ms"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--long-tokens", type=int, default=470)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4, help="--n-seq-max")
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("--log-dir", default=".cache/gap_split", help="where the server's log goes")
    args = ap.parse_args()
    rows = split(*asyncio.run(measure(args)))
    if not rows:
        raise SystemExit("no request could be matched to the service's events")
    for r in sorted(rows, key=lambda r: -r["client_max_gap_ms"]):
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    diff = [abs(r["client_max_gap_ms"] - r["worker_max_gap_ms"]) for r in rows]
    deliver = sorted(r["first_token_delivery_ms"] for r in rows)
    print(f"rate {args.rate} req/s, seed {args.seed}, {args.threads} thread(s), {len(rows)} requests: largest gap p50 "
          f"client {statistics.median(r['client_max_gap_ms'] for r in rows):.0f} ms, worker "
          f"{statistics.median(r['worker_max_gap_ms'] for r in rows):.0f} ms, apart by at most {max(diff):.1f} ms; "
          f"within {GAP_BUDGET_MS:.0f} ms: client {sum(r['client_max_gap_ms'] <= GAP_BUDGET_MS for r in rows)}, "
          f"worker {sum(r['worker_max_gap_ms'] <= GAP_BUDGET_MS for r in rows)}; first token delivered in "
          f"{deliver[0]:.1f}-{deliver[-1]:.1f} ms (median {statistics.median(deliver):.1f})")


if __name__ == "__main__":
    main()
