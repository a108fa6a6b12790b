"""The step log as a bounded stream: what ``homepd serve``'s ``/events`` sends the attached app, and what the
embedded app reads from its own engine, in one shape.

A ``StepSample`` holds the steps of one interval: at most ``max_steps`` of
them (``StepSampler``: a uniform sample once there are more, steps that carry
prompt tokens first, since stall attribution names them and the interference
index compares them with decode-only steps), plus figures exact over *every*
step of the interval (how many, decode tokens, the slowest decode step), so
the ITL-max and tok/s charts do not depend on the sampling.  A ``TokenGaps``
is what the dashboard needs of a finished request's token times: its largest
gap and the gaps over the ITL target (the ``limit`` largest), which
``homepd.measure.stalls.attribute_gaps`` attributes on the sampled steps.

The JSON is compact (a step is a list, not an object; the step policy's
budget and KV fill are left out; what stall attribution names — a grant, the
KV store's time before the step — is kept, and a step of an older service
without it reads as none) and decoded once, here, with ``RecordShapeError``
naming what is wrong.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from homepd.core.protocol import StepRecord
from homepd.core.records import RecordShapeError
from homepd.measure.stalls import Gap, gaps_over

MAX_STEPS = 256        # steps per sample (per /events interval and subscriber): a bound whatever the traffic
MAX_GAPS = 16          # gaps over the target sent per request (the largest; the row shows the largest)


@dataclass(frozen=True)
class StepSample:
    """The steps that ended in one interval, sampled (``steps``) and counted (the rest, over all of them)."""
    t_s: float                          # the producer's monotonic clock when the interval closed
    steps: tuple[StepRecord, ...]       # at most the sampler's bound, in start-time order
    n_steps: int                        # every step of the interval, kept or not
    n_decode_tokens: int                # over every step
    max_decode_step_ms: float | None    # the slowest step that carried a decode token (None: none did)

    @property
    def n_dropped(self) -> int:
        return self.n_steps - len(self.steps)

    @classmethod
    def of(cls, steps: Sequence[StepRecord], t_s: float) -> "StepSample":
        """Every step of ``steps``, none dropped (the embedded engine's own log)."""
        decode_ms = [s.duration_ms for s in steps if s.n_decode_tokens]
        return cls(t_s, tuple(sorted(steps, key=lambda s: s.t_start_s)), len(steps),
                   sum(s.n_decode_tokens for s in steps), max(decode_ms, default=None))

    @classmethod
    def merge(cls, samples: Sequence["StepSample"]) -> "StepSample | None":
        """One sample of several consecutive ones (None for none)."""
        if not samples:
            return None
        maxes = [s.max_decode_step_ms for s in samples if s.max_decode_step_ms is not None]
        return cls(max(s.t_s for s in samples), tuple(st for s in samples for st in s.steps),
                   sum(s.n_steps for s in samples), sum(s.n_decode_tokens for s in samples), max(maxes, default=None))

    def to_dict(self) -> dict:
        return {"t_s": self.t_s, "n_steps": self.n_steps, "n_decode_tokens": self.n_decode_tokens,
                "max_decode_step_ms": self.max_decode_step_ms,
                "steps": [[s.worker_role, s.index, s.t_start_s, s.t_end_s, list(s.decode_request_ids),
                           [[rid, n] for rid, n in s.prefill], s.granted_to, s.grant_lost, s.store_ms]
                          for s in self.steps]}

    @classmethod
    def from_dict(cls, data: dict) -> "StepSample":
        """The inverse of ``to_dict`` (budget and KV fill read as 0); ``RecordShapeError`` naming the field."""
        try:
            steps = tuple(_step(v) for v in data["steps"])
            max_ms = data["max_decode_step_ms"]
            return cls(float(data["t_s"]), steps, int(data["n_steps"]), int(data["n_decode_tokens"]),
                       None if max_ms is None else float(max_ms))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordShapeError(f"steps event: missing or mistyped field {exc}") from None


def _step(v: list) -> StepRecord:
    role, index, t_start_s, t_end_s, decode_ids, prefill, *attribution = v
    granted_to, grant_lost, store_ms = attribution if attribution else (None, False, 0.0)  # an older service's
    if not isinstance(role, str) or not all(isinstance(r, str) for r in decode_ids) or \
            not (granted_to is None or isinstance(granted_to, str)) or not isinstance(grant_lost, bool):
        raise TypeError(f"step {v!r:.60}")
    return StepRecord(role, int(index), float(t_start_s), float(t_end_s), tuple(decode_ids),
                      tuple((str(rid), int(n)) for rid, n in prefill), granted_to=granted_to,
                      grant_lost=grant_lost, store_ms=float(store_ms))


class StepSampler:
    """A bounded sample of the steps of one interval: ``add`` each step (O(1), memory at most twice
    ``max_steps`` records), ``drain`` at the interval's end.  Two reservoirs (Algorithm R), one for steps
    with prompt tokens and one for decode-only steps; at the drain each gets half of ``max_steps``, and the
    half one does not fill goes to the other."""

    def __init__(self, max_steps: int = MAX_STEPS, seed: int = 0):
        assert max_steps >= 2
        self.max_steps = max_steps
        self._rng = random.Random(seed)
        self._reset()

    def _reset(self) -> None:
        self._kept: dict[bool, list[StepRecord]] = {True: [], False: []}  # carries prompt tokens -> reservoir
        self._seen = {True: 0, False: 0}
        self._n_decode_tokens = 0
        self._max_decode_step_ms: float | None = None

    def add(self, step: StepRecord) -> None:
        if step.n_decode_tokens:
            self._n_decode_tokens += step.n_decode_tokens
            if self._max_decode_step_ms is None or step.duration_ms > self._max_decode_step_ms:
                self._max_decode_step_ms = step.duration_ms
        key = step.n_prompt_tokens > 0
        self._seen[key] += 1
        kept = self._kept[key]
        if len(kept) < self.max_steps:
            kept.append(step)
        else:
            j = self._rng.randrange(self._seen[key])
            if j < self.max_steps:
                kept[j] = step

    def drain(self, t_s: float) -> StepSample:
        """The interval's sample; the sampler starts the next interval empty."""
        prompt, decode = self._kept[True], self._kept[False]
        n_prompt = min(len(prompt), max(self.max_steps - len(decode), self.max_steps // 2))
        n_decode = min(len(decode), self.max_steps - n_prompt)
        steps = self._pick(prompt, n_prompt) + self._pick(decode, n_decode)
        sample = StepSample(t_s, tuple(sorted(steps, key=lambda s: s.t_start_s)), sum(self._seen.values()),
                            self._n_decode_tokens, self._max_decode_step_ms)
        self._reset()
        return sample

    def _pick(self, steps: list[StepRecord], n: int) -> list[StepRecord]:
        return steps if n >= len(steps) else self._rng.sample(steps, n)


@dataclass(frozen=True)
class TokenGaps:
    """What the dashboard needs of a finished request's token times: its largest gap and its gaps over the
    ITL target (the largest ``MAX_GAPS``; ``n_over`` counts them all)."""
    request_id: str
    itl_max_ms: float | None            # None: fewer than two tokens
    over_target: tuple[Gap, ...]
    n_over: int

    @classmethod
    def of(cls, request_id: str, token_times_s: Sequence[float], itl_target_ms: float,
           limit: int = MAX_GAPS) -> "TokenGaps":
        times = list(token_times_s)
        over = gaps_over(times, itl_target_ms)
        itl_max_ms = max(((b - a) * 1e3 for a, b in zip(times, times[1:])), default=None)
        return cls(request_id, itl_max_ms, tuple(over[:limit]), len(over))

    def to_dict(self) -> dict:
        """The fields a ``request`` event adds to the request's lifecycle."""
        return {"itl_max_ms": self.itl_max_ms, "n_gaps_over": self.n_over,
                "gaps_over": [[g.token_index, g.t_prev_s, g.t_s] for g in self.over_target]}

    @classmethod
    def from_dict(cls, request_id: str, data: dict) -> "TokenGaps":
        try:
            itl_max = data["itl_max_ms"]
            gaps = tuple(Gap(int(i), float(t0), float(t1)) for i, t0, t1 in data["gaps_over"])
            return cls(request_id, None if itl_max is None else float(itl_max), gaps, int(data["n_gaps_over"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordShapeError(f"request {request_id}: missing or mistyped field {exc}") from None


def gaps_by_request(gaps: Iterable[TokenGaps]) -> list[tuple[str, list[Gap]]]:
    """``attribute_gaps``'s input."""
    return [(g.request_id, list(g.over_target)) for g in gaps]
