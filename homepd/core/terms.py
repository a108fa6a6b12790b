"""The scheduler's vocabulary: the value types that the records, the worker⇄controller protocol and the lifecycle
speak, and that every room reads.  Below every policy module (admission, the prefix cache, the step-time model
own the rules; these are only their words), so a record never imports a policy to name a class.  Pure: standard
library only.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple


class RequestClass(str, enum.Enum):
    INTERACTIVE = "interactive"   # chat, voice: tight TTFT and ITL
    BACKGROUND = "background"     # summaries, batch: loose TTFT, throughput matters

    def __str__(self) -> str:  # why: f-strings, dict keys in JSON and metric labels show the value, as before
        return self.value

    @classmethod
    def parse(cls, value: "str | RequestClass | None") -> "RequestClass":
        if value is None:
            return cls.INTERACTIVE
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"request class must be one of {', '.join(c.value for c in cls)}, "
                             f"got {value!r}") from None


@dataclass(frozen=True)
class ClassBudget:
    """A request class's latency targets; the one table of them is ``EngineConfig.class_budgets``."""
    ttft_ms: float
    itl_ms: float | None          # None: no per-token budget (background)


class ReuseMode(str, enum.Enum):
    """What a worker's KV cache type allows to reuse (stated in its cache stats)."""
    OFF = "off"        # no reuse (disabled, or the cache cannot keep a finished sequence)
    PREFIX = "prefix"  # any prefix of a cached sequence: its tail is dropped
    EXACT = "exact"    # only a whole cached sequence that the new prompt continues



@dataclass(frozen=True)
class StepEstimate:
    """The fitted coefficients (ms), how many steps were seen (of them, with prompt tokens), and the recent
    error of the predictions.  A worker publishes its own on every ``StepReport``."""
    base_ms: float
    ms_per_prompt_token: float
    ms_per_decode_token: float
    ms_per_kv_ktoken: float
    n_steps: int
    error_ms: float           # how much longer than predicted steps ran (before each update): one-sided, robust
                              # (OnlineStepModel.observe); symmetric noise gives its RMS
    n_prompt_steps: int = 0   # steps with prompt tokens: what the prefill cost is measured from
    late_share: float = 0.0   # the tail of the recent lateness, as a share of the predicted time (its 99th
                              # percentile: OnlineStepModel.late_share); 0: not measured yet

    def predict_ms(self, n_prompt: int, n_decode: int, kv_in_use: int = 0) -> float:
        return (self.base_ms + self.ms_per_prompt_token * n_prompt + self.ms_per_decode_token * n_decode
                + self.ms_per_kv_ktoken * (n_prompt + n_decode) * kv_in_use / 1000.0)

    def tail_ms(self, n_prompt: int, n_decode: int, kv_in_use: int = 0, margin_sd: float = 2.0) -> float:
        """How long such a step may run at the tail of the box's noise: the prediction with ``margin_sd`` times
        the recent error, or stretched by the recent lateness's 99th percentile, whichever is longer.  What a
        budget must hold (a gap SLO lives in the tail): on a 2-vCPU VM a step's noise grows with its length, and
        an absolute margin fitted mostly on short decode steps let 85 ms prompt steps run 95-109 ms."""
        predicted = self.predict_ms(n_prompt, n_decode, kv_in_use)
        return max(predicted + margin_sd * self.error_ms, predicted * (1.0 + self.late_share))

    def chunk_for_itl(self, itl_budget_ms: float, n_decode: int, kv_in_use: int = 0, lo: int = 8,
                      hi: int = 2048, margin_sd: float = 2.0) -> int:
        """Largest prompt budget (clamped to [lo, hi]) whose step's ``tail_ms`` is within ``itl_budget_ms``;
        ``lo`` when even a step without prompt tokens would be over."""
        per_token = self.prompt_token_ms(kv_in_use)
        base = self.predict_ms(0, n_decode, kv_in_use)
        room = min(itl_budget_ms - margin_sd * self.error_ms, itl_budget_ms / (1.0 + self.late_share)) - base
        return int(max(lo, min(hi, math.floor(room / per_token))))

    def prompt_token_ms(self, kv_in_use: int = 0) -> float:
        """What one more prompt token adds to a step with ``kv_in_use`` cells in use (at least 1 µs)."""
        return max(self.ms_per_prompt_token + self.ms_per_kv_ktoken * kv_in_use / 1000.0, 1e-3)

    def prefill_tok_s(self, n_decode: int = 0, chunk: int = 256) -> float:
        """Prompt tokens per second when steps of ``chunk`` prompt tokens run beside ``n_decode`` decodes."""
        return chunk / max(self.predict_ms(chunk, n_decode), 1e-3) * 1e3


class SpecialToken(NamedTuple):
    """A token that only ``parse_special=True`` turns text into (llama.cpp's CONTROL and UNKNOWN tokens).

    ``lstrip``/``rstrip``: the whitespace left/right of it is dropped when it is matched (llama.cpp's
    LLAMA_TOKEN_ATTR_LSTRIP/RSTRIP)."""
    text: str
    id: int
    lstrip: bool = False
    rstrip: bool = False
