"""How much KV a request reserves, when it grows, and who gives cells back when the context is full.

Pure policy over ``Sequence`` states (no llama_cpp, no clock); the scheduler applies it through the
``KVAllocator``.  Cells are reserved as they are needed, as llama-server (per slot) and vLLM (per block)
do, not for the worst case (prompt + ``max_tokens``), so chats that send no ``max_tokens`` run together:

* **admit**: a waiting request is admitted when what its next steps need — its prompt (with its output
  so far, when it comes back from a preemption or a KV handoff) and the cell of its next decode, rounded
  up to a block of ``BLOCK_CELLS`` — fits the unreserved cells with a block of headroom left for every
  running sequence.  A reservation never exceeds the request's worst case (``Sequence.n_ctx_needed``),
  which the engine caps to the context, so a request alone always fits.
* **grow**: before a decode step, a sequence whose next token would pass its reservation reserves one
  more block (or, when no whole block is free, the one cell it needs).
* **context full**: when a decode cannot get its cell, cells are taken back from the running sequences,
  newest first and background before interactive, until it fits.  The request taken is *preempted*: its
  KV is dropped and it goes back to the front of the waiting queue with its output appended to its prompt,
  to be recomputed when room is back — with the same sampler and text stream, so it loses no token and its
  stream only pauses.  Interactive requests are taken only when no background request is left to take.
  A request already preempted ``MAX_KV_PREEMPTIONS`` times that is taken again while decoding ends instead,
  with ``finish_reason="length"`` marked ``kv_full`` on its ``RequestDone`` (the context is full, as when
  ``max_tokens`` is reached): the recompute work per request stays bounded.  Never an error.

  A request alone always fits, so the oldest interactive request (with none, the oldest background one)
  always progresses; a background request can wait while interactive ones fill the context, which is its
  class.  A step that had to take cells back admits no new request (the cells it freed go to the decodes
  that needed them, not to a newcomer that would be the next victim).  Both actions are counted by class
  in ``/metrics`` (``homepd_kv_context_full``).

# why preempt the interactive ones too (not end them with 'length'): a chat cut short mid-answer is lost
# to its user, and a request that asked for max_tokens would get fewer than worst-case reservation gave it
# (a replica's resumed requests, tests/integration/test_replicas.py); a pause loses nothing (vLLM's choice)
"""
from __future__ import annotations

import enum
from typing import Iterable

from homepd.core.terms import RequestClass
from homepd.core.sequence import Sequence

# why 16: like vLLM's block; a sequence asks the allocator once per 16 tokens, and the admission headroom
# (a block per running sequence) covers every running decode's next growth
BLOCK_CELLS = 16
# why 3: each recompute prefills prompt + output again; like a worker death's MAX_RESUMES, it bounds the work
MAX_KV_PREEMPTIONS = 3


class KVAction(str, enum.Enum):
    """What the full context did to a request."""
    PREEMPT = "preempt"              # KV dropped, re-queued, recomputed later: nothing lost
    FINISH_LENGTH = "finish_length"  # ended with finish_reason "length": preempted too often already


def round_up_to_block(n_cells: int) -> int:
    return -(-n_cells // BLOCK_CELLS) * BLOCK_CELLS


def cells_to_admit(seq: Sequence, decodes: bool) -> int:
    """Cells ``seq`` reserves when admitted: its prompt alone on a prefill-only worker; on a decoding worker
    the cells up to and including its next decode (prompt + outputs so far, at least one), in whole blocks,
    at most its worst case."""
    if not decodes:
        return seq.n_prompt
    return min(seq.n_ctx_needed, round_up_to_block(seq.n_prompt + max(1, len(seq.output_ids))))


def admission_headroom(n_running: int) -> int:
    """Unreserved cells that must remain after an admission: one block for every running sequence."""
    return BLOCK_CELLS * n_running


def cells_to_grow(seq: Sequence, n_reserved: int) -> tuple[int, int] | None:
    """For a decoding ``seq`` holding ``n_reserved`` cells: None if its next decode fits them, else
    (the reservation to ask for: the next whole block, at most its worst case; the least that would do)."""
    n_needed = seq.n_kv_tokens + 1  # the cell its next decode token takes
    if n_needed <= n_reserved:
        return None
    return min(seq.n_ctx_needed, round_up_to_block(n_needed)), n_needed


def victim_order(running: Iterable[Sequence]) -> list[Sequence]:
    """Who gives cells back first when the context is full: background before interactive, newest first."""
    return sorted(running, key=lambda s: (s.request_class != RequestClass.BACKGROUND,
                                          -(s.arrival_order or 0)))


def action_for(seq: Sequence) -> KVAction:
    """What taking ``seq``'s cells does to it (see the module docstring)."""
    if seq.output_ids and seq.n_preemptions >= MAX_KV_PREEMPTIONS:
        return KVAction.FINISH_LENGTH
    return KVAction.PREEMPT
