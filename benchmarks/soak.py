"""Soak: ``homepd serve`` under mixed traffic for N minutes, with disconnects, malformed requests and a worker
``kill -9`` every few minutes, all on loopback; bounded in time and in requests.

It starts its own server (``python -m homepd serve`` on a free loopback port, no API key), runs
``--clients`` concurrent clients drawing a seeded mix of requests (chat and text completions, streamed or
not; streams dropped after a few chunks; requests abandoned before their answer; malformed JSON, wrong types,
lone surrogates, unknown fields, too many messages, oversized bodies; /health, /metrics, /status), kills
one worker with SIGKILL every ``--kill-every-min`` minutes, then stops the server with SIGTERM.

    uv run python benchmarks/soak.py                                   # 30 minutes, the real model
    uv run python benchmarks/soak.py --minutes 3 --kill-every-min 1 -- --backend fake --mode disaggregated

Arguments after ``--`` go to ``homepd serve``.  Reports: requests completed, every status by code (a 5xx
by its error code: 503s with Retry-After are by design while a worker restarts; a 500 is a bug), requests
whose answer was not what their kind expects, the RSS of every process at its start and its end, the
server's exit status, and the /dev/shm segments left behind.  ``-o FILE`` keeps the report as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from homepd.kv.segment import SHM_DIR, parse_segment_name

MODEL = "smollm2-135m-instruct-q4_1"
READY_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 60.0
RSS_PERIOD_S = 10.0
RSS_REPORT_PERIOD_S = 300.0  # the report's controller RSS: one sample every 5 minutes
KINDS = {  # kind -> weight
    "chat": 20, "chat_stream": 20, "completion": 8, "stream_dropped": 10, "abandoned": 6, "malformed_json": 4,
    "wrong_type": 4, "surrogate": 3, "unknown_field": 3, "too_many_messages": 2, "oversized": 1, "health": 8,
    "metrics": 3, "status": 3, "tool_call": 4, "structured": 4, "sampled": 6,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"]}
EXPECTED = {"malformed_json": {400}, "wrong_type": {400}, "surrogate": {400}, "unknown_field": {200},
            "too_many_messages": {413}, "oversized": {413}, "health": {200}, "metrics": {200}, "status": {200}}
# why: a body over the bound is answered 413 before it is read, and the connection closed: a client still
# sending may see the reset instead of the answer
MAY_RESET = {"oversized"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> tuple[int, int] | None:
    """(own, shared) resident bytes of ``pid``: its own pages (VmRSS less RssShmem), and the shared-memory
    pages it has touched (RssShmem: the KV store's and the arena's segments, which fill up to their bound by
    design and are one copy in /dev/shm however many processes map them)."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return None
    if "VmRSS" not in fields:
        return None
    shared = fields.get("RssShmem", 0)
    return fields["VmRSS"] - shared, shared


def shm_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if parse_segment_name(n)} if SHM_DIR.is_dir() else set()


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.statuses: Counter[str] = Counter()       # "200", "400", "503 worker_restarting", "stream error ..."
        self.unexpected: Counter[str] = Counter()     # "kind -> status" that the kind does not expect
        self.n_sent = self.n_completed = 0
        self.kills: list[dict] = []
        self.rss: dict[int, dict] = {}                # pid -> {role, start_bytes, end_bytes, shared_end_bytes}
        self.controller_rss: list[tuple[float, int]] = []  # (seconds into the soak, bytes): flat after warm-up?
        self.worker_rss: dict[int, list[tuple[float, int]]] = {}  # pid -> (seconds into the soak, bytes)
        self.deadline = 0.0

    # the server ------------------------------------------------------------------------------
    def start_server(self, log_path: Path) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HOMEPD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        argv = [sys.executable, "-m", "homepd", "serve", "--port", str(self.port), "--max-prompt-bytes", "65536",
                "--max-messages", "256", *self.args.serve_args]
        self.log = open(log_path, "wb")
        return subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    async def wait_ready(self, client: httpx.AsyncClient, server: subprocess.Popen, timeout_s: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if server.poll() is not None:
                raise SystemExit(f"homepd serve exited ({server.returncode}); see {self.args.log}")
            try:
                if (await client.get("/ready", timeout=5)).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)  # polling /ready: the readiness signal itself
        raise SystemExit(f"homepd serve not ready after {timeout_s:.0f} s; see {self.args.log}")

    async def processes(self, client: httpx.AsyncClient, server_pid: int) -> dict[int, str]:
        status = (await client.get("/status", timeout=10)).json()
        workers = (status.get("engine") or {}).get("workers", [])
        return {server_pid: "controller", **{w["pid"]: w.get("role", "worker") for w in workers if w.get("pid")}}

    def sample_rss(self, pids: dict[int, str]) -> None:
        for pid, role in pids.items():
            if (sample := rss_bytes(pid)) is None:
                continue
            rss, shared = sample
            entry = self.rss.setdefault(pid, {"role": role, "start_bytes": rss, "end_bytes": rss})
            entry["end_bytes"], entry["shared_end_bytes"] = rss, shared
            if self.deadline:
                at_s = round(time.monotonic() - self.started_s, 1)
                series = self.controller_rss if role == "controller" else self.worker_rss.setdefault(pid, [])
                series.append((at_s, rss))

    # traffic ---------------------------------------------------------------------------------
    def draw(self) -> str:
        kinds = self.args.kinds
        return self.rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]

    def chat_body(self, **extra) -> dict:
        words = " ".join(self.rng.choice(["cats", "rain", "soup", "maps", "jazz", "tea"]) for _ in range(
            self.rng.randint(1, 40)))
        return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {words}."}],
                "max_tokens": self.rng.randint(1, 24), "temperature": 0, **extra}

    async def one(self, client: httpx.AsyncClient, kind: str) -> str:
        """Send one request of ``kind``; return its outcome ('200', '503 worker_restarting', ...)."""
        chat = "/v1/chat/completions"
        raw = {"Content-Type": "application/json"}
        if kind in ("health", "metrics", "status"):
            return str((await client.get(f"/{kind}")).status_code)
        if kind == "malformed_json":
            return self.outcome(await client.post(chat, content=b'{"model": "x", "messages": [', headers=raw))
        if kind == "wrong_type":
            field, value = self.rng.choice([("max_tokens", True), ("temperature", "0.5"), ("stream", "yes")])
            return self.outcome(await client.post(chat, json=self.chat_body(**{field: value})))
        if kind == "surrogate":
            body = '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL
            return self.outcome(await client.post(chat, content=body.encode(), headers=raw))
        if kind == "tool_call":  # a grammar sampler per request: none may leak
            return self.outcome(await client.post(chat, json=self.chat_body(
                tools=[WEATHER], tool_choice="required", max_tokens=48)))
        if kind == "structured":
            return self.outcome(await client.post(chat, json=self.chat_body(max_tokens=64, temperature=1.0,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})))
        if kind == "sampled":  # what clients send: the sampler chain, penalties, logprobs
            return self.outcome(await client.post(chat, json=self.chat_body(
                temperature=0.7, top_p=0.9, presence_penalty=0.3, logprobs=True, top_logprobs=3)))
        if kind == "unknown_field":
            return self.outcome(await client.post(chat, json=self.chat_body(frobnicate=1)))
        if kind == "too_many_messages":
            return self.outcome(await client.post(chat, json=self.chat_body(messages=[{"role": "user"}] * 300)))
        if kind == "oversized":
            return self.outcome(await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 600_000}))
        if kind == "completion":
            return self.outcome(await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": self.rng.randint(1, 24)}))
        if kind == "chat":
            return self.outcome(await client.post(chat, json=self.chat_body()))
        if kind == "abandoned":  # the client gives up before the answer: the server must free its sequence
            try:
                await client.post(chat, json=self.chat_body(max_tokens=64), timeout=self.rng.uniform(0.01, 0.3))
                return "200"
            except httpx.TimeoutException:
                return "abandoned"
        # a stream, read to the end or dropped after a few chunks
        limit = self.rng.randint(1, 4) if kind == "stream_dropped" else None
        async with client.stream("POST", chat, json=self.chat_body(stream=True)) as response:
            if response.status_code != 200:
                await response.aread()
                return self.outcome(response)
            n = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    return f"stream error {json.loads(line[6:])['error'].get('code')}"
                n += line.startswith("data: ")
                if limit is not None and n >= limit:
                    return "dropped"
            return "200"

    @staticmethod
    def outcome(response: httpx.Response) -> str:
        if response.status_code >= 500:
            try:
                return f"{response.status_code} {response.json()['error'].get('code')}"
            except (ValueError, KeyError, TypeError):
                return f"{response.status_code} (not JSON)"
        return str(response.status_code)

    async def client_loop(self, client: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline and self.n_sent < self.args.max_requests:
            kind = self.draw()
            self.n_sent += 1
            try:
                result = await self.one(client, kind)
            except httpx.TransportError as exc:
                result = f"transport {type(exc).__name__}"
            self.n_completed += 1
            self.statuses[result] += 1
            code = result.split()[0]
            if kind in MAY_RESET and code == "transport":
                continue
            if kind in EXPECTED and (not code.isdigit() or int(code) not in EXPECTED[kind]) and code != "503":
                self.unexpected[f"{kind} -> {result}"] += 1

    async def killer(self, client: httpx.AsyncClient, server: subprocess.Popen) -> None:
        if self.args.kill_every_min <= 0:
            return
        period_s = self.args.kill_every_min * 60
        next_s = time.monotonic() + period_s
        while next_s < self.deadline:
            await asyncio.sleep(next_s - time.monotonic())
            workers = {pid: role for pid, role in (await self.processes(client, server.pid)).items()
                       if pid != server.pid}
            if not workers:
                continue
            pid = self.rng.choice(sorted(workers))
            self.sample_rss({pid: workers[pid]})  # its end
            os.kill(pid, signal.SIGKILL)
            killed_s = time.monotonic()
            while pid in await self.processes(client, server.pid):  # until the controller has replaced it
                await asyncio.sleep(0.05)
            await self.wait_ready(client, server, READY_TIMEOUT_S)
            back_s = time.monotonic() - killed_s
            self.kills.append({"at_s": round(killed_s - self.started_s, 1), "role": workers[pid], "pid": pid,
                               "back_after_s": round(back_s, 2)})
            print(f"  kill -9 {workers[pid]} worker {pid} at {killed_s - self.started_s:.0f} s: ready again after "
                  f"{back_s:.1f} s", flush=True)
            next_s += period_s

    async def sampler(self, client: httpx.AsyncClient, server: subprocess.Popen) -> None:
        while time.monotonic() < self.deadline:
            try:
                self.sample_rss(await self.processes(client, server.pid))
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(min(RSS_PERIOD_S, max(0.0, self.deadline - time.monotonic())))

    # the run ---------------------------------------------------------------------------------
    async def run(self) -> dict:
        shm_before = shm_segments()
        server = self.start_server(Path(self.args.log))
        limits = httpx.Limits(max_connections=self.args.clients + 4)
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
                ready_s = await self.wait_ready(client, server, READY_TIMEOUT_S)
                print(f"homepd serve ready after {ready_s:.1f} s on {self.url}; soaking for {self.args.minutes} min",
                      flush=True)
                self.sample_rss(await self.processes(client, server.pid))
                self.started_s = time.monotonic()
                self.deadline = self.started_s + self.args.minutes * 60
                tasks = [asyncio.ensure_future(self.client_loop(client)) for _ in range(self.args.clients)]
                tasks += [asyncio.ensure_future(self.killer(client, server)),
                          asyncio.ensure_future(self.sampler(client, server))]
                await asyncio.wait_for(asyncio.gather(*tasks), self.args.minutes * 60 + 2 * READY_TIMEOUT_S)
                await self.wait_ready(client, server, READY_TIMEOUT_S)  # the abandoned requests are freed
                status = (await client.get("/status")).json()
                self.sample_rss(await self.processes(client, server.pid))
                elapsed_s = time.monotonic() - self.started_s
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
            try:
                exit_status = server.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                exit_status = server.wait()
            self.log.close()
        ours = {int(pid) for pid in self.rss} | {server.pid}  # other homepds on this box are none of ours
        left = sorted(n for n in shm_segments() - shm_before if parse_segment_name(n)[0] in ours)
        n_5xx = sum(n for s, n in self.statuses.items() if s[:1] == "5")
        return {
            "minutes": self.args.minutes, "elapsed_s": round(elapsed_s, 1), "serve_args": self.args.serve_args,
            "requests_sent": self.n_sent, "requests_completed": self.n_completed,
            "statuses": dict(self.statuses.most_common()), "n_5xx": n_5xx,
            "n_500": sum(n for s, n in self.statuses.items() if s.startswith("500")),
            "unexpected": dict(self.unexpected), "kills": self.kills,
            "in_flight_at_end": status["admission"]["in_flight"],
            "rss": {str(pid): e for pid, e in self.rss.items()}, "controller_rss": self.controller_rss,
            "worker_rss": {str(pid): series for pid, series in self.worker_rss.items()}, "kinds": self.args.kinds,
            "exit_status": exit_status, "shm_segments_left": left,
        }


def print_report(r: dict) -> None:
    print(f"\n{r['requests_completed']} requests completed in {r['elapsed_s']:.0f} s "
          f"({r['requests_completed'] / max(r['elapsed_s'], 1e-9):.1f}/s); 5xx: {r['n_5xx']} (500: {r['n_500']})")
    for outcome, n in r["statuses"].items():
        print(f"  {outcome:<34} {n}")
    print(f"unexpected answers: {r['unexpected'] or 'none'}")
    print(f"kills: {len(r['kills'])}; in flight at the end: {r['in_flight_at_end']}")
    print("RSS (MB, own pages)  start    end   (+ shared memory touched at the end)")
    for pid, e in r["rss"].items():
        print(f"  {e['role']:<10} {pid:>7} {e['start_bytes'] / 1e6:7.1f} {e['end_bytes'] / 1e6:7.1f}   "
              f"(+ {e['shared_end_bytes'] / 1e6:.0f})")
    series = r["controller_rss"]
    if series:
        print("controller RSS (MB) every 5 minutes: " + ", ".join(
            f"{t / 60:.0f} min {b / 1e6:.1f}" for t, b in every(series, RSS_REPORT_PERIOD_S)))
    for pid, series in r["worker_rss"].items():
        print(f"worker {pid} RSS (MB) every minute: " + ", ".join(
            f"{t / 60:.0f} min {b / 1e6:.0f}" for t, b in every(series, 60.0)))
    print(f"exit status: {r['exit_status']}; /dev/shm segments left: {len(r['shm_segments_left'])} "
          f"{r['shm_segments_left'] or ''}")


def every(series: list[tuple[float, int]], period_s: float) -> list[tuple[float, int]]:
    """The first sample of ``series`` ((seconds, bytes), in time order) at or after each multiple of
    ``period_s``, and the last one."""
    picks, next_s = [], 0.0
    for t, b in series:
        if t >= next_s:
            picks.append((t, b))
            next_s = (t // period_s + 1) * period_s
    if series and picks[-1] != series[-1]:
        picks.append(series[-1])
    return picks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--kill-every-min", type=float, default=5.0, help="a worker kill -9 this often (0: never)")
    p.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS),
                   help=f"a comma-separated subset of the request kinds to draw, at their weights ({', '.join(KINDS)})")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--log", default="soak-serve.log", help="the server's log")
    p.add_argument("-o", "--out", help="write the report here (JSON)")
    args = p.parse_args(argv)
    args.serve_args = serve_args
    if unknown := set(args.kinds) - set(KINDS):
        p.error(f"--kinds: unknown kind(s) {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")
    report = asyncio.run(Soak(args).run())
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if report["n_500"] == 0 and not report["shm_segments_left"] and report["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
