"""Whether a candidate's runs exercised its architecture: where each run's prompts were prefilled.

A disaggregated candidate whose prompts were all prefilled on the decode worker moved no KV: its runs measured
a one-worker colocated engine under the name "disaggregated".  Such a (candidate, mix) is flagged in the
evidence and not ranked.  Pure: run records in, counts and reasons out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from homepd.core.lifecycle import Lifecycle, RequestTimings
from homepd.core.modes import Candidate


@dataclass(frozen=True)
class PrefillSplit:
    """Where prompts were prefilled: on the worker that decodes them ("local": a colocated worker, or a
    disaggregated engine's decode worker) or on a prefill worker, then handed off with their KV."""
    n_local_prompts: int = 0
    n_local_tokens: int = 0
    n_handoff_prompts: int = 0
    n_handoff_tokens: int = 0

    def __add__(self, other: "PrefillSplit") -> "PrefillSplit":
        return PrefillSplit(self.n_local_prompts + other.n_local_prompts, self.n_local_tokens + other.n_local_tokens,
                            self.n_handoff_prompts + other.n_handoff_prompts,
                            self.n_handoff_tokens + other.n_handoff_tokens)

    @property
    def n_prompts(self) -> int:
        return self.n_local_prompts + self.n_handoff_prompts

    def describe(self) -> str:
        return (f"{self.n_local_prompts} prompts ({self.n_local_tokens} tokens) prefilled where they decode, "
                f"{self.n_handoff_prompts} ({self.n_handoff_tokens} tokens) handed off")


def prefill_split(requests: Iterable[Lifecycle | RequestTimings]) -> PrefillSplit:
    """Where these requests' prompts were prefilled (a run record's lifecycles, or their timings): a request
    whose KV was handed off has its transfer's figures (``kv_bytes``, ``kv_transfer_s``); every other
    prefilled one was prefilled where it decodes."""
    split = PrefillSplit()
    for request in requests:
        r = request.timings() if isinstance(request, Lifecycle) else request
        handed_off = r.kv_bytes is not None or r.kv_transfer_s is not None
        if handed_off:
            split += PrefillSplit(n_handoff_prompts=1, n_handoff_tokens=r.n_prompt_tokens)
        elif r.ttft_s is not None:  # prefilled (a request that failed or was cancelled before it may not be)
            split += PrefillSplit(n_local_prompts=1, n_local_tokens=r.n_prompt_tokens)
    return split


def not_exercised_reason(candidate: Candidate, split: PrefillSplit) -> str | None:
    """Why runs with ``split`` did not exercise ``candidate``'s architecture; None when they did (or when the
    architecture has nothing to check: every colocated prompt is local by definition)."""
    if candidate.mode.traits.hands_off_kv and split.n_prompts and not split.n_handoff_prompts:
        return (f"no KV was handed off: all {split.n_local_prompts} prompts ({split.n_local_tokens} tokens) were "
                "prefilled on the decode worker, so these runs measured one colocated worker")
    return None


def splits_by_run(records: Mapping[tuple[str, str, int], object]) -> dict[tuple[str, str], PrefillSplit]:
    """(candidate, mix) -> where the prompts of its runs (every repeat) were prefilled; ``records`` maps
    (candidate, mix, repeat) to a ``RunRecord``."""
    out: dict[tuple[str, str], PrefillSplit] = {}
    for (name, mix, _), record in records.items():
        out[(name, mix)] = out.get((name, mix), PrefillSplit()) + prefill_split(record.requests)
    return out


def not_exercised(candidates: Iterable[Candidate], records: Mapping[tuple[str, str, int], object]
                  ) -> dict[tuple[str, str], str]:
    """(candidate, mix) -> why its runs on that mix did not exercise its architecture, for those that did not."""
    by_name = {c.name: c for c in candidates}
    out = {}
    for (name, mix), split in splits_by_run(records).items():
        reason = not_exercised_reason(by_name[name], split) if name in by_name else None
        if reason is not None:
            out[(name, mix)] = reason
    return out
