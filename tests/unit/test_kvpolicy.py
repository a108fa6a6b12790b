"""Lazy KV reservation and the full-context policy, on constructed sequence states (no scheduler, no model)."""
from __future__ import annotations

from homepd.core import kvpolicy
from homepd.core.kvpolicy import BLOCK_CELLS, KVAction
from homepd.core.sampling import SamplingParams
from homepd.core.sequence import Sequence


def seq(rid: str, n_prompt: int, max_tokens: int = 2048, n_output: int = 0, klass: str = "interactive",
        arrival: int = 0) -> Sequence:
    q = Sequence(request_id=rid, prompt_ids=list(range(3, 3 + n_prompt)), params=SamplingParams(max_tokens=max_tokens),
                 request_class=klass, arrival_order=arrival)
    if n_output:
        q.n_prefilled, q.output_ids = n_prompt, list(range(50, 50 + n_output))
    return q


def test_a_request_without_max_tokens_reserves_its_prompt_and_a_block_not_its_worst_case():
    q = seq("chat", 30, max_tokens=2048)
    assert q.n_ctx_needed == 30 + 2047
    assert kvpolicy.cells_to_admit(q, decodes=True) == 2 * BLOCK_CELLS  # 30 prompt + its first decode, in blocks
    assert kvpolicy.cells_to_admit(q, decodes=False) == 30               # a prefill-only worker: the prompt alone


def test_an_admission_never_reserves_past_the_worst_case():
    assert kvpolicy.cells_to_admit(seq("one", 30, max_tokens=1), decodes=True) == 30  # no decode ever
    assert kvpolicy.cells_to_admit(seq("few", 30, max_tokens=3), decodes=True) == 32


def test_an_imported_or_recomputed_request_reserves_its_output_so_far_and_its_next_decode():
    q = seq("handed-off", 40, n_output=9)  # 40 + 8 in the KV, the 9th output decodes next
    assert q.n_kv_tokens == 48 and kvpolicy.cells_to_admit(q, decodes=True) == round_up(49)


def test_a_decode_grows_by_a_block_only_when_its_next_token_passes_its_reservation():
    q = seq("d", 30, n_output=3)  # 32 in the KV, the next decode takes cell 33
    assert kvpolicy.cells_to_grow(q, 33) is None
    assert kvpolicy.cells_to_grow(q, 32) == (48, 33)  # the next whole block; at least the one cell
    near_end = seq("e", 30, max_tokens=5, n_output=4)  # worst case 34 cells
    assert kvpolicy.cells_to_grow(near_end, 33) == (34, 34)


def test_victims_are_background_before_interactive_newest_first():
    old_chat, new_chat = seq("old-chat", 5, n_output=2, arrival=0), seq("new-chat", 5, n_output=2, arrival=3)
    old_batch = seq("old-batch", 5, n_output=2, klass="background", arrival=1)
    new_batch = seq("new-batch", 5, klass="background", arrival=2)
    order = kvpolicy.victim_order([old_chat, old_batch, new_batch, new_chat])
    assert [q.request_id for q in order] == ["new-batch", "old-batch", "new-chat", "old-chat"]


def test_a_request_is_preempted_until_it_was_preempted_too_often_then_a_decoding_one_ends_with_length():
    assert kvpolicy.action_for(seq("batch", 5, n_output=7, klass="background")) is KVAction.PREEMPT
    assert kvpolicy.action_for(seq("chat", 5, n_output=7)) is KVAction.PREEMPT
    often = seq("chat", 5, n_output=7)
    often.n_preemptions = kvpolicy.MAX_KV_PREEMPTIONS
    assert kvpolicy.action_for(often) is KVAction.FINISH_LENGTH
    often.restart_for_recompute()  # prefilling again, nothing new to show yet: preempted, never ended empty
    assert kvpolicy.action_for(often) is KVAction.PREEMPT


def test_a_preempted_request_recomputes_its_output_as_prompt_with_the_rest_of_max_tokens():
    q = seq("batch", 5, max_tokens=10, n_output=4, klass="background")
    q.seq_id, worst = 3, q.n_ctx_needed
    q.restart_for_recompute()
    assert q.prompt_ids == list(range(3, 8)) + [50, 51, 52, 53] and q.output_ids == []
    assert q.params.max_tokens == 6 and q.n_prefilled == 0 and q.seq_id is None
    assert q.n_ctx_needed == worst  # the same worst case: it never needs more room than it did


def round_up(n: int) -> int:
    return -(-n // BLOCK_CELLS) * BLOCK_CELLS
