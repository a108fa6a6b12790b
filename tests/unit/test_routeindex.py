"""The controller's approximate prefix index of one worker (homepd.core.routeindex): longest match,
LRU eviction within the worker's cell budget, and correction from the worker's real reuse."""
from __future__ import annotations

import random

from homepd.core.routeindex import RouteIndex


def seq(*parts):
    """Token ids from ranges: seq((0, 10), (100, 105)) is 0..9 then 100..104."""
    return [t for a, b in parts for t in range(a, b)]


def test_the_longest_held_prefix_is_matched_across_branches_and_inside_an_edge():
    index = RouteIndex(capacity_tokens=1000)
    system, doc_a, doc_b = seq((0, 20)), seq((100, 150)), seq((200, 230))
    index.insert(system + doc_a)
    index.insert(system + doc_b)
    assert index.match(system + doc_a + seq((900, 905))) == 70          # a whole conversation, then new tokens
    assert index.match(system + doc_b[:10] + seq((900, 905))) == 30     # diverges inside doc_b's edge
    assert index.match(system + seq((300, 310))) == 20                  # only the shared head
    assert index.match(seq((500, 510))) == 0 and index.match([]) == 0
    assert len(index) == 20 + 50 + 30                                   # the shared head is held once


def test_a_followup_turn_extends_the_conversation_without_counting_its_history_twice():
    index = RouteIndex(capacity_tokens=1000)
    turn1 = seq((0, 40))
    index.insert(turn1)
    turn2 = turn1 + seq((40, 60))     # history + the answer + a new question
    assert index.match(turn2) == 40
    index.insert(turn2)
    assert index.match(turn2) == 60 and len(index) == 60


def test_over_budget_the_least_recently_used_conversation_goes_first():
    index = RouteIndex(capacity_tokens=100)
    a, b, c = seq((0, 40)), seq((100, 140)), seq((200, 240))
    index.insert(a)
    index.insert(b)
    index.touch(a + seq((900, 901)))  # a reused: b is now the oldest
    index.insert(c)                   # 120 > 100: one 40-token conversation must go
    assert index.match(b) == 0 and index.match(a) == 40 and index.match(c) == 40
    assert len(index) == 80 <= index.capacity_tokens and index.n_evicted_tokens == 40


def test_match_does_not_refresh_recency_routing_looks_at_every_worker():
    index = RouteIndex(capacity_tokens=80)
    a, b = seq((0, 40)), seq((100, 140))
    index.insert(a)
    index.insert(b)
    assert index.match(a) == 40       # looked at, not sent here
    index.insert(seq((200, 240)))
    assert index.match(a) == 0 and index.match(b) == 40


def test_an_inner_node_left_childless_is_evicted_in_its_own_lru_turn():
    index = RouteIndex(capacity_tokens=1000)
    head, x, z = seq((0, 30)), seq((100, 110)), seq((500, 520))
    index.insert(head + x)   # oldest: the head and its one branch
    index.insert(z)          # newer: another conversation
    index.evict_tokens(len(index) - 20)  # x goes; then the head, now a leaf and older than z, goes before z
    assert index.match(z) == 20 and index.match(head) == 0 and len(index) == 20


def test_the_budget_holds_under_any_sequence_of_inserts():
    rng = random.Random(7)
    index = RouteIndex(capacity_tokens=300)
    convs = [[rng.randrange(50)] for _ in range(12)]
    for _ in range(400):
        i = rng.randrange(len(convs))
        convs[i] = convs[i] + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        if len(convs[i]) > 250:
            convs[i] = convs[i][:1]  # a new conversation on the same head
        index.insert(convs[i])
        assert len(index) <= 300
        assert index.match(convs[i]) == len(convs[i])  # the newest is never what goes
    assert index.n_evicted_tokens > 0


def test_a_prompt_longer_than_the_budget_is_not_kept():
    index = RouteIndex(capacity_tokens=50)
    index.insert(seq((0, 60)))
    assert len(index) == 0 and index.match(seq((0, 60))) == 0


def test_the_workers_real_reuse_truncates_the_path_beyond_it_and_leaves_other_branches():
    index = RouteIndex(capacity_tokens=1000)
    head, x, y = seq((0, 30)), seq((100, 150)), seq((200, 250))
    index.insert(head + x)
    index.insert(head + y)
    prompt = head + x + seq((900, 910))
    index.truncate(prompt, 40)  # the worker reused 40: x's tail beyond 10 tokens was evicted there
    assert index.match(prompt) == 40
    assert index.match(head + y) == 80  # the other conversation is not touched
    assert len(index) == 30 + 10 + 50
    index.truncate(prompt, 30)  # cut exactly at a node boundary
    assert index.match(prompt) == 30 and index.match(head + y) == 80
    index.truncate(head + y, 0)  # nothing held after all
    assert index.match(head + y) == 0 and len(index) == 0


def test_a_truncate_that_says_the_worker_holds_more_changes_nothing():
    index = RouteIndex(capacity_tokens=1000)
    index.insert(seq((0, 30)))
    index.truncate(seq((0, 30)) + seq((50, 60)), 35)
    assert index.match(seq((0, 40))) == 30 and len(index) == 30


def test_clear_forgets_everything():
    index = RouteIndex(capacity_tokens=1000)
    index.insert(seq((0, 30)))
    index.clear()
    assert index.match(seq((0, 30))) == 0 and len(index) == 0
