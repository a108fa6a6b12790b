"""A deterministic data source for the app's tests and snapshots: no engine, no hardware, no store.

Every figure is a pure function of a counter, so two runs draw the same
screens.  A chat reply echoes the question; with ``thinking`` it starts with
reasoning, and when the demo tool is offered it ends with a call to it.
``hold()`` keeps chat, background prompts or advise runs in flight until
``release()``, to prove that the app stays responsive meanwhile.
"""
from __future__ import annotations

import dataclasses
import statistics
import threading

from homepd.advise.report.pictures import CapacityCurve, Latencies, Pictures, TwinCurve
from homepd.advise.report.twobox import HandoffSample, project
from homepd.config import EngineConfig
from homepd.chat.reply import Delta, DeltaKind
from homepd.core.modes import Mode, Role
from homepd.core.terms import ReuseMode
from homepd.core.records import WorkerSnapshot
from homepd.tui.liveadvice import advice_view
from homepd.tui.records import (AdviseStep, AdviseView, ArchitectureView, ArenaView, CacheView, ChartPoint, ChatStats,
                                EvidenceRow, HardwareView, ModelRow, ProcessView, RecommendationView, RequestRow,
                                RunListRow, Tick)
from homepd.tui.sources.base import CHAT_MAX_TOKENS, DataSource, Emit, OnDelta

MIB = 2 ** 20
GIB = 2 ** 30
CANDIDATES = ("colocated-unchunked", "colocated-chunk-256", "disaggregated", "replicas-2")
MIXES = ("short", "long", "mixed")


def _worker(role: Role, pid: int, restarts: int, cores: tuple[int, ...], n_running: int, backlog: int) -> WorkerSnapshot:
    return WorkerSnapshot(role, pid, alive=True, ready=True, restarts=restarts, n_threads=len(cores), cpu_cores=cores,
                          cuda_visible_devices="", n_gpu_layers=0,
                          in_flight=tuple(f"req-{pid}-{i}" for i in range(n_running)), backlog=backlog)


def fake_advise_view(run_id: int = 7) -> AdviseView:
    """A plausible, fixed advise result: chunked colocated wins, disaggregated protects ITL."""
    rows = []
    for i, cand in enumerate(CANDIDATES[:3]):
        for j, mix in enumerate(MIXES):
            rows.append(EvidenceRow(
                cand, mix, n_repeats=1, goodput_per_s=round(1.8 - 0.4 * i + 0.1 * j, 2),
                slo_attainment=1.0 - 0.125 * ((i + j) % 3), ttft_ms_p99=900.0 + 700 * i + 350 * j,
                tpot_ms_p50=38.0 - 2 * i, itl_ms_p99=[910.0, 120.0, 41.0][i] + 10 * j,
                itl_ms_max=[1400.0, 160.0, 55.0][i] + 20 * j, output_tok_s=24.0 - 3 * i + j,
                interference=[37.5, 3.1, 1.08][i], kv_transfer_ms=12.5 if cand == "disaggregated" else None,
                pss_mib=[239.0, 241.0, 370.0][i]))
    rows.append(EvidenceRow("replicas-2", "-", infeasible="2 replicas need 2 usable cores each"))
    rec = RecommendationView(
        candidate="colocated-chunk-256", config={"mode": "colocated", "chunk": 256},
        rule="colocated: best goodput", reason="disaggregated goodput 1.0/s does not beat colocated-chunk-256 "
                                               "1.5/s by 1.2x; interference measured x3.1",
        confidence="medium", confidence_why="one repeat; margin 50%",
        per_mix=tuple((m, "colocated-chunk-256") for m in MIXES))
    return AdviseView(run_id, f"advise run {run_id}", tuple(rows), rec,
                      ("quick campaign: 3 prompt mixes x 1 repeat(s); medians over repeats",))


def fake_pictures(title: str = "advise run 7") -> Pictures:
    """Fixed capacity curves, latencies and a two-box projection for the candidates of ``fake_advise_view``."""
    curves, lats, projections = [], [], []
    for i, cand in enumerate(CANDIDATES[:3]):
        for j, mix in enumerate(MIXES):
            capacity = round(0.6 - 0.15 * i + 0.1 * j, 2)
            rates = [round(capacity * f, 3) for f in (0.25, 0.5, 1.0, 1.5, 2.0)]
            points = tuple((r, 1.0 if r <= capacity else max(0.0, 0.9 - 0.6 * (r / capacity - 1))) for r in rates)
            curves.append(CapacityCurve(cand, mix, 0.9, points, capacity, 0.05, "every gap <= 100 ms"))
            ttft = tuple(sorted(200.0 * (1 + i) + 37.0 * ((k * 7) % 13) for k in range(20)))
            itl = tuple(sorted(30.0 + 5 * i + [0, 2, 5, 9, 14, 60, 180][k % 7] * (1 if i == 0 else 0.2)
                               for k in range(70)))
            lats.append(Latencies(cand, mix, ttft, itl))
            if cand == "disaggregated":
                samples = [HandoffSample(n, n * 30_720, t / 1e3) for n, t in zip((60, 300, 900, 1800), ttft)]
                projections.append(project(cand, mix, samples, ttft_budget_ms=4000.0))
    # the twin on the mixed trace: colocated-chunk-256 checked within 4 points, disaggregated off by 25 (not trusted)
    twins = []
    for cand, capacity, checks, trusted in (("colocated-chunk-256", 0.8, ((0.8, 0.92, 0.88),), True),
                                            ("disaggregated", 0.5, ((0.5, 0.65, 0.9),), False)):
        rates = [round(capacity * 2 ** (k / 4), 3) for k in range(-4, 5)]
        points = tuple((r, a, max(0.0, a - 0.08), min(1.0, a + 0.05)) for r in rates
                       for a in [1.0 if r < capacity else max(0.0, 0.9 - 0.8 * (r / capacity - 1))])
        error = statistics.median(abs(m - p) * 100 for _, m, p in checks)
        twins.append(TwinCurve(cand, "mixed", 0.9, points, capacity, (round(capacity * 0.93, 2),
                                                                      round(capacity * 1.06, 2)),
                               checks, trusted, error))
    return Pictures(title, tuple(curves), tuple(lats), tuple(projections), tuple(twins))


class FakeSource(DataSource):
    can_switch_mode = True

    def __init__(self, config: EngineConfig | None = None, *, gpus: bool = False, pictures: bool = False,
                 thinking: bool = False, stored_runs: bool = True):
        """``thinking``: each reply starts with reasoning, as a thinking model's does; ``stored_runs``: its store
        holds runs 7 and 6 (False: none yet)."""
        super().__init__(config or EngineConfig(backend="fake"))
        self.thinking = thinking
        self.offered_tool: list[bool] = []                # chat's offer_tool argument, per turn
        self.chat_models: list[str | None] = []           # the model picked when each chat turn was sent
        self.pictures = pictures  # advise views carry fake_pictures()
        self.stored_runs = stored_runs
        self.mode = Mode(self.config.mode)
        self.n_ticks = 0
        self.applied: list[dict] = []
        self.advise_traffic: list[str | None] = []   # run_advise's traffic argument, per run
        self.started = self.stopped = False
        self.gpus = gpus
        self._gates: dict[str, threading.Event] = {}
        self.in_flight: dict[str, threading.Event] = {}   # what -> set once it waits at its gate
        self.advice_data: dict | None = None              # the live advice it reports (GET /advice's shape)
        self.applied_advice: list[str] = []               # the candidates the app switched to (apply_advice)

    # test control -----------------------------------------------------------------------------
    def hold(self, what: str) -> None:
        """Make ``what`` ("chat", "background", "advise") wait until ``release(what)``."""
        self._gates[what] = threading.Event()
        self.in_flight[what] = threading.Event()

    def release(self, what: str) -> None:
        self._gates.pop(what).set()

    def _wait(self, what: str) -> None:
        gate = self._gates.get(what)
        if gate is not None:
            self.in_flight[what].set()
            gate.wait(timeout=30)

    # the interface ----------------------------------------------------------------------------
    def start(self, emit: Emit) -> str:
        self.started = True
        return self.description

    @property
    def description(self) -> str:
        return f"fake source: {self.mode}" + (", chunk 256" if self.mode is Mode.COLOCATED else "")

    def stop(self) -> None:
        self.stopped = True
        for gate in self._gates.values():
            gate.set()

    def advice(self):
        return advice_view(self.advice_data)

    def tick(self) -> Tick:
        i = self.n_ticks = self.n_ticks + 1
        wave = (i * 7) % 11
        colocated = self.mode is Mode.COLOCATED  # the fake shows colocated, else a disaggregated pair
        hw = HardwareView(
            cpu_model="Fake CPU @ 2.0GHz", n_cpus=2, cpu_pct=40.0 + wave * 5, cpu_pct_per_core=(35.0, 65.0),
            ram_used_bytes=3 * GIB, ram_total_bytes=24 * GIB, gpus=(), gpu_note="no GPU on this box",
            processes=(ProcessView("app", 100, 3.0, 120 * MIB, 90 * MIB),
                       ProcessView(Role.COLOCATED if colocated else Role.DECODE, 101, 95.0, 240 * MIB,
                                   150 * MIB)))
        if colocated:
            workers = (_worker(Role.COLOCATED, 101, 0, (0, 1), 2, 1),)
            kv: dict = {"caches": (CacheView(Role.COLOCATED, 0.62, 744, 1200, 7 * MIB // 2, 12 * MIB, 4),)}
        else:
            workers = (_worker(Role.PREFILL, 101, 0, (0,), 1, 0), _worker(Role.DECODE, 102, 1, (1,), 2, 0))
            # why this shape: the arena as the engine reports it, one segment with two extents in transit
            kv = dict(kv_arena=ArenaView(91 * MIB, 2 * 3 * MIB, {"WRITING": 1, "READY": 1, "READING": 0},
                                         self.config.n_extents), kv_mb_s=3.2,
                      caches=(CacheView(Role.DECODE, 0.4, 480, 1200, 2 * MIB, mode=ReuseMode.EXACT),))
        arch = ArchitectureView(self.mode, "fake.gguf", 256 if colocated else None, 4096, workers,
                                {"waiting": 1, "prefilling": 1, "decoding": 2}, **kv,
                                events=("decode worker restarted after 1.2 s",) if "kv_arena" in kv else ())
        rows = (RequestRow(f"req-{i}", "finished", 40 + 30 * wave, 24, 180.0 + 40 * wave, 36.0 + wave, 48.0 + wave * 9,
                           stall=f"{300 + 20 * wave} ms ← req-{i - 1} (256 tok, same step)"
                           if wave > 6 else ""),)
        point = ChartPoint(i * 0.5, ttft_ms=150.0 + 60 * wave, itl_ms=40.0 + 25 * wave, tpot_ms=36.0 + wave,
                           tok_s=20.0 + 2 * wave, interference=1.0 + wave / 4)
        models = (ModelRow("fake-chat:latest", "chat", "loaded"), ModelRow("fake-coder:latest", "chat", "unloaded"),
                  ModelRow("fake-embed:latest", "embedding", "unloaded"))
        return Tick(hw, arch, rows, point, self.description, models)

    def chat(self, messages: list[dict], on_delta: OnDelta, *, max_tokens: int = CHAT_MAX_TOKENS,
             offer_tool: bool = False) -> ChatStats:
        self._wait("chat")
        self.offered_tool.append(offer_tool)
        self.chat_models.append(self.chat_model)
        question = messages[-1]["content"]
        if self.thinking:  # why two lines: the chat screen shows reasoning line by line
            for k, word in enumerate(f"The user wrote: {question}\nI repeat it back.".split(" ")):
                on_delta(Delta(DeltaKind.REASONING, word if k == 0 else " " + word))
        words = f"You said: {question}. This is turn {len(messages) // 2 + 1}.".split(" ")
        for k, word in enumerate(words):
            on_delta(Delta(DeltaKind.CONTENT, word if k == 0 else " " + word))
        if offer_tool:  # the model calls the demo tool, its arguments in two fragments
            on_delta(Delta(DeltaKind.TOOL_CALL_START, index=0, id="call_fake0", name="get_current_time"))
            for fragment in ('{"timezone": ', '"UTC"}'):
                on_delta(Delta(DeltaKind.TOOL_CALL_ARGS, fragment, index=0))
        kv = {} if self.mode is Mode.COLOCATED else {"kv_bytes": 3_200_000, "kv_transfer_ms": 4.1}
        # why: a later turn resends the history; the fake reuses the previous turn's prompt as its prefix
        cached = 0 if len(messages) < 3 else 20 + 10 * (len(messages) - 2)
        return ChatStats(self.mode, 120.0, 35.0, 20 + 10 * len(messages), len(words), "stop", **kv,
                         n_cached_tokens=cached)

    def background_prompt(self) -> ChatStats:
        self._wait("background")
        return ChatStats(self.mode, 2400.0, 38.0, 1200, 48, "length")

    def switch_mode(self, mode: str) -> str:
        self.mode = Mode(mode)
        return self.description

    def apply_advice(self, candidate: str) -> str:
        self.applied_advice.append(candidate)
        return f"{candidate} (switched by live advice)"

    def run_advise(self, quick: bool, emit: Emit, traffic: str | None = None) -> AdviseView:
        # why: textual (the app's messages) stays out of the data source's own imports
        from homepd.tui.messages import AdviseProgress

        self.advise_traffic.append(traffic)

        total = len(CANDIDATES[:3]) * len(MIXES)
        emit(AdviseProgress(AdviseStep(0, total, f"{CANDIDATES[0]} on the short trace (repeat 1/1)", CANDIDATES[0],
                                       0.0, None)))
        self._wait("advise")
        for n in range(1, total + 1):
            cand = CANDIDATES[(n - 1) // len(MIXES)]
            emit(AdviseProgress(AdviseStep(n, total, f"{cand} on the {MIXES[(n - 1) % 3]} trace done", cand,
                                           10.0 * n, 10.0 * (total - n))))
        return self._with_pictures(fake_advise_view())

    def list_runs(self, limit: int = 50) -> list[RunListRow]:
        if not self.stored_runs:
            return []
        return [RunListRow(7, "advise", "complete", "2026-01-02 10:00:00", 9, ", ".join(CANDIDATES[:3]),
                           "colocated-chunk-256 (colocated: best goodput, confidence medium)"),
                RunListRow(6, "advise", "incomplete", "2026-01-01 09:30:00", 2, CANDIDATES[0], "-")]

    def open_run(self, run_id: int) -> AdviseView:
        return self._with_pictures(fake_advise_view(run_id))

    def _with_pictures(self, view: AdviseView) -> AdviseView:
        if not self.pictures:
            return view
        return dataclasses.replace(view, pictures=fake_pictures(view.title), ttft_budget_ms=4000.0,
                                   itl_budget_ms=100.0)

    def apply(self, values: dict) -> str:
        self.applied.append(dict(values))
        return "/fake/config.toml"
