"""Two queues, two latency budgets: request classes, SLO-aware admission and per-request routing in disaggregated mode.  Pure policy: measurements in, decisions out.

* ``admit``: predicts a new request's TTFT from the prompt tokens queued ahead of it (interactive work
  goes first, so background prompts are not ahead of an interactive one) and the measured prefill speed;
  a request that would miss its class's TTFT budget is rejected early (Mooncake's early rejection) with a
  retry-after, instead of failing late.  Background work is deferred while interactive work is queued.
* the prompt budget of each step and the order prompts are served in: ``homepd.core.steppolicy``.
* ``route``: in disaggregated mode, whether a prompt is prefilled on the decode worker itself (short
  prompts: no handoff, no queue behind long documents) or on the prefill worker (long ones), from the
  measured prefill speeds, the handoff cost and the queue depths — not a constant threshold.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from homepd.core.terms import ClassBudget, RequestClass
from homepd.errors import RequestError


class Verdict(str, enum.Enum):
    ADMIT = "admit"
    DEFER = "defer"               # wait in its queue (background behind interactive work)
    REJECT = "reject"             # early rejection: it would miss its budget


class AdmissionRejected(RequestError):
    """Early rejection: the request is predicted to miss its class's TTFT budget; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float, request_class: RequestClass, predicted_ttft_ms: float):
        self.retry_after_s, self.request_class, self.predicted_ttft_ms = retry_after_s, request_class, predicted_ttft_ms
        super().__init__(message)


@dataclass(frozen=True)
class QueueState:
    """What admission sees: prompt tokens waiting (not yet prefilled) per class, and the prefill speed."""
    queued_interactive_tokens: int
    queued_background_tokens: int
    prefill_tok_s: float          # measured, tokens per second of prefill on the entry worker
    step_overhead_ms: float = 0.0  # the step a first token waits for besides prefill (one decode step)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    predicted_ttft_ms: float
    budget_ms: float
    retry_after_s: float | None = None
    reason: str = ""


def predict_ttft_ms(req_class: RequestClass, n_prompt: int, q: QueueState) -> float:
    """Prompt tokens ahead of this one (interactive ones only, for an interactive request), plus its own,
    at the measured prefill speed, plus one step."""
    ahead = q.queued_interactive_tokens + (q.queued_background_tokens if req_class is RequestClass.BACKGROUND
                                           else 0)
    return (ahead + n_prompt) / max(q.prefill_tok_s, 1e-6) * 1e3 + q.step_overhead_ms


def admit(req_class: RequestClass, n_prompt: int, q: QueueState,
          budgets: dict[RequestClass, ClassBudget]) -> Decision:
    """Admit, defer or reject a new request of ``n_prompt`` tokens."""
    budget = budgets[req_class].ttft_ms
    predicted = predict_ttft_ms(req_class, n_prompt, q)
    if predicted > budget:
        # why: the queue drains at prefill speed; retry when the excess has drained
        retry = (predicted - budget) / 1e3
        return Decision(Verdict.REJECT, predicted, budget, retry_after_s=max(1.0, round(retry, 1)),
                        reason=f"predicted TTFT {predicted:.0f} ms exceeds the {req_class.value} budget "
                               f"{budget:.0f} ms ({q.queued_interactive_tokens} interactive and "
                               f"{q.queued_background_tokens} background prompt tokens queued at "
                               f"{q.prefill_tok_s:.0f} tok/s)")
    if req_class is RequestClass.BACKGROUND and q.queued_interactive_tokens > 0:
        return Decision(Verdict.DEFER, predicted, budget, reason="interactive prompts are queued: background "
                                                                 "waits behind them")
    return Decision(Verdict.ADMIT, predicted, budget)


@dataclass(frozen=True)
class RouteState:
    """Measurements for routing one prompt in disaggregated mode."""
    prefill_queue_tokens: int         # prompt tokens waiting on the prefill worker
    prefill_tok_s_prefill: float      # prefill speed of the prefill worker
    prefill_tok_s_decode: float       # prefill speed of the decode worker (while it decodes)
    handoff_ms_per_token: float       # export + transfer + import, per KV token
    handoff_base_ms: float = 0.0
    max_local_tokens: int = 64        # the prompt budget that keeps the decode worker's ITL (prompt_budget)
    cached_local_tokens: int = 0      # of this prompt, probably held by the decode worker (not computed there)
    cached_remote_tokens: int = 0     # ... and by the prefill worker


@dataclass(frozen=True)
class Route:
    on_decode_worker: bool
    predicted_local_ms: float
    predicted_remote_ms: float
    threshold_tokens: int             # the prompt length at which the two paths cost the same here


def route(n_prompt: int, s: RouteState) -> Route:
    """Prefill on the decode worker when that is predicted faster and fits the ITL-safe prompt budget.

    Each side computes only its uncached tokens (as llm-d's prefill/decode threshold counts them); the
    handoff still moves the whole prompt's KV.  ``threshold_tokens`` is in uncached tokens on the decode worker."""
    local_uncached = max(0, n_prompt - s.cached_local_tokens)
    local = local_uncached / max(s.prefill_tok_s_decode, 1e-6) * 1e3
    remote = (s.prefill_queue_tokens + max(0, n_prompt - s.cached_remote_tokens)) \
        / max(s.prefill_tok_s_prefill, 1e-6) * 1e3 + s.handoff_base_ms + s.handoff_ms_per_token * n_prompt
    per_token_local = 1e3 / max(s.prefill_tok_s_decode, 1e-6)
    per_token_remote = 1e3 / max(s.prefill_tok_s_prefill, 1e-6) + s.handoff_ms_per_token
    fixed_remote = s.prefill_queue_tokens * 1e3 / max(s.prefill_tok_s_prefill, 1e-6) + s.handoff_base_ms
    if per_token_local <= per_token_remote:
        break_even = s.max_local_tokens
    else:
        break_even = int(fixed_remote / (per_token_local - per_token_remote))
    threshold = min(s.max_local_tokens, break_even)
    # why not ``local_uncached <= threshold``: the threshold is where the two costs meet without a cache, so
    # ``local <= remote`` already implies it then, and with a cache on either side the costs are what decide
    return Route(on_decode_worker=local_uncached <= s.max_local_tokens and local <= remote, predicted_local_ms=local,
                 predicted_remote_ms=remote, threshold_tokens=threshold)
