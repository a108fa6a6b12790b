"""What each step carries: its prompt-token budget, and the order waiting prompts are served in.

Pure policy over a worker's own measurements (``homepd.core.stepmodel``):

* ``prompt_budget``: while interactive streams decode, the prompt tokens a step may carry so that the step — and so
  every running interactive stream's next token — stays within the ITL budget, from the online step-time model
  (decode batch size, prompt tokens, context).  When only background streams decode, or none, as much as an eighth
  of the TTFT budget holds (an interactive prompt arriving then waits for that step), at most ``max_chunk``: on a
  GPU the whole chunk, on a CPU a chunk of about 500 ms.
* ``prompt_order``: interactive prompts before background ones; among interactive prompts, those whose TTFT
  deadline can still be met in deadline order (earliest first), and the ones that cannot all be met are set aside —
  Moore–Hodgson: when the deadlines ahead cannot all be kept, the prompt with the most remaining work goes last, so
  that one long prompt does not make several short ones late.  Set-aside prompts still run, after the others.
  Without a model (or deadlines), arrival order.
* ``deadline_grant`` and ``lost_grant``: a step past the ITL budget — bounded by the gap ceiling — for an interactive
  prompt's deadline, or for a prompt whose deadline is lost anyway, only where it puts no more requests out of
  their budgets than it keeps: beside at most one interactive stream still within its gap budget for a deadline
  it keeps, beside none for a lost one (docs/scheduling.md, "Deadlines against gaps").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

from homepd.core.terms import RequestClass, StepEstimate
from homepd.core.sequence import Sequence

# why: a client sees a step's tokens after the controller, the HTTP server and the OS scheduler have passed
# them on; on a busy 2-core box that adds up to ~10-15 ms of jitter to single gaps, so steps aim at 85% of
# the ITL budget (measured: at 100% of it a third of the requests saw one gap over the budget at 0.5 req/s)
STEP_SHARE_OF_ITL = 0.85
# why: when no interactive stream decodes, a step may carry the whole chunk, and an interactive prompt that
# arrives then waits for that step and then shares its own with the rest of the long prompt.  On a CPU a
# 256-token chunk over a 600-token document is a 2.5 s step: a RAG follow-up question waited 4-5 s behind
# another document's prefill (benchmarks/chat_bench.py), where llama-server answered in 0.7 s.  So such a
# step is capped at an eighth of the TTFT budget (500 ms of 4 s); on a GPU the chunk binds long before.
IDLE_STEP_SHARE_OF_TTFT = 0.125
# why: a capped step still carries a useful chunk when the model's recent error eats the cap (measured here:
# prefill speed is flat from 64 to 512 tokens a step on this CPU)
MIN_IDLE_CHUNK = 32
# why: before the step model has seen MIN_STEPS steps (a fresh worker: after start, a restart or a switch; the
# warm-up is one or two) the cap above cannot be priced, and the whole chunk was a 2-3 s step here; 64 tokens
# is ~0.3-0.6 s on this CPU at either thread count and a few ms on a GPU, and the steps it gives teach the model
COLD_IDLE_CHUNK = 64


def prompt_budget(model: StepEstimate | None, n_decodes: int, n_interactive_decodes: int,
                  itl_budget_ms: float | None, kv_in_use: int = 0, min_chunk: int = 4,
                  max_chunk: int = 512, idle_step_ms: float | None = None) -> int:
    """Prompt tokens the next step may carry (before the batch-size cap).

    Before the model has seen enough steps: ``min_chunk`` while interactive streams decode (safe until
    measured).  ``idle_step_ms``: when no interactive stream decodes, the longest step (an interactive prompt
    arriving meanwhile waits for it; ``idle_step_budget``; ``COLD_IDLE_CHUNK`` tokens before the model is
    fitted); None: the whole ``max_chunk``."""
    if itl_budget_ms is None:
        return max_chunk
    if n_interactive_decodes == 0:
        if model is None:
            return max_chunk if idle_step_ms is None else min(max_chunk, COLD_IDLE_CHUNK)
        return idle_step_budget(model, n_decodes, kv_in_use, idle_step_ms, max_chunk)
    if model is None:
        return min_chunk
    return model.chunk_for_itl(itl_budget_ms * STEP_SHARE_OF_ITL, n_decodes, kv_in_use=kv_in_use, lo=min_chunk, hi=max_chunk)


def idle_step_budget(model: StepEstimate, n_decodes: int, kv_in_use: int, idle_step_ms: float | None,
                     max_chunk: int) -> int:
    """The prompt budget of a step no interactive stream waits on: as much as ``idle_step_ms`` holds less the
    model's recent error (as the ITL budget does), at least ``MIN_IDLE_CHUNK``, at most ``max_chunk``."""
    if idle_step_ms is None:
        return max_chunk
    return model.chunk_for_itl(idle_step_ms, n_decodes, kv_in_use, lo=min(MIN_IDLE_CHUNK, max_chunk), hi=max_chunk)


def prompt_order(prompts: Seq[Sequence], now_s: float, ms_per_prompt_token: float | None,
                 tokens_per_step: int | None = None, step_ms: float = 0.0) -> list[Sequence]:
    """``prompts`` (prefilling and waiting) in the order their tokens should be served.

    ``ms_per_prompt_token``: the measured marginal prefill cost; with ``tokens_per_step`` and ``step_ms``
    (the budget and the cost of the rest of a step) the time a prompt's remaining tokens take is
    ``remaining × per_token + ceil(remaining / tokens_per_step) × step_ms``."""
    interactive = [s for s in prompts if s.request_class != RequestClass.BACKGROUND]
    background = [s for s in prompts if s.request_class == RequestClass.BACKGROUND]
    if ms_per_prompt_token is None or any(s.deadline_s is None for s in interactive):
        return interactive + background

    def work_s(seq: Sequence) -> float:
        # a waiting prompt's cached prefix is not work: it is taken, not computed, when admitted
        left = seq.n_prompt - (seq.n_prefilled if seq.seq_id is not None else max(seq.n_prefilled, seq.n_expected_reuse))
        steps = -(-left // tokens_per_step) if tokens_per_step else 1
        return (left * ms_per_prompt_token + steps * step_ms) / 1e3

    return moore_hodgson(interactive, now_s, work_s, lambda s: s.deadline_s) + background


def moore_hodgson(jobs: list, now_s: float, work_s: Callable, deadline_s: Callable) -> list:
    """Jobs in earliest-deadline order, except that whenever the deadlines so far cannot all be kept, the
    longest job so far moves to the end.  Stable: equal deadlines keep their given (arrival) order.
    Maximises the number of deadlines kept on one server.  The late ones follow, shortest work first (ties:
    earliest deadline): their deadlines are lost whatever their order, and shortest first makes them wait
    least in all (a 190-token chat turn judged late waited 20 s behind two late documents in deadline order)."""
    kept: list = []
    late: list = []
    t = now_s
    for job in sorted(jobs, key=deadline_s):
        if now_s + work_s(job) > deadline_s(job):  # cannot be kept even if served alone now
            late.append(job)
            continue
        kept.append(job)
        t += work_s(job)
        if t > deadline_s(job):
            longest = max(reversed(kept), key=work_s)  # ties: the latest deadline goes
            kept.remove(longest)
            late.append(longest)
            t -= work_s(longest)
    return kept + sorted(late, key=lambda job: (work_s(job), deadline_s(job)))


@dataclass(frozen=True)
class DeadlineGrant:
    """A step larger than the ITL budget holds: ``budget`` prompt tokens for ``request_id``'s prompt, a predicted
    ``step_ms`` within the gap ceiling, given where it puts no more requests out of their budgets than it keeps."""
    request_id: str
    budget: int
    step_ms: float
    lost: bool = False  # the deadline is lost anyway: the step shortens the prompt's TTFT and its hold on an id


# a deadline's grant keeps one request (the prompt): beside this many streams still within their gap budget it
# loses none on balance.  # why not 0: on the RAG trace (2026-12-07) a document's first question beside the other's
# answer took 6.2-7.0 s at 0 and one turn of 8 more missed; at 1, 4.4-5.3 s, as with grants beside any stream
GRANT_KEEPERS = 1


def gap_keepers(decode: Seq[Sequence]) -> int:
    """The interactive streams of ``decode`` whose every gap so far was within their ITL budget
    (``Sequence.gap_broken`` false): the requests a step past that budget would put out of it."""
    return sum(1 for s in decode if s.request_class != RequestClass.BACKGROUND and not s.gap_broken)


@dataclass(frozen=True)
class PromptPace:
    """How long the steps of one prompt's remaining ``left`` tokens take, by the step-time model: each step
    beside ``n_decode`` decodes, priced at the context it will have half-way (its own cells join it as it
    goes), each at the tail of the box's noise (``StepEstimate.tail_ms``, as the ITL budget's steps are)."""
    est: StepEstimate
    n_decode: int
    kv_in_use: int
    left: int

    def step_ms(self, b: int) -> float:
        """One step carrying ``b`` of its tokens."""
        return self.est.tail_ms(b, self.n_decode, self.kv_in_use + self.left // 2)

    def done_s(self, start_s: float, n_left: int, b: int) -> float:
        """When ``n_left`` of its tokens are done from ``start_s``, at ``b`` a step."""
        return start_s + math.ceil(n_left / b) * self.step_ms(b) / 1e3


def prompt_work_tokens(seq: Sequence) -> int:
    """The prompt tokens ``seq`` still has to compute (a waiting prompt's expected cached prefix is not work)."""
    done = seq.n_prefilled if seq.seq_id is not None else max(seq.n_prefilled, seq.n_expected_reuse)
    return max(0, seq.n_prompt - done)


def deadline_grant(est: StepEstimate, prompts: Seq[Sequence], decode: Seq[Sequence], now_s: float,
                   itl_budget_ms: float, gap_ceiling_ms: float, budget: int, max_budget: int,
                   kv_in_use: int = 0) -> DeadlineGrant | None:
    """A larger step for the first interactive prompt of ``prompts`` (in serving order), or None.

    ``budget``: the prompt budget the ITL budget gives this step.  Granted only when all of these hold:

    * interactive streams decode (else the step is not bound by their gaps) and the prompt has a deadline;
    * at ``budget`` tokens a step the prompt would miss its deadline (a far deadline gets nothing);
    * a step within ``gap_ceiling_ms`` keeps it (one that cannot be saved within the ceiling gets nothing);
    * the step puts at most one stream over its gap budget that was within it so far (``GRANT_KEEPERS``,
      ``gap_keepers``): the grant keeps one request within both budgets (the prompt, if the step model is right),
      so beside one such stream the count is even and the prompt's first token comes seconds sooner; beside two
      or more it loses.  Refused, the prompt goes on in the ITL budget's steps; once the streams beside it have
      missed a gap or ended, a later step may still grant it.  A stream that already missed a gap has nothing
      left to lose.

    The step granted is at the ceiling (at the tail of the box's noise, ``StepEstimate.tail_ms``, as the ITL
    budget's own steps are): the prompt's first token comes soonest.  Every decode still takes its token in it."""
    interactive = any(s.request_class != RequestClass.BACKGROUND for s in decode)
    head = next((s for s in prompts if s.request_class != RequestClass.BACKGROUND), None)
    if not interactive or head is None or head.deadline_s is None or budget >= max_budget:
        return None
    left = prompt_work_tokens(head)
    if left <= budget:
        return None  # this step completes it anyway
    pace = PromptPace(est, len(decode), kv_in_use, left)
    step_ms, done_s = pace.step_ms, pace.done_s
    if done_s(now_s, left, budget) <= head.deadline_s:
        return None  # the ITL budget keeps it: the deadline is far enough
    ceiling = min(max_budget, int((gap_ceiling_ms - step_ms(0)) // max(step_ms(1) - step_ms(0), 1e-6)))
    if ceiling <= budget or done_s(now_s, left, ceiling) > head.deadline_s:
        return None  # not even the ceiling keeps it: lost_grant's case
    predicted = step_ms(ceiling)
    if predicted > itl_budget_ms * STEP_SHARE_OF_ITL and gap_keepers(decode) > GRANT_KEEPERS:  # as ITL steps aim
        return None  # it would put more streams out of their gap budget than the one prompt it keeps
    return DeadlineGrant(head.request_id, ceiling, predicted)


def lost_grant(est: StepEstimate, prompts: Seq[Sequence], decode: Seq[Sequence], now_s: float,
               gap_ceiling_ms: float, budget: int, max_budget: int, kv_in_use: int = 0) -> DeadlineGrant | None:
    """A step at the gap ceiling for an interactive prompt whose TTFT deadline is lost, or None.

    A late prompt still counts in every mean TTFT, and while it prefills it holds a sequence id that the prompts
    behind it wait for.  So once such a prompt is admitted (it holds an id, is prefilling, and even steps at the
    ceiling from now on would not keep its deadline), while interactive streams decode that have all missed a
    gap already, every step it is served in may be as long as the gap ceiling (at the tail of the box's noise)
    and no longer.  Beside a stream still within its gap budget, nothing: the prompt is out of its budgets
    whatever its steps, and a step past the ITL budget would put the stream out too.  # why: at 2026-12-07's
    ceiling steps beside every stream, the conversations-and-documents mix kept 4-15 of 32 turns within both
    budgets, against 29-30 with no step past the ITL budget (docs/scheduling.md, "Deadlines against gaps").
    A prompt that is only waiting gets nothing here: it is admitted when an id and its turn in the order come."""
    interactive = any(s.request_class != RequestClass.BACKGROUND for s in decode)
    if not interactive or gap_keepers(decode) or budget >= max_budget:
        return None
    n_decode = len(decode)
    ceiling = est.chunk_for_itl(gap_ceiling_ms, n_decode, kv_in_use, lo=budget, hi=max_budget)
    if ceiling <= budget:
        return None

    def is_lost(seq: Sequence) -> bool:
        left = prompt_work_tokens(seq)
        return PromptPace(est, n_decode, kv_in_use, left).done_s(now_s, left, ceiling) > seq.deadline_s

    # why only admitted ones: a prompt that still can be kept is deadline_grant's decision, with its own trade
    lost = next((s for s in prompts if s.request_class != RequestClass.BACKGROUND and s.deadline_s is not None
                 and s.seq_id is not None and s.is_prefilling and is_lost(s)), None)
    if lost is None:
        return None
    step_ms = est.tail_ms(ceiling, n_decode, kv_in_use)
    return DeadlineGrant(lost.request_id, ceiling, step_ms, lost=True)


class StepPolicy:
    """A worker's step policy: the prompt budget of each step (fixed ``chunk``, or adaptive from the ITL
    budget) and the order of prompts.  ``estimate``: the worker's online step-time model, read per step."""

    def __init__(self, chunk: int | None, n_batch: int, itl_budget_ms: float | None = None,
                 estimate: Callable[[], StepEstimate | None] = lambda: None, min_chunk: int = 4,
                 idle_step_ms: float | None = None, gap_ceiling_ms: float | None = None):
        self.chunk, self.n_batch, self.itl_budget_ms = chunk, n_batch, itl_budget_ms
        self.idle_step_ms = idle_step_ms
        self.gap_ceiling_ms = gap_ceiling_ms  # None: no step is ever granted past the ITL budget
        self.estimate, self.min_chunk = estimate, min(min_chunk, n_batch)
        self.between_steps_ms = 0.0  # time spent outside steps before the next one (set by the worker loop)

    @classmethod
    def of_spec(cls, spec, estimate: Callable[[], StepEstimate | None] = lambda: None) -> "StepPolicy":
        """The policy a worker started with ``spec`` (a ``WorkerSpec``) steps with: the worker builds its own
        with this, and the admission gate and advise ask the same one what a step would carry."""
        return cls(spec.chunk, spec.n_batch, spec.step_itl_budget_ms, estimate=estimate, idle_step_ms=spec.idle_step_ms,
                   gap_ceiling_ms=spec.step_gap_ceiling_ms)

    @property
    def adaptive(self) -> bool:
        return self.itl_budget_ms is not None

    def budget(self, decode: Seq[Sequence], kv_in_use: int = 0) -> int:
        """Prompt tokens for the next step, given the sequences it decodes and the KV cells in use."""
        interactive = sum(1 for s in decode if s.request_class != RequestClass.BACKGROUND)
        return self.budget_for(len(decode), interactive, kv_in_use)

    def budget_for(self, n_decode: int, n_interactive_decode: int, kv_in_use: int = 0) -> int:
        """``budget`` from counts: a step beside ``n_decode`` decodes (``n_interactive_decode`` of them
        interactive) with ``kv_in_use`` cells in use.  The one rule for the worker, the gate and advise."""
        if not self.adaptive:
            return min(self.n_batch if self.chunk is None else self.chunk, self.n_batch) - n_decode
        itl = self._step_itl_ms()
        return min(self.n_batch - n_decode,
                   prompt_budget(self.estimate(), n_decode, n_interactive_decode, itl, kv_in_use,
                                 min_chunk=self.min_chunk, max_chunk=self.n_batch, idle_step_ms=self.idle_step_ms))

    def _step_ceiling_ms(self) -> float:
        """The longest step the gap ceiling allows: the ceiling less the time between steps, at the step's share
        (a client sees the step after delivery, as with the ITL budget's own steps)."""
        return (self.gap_ceiling_ms - self.between_steps_ms) * STEP_SHARE_OF_ITL

    def _step_itl_ms(self) -> float:
        """The ITL budget a step may use: the budget less the time spent between steps (at the step's share)."""
        return max(1.0, self.itl_budget_ms - self.between_steps_ms / STEP_SHARE_OF_ITL)

    def grant(self, prompts: Seq[Sequence], decode: Seq[Sequence], now_s: float, budget: int,
              kv_in_use: int = 0) -> DeadlineGrant | None:
        """``deadline_grant`` for this worker: a step past the ITL budget for the first interactive prompt of
        ``prompts`` (in serving order), when its deadline needs it and the step puts no stream out of its gap
        budget, else ``lost_grant``'s; None without a gap ceiling, an ITL budget or a fitted model."""
        est = self.estimate() if self.adaptive and self.gap_ceiling_ms else None
        if est is None:
            return None
        itl, ceiling_ms = self._step_itl_ms(), self._step_ceiling_ms()
        max_budget = self.n_batch - len(decode)
        kept = deadline_grant(est, prompts, decode, now_s, itl, ceiling_ms, budget, max_budget, kv_in_use)
        if kept is not None:
            return kept
        return lost_grant(est, prompts, decode, now_s, ceiling_ms, budget, max_budget, kv_in_use)

    def restore_limit_ms(self, seq: Sequence, decode: Seq[Sequence], now_s: float, kv_in_use: int = 0) -> float | None:
        """The longest KV store restore ``seq``'s admission may make now: ``store_room_ms`` (a longer one is not
        made, the prompt is prefilled in budgeted steps instead), unless prefilling at this step's budget's pace
        would miss its TTFT deadline (then any: one request kept within its budgets for the streams' next gap)."""
        room = self.store_room_ms(decode, kv_in_use)
        if room is None or seq.request_class == RequestClass.BACKGROUND or seq.deadline_s is None:
            return room
        pace = PromptPace(self.estimate(), len(decode), kv_in_use, seq.n_prompt)
        return None if pace.done_s(now_s, seq.n_prompt, max(1, self.budget(decode, kv_in_use))) > seq.deadline_s \
            else room

    def store_room_ms(self, decode: Seq[Sequence], kv_in_use: int = 0) -> float | None:
        """How long the KV store may work between two steps (a save, a restore: every decoding stream waits for it
        as for a step; on this box a 430-token document's restore took 130 ms): what a step beside ``decode``
        leaves of the ITL budget at the tail of the box's noise.  None (no limit): a fixed chunk, no fitted
        model, or no interactive stream still within its gap budget (``Sequence.gap_broken``)."""
        est = self.estimate() if self.adaptive else None
        if est is None or not any(s.request_class != RequestClass.BACKGROUND and not s.gap_broken for s in decode):
            return None
        return max(0.0, self._step_itl_ms() * STEP_SHARE_OF_ITL - est.tail_ms(0, len(decode), kv_in_use))

    def tokens_in_ms(self, ms: float, kv_in_use: int = 0) -> int:
        """The prompt tokens a step computes in ``ms`` (at least what ``ms`` holds; 0 unmeasured or fixed)."""
        est = self.estimate() if self.adaptive else None
        if est is None or ms <= 0:
            return 0
        return math.ceil(ms / est.prompt_token_ms(kv_in_use))

    def after_first_token(self, kv_in_use: int = 0) -> int | None:
        """The prompt tokens a step may still carry after an interactive prompt completes in it: what one ITL
        budget's share holds (its first token waits for the whole step; on a GPU that is thousands of tokens).
        None: no limit (a fixed chunk, or the box unmeasured)."""
        est = self.estimate() if self.adaptive else None
        if est is None:
            return None
        return int(self.itl_budget_ms * STEP_SHARE_OF_ITL // est.prompt_token_ms(kv_in_use))

    def order(self, prompts: Seq[Sequence], now_s: float, n_decode: int, kv_in_use: int = 0,
              tokens_per_step: int = 1, n_gap_keepers: int = 0) -> list[Sequence]:
        """``prompts`` in serving order; ``tokens_per_step``: this step's prompt budget (``budget``), what the
        deadline order assumes each step gives, or with a gap ceiling and no more streams a grant would put over
        their gap budget than it may (``n_gap_keepers``, ``gap_keepers``) what a step at its share holds, if more
        (a prompt whose deadline a grant keeps is not late: ``deadline_grant``)."""
        est = self.estimate()
        if est is None or not prompts:   # why: most steps only decode (the twin runs this per step)
            return prompt_order(prompts, now_s, None)
        if self.adaptive and self.gap_ceiling_ms and n_gap_keepers <= GRANT_KEEPERS:
            tokens_per_step = max(tokens_per_step, est.chunk_for_itl(self._step_ceiling_ms(), n_decode, kv_in_use,
                                                                      lo=1, hi=max(1, self.n_batch - n_decode)))
        return prompt_order(prompts, now_s, est.prompt_token_ms(kv_in_use), tokens_per_step=max(1, tokens_per_step),
                            step_ms=est.predict_ms(0, n_decode, kv_in_use))
