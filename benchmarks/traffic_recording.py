"""What recording the service's traffic costs on this machine.

    PYTHONPATH=. python benchmarks/traffic_recording.py [--requests 5000] [--repeat 5]

* the prefix tracker (recorder thread): microseconds per prompt of 512, 2,048 and 16,384 tokens;
* the event loop's share: ``arrived`` + ``ended`` per request (two ``put_nowait``), in microseconds;
* the recorder end to end: ``--requests`` requests through the thread into a real sqlite file, rows per second
  (batches of ``FLUSH_ROWS``, one transaction each, pruned after each), and the file's bytes per row.
Figures are the best of ``--repeat`` runs unless marked otherwise.
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from homepd.core.lifecycle import Lifecycle
from homepd.core.records import FinishReason
from homepd.measure.trace.prefixes import PrefixTracker
from homepd.serve.traffic import TrafficRecorder
from homepd.store import Store


def best_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def tracker_us(n_tokens: int, repeat: int, n_prompts: int = 50) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(50_000) for _ in range(n_tokens)] for _ in range(n_prompts)]

    def run():
        t = PrefixTracker()
        for i, p in enumerate(prompts):
            t.observe(str(i), p)
    return best_s(run, repeat) / n_prompts * 1e6


def lifecycle(rid: str) -> Lifecycle:
    lc = Lifecycle(request_id=rid, arrived_s=1.0, first_token_s=1.2, ended_s=2.0, finish_reason=FinishReason.STOP)
    lc.token_times_s = [1.2 + 0.02 * i for i in range(40)]
    return lc


def recorder_figures(n: int) -> tuple[float, float, float]:
    """(loop-side us per request, rows per second end to end, bytes per row); one run (it writes a file)."""
    rng = random.Random(1)
    system = tuple(rng.randrange(50_000) for _ in range(64))
    prompts = [system + tuple(rng.randrange(50_000) for _ in range(rng.randrange(20, 600))) for _ in range(n)]
    lcs = [lifecycle(f"r{i}") for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        rec = TrafficRecorder(lambda: Store.open(path))
        rec.start()
        now = time.time()
        start = time.perf_counter()
        loop_s = 0.0
        for i in range(n):
            t0 = time.perf_counter()
            rec.arrived(f"r{i}", prompts[i], now + i * 0.01, "chat", "interactive", 64)
            rec.ended(f"r{i}", lcs[i])
            loop_s += time.perf_counter() - t0
        rec.stop(timeout_s=300)
        total_s = time.perf_counter() - start
        assert rec.n_recorded == n, (rec.n_recorded, rec.n_dropped, rec.last_error)
        size = os.path.getsize(path) + (os.path.getsize(path + "-wal") if os.path.exists(path + "-wal") else 0)
    return loop_s / n * 1e6, n / total_s, size / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    for n_tokens in (512, 2048, 16384):
        print(f"prefix tracker, {n_tokens:>6}-token prompt: {tracker_us(n_tokens, args.repeat):8.1f} us")
    loop_us, rows_s, bytes_row = recorder_figures(args.requests)
    print(f"event loop per request (arrived + ended): {loop_us:.1f} us")
    print(f"recorder end to end ({args.requests} requests, one run): {rows_s:.0f} rows/s, {bytes_row:.0f} bytes/row")


if __name__ == "__main__":
    main()
