"""The prefix index on constructed token sequences: longest match, which entry, eviction order."""
from __future__ import annotations

from homepd.core.prefixcache import PrefixIndex, ReuseMode


def _index(*entries: tuple[int, list[int]]) -> PrefixIndex:
    index = PrefixIndex()
    for seq_id, tokens in entries:
        index.insert(seq_id, tokens)
    return index


def test_longest_match_is_the_entry_sharing_the_most_leading_tokens():
    index = _index((0, [1, 2, 3, 4]), (1, [1, 2, 9, 9, 9]), (2, [7, 7]))
    match = index.longest_match([1, 2, 3, 8, 8])
    assert (match.entry.seq_id, match.n_tokens) == (0, 3)
    assert index.longest_match([1, 2, 9, 9]).entry.seq_id == 1
    assert index.longest_match([5, 1, 2]) is None
    assert index.match_length([7, 7, 7, 7]) == 2 and index.match_length([1, 5]) == 1


def test_a_match_never_covers_more_than_max_tokens():
    index = _index((0, [1, 2, 3, 4]))
    assert index.longest_match([1, 2, 3, 4], max_tokens=3).n_tokens == 3  # the last token is computed


def test_exact_mode_takes_only_an_entry_wholly_inside_the_prompt():
    index = _index((0, [1, 2, 3, 4]), (1, [1, 2]))
    assert index.longest_match([1, 2, 3, 4, 5], ReuseMode.EXACT).entry.seq_id == 0
    match = index.longest_match([1, 2, 3, 9], ReuseMode.EXACT)  # entry 0 would need its tail dropped
    assert (match.entry.seq_id, match.n_tokens) == (1, 2)
    assert index.longest_match([1, 2, 3, 4], ReuseMode.EXACT, max_tokens=3).entry.seq_id == 1
    assert index.longest_match([1, 2, 3], ReuseMode.OFF) is None


def test_among_equal_matches_the_entry_with_least_beyond_it_then_the_most_recent_wins():
    index = _index((0, [1, 2, 3, 4, 5, 6]), (1, [1, 2, 3, 8]), (2, [1, 2, 3, 7]))
    assert index.longest_match([1, 2, 3, 9]).entry.seq_id == 2  # 1 and 2 both end one past; 2 is newer
    assert index.longest_match([1, 2, 3]).entry.seq_id == 2


def test_the_chat_templates_fixed_head_matches_any_conversation_that_had_it():
    head = [1, 50, 51, 52, 2]  # <|im_start|>system ... <|im_end|>
    index = _index((0, head + [1, 60, 61, 2, 1, 70, 71]), (1, head + [1, 80, 2]))
    assert index.match_length(head + [1, 90, 91, 2, 1]) == len(head) + 1


def test_lru_order_is_insertion_order_and_a_touched_entry_goes_last():
    index = _index((3, [1]), (1, [2]), (2, [3]))
    assert [e.seq_id for e in index.lru()] == [3, 1, 2]
    index.entry_of(3).last_used = index.touch()
    assert [e.seq_id for e in index.lru()] == [1, 2, 3]


def test_remove_prunes_only_what_the_removed_entry_alone_used():
    index = _index((0, [1, 2, 3]), (1, [1, 2, 4]), (2, [1, 2]))
    index.remove(index.entry_of(0))
    assert index.longest_match([1, 2, 3]).entry.seq_id in (1, 2) and index.match_length([1, 2, 3]) == 2
    index.remove(index.entry_of(2))
    assert index.duplicate_of([1, 2]) is None and index.match_length([1, 2, 4]) == 3
    index.remove(index.entry_of(1))
    assert len(index) == 0 and index.longest_match([1, 2, 4]) is None and index.n_cells == 0


def test_duplicate_of_finds_an_entry_with_exactly_those_tokens():
    index = _index((0, [1, 2, 3]))
    assert index.duplicate_of([1, 2, 3]).seq_id == 0
    assert index.duplicate_of([1, 2]) is None and index.duplicate_of([1, 2, 3, 4]) is None
