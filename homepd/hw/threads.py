"""Which threads of a process burned CPU over an interval, from ``/proc/<pid>/task/*/schedstat``.

A benchmark asks a process to compute with ``n_threads`` threads; this checks
that it did.  ``read_tasks`` takes one reading (per thread: nanoseconds on a
CPU and nanoseconds spent runnable but waiting for one); ``thread_use``
compares two readings of the same process over ``wall_s``.  A thread counts as
busy when it ran at least a quarter of what the busiest thread ran (an OpenMP
team shares a step's work about evenly; an idle pool thread runs ~0) and at
least ``MIN_BUSY_SHARE`` of the wall time.  The wait figure says how much of the
interval the busy threads were kept off a CPU by other runnable threads on the
box: the noise a figure measured then carries.  Linux only; elsewhere a reading
is empty and the use reports 0 threads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

MIN_BUSY_SHARE = 0.02        # of the wall time: below it a thread only woke now and then
MIN_BUSY_OF_BUSIEST = 0.25   # of the busiest thread's CPU time

TaskTimes = dict[int, tuple[int, int]]   # tid -> (ns on a CPU, ns runnable and waiting)


def parse_schedstat(text: str) -> tuple[int, int]:
    """``/proc/<pid>/task/<tid>/schedstat`` ("on-CPU ns, wait ns, timeslices") -> (on-CPU ns, wait ns)."""
    fields = text.split()
    if len(fields) < 2:
        raise ValueError(f"schedstat needs at least 2 fields, got {text!r}")
    return int(fields[0]), int(fields[1])


def read_tasks(pid: int | str = "self") -> TaskTimes:
    """One reading of every thread of ``pid``; a thread that ends while it is read is left out."""
    out: TaskTimes = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                out[int(tid)] = parse_schedstat(fh.read())
        except (OSError, ValueError):
            continue
    return out


@dataclass(frozen=True)
class ThreadUse:
    """What one process's threads did over ``wall_s``."""
    wall_s: float
    busy_tids: tuple[int, ...]   # threads that computed (see the module docstring)
    cpu_s: float                 # CPU time of every thread of the process together
    wait_s: float                # time its busy threads were runnable but off a CPU (the box was busy)

    @property
    def n_busy_threads(self) -> int:
        return len(self.busy_tids)

    @property
    def wait_share(self) -> float:
        """Wait time per busy thread, as a share of the wall time (0: never kept waiting)."""
        return self.wait_s / self.n_busy_threads / self.wall_s if self.busy_tids and self.wall_s > 0 else 0.0


def thread_use(before: TaskTimes, after: TaskTimes, wall_s: float) -> ThreadUse:
    """Compare two readings of one process taken ``wall_s`` apart (a thread born between them starts at 0)."""
    ran = {tid: (cpu - before.get(tid, (0, 0))[0], wait - before.get(tid, (0, 0))[1])
           for tid, (cpu, wait) in after.items()}
    busiest_ns = max((cpu for cpu, _ in ran.values()), default=0)
    floor_ns = max(MIN_BUSY_OF_BUSIEST * busiest_ns, MIN_BUSY_SHARE * wall_s * 1e9, 1)
    busy = tuple(sorted(tid for tid, (cpu, _) in ran.items() if cpu >= floor_ns))
    return ThreadUse(wall_s=wall_s, busy_tids=busy, cpu_s=sum(cpu for cpu, _ in ran.values()) / 1e9,
                     wait_s=sum(ran[tid][1] for tid in busy) / 1e9)
