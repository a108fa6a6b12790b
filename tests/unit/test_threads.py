"""Which threads burned CPU over a run (homepd.hw.threads), and the bench's guard on engine / reference."""
from __future__ import annotations

import threading
import time

import pytest

from homepd.hw.threads import parse_schedstat, read_tasks, thread_use
from homepd.measure.bench import GuardVerdict, engine_guard

MS = 1_000_000  # ns


def test_schedstat_gives_cpu_and_wait_nanoseconds():
    assert parse_schedstat("123456 789 12\n") == (123456, 789)
    with pytest.raises(ValueError, match="schedstat"):
        parse_schedstat("123456")


def test_an_openmp_team_of_two_is_two_busy_threads_and_idle_threads_do_not_count():
    wall_s = 1.0
    before = {10: (5_000 * MS, 100 * MS), 11: (4_000 * MS, 50 * MS), 12: (1 * MS, 0), 13: (0, 0)}
    after = {10: (5_900 * MS, 150 * MS),   # main thread: computed 900 ms, waited 50 ms
             11: (4_850 * MS, 80 * MS),    # its OpenMP partner: 850 ms, waited 30 ms
             12: (3 * MS, 0),              # a pool thread that woke twice: 2 ms
             13: (15 * MS, 0),             # above 2% of the wall would count, but far under the busiest
             14: (600 * MS, 0)}            # born during the run: everything it ran is new
    use = thread_use(before, after, wall_s)
    assert use.busy_tids == (10, 11, 14)
    assert use.n_busy_threads == 3
    assert use.cpu_s == pytest.approx(0.9 + 0.85 + 0.002 + 0.015 + 0.6)
    assert use.wait_s == pytest.approx(0.08)
    assert use.wait_share == pytest.approx(0.08 / 3)


def test_a_thread_that_only_woke_now_and_then_is_not_busy_even_when_nothing_else_ran():
    use = thread_use({1: (0, 0)}, {1: (10 * MS, 0)}, wall_s=1.0)   # 1% of the wall
    assert use.busy_tids == ()
    assert use.wait_share == 0.0


def test_reading_this_process_counts_the_computing_thread_not_the_blocked_one():
    released = threading.Event()
    blocked = threading.Thread(target=released.wait)
    blocked.start()
    try:
        before, t0 = read_tasks(), time.monotonic()
        while time.monotonic() - t0 < 0.3:   # compute on this thread only
            sum(range(1000))
        use = thread_use(before, read_tasks(), time.monotonic() - t0)
    finally:
        released.set()
        blocked.join()
    assert use.busy_tids == (threading.get_native_id(),)


@pytest.mark.parametrize("ratio, checked, verdict", [
    (0.97, True, GuardVerdict.PASS), (1.3, True, GuardVerdict.PASS), (0.969, True, GuardVerdict.FAIL),
    (1.3, False, GuardVerdict.UNCHECKED), (0.5, False, GuardVerdict.UNCHECKED)])
def test_the_guard_judges_only_against_a_checked_reference(ratio, checked, verdict):
    assert engine_guard(ratio, reference_checked=checked) is verdict
