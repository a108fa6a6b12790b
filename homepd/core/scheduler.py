"""Colocated step policy: stall-free batching with bounded prefill chunks (Sarathi-Serve).

Pure policy: no llama_cpp, no pipes, no clock.  Every step first takes one
decode token for every running sequence that has finished its prompt, then
fills the rest of the token budget (``chunk``) with the next slices of waiting
prompts, oldest first.  ``chunk=None`` is the unchunked baseline: whole
prompts in one step, bounded only by the batch size.  Which sequence ids and
KV cells are free is the allocator's business (``homepd.core.allocator``); the
scheduler decides how many cells a request reserves and when it is admitted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from homepd.core.allocator import KVAllocator
from homepd.core.sequence import Sequence
from homepd.core.steppolicy import StepPolicy


@dataclass(frozen=True)
class PrefillSlice:
    seq: Sequence
    start: int
    stop: int

    @property
    def n_tokens(self) -> int:
        return self.stop - self.start

    @property
    def completes_prompt(self) -> bool:
        return self.stop == self.seq.n_prompt


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[Sequence, ...]
    prefill: tuple[PrefillSlice, ...]
    budget: int = 0  # the prompt-token budget the policy gave this step
    kv_in_use: int = 0  # KV cells held by every running sequence once this step's prompt tokens are in

    @property
    def n_decode_tokens(self) -> int:
        return len(self.decode)

    @property
    def n_prompt_tokens(self) -> int:
        return sum(s.n_tokens for s in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Owns the waiting queue and the running set; admits through a ``KVAllocator``."""

    def __init__(self, n_seq_max: int, n_ctx: int, n_batch: int, chunk: int | None, decodes: bool = True,
                 policy: StepPolicy | None = None):
        assert n_seq_max >= 1 and n_ctx >= 1 and n_batch >= n_seq_max
        assert chunk is None or chunk >= 1
        self.n_batch = n_batch
        self.policy = policy or StepPolicy(chunk, n_batch)  # the chunk lives in the policy
        self.decodes = decodes  # False for a prefill-only worker: finished prompts wait for hand-off
        self.allocator = KVAllocator(n_seq_max=n_seq_max, n_ctx=n_ctx)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # queue management ---------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cells_needed(self, seq: Sequence) -> int:
        """KV cells reserved for seq: the prompt alone on a prefill-only worker, else prompt + outputs."""
        return seq.n_ctx_needed if self.decodes else seq.n_prompt

    def can_admit(self, seq: Sequence) -> bool:
        return self.allocator.can_allocate(self.cells_needed(seq))

    def admit(self, seq: Sequence) -> None:
        """Give seq a sequence id and reserve its worst-case KV cells."""
        seq.seq_id = self.allocator.allocate(self.cells_needed(seq))
        self.running.append(seq)

    def release(self, seq: Sequence) -> None:
        """Take seq out (finished, cancelled or handed off); its sequence id and cells become free."""
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.is_finished = True

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # the policy ------------------------------------------------------------
    def schedule(self, now_s: float = 0.0) -> StepPlan:
        """Decide the next step's composition; admits waiting requests as room allows.

        The policy gives the prompt budget and the order prompts are served in (``now_s``: the clock its
        deadlines are on); a waiting prompt that does not fit the KV yet holds the ones after it (no starving)."""
        decode = tuple(s for s in self.running if not s.is_prefilling) if self.decodes else ()
        kv_in_use = sum(s.n_kv_tokens for s in self.running)
        budget = self.policy.budget(decode, kv_in_use)
        prefilling = [s for s in self.running if s.is_prefilling]
        if prefilling or self.waiting:
            # why: a prompt always advances, even when decodes fill the chunk
            budget = max(budget, 1)
        planned = budget
        slices: list[PrefillSlice] = []
        for seq in self.policy.order([*prefilling, *self.waiting], now_s, len(decode), kv_in_use, budget):
            if budget <= 0:
                break
            if seq.seq_id is None:  # waiting: admit it if its KV fits, else it (and all after it) wait
                if not self.can_admit(seq):
                    break
                self.waiting.remove(seq)
                self.admit(seq)
            slices.append(self._slice(seq, budget))
            budget -= slices[-1].n_tokens
        return StepPlan(decode=decode, prefill=tuple(slices), budget=planned,
                        kv_in_use=kv_in_use + sum(sl.n_tokens for sl in slices))

    @staticmethod
    def _slice(seq: Sequence, budget: int) -> PrefillSlice:
        stop = min(seq.n_prompt, seq.n_prefilled + budget)
        return PrefillSlice(seq=seq, start=seq.n_prefilled, stop=stop)

    def postprocess(self, plan: StepPlan, sampled: dict[str, int]) -> list[Sequence]:
        """Apply a finished step: advance prompts, append sampled tokens (keyed by request id).

        Returns the sequences that received a new token this step.
        """
        got_token: list[Sequence] = []
        for seq in plan.decode:
            seq.output_ids.append(sampled[seq.request_id])
            got_token.append(seq)
        for sl in plan.prefill:
            sl.seq.n_prefilled = sl.stop
            if sl.completes_prompt:
                sl.seq.output_ids.append(sampled[sl.seq.request_id])
                got_token.append(sl.seq)
        return got_token
