"""The request lifecycle: an explicit state machine with a timestamp at each transition.

All timestamps are ``time.monotonic()`` seconds (CLOCK_MONOTONIC, shared by every process on the box), so
worker-side and controller-side times compare. Metrics (queue wait, TTFT, TPOT, transfer time) fall out of the
record, as one ``RequestTimings``: the figures of ``Lifecycle.to_dict``, of the ``homepd`` object in every HTTP
response, and of what the app shows.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from homepd.core.terms import RequestClass
from homepd.core.records import OLD_NAME, FinishReason, RecordShapeError, from_plain, renamed_from, to_plain


class RequestState(enum.Enum):
    WAITING = "waiting"          # arrived, not yet admitted to a worker sequence
    PREFILLING = "prefilling"    # prompt being evaluated
    TRANSFERRING = "transferring"  # KV state moving prefill -> decode worker
    DECODING = "decoding"        # generating tokens
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED)


_ALLOWED: dict[RequestState, set[RequestState]] = {
    RequestState.WAITING: {RequestState.PREFILLING},
    RequestState.PREFILLING: {RequestState.TRANSFERRING, RequestState.DECODING, RequestState.FINISHED},
    # a worker death sends a request back to PREFILLING when it is resumed by recompute
    RequestState.TRANSFERRING: {RequestState.DECODING, RequestState.FINISHED, RequestState.PREFILLING},
    RequestState.DECODING: {RequestState.FINISHED, RequestState.TRANSFERRING, RequestState.PREFILLING},
    RequestState.FINISHED: set(),
    RequestState.FAILED: set(),
    RequestState.CANCELLED: set(),
}
for _state in RequestState:
    if not _state.is_terminal:
        _ALLOWED[_state] |= {RequestState.FAILED, RequestState.CANCELLED}


def end_state(reason: FinishReason) -> RequestState:
    """The state a request that ended for ``reason`` is left in."""
    if reason is FinishReason.CANCELLED:
        return RequestState.CANCELLED
    return RequestState.FAILED if reason is FinishReason.ERROR else RequestState.FINISHED


class LifecycleError(AssertionError):
    """An illegal transition: an internal bug, never a user error."""


# ``Lifecycle.resumed_by``'s value for a request whose KV was re-imported from its arena extent after a worker
# death.  The value in JSON (``/events``, the store) keeps the extent's old name, "slot", so that readers of
# it and stored runs read it as they did.
RESUMED_FROM_EXTENT = "slot"


@dataclass(frozen=True)
class RequestTimings:
    """One request's figures (seconds, tokens, tokens per second), from ``Lifecycle.timings``.

    ``to_dict`` is the shape everywhere: inside ``Lifecycle.to_dict`` (``/events``, the store, ``--json``) and,
    with the mode, ``homepd serve``'s ``homepd`` object.  The ``kv_`` figures are None unless the request's KV
    was handed off (disaggregated, prefilled on the prefill worker)."""
    request_id: str
    state: RequestState
    request_class: RequestClass
    n_prompt_tokens: int
    n_output_tokens: int
    queue_wait_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None                  # arrival -> end
    prompt_tok_s: float | None           # prompt tokens computed (not reused from a cached prefix) / prefill time
    decode_tok_s: float | None           # 1 / TPOT
    n_resumes: int
    kv_bytes: int | None
    kv_transfer_s: float | None          # prompt done -> KV imported
    kv_export_s: float | None
    kv_import_s: float | None
    kv_extent_wait_s: float | None = field(  # prompt done -> extent allocated in the arena (back-pressure);
        metadata=renamed_from("kv_slot_wait_s"))  # JSON: under its old name too
    n_kv_preemptions: int = 0            # times the full KV context preempted it (recomputed: nothing lost)
    ended_by_kv_full: bool = False       # ended with 'length' because the KV context was full (kvpolicy)
    n_cached_tokens: int = 0             # prompt tokens not computed: a cached prefix was reused
    ttfa_s: float | None = None          # arrival -> first answer token, past any reasoning (set by the face
                                         # that parses the reply; None where none did)

    def to_dict(self) -> dict:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RequestTimings":
        """The exact inverse of ``to_dict``; ``RecordShapeError`` on a missing, unknown or mistyped field."""
        return from_plain(cls, data)

    @classmethod
    def from_lifecycle_dict(cls, data: dict) -> "RequestTimings":
        """The figures inside a ``Lifecycle.to_dict()`` (which adds timestamps); every figure must be there."""
        names = {f.name: f.metadata.get(OLD_NAME) for f in dataclasses.fields(cls)}
        missing = [n for n, old in names.items() if n not in data and old not in data]
        if missing:
            raise RecordShapeError(f"request {data.get('request_id', '?')}: missing field(s) {', '.join(missing)}")
        return from_plain(cls, {k: data[k] for k in (*names, *filter(None, names.values())) if k in data})


@dataclass
class Lifecycle:
    """State plus the time of every transition and every generated token."""

    request_id: str
    arrived_s: float
    state: RequestState = RequestState.WAITING
    admitted_s: float | None = None
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    transfer_start_s: float | None = None
    transfer_end_s: float | None = None
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    ended_s: float | None = None
    error: str | None = None
    finish_reason: FinishReason | None = None
    n_prompt_tokens: int = 0
    request_class: RequestClass = RequestClass.INTERACTIVE  # its latency budgets
    predicted_ttft_s: float | None = None  # admission's prediction when it arrived
    admission: str | None = None         # a homepd.core.admission.Verdict value: "admit", "defer" or "reject"
    n_prefilled: int = 0                 # prompt tokens prefilled so far (from the step log)
    # KV handoff (disaggregated): bytes moved and where the transfer time went
    kv_bytes: int | None = None
    kv_extent_wait_s: float | None = None
    kv_export_s: float | None = None
    kv_import_s: float | None = None
    # recovery: how often a worker death interrupted it, and how it came back
    n_resumes: int = 0
    resumed_by: list[str] = field(default_factory=list)  # RESUMED_FROM_EXTENT (KV re-imported) or "recompute"
    # the full KV context (homepd.core.kvpolicy): times it was preempted and recomputed, and whether it
    # ended with 'length' because the context was full rather than at its max_tokens
    n_kv_preemptions: int = 0
    ended_by_kv_full: bool = False
    n_cached_tokens: int = 0             # prompt tokens reused from a cached prefix (the latest prefill's)
    # routing (homepd.core.routing): the worker it entered, why (a RouteReason value), and the prompt tokens
    # the controller expected that worker to hold (compare n_cached_tokens: what it reused)
    routed_to: str | None = None
    route_reason: str | None = None
    route_cached_tokens: int = 0
    # the first token of the answer itself, past any reasoning (set by the face that parses the reply:
    # homepd.serve): what a user of a thinking model waits for
    first_answer_s: float | None = None

    def __post_init__(self):
        self.request_class = RequestClass(self.request_class)
        self.finish_reason = FinishReason.parse(self.finish_reason)

    def advance(self, new: RequestState, at_s: float) -> None:
        """Move to ``new``; the only place the state changes."""
        if new is self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise LifecycleError(f"request {self.request_id}: {self.state.value} -> {new.value} is not allowed")
        self.state = new
        if new is RequestState.PREFILLING:
            self.admitted_s = self.admitted_s if self.admitted_s is not None else at_s
            self.prefill_start_s = self.prefill_start_s if self.prefill_start_s is not None else at_s
        elif new is RequestState.TRANSFERRING:
            self.transfer_start_s, self.transfer_end_s = at_s, None
        elif new.is_terminal:
            self.ended_s = at_s

    def add_token(self, at_s: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = at_s
        self.token_times_s.append(at_s)

    # derived metrics ---------------------------------------------------
    @property
    def queue_wait_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrived_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrived_s

    @property
    def ttfa_s(self) -> float | None:
        """Arrival to the first answer token (after any reasoning; None until the reply parser saw one)."""
        return None if self.first_answer_s is None else self.first_answer_s - self.arrived_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times_s
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def transfer_s(self) -> float | None:
        if self.transfer_start_s is None or self.transfer_end_s is None:
            return None
        return self.transfer_end_s - self.transfer_start_s

    def timings(self) -> RequestTimings:
        prefill_s = (self.prefill_end_s - self.prefill_start_s) if self.prefill_end_s and self.prefill_start_s \
            else None
        n_out = len(self.token_times_s)
        return RequestTimings(
            request_id=self.request_id, state=self.state, request_class=self.request_class,
            n_prompt_tokens=self.n_prompt_tokens, n_output_tokens=n_out, queue_wait_s=self.queue_wait_s,
            ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=None if self.ended_s is None else self.ended_s - self.arrived_s,
            # why computed only: a follow-up turn with 578 of 599 tokens reused read 28x its real prefill speed
            prompt_tok_s=(self.n_prompt_tokens - self.n_cached_tokens) / prefill_s
            if prefill_s and self.n_prompt_tokens > self.n_cached_tokens else None,
            decode_tok_s=1.0 / self.tpot_s if self.tpot_s else None, n_resumes=self.n_resumes,
            kv_bytes=self.kv_bytes, kv_transfer_s=self.transfer_s,
            kv_export_s=self.kv_export_s, kv_import_s=self.kv_import_s, kv_extent_wait_s=self.kv_extent_wait_s,
            n_kv_preemptions=self.n_kv_preemptions, ended_by_kv_full=self.ended_by_kv_full,
            n_cached_tokens=self.n_cached_tokens, ttfa_s=self.ttfa_s)

    def to_dict(self) -> dict:
        """``timings()`` as a dict plus the transition times and what admission and recovery did."""
        return {
            **self.timings().to_dict(), "arrived_s": self.arrived_s,
            "admitted_s": self.admitted_s, "prefill_start_s": self.prefill_start_s,
            "prefill_end_s": self.prefill_end_s, "transfer_start_s": self.transfer_start_s,
            "transfer_end_s": self.transfer_end_s, "first_token_s": self.first_token_s,
            "ended_s": self.ended_s, "resumed_by": list(self.resumed_by),
            "finish_reason": self.finish_reason, "error": self.error,
            "predicted_ttft_s": self.predicted_ttft_s, "admission": self.admission,
            "routed_to": self.routed_to, "route_reason": self.route_reason,
            "route_cached_tokens": self.route_cached_tokens,
        }
