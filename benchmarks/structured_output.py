"""Structured output on the real model: validity at temperature 1.0, and what sampling and grammars cost decode.

1. For each of five schemas (``tests/integration/structured_schemas.py``: nested objects, arrays, enums,
   optional fields, bounded numbers), ``--samples`` answers at temperature 1.0 through ``homepd serve``
   (``response_format: json_schema``, strict), each parsed with ``json.loads`` and validated with
   ``jsonschema``: the share that parse, the share that validate, the finish reasons.
2. Single-stream decode tok/s (the server's own ``homepd.decode_tok_s``, one request at a time, medians of
   ``--repeats``): greedy, temperature 0.7 / top_p 0.9 (what clients send) with llama-server's default top_k
   40 and min_p 0.05, the same without top_k (``top_k: 0``), and under a json_schema grammar.

    uv run python benchmarks/structured_output.py [--samples 50] [--threads 1]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))
sys.path.insert(0, str(HERE.parent / "tests"))
from structured_schemas import SCHEMAS  # noqa: E402
from test_serve_harness import ServeProcess  # noqa: E402

LONG_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["lines"], "properties": {
    "lines": {"type": "array", "minItems": 12, "maxItems": 12,
              "items": {"type": "string", "minLength": 20, "maxLength": 40}}}}


def validity(client: httpx.Client, n_samples: int, parallel: int) -> None:
    def one(args):
        name, seed = args
        body = {"model": "m", "temperature": 1.0, "seed": seed, "max_tokens": 400,
                "messages": [{"role": "user", "content": f"Write a {name} as JSON."}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": SCHEMAS[name], "strict": True}}}
        r = client.post("/v1/chat/completions", json=body).json()
        choice = r["choices"][0]
        try:
            value = json.loads(choice["message"]["content"])
        except ValueError:
            return name, choice["finish_reason"], False, False
        try:
            jsonschema.validate(value, SCHEMAS[name])
            return name, choice["finish_reason"], True, True
        except jsonschema.ValidationError:
            return name, choice["finish_reason"], True, False

    jobs = [(name, seed) for name in SCHEMAS for seed in range(n_samples)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(one, jobs))
    print(f"structured output at temperature 1.0: {len(jobs)} answers in {time.monotonic() - t0:.0f} s "
          f"({parallel} at a time)")
    print(f"{'schema':<20}{'parsed':>9}{'valid':>9}  finish reasons")
    for name in SCHEMAS:
        mine = [r for r in results if r[0] == name]
        reasons = collections.Counter(r[1] for r in mine)
        print(f"{name:<20}{sum(r[2] for r in mine):>5}/{len(mine):<3}{sum(r[3] for r in mine):>5}/{len(mine):<3}"
              f"  {dict(reasons)}")
    print(f"{'all':<20}{sum(r[2] for r in results):>5}/{len(results):<3}{sum(r[3] for r in results):>5}/"
          f"{len(results):<3}")


def decode_speed(client: httpx.Client, repeats: int) -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "Write twelve lines about the sea."}],
            "max_tokens": 160}
    settings = {
        "greedy": dict(temperature=0, ignore_eos=True),
        "T0.7 top_p0.9 (top_k 40, min_p 0.05)": dict(temperature=0.7, top_p=0.9, ignore_eos=True),
        "T0.7 top_p0.9 top_k 0": dict(temperature=0.7, top_p=0.9, top_k=0, ignore_eos=True),
        "T0.7 top_p0.9 + json_schema": dict(temperature=0.7, top_p=0.9, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": LONG_SCHEMA}}),
    }
    figures: dict[str, list[float]] = {k: [] for k in settings}
    for r in range(repeats):      # interleaved: each setting once per round
        for label, extra in settings.items():
            body = {**base, **extra, "seed": r}
            reply = client.post("/v1/chat/completions", json=body).json()
            figures[label].append(reply["homepd"]["decode_tok_s"])
    print(f"\nsingle-stream decode tok/s (the server's own, median of {repeats}, min-max)")
    for label, values in figures.items():
        print(f"  {label:<40}{statistics.median(values):7.1f}   ({min(values):.1f}-{max(values):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    extra = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory() as tmp:
        server = ServeProcess(Path(tmp), "--threads", str(args.threads), "--no-advice", "--no-record-traffic",
                              *extra).wait_ready()
        try:
            print(f"homepd serve, {args.threads} thread(s)\n")
            with server.client(timeout=600) as client:
                validity(client, args.samples, args.parallel)
                decode_speed(client, args.repeats)
        finally:
            server.terminate()


if __name__ == "__main__":
    main()
