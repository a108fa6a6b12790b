"""A stored run as typed records, decoded once: ``decode_run(Store.get_run(...))`` -> ``Run``.

The readers of a run (advise's report and pictures, the export, live advice, the app) read attributes of
these frozen records, never the plain dicts: a corrupt row fails here with a ``RecordShapeError`` that names
the field, and a row older than a field gets that field's default here (``from_stored``), not a ``.get()``
later.  A live advise result is turned into the same ``Run`` (``homepd.advise.campaign.run.AdviseResult.run``,
through the store's own row functions), so one reader serves both.

    Run                  the run's columns, its configuration (``RunConfig``), its probes, its advice
    RunProbe             one result row: a candidate on a mix (``mix@rate/s``: a capacity probe) and repeat
    RequestTimeline      one request of a probe: its figures and the time of every token
    RunAdvice            an advise recommendation: the answer, the capacity curves, every candidate
    MixPick, NotExercised  parts of the advice

The JSON on disk is unchanged: ``Store.get_run`` still returns it as plain dicts (``homepd history export``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from homepd.core.terms import RequestClass
from homepd.core.lifecycle import RequestState, RequestTimings
from homepd.core.modes import Candidate, Mode
from homepd.core.records import RecordShapeError, from_stored
from homepd.measure.curve import CapacityCurve
from homepd.measure.metrics import SLO
from homepd.twin.records import TwinEvidence

MEASURED = "measured"      # a result's status: measured, else "infeasible" (with its reason)


@dataclass(frozen=True)
class RequestTimeline:
    """One request of a probe (``requests.lifecycle_json``): its figures and the time of every token."""
    timings: RequestTimings
    token_times_s: tuple[float, ...] = ()
    routed_to: str | None = None        # disaggregated: "decode" (kept local) or "prefill"

    @property
    def is_finished(self) -> bool:
        return self.timings.state is RequestState.FINISHED

    @property
    def is_interactive(self) -> bool:
        return self.timings.request_class is RequestClass.INTERACTIVE

    @property
    def n_uncached_prompt_tokens(self) -> int:
        return self.timings.n_prompt_tokens - self.timings.n_cached_tokens


@dataclass(frozen=True)
class RunProbe:
    """One result: a candidate on a mix (``mixed@0.5/s`` for a capacity probe, its rate in the name) and a
    repeat, measured (the flattened figures, ms unless named) or infeasible (``reason``).  ``requests``: the
    request timelines, when the run was read with them."""
    candidate: str
    status: str                         # MEASURED or "infeasible"
    mix: str | None = None
    repeat: int | None = None
    reason: str | None = None
    mode: str | None = None             # the record's mode ("colocated"...; "http-client" for bench slo)
    n_requests: int | None = None
    n_finished: int | None = None
    n_failed: int | None = None
    n_worker_deaths: int | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    e2e_p99_ms: float | None = None
    prompt_tok_s: float | None = None
    output_tok_s: float | None = None
    goodput_per_s: float | None = None
    slo_attainment: float | None = None
    interference_slowdown: float | None = None
    total_pss_bytes: int | None = None
    kv_transfer_ms_p50: float | None = None   # the record's summary (None: no KV moved, or no record)
    requests: tuple[RequestTimeline, ...] = ()

    @property
    def is_measured(self) -> bool:
        return self.status == MEASURED

    @property
    def architecture(self) -> Mode | None:
        """The mode as a ``Mode`` (None for a mode that is not one of homepd's, e.g. bench slo's client)."""
        try:
            return Mode(self.mode)
        except ValueError:
            return None


@dataclass(frozen=True)
class MixPick:
    """The answer on one prompt mix."""
    mix: str
    candidate: str


@dataclass(frozen=True)
class NotExercised:
    """A candidate's runs on a mix that did not exercise its architecture (shown, never ranked)."""
    candidate: str
    mix: str
    reason: str


@dataclass(frozen=True)
class RunAdvice:
    """An advise recommendation (``recommendations.data_json``: ``to_plain(Recommendation)`` plus the campaign's
    capacity curves, every candidate and what did not exercise its architecture).  A recommendation stored
    before candidates were lists only the recommended one in ``candidates``; one stored before curves, none;
    the oldest hold only the ``config`` they applied (no rule: ``rule`` empty)."""
    candidate: Candidate | None = None
    config: dict = dataclasses.field(default_factory=dict)   # the EngineConfig values it applies
    rule: str = ""
    reason: str = ""
    confidence: str = ""
    confidence_why: str = ""
    per_mix: tuple[MixPick, ...] = ()
    capacity: tuple[CapacityCurve, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    not_exercised: tuple[NotExercised, ...] = ()
    twins: tuple[TwinEvidence, ...] = ()     # each candidate's twin: calibration, capacities, checks (none before it)

    def twin(self, candidate: str) -> TwinEvidence | None:
        return next((t for t in self.twins if t.candidate == candidate), None)

    def curve(self, candidate: str, mix: str = "mixed") -> CapacityCurve | None:
        """The candidate's curve on ``mix``, else its first one."""
        mine = [c for c in self.capacity if c.candidate == candidate]
        return next((c for c in mine if c.mix == mix), mine[0] if mine else None)

    def is_exercised(self, candidate: str, mix: str) -> bool:
        return not any(f.candidate == candidate and f.mix == mix for f in self.not_exercised)


@dataclass(frozen=True)
class RunConfig:
    """What a run's configuration (``runs.config_json``; advise: the base ``EngineConfig`` and the
    ``AdviseSettings``) says that its readers use; each default is the one the configuration had when the
    field did not exist."""
    model: str = ""
    n_ctx: int = 4096
    n_seq_max: int = 8
    n_threads: int | None = None
    prefix_cache: bool = True
    itl_budget_ms: float | None = 100.0     # the base's interactive per-token budget
    slo: SLO = SLO()                        # the campaign's SLO (a run before it stored one: the base's budgets)
    max_tokens: int = 32                    # the campaign's trace settings
    long_tokens: int = 400
    seed: int = 0

    @property
    def budgets_ms(self) -> tuple[float, float | None]:
        """(TTFT, ITL) budget of the interactive class the pictures draw: the SLO's (an SLO that checks no
        per-token target: the base's per-token budget)."""
        return self.slo.ttft_ms, self.slo.itl_ms or self.itl_budget_ms or SLO().itl_ms


@dataclass(frozen=True)
class Run:
    """A run as the store keeps it (``Store.load_run``), or a live advise result in the same shape."""
    id: int | None
    kind: str
    status: str
    config: RunConfig
    probes: tuple[RunProbe, ...]
    advice: RunAdvice | None            # the latest advise recommendation (None: none, or another kind's)
    headline: str | None = None         # the latest recommendation's one-liner
    n_recommendations: int = 0
    started_at: str | None = None
    ended_at: str | None = None
    error: str | None = None
    hardware: dict | None = None        # the probe snapshot (``homepd.hw.probe.to_dict``), read by hw's own code
    n_physical_cores: int | None = None  # of that probe

    @property
    def measured(self) -> tuple[RunProbe, ...]:
        return tuple(p for p in self.probes if p.is_measured)


# ---- decoding ---------------------------------------------------------------------------------

def decode_run(data: dict) -> Run:
    """``Store.get_run``'s plain dict -> ``Run``; ``RecordShapeError`` naming the field of a corrupt row."""
    path = f"run {data.get('id', '?')}"
    _expect_dict(data, path)
    recs = data.get("recommendations") or []
    advice_rows = [r for r in recs if isinstance(r.get("data"), dict)] if data.get("kind") == "advise" else []
    hardware = data.get("hardware")
    cpu = hardware.get("cpu") if isinstance(hardware, dict) else None
    cores = cpu.get("physical_cores") if isinstance(cpu, dict) else None
    columns = from_stored(_RunColumns, data, path)
    return Run(
        id=columns.id, kind=columns.kind, status=columns.status, started_at=columns.started_at,
        ended_at=columns.ended_at, error=columns.error, config=decode_config(data.get("config"), f"{path}.config"),
        probes=tuple(decode_probe(r, f"{path}.results[{i}]") for i, r in enumerate(data.get("results") or ())),
        advice=decode_advice(advice_rows[-1]["data"], f"{path}.recommendation") if advice_rows else None,
        headline=recs[-1].get("headline") if recs else None, n_recommendations=len(recs),
        hardware=hardware if isinstance(hardware, dict) else None,
        n_physical_cores=cores if isinstance(cores, int) else None)


@dataclass(frozen=True)
class _RunColumns:
    id: int | None
    kind: str
    status: str
    started_at: str | None = None
    ended_at: str | None = None
    error: str | None = None


def decode_config(config, path: str = "config") -> RunConfig:
    """A run's configuration: an advise run's ``{"base": EngineConfig, "settings": AdviseSettings}`` (plain);
    any other shape keeps the defaults."""
    config = config if isinstance(config, dict) else {}
    base = config.get("base") if isinstance(config.get("base"), dict) else {}
    settings = config.get("settings") if isinstance(config.get("settings"), dict) else {}
    fields = {k: base[k] for k in ("model", "n_ctx", "n_seq_max", "n_threads", "prefix_cache", "itl_budget_ms")
              if base.get(k) is not None or k in ("n_threads", "itl_budget_ms") and k in base}
    fields.update({k: settings[k] for k in ("max_tokens", "long_tokens", "seed") if settings.get(k) is not None})
    if "model" in fields:
        fields["model"] = str(fields["model"])  # why: a path, written as its text
    decoded = from_stored(RunConfig, fields, path)
    return dataclasses.replace(decoded, slo=_slo(settings.get("slo"), base, f"{path}.settings.slo"))


def _slo(slo, base: dict, path: str) -> SLO:
    """The stored SLO; an older one names its per-token target ``tpot_ms``; a run that stored none had the
    base's budgets (today's defaults where the base lacks them too)."""
    if not isinstance(slo, dict):
        default = SLO()
        return SLO(ttft_ms=float(base.get("ttft_budget_ms") or default.ttft_ms),
                   itl_ms=base.get("itl_budget_ms", default.itl_ms))
    slo = dict(slo)
    if "itl_ms" not in slo and "tpot_ms" in slo:
        slo["itl_ms"] = slo.pop("tpot_ms")
    if slo.get("ttft_ms") is None:  # why: "or" in the readers this replaces: a missing TTFT is the base's
        slo["ttft_ms"] = float(base.get("ttft_budget_ms") or SLO().ttft_ms)
    return from_stored(SLO, slo, path)


def decode_probe(row: dict, path: str = "result") -> RunProbe:
    """One ``results`` row (``Store.get_run``'s, its record decoded) -> ``RunProbe``."""
    _expect_dict(row, path)
    record = row.get("record")
    fields = {k: v for k, v in row.items() if k not in ("record", "requests")}
    if isinstance(record, dict):
        if fields.get("mode") is None:
            fields["mode"] = record.get("mode")
        fields["kv_transfer_ms_p50"] = _kv_transfer_ms_p50(record)
        fields["requests"] = [_timeline_fields(r) for r in record.get("requests") or ()]
    return from_stored(RunProbe, fields, path)


def _kv_transfer_ms_p50(record: dict) -> float | None:
    kv = (record.get("summary") or {}).get("kv")
    return kv["transfer_ms"]["p50"] if isinstance(kv, dict) and isinstance(kv.get("transfer_ms"), dict) else None


# the figures a stored request may predate (the store is older than them), and what they were then.
# kv_slot_wait_s: kv_extent_wait_s's old name (renamed_from), which every row that has the figure carries
_REQUEST_DEFAULTS = {"request_class": RequestClass.INTERACTIVE.value, "queue_wait_s": None, "e2e_s": None,
                     "prompt_tok_s": None, "decode_tok_s": None, "n_resumes": 0, "kv_bytes": None,
                     "kv_transfer_s": None, "kv_export_s": None, "kv_import_s": None, "kv_slot_wait_s": None}


def _timeline_fields(lifecycle) -> dict:
    """A stored request (``Lifecycle.to_dict()`` plus ``token_times_s``) as ``RequestTimeline``'s fields."""
    if not isinstance(lifecycle, dict):
        return lifecycle  # from_stored names it
    return {"timings": {**_REQUEST_DEFAULTS, **lifecycle},
            **{k: lifecycle[k] for k in ("token_times_s", "routed_to") if k in lifecycle}}


def decode_advice(data: dict, path: str = "recommendation") -> RunAdvice:
    """A stored advise recommendation -> ``RunAdvice`` (an older one that lists no candidates: the recommended
    one)."""
    _expect_dict(data, path)
    advice = from_stored(RunAdvice, data, path)
    if not advice.candidates and advice.candidate is not None:
        advice = dataclasses.replace(advice, candidates=(advice.candidate,))
    return advice


def _expect_dict(value, path: str) -> None:
    if not isinstance(value, dict):
        raise RecordShapeError(f"{path}: expected an object, got {type(value).__name__}")
