"""Metrics computed from request lifecycles and the step log.

Everything here is derived, never measured twice: TTFT, TPOT, queue wait come
from ``Lifecycle`` timestamps; interference comes from the step log — how much
longer a decode step takes when prompt tokens share it (colocated) or when the
prefill worker runs at the same time (disaggregated).
"""
from __future__ import annotations

import bisect
import enum
import statistics
from dataclasses import dataclass, field

from homepd.core.terms import ClassBudget, RequestClass
from homepd.core.protocol import StepRecord
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.modes import Role
from homepd.core.records import renamed_from
from homepd.stats import percentile
from homepd.config import EngineConfig

_INTERACTIVE = EngineConfig().class_budgets[RequestClass.INTERACTIVE]
_BACKGROUND = EngineConfig().class_budgets[RequestClass.BACKGROUND]


@dataclass(frozen=True)
class Interference:
    """How much longer decode steps take when prefill work disturbs them.

    Colocated: a decode step is disturbed when prompt tokens share it.
    Disaggregated: when a prefill step of the other worker ran at the same time
    (shared memory bandwidth, caches, SMT siblings or the GPU).
    """
    decode_only_steps: int
    mixed_steps: int
    decode_only_ms: float | None   # median duration of undisturbed decode steps
    mixed_ms: float | None         # median duration of disturbed decode steps
    mixed_prompt_tokens: float | None  # mean prompt tokens in (or beside) the disturbed steps
    slowdown: float | None         # disturbed / undisturbed, matched on decode batch size; 1.0 = none


def _overlapping_prefill(step: StepRecord, starts: list[float], spans: list[StepRecord]) -> StepRecord | None:
    """The prefill step that ran during at least half of ``step``, if any."""
    # why: one prefill worker's steps are disjoint and ordered: check the ones starting before step ends
    i = bisect.bisect_left(starts, step.t_end_s) - 1
    length = step.t_end_s - step.t_start_s
    overlap, best = 0.0, None
    while i >= 0 and spans[i].t_end_s > step.t_start_s:
        shared = min(spans[i].t_end_s, step.t_end_s) - max(spans[i].t_start_s, step.t_start_s)
        overlap += shared
        best = best or spans[i]
        i -= 1
    return best if length > 0 and overlap >= length / 2 else None


def interference(steps: list[StepRecord]) -> Interference:
    """Interference of prefill on decode, measured on the live step log."""
    spans = sorted((s for s in steps if s.worker_role == Role.PREFILL), key=lambda s: s.t_start_s)
    starts = [s.t_start_s for s in spans]
    alone: dict[int, list[float]] = {}
    mixed: dict[int, list[float]] = {}
    prompt_tokens: list[int] = []
    for s in steps:
        if not s.n_decode_tokens:
            continue
        beside = None if s.n_prompt_tokens else _overlapping_prefill(s, starts, spans)
        if s.n_prompt_tokens or beside is not None:
            mixed.setdefault(s.n_decode_tokens, []).append(s.duration_ms)
            prompt_tokens.append(s.n_prompt_tokens or beside.n_prompt_tokens)
        else:
            alone.setdefault(s.n_decode_tokens, []).append(s.duration_ms)
    matched = [(len(mixed[n]), statistics.median(mixed[n]) / statistics.median(alone[n]))
               for n in mixed if n in alone]
    all_alone = [d for ds in alone.values() for d in ds]
    all_mixed = [d for ds in mixed.values() for d in ds]
    return Interference(
        decode_only_steps=len(all_alone), mixed_steps=len(all_mixed),
        decode_only_ms=statistics.median(all_alone) if all_alone else None,
        mixed_ms=statistics.median(all_mixed) if all_mixed else None,
        mixed_prompt_tokens=statistics.mean(prompt_tokens) if prompt_tokens else None,
        slowdown=sum(w * r for w, r in matched) / sum(w for w, _ in matched) if matched else None)


@dataclass(frozen=True)
class Dist:
    """A distribution of one latency, in milliseconds (nearest-rank percentiles; None when empty)."""
    n: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values_ms: list[float]) -> "Dist":
        v = list(values_ms)
        return cls(n=len(v), mean=statistics.mean(v) if v else None, p50=percentile(v, 50), p90=percentile(v, 90),
                   p95=percentile(v, 95), p99=percentile(v, 99), max=max(v) if v else None)


class TokenTarget(str, enum.Enum):
    """What an interactive request's per-token budget is checked against."""
    EVERY_GAP = "gap"     # every inter-token gap within the budget: a stall fails the request (the default)
    P99_GAP = "p99"       # the p99 of its gaps (nearest rank: at most 1 % of them over; with < 100 gaps, all)
    MEAN_TPOT = "tpot"    # its mean time per output token (a stall hides in the mean)


class SLOTarget(str, enum.Enum):
    """Which part of the SLO a request missed (the first that fails, in this order)."""
    FINISHED = "finished"
    TTFT = "ttft"
    TOKEN = "token"
    BACKGROUND_TTFT = "background_ttft"


@dataclass(frozen=True)
class SLO:
    """The latency targets a request must meet to count towards goodput (DistServe's definition), per request
    class.  Built from the engine's one table of class budgets (``SLO.from_budgets(config.class_budgets)``):
    interactive TTFT <= ``ttft_ms`` and each gap <= ``itl_ms`` (``token_target`` says which statistic of the
    gaps: every gap by default, else their p99 or mean); background TTFT <= ``background_ttft_ms``.  Every
    request must finish.  ``itl_ms`` None: per-token latency not checked."""
    ttft_ms: float = _INTERACTIVE.ttft_ms
    itl_ms: float | None = _INTERACTIVE.itl_ms
    token_target: TokenTarget = TokenTarget.EVERY_GAP
    background_ttft_ms: float = _BACKGROUND.ttft_ms

    def __post_init__(self):
        object.__setattr__(self, "token_target", TokenTarget(self.token_target))

    @classmethod
    def from_budgets(cls, budgets: dict[RequestClass, ClassBudget], **overrides) -> "SLO":
        """The SLO that the class budgets ``budgets`` (``EngineConfig.class_budgets``) state; ``overrides``
        (a field name -> value, None values ignored) replace single targets (the ``--slo-*`` flags)."""
        fields = dict(ttft_ms=budgets[RequestClass.INTERACTIVE].ttft_ms,
                      itl_ms=budgets[RequestClass.INTERACTIVE].itl_ms,
                      background_ttft_ms=budgets[RequestClass.BACKGROUND].ttft_ms)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def miss(self, lc: Lifecycle) -> SLOTarget | None:
        """The target ``lc`` missed (None: it met every target of its class)."""
        if lc.state is not RequestState.FINISHED or lc.ttft_s is None:
            return SLOTarget.FINISHED
        if lc.request_class is RequestClass.BACKGROUND:
            return SLOTarget.BACKGROUND_TTFT if lc.ttft_s * 1e3 > self.background_ttft_ms else None
        if lc.ttft_s * 1e3 > self.ttft_ms:
            return SLOTarget.TTFT
        if self.itl_ms is None or not lc.itl_s:
            return None
        if self.token_target is TokenTarget.EVERY_GAP:
            over = max(lc.itl_s) * 1e3 > self.itl_ms
        elif self.token_target is TokenTarget.P99_GAP:
            over = percentile(lc.itl_s, 99) * 1e3 > self.itl_ms
        else:
            over = lc.tpot_s * 1e3 > self.itl_ms
        return SLOTarget.TOKEN if over else None

    def is_met_by(self, lc: Lifecycle) -> bool:
        return self.miss(lc) is None

    def is_doomed(self, lc: Lifecycle, now_s: float) -> bool:
        """Whether a *running* interactive request can no longer meet its targets: no first token and already
        past the TTFT target, or (every-gap target) a gap over the per-token target so far."""
        if lc.request_class is not RequestClass.INTERACTIVE:
            return False
        if lc.first_token_s is None:
            return (now_s - lc.arrived_s) * 1e3 > self.ttft_ms
        gaps = lc.itl_s
        return (self.token_target is TokenTarget.EVERY_GAP and self.itl_ms is not None and bool(gaps)
                and max(gaps) * 1e3 > self.itl_ms)

    def target_text(self, target: SLOTarget) -> str:
        """One target in words, as the evidence names the one that decided (``every gap <= 100 ms``)."""
        if target is SLOTarget.FINISHED:
            return "every request finishes"
        if target is SLOTarget.TTFT:
            return f"interactive TTFT <= {self.ttft_ms / 1e3:g} s"
        if target is SLOTarget.BACKGROUND_TTFT:
            return f"background TTFT <= {self.background_ttft_ms / 1e3:g} s"
        what = {TokenTarget.EVERY_GAP: "every gap", TokenTarget.P99_GAP: "p99 gap",
                TokenTarget.MEAN_TPOT: "mean TPOT"}[self.token_target]
        return f"{what} <= {self.itl_ms:g} ms"

    @property
    def per_token_ms(self) -> float | None:
        """The per-token budget, whichever statistic checks it (the stall threshold of the evidence)."""
        return self.itl_ms

    def describe(self) -> str:
        """The targets in words, per class."""
        parts = [self.target_text(SLOTarget.TTFT)]
        if self.itl_ms is not None:
            parts.append(self.target_text(SLOTarget.TOKEN))
        return (f"interactive: {', '.join(p.removeprefix('interactive ') for p in parts)}; background: TTFT <= "
                f"{self.background_ttft_ms / 1e3:g} s; every request finishes")


@dataclass(frozen=True)
class KVSummary:
    """Disaggregated runs: the KV handoff of the requests that moved."""
    n_moved: int
    bytes_mean: float
    bytes_total: int
    transfer_ms: Dist               # prompt done -> imported on the decode worker
    export_ms_p50: float | None
    import_ms_p50: float | None
    extent_wait_ms_p95: float | None = field(  # prompt done -> extent allocated; JSON: under its old
        metadata=renamed_from("slot_wait_ms_p95"))  # name too


@dataclass(frozen=True)
class RunSummary:
    """Run-level figures for a set of requests and the step log they produced (seconds in, ms out)."""
    n_requests: int
    n_finished: int
    n_failed: int
    n_cancelled: int
    n_resumed: int
    n_prompt_tokens: int
    n_output_tokens: int
    span_s: float
    prompt_tok_s: float | None      # prompt tokens / time of the steps that carried prompt tokens
    output_tok_s: float | None
    request_per_s: float | None
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    queue_ms: Dist
    n_steps: int
    max_prompt_tokens_per_step: int
    interference: Interference
    interference_kind: str          # "same_step" (colocated) or "concurrent" (disaggregated)
    kv: KVSummary | None
    slo: SLO
    n_slo_met: int
    goodput_per_s: float | None     # requests per second that met every SLO
    # two queues, two budgets: how far admission's TTFT predictions were off (|predicted - actual|), what it
    # decided, and the interactive class's own gaps
    ttft_prediction_error_ms: Dist | None = None
    n_rejected: int = 0
    n_deferred: int = 0
    interactive_itl_ms: Dist | None = None
    n_cached_prompt_tokens: int = 0  # of n_prompt_tokens, those reused from a cached prefix (not computed)

    @property
    def slo_attainment(self) -> float | None:
        return self.n_slo_met / self.n_requests if self.n_requests else None

    @property
    def n_computed_prompt_tokens(self) -> int:
        """Prompt tokens of finished requests that were prefilled (not reused from a cached prefix)."""
        return self.n_prompt_tokens - self.n_cached_prompt_tokens

    @property
    def cached_prompt_share(self) -> float | None:
        """Share of the finished requests' prompt tokens reused from a cached prefix (None: no prompt tokens)."""
        return self.n_cached_prompt_tokens / self.n_prompt_tokens if self.n_prompt_tokens else None


def summarize(records: list[Lifecycle], steps: list[StepRecord], slo: SLO | None = None) -> RunSummary:
    """Run-level figures for ``records`` (finished or not) and the step log ``steps``."""
    slo = slo or SLO()
    done = [r for r in records if r.state is RequestState.FINISHED]
    prompt_steps = [s for s in steps if s.n_prompt_tokens]
    prompt_step_s = sum(s.t_end_s - s.t_start_s for s in prompt_steps)
    n_out = sum(len(r.token_times_s) for r in done)
    span_s = (max(r.ended_s for r in done) - min(r.arrived_s for r in done)) if done else 0.0
    moved = [r for r in done if r.kv_bytes]
    kv = None
    if moved:
        kv = KVSummary(
            n_moved=len(moved), bytes_mean=statistics.mean(r.kv_bytes for r in moved),
            bytes_total=sum(r.kv_bytes for r in moved),
            transfer_ms=Dist.of([r.transfer_s * 1e3 for r in moved if r.transfer_s is not None]),
            export_ms_p50=percentile([r.kv_export_s * 1e3 for r in moved if r.kv_export_s is not None], 50),
            import_ms_p50=percentile([r.kv_import_s * 1e3 for r in moved if r.kv_import_s is not None], 50),
            extent_wait_ms_p95=percentile([r.kv_extent_wait_s * 1e3 for r in moved
                                           if r.kv_extent_wait_s is not None], 95))
    n_met = sum(slo.is_met_by(r) for r in records)
    return RunSummary(
        n_requests=len(records), n_finished=len(done),
        n_failed=sum(r.state is RequestState.FAILED for r in records),
        n_cancelled=sum(r.state is RequestState.CANCELLED for r in records),
        n_resumed=sum(r.n_resumes > 0 for r in records),
        n_prompt_tokens=sum(r.n_prompt_tokens for r in done), n_output_tokens=n_out, span_s=span_s,
        prompt_tok_s=sum(s.n_prompt_tokens for s in prompt_steps) / prompt_step_s if prompt_step_s else None,
        output_tok_s=n_out / span_s if span_s > 0 else None,
        request_per_s=len(done) / span_s if span_s > 0 else None,
        ttft_ms=Dist.of([r.ttft_s * 1e3 for r in done if r.ttft_s is not None]),
        tpot_ms=Dist.of([r.tpot_s * 1e3 for r in done if r.tpot_s is not None]),
        itl_ms=Dist.of([x * 1e3 for r in done for x in r.itl_s]),
        e2e_ms=Dist.of([(r.ended_s - r.arrived_s) * 1e3 for r in done if r.ended_s is not None]),
        queue_ms=Dist.of([r.queue_wait_s * 1e3 for r in done if r.queue_wait_s is not None]),
        n_steps=len(steps), max_prompt_tokens_per_step=max((s.n_prompt_tokens for s in steps), default=0),
        interference=interference(steps),
        interference_kind="concurrent" if any(s.worker_role == Role.PREFILL for s in steps) else "same_step",
        kv=kv, slo=slo, n_slo_met=n_met, goodput_per_s=n_met / span_s if span_s > 0 else None,
        ttft_prediction_error_ms=Dist.of([abs(r.ttft_s - r.predicted_ttft_s) * 1e3 for r in done
                                          if r.ttft_s is not None and r.predicted_ttft_s is not None]),
        n_rejected=sum(r.admission == "reject" for r in records),
        n_deferred=sum(r.admission == "defer" for r in records),
        interactive_itl_ms=Dist.of([x * 1e3 for r in done if r.request_class == RequestClass.INTERACTIVE
                                    for x in r.itl_s]),
        n_cached_prompt_tokens=sum(r.n_cached_tokens for r in done))
