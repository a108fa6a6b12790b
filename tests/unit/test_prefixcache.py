"""The prefix index on constructed token sequences: longest match, which entry, eviction order."""
from __future__ import annotations

from homepd.core.prefixcache import PrefixIndex
from homepd.core.terms import ReuseMode


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


def _reference_match(entries: dict, prompt: list[int], mode: ReuseMode, max_tokens: int | None):
    """What longest_match must answer, by brute force over the entries: (n_tokens, the candidates' seq ids)."""
    limit = len(prompt) if max_tokens is None else min(max_tokens, len(prompt))

    def common(tokens):
        n = 0
        while n < min(len(tokens), limit) and tokens[n] == prompt[n]:
            n += 1
        return n
    exact = {s: len(t) for s, t in entries.items() if common(t) == len(t)}
    if mode is ReuseMode.EXACT or not entries or max(common(t) for t in entries.values()) == 0:
        if not exact:
            return None
        best = max(exact.values())
        return best, {s for s, n in exact.items() if n == best}
    best = max(common(t) for t in entries.values())
    beyond = {s: len(t) - best for s, t in entries.items() if common(t) == best}
    least = min(beyond.values())
    return best, {s for s, b in beyond.items() if b == least}


def test_random_inserts_removes_and_matches_agree_with_brute_force():
    import random
    rng = random.Random(7)
    index, entries, next_id = PrefixIndex(), {}, 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not entries:
            base = list(rng.choice(list(entries.values()))) if entries and rng.random() < 0.7 else []
            tokens = base[:rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
            if index.duplicate_of(tokens) is None:
                index.insert(next_id, tokens)
                entries[next_id] = tuple(tokens)
                next_id += 1
            else:
                assert tuple(tokens) in entries.values()
        elif op < 0.55:
            seq_id = rng.choice(list(entries))
            index.remove(index.entry_of(seq_id))
            del entries[seq_id]
        else:
            prompt = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
            mode = rng.choice([ReuseMode.PREFIX, ReuseMode.EXACT])
            max_tokens = rng.choice([None, rng.randint(1, 12)])
            got, want = index.longest_match(prompt, mode, max_tokens), _reference_match(entries, prompt, mode,
                                                                                        max_tokens)
            if want is None:
                assert got is None
            else:
                # among the candidates, the most recently used: the highest last_used
                assert got is not None and got.n_tokens == want[0] and got.entry.seq_id in want[1]
                assert got.entry.last_used == max(index.entry_of(s).last_used for s in want[1])
        assert len(index) == len(entries) and index.n_cells == sum(map(len, entries.values()))
        # every prefix is held once: the tree never holds more tokens than the entries' distinct prefixes
        assert index.n_tokens == len({t[:i] for t in entries.values() for i in range(1, len(t) + 1)})


def test_a_long_prompt_is_one_node_until_another_parts_from_it():
    index = _index((0, list(range(4000))))
    assert index.n_tokens == 4000 and len(index._trie.root.children) == 1
    index.insert(1, list(range(2000)) + [9999])
    (top,) = index._trie.root.children.values()
    assert len(top.edge) == 2000 and len(top.children) == 2 and index.n_tokens == 4001
