"""One background thread that samples the box; everyone else reads its snapshots.

Every ``period_s`` the ``Sampler`` records GPU, CPU, RAM, RAPL and per-worker
process figures into a frozen ``Snapshot`` kept as ``latest()`` and in a
bounded history ring.  Engine metrics, the dashboard and the benchmarks read
snapshots; nothing else queries NVML, so no UI render or request ever waits on
the hardware.  ``energy_by_source_j`` attributes energy to a run or a phase
from the history.
"""
from __future__ import annotations

import collections
import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Iterable, Sequence

import psutil

from homepd.hw.nvml import Nvml
from homepd.hw.probe import POWERCAP_ROOT, RaplZone, read_rapl_zones


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization_pct: int | None
    memory_utilization_pct: int | None
    vram_used_bytes: int | None
    vram_total_bytes: int | None
    power_w: float | None
    energy_mj: int | None          # NVML's running counter, not a delta
    temperature_c: int | None
    pcie_tx_bytes_s: int | None
    pcie_rx_bytes_s: int | None


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    role: str                      # what registered it: "prefill", "decode", ...
    is_alive: bool
    rss_bytes: int | None
    uss_bytes: int | None          # memory only this process holds
    pss_bytes: int | None          # RSS with shared pages split between their users
    cpu_pct: float | None          # since the previous sample; 100 = one core; None first time


@dataclass(frozen=True)
class Snapshot:
    seq: int
    t_mono_s: float                # time.monotonic(), for attribution to runs and phases
    t_wall_s: float
    cpu_pct: float | None          # whole box, since the previous sample
    ram_used_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuSample, ...]
    processes: tuple[ProcessSample, ...]
    rapl: tuple[RaplZone, ...]


class Sampler:
    """Samples every ``period_s`` on a daemon thread once ``start()``-ed.

    ``sample_once()`` takes a sample now (the thread calls it; so may tests).
    Worker processes are added with ``register_process(pid, role)``.
    """

    def __init__(self, period_s: float = 0.5, history_len: int = 1200, *,
                 nvml_module: Any = None, powercap_root: Path = POWERCAP_ROOT,
                 read_pcie: bool = True):
        assert period_s > 0 and history_len > 0
        self.period_s = period_s
        self._nvml_module, self._powercap_root, self._read_pcie = nvml_module, powercap_root, read_pcie
        self._nvml: Nvml | None = None
        self._history: collections.deque[Snapshot] = collections.deque(maxlen=history_len)
        self._changed = threading.Condition()          # guards _history, wakes waiters
        self._sample_lock = threading.Lock()           # one sample at a time
        self._procs: dict[int, tuple[str, psutil.Process | None]] = {}
        self._primed: set[int] = set()
        self._procs_lock = threading.Lock()
        self._cpu_busy_total: tuple[float, float] | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- processes ------------------------------------------------------

    def register_process(self, pid: int, role: str) -> None:
        """Sample ``pid`` from the next snapshot on, labelled ``role``."""
        try:
            proc: psutil.Process | None = psutil.Process(pid)
        except psutil.NoSuchProcess:
            proc = None
        with self._procs_lock:
            self._procs[pid] = (role, proc)
            self._primed.discard(pid)

    def unregister_process(self, pid: int) -> None:
        """Stop sampling ``pid``; unknown pids are ignored."""
        with self._procs_lock:
            self._procs.pop(pid, None)
            self._primed.discard(pid)

    def _sample_process(self, pid: int, role: str, proc: psutil.Process | None) -> ProcessSample:
        if proc is None:
            return ProcessSample(pid, role, False, None, None, None, None)
        try:
            with proc.oneshot():
                cpu = proc.cpu_percent(None)
                mem = proc.memory_full_info()
        except psutil.NoSuchProcess:  # includes zombies
            return ProcessSample(pid, role, False, None, None, None, None)
        except psutil.AccessDenied:
            return ProcessSample(pid, role, True, None, None, None, None)
        with self._procs_lock:
            first = pid not in self._primed
            self._primed.add(pid)
        return ProcessSample(pid, role, True, int(mem.rss), getattr(mem, "uss", None),
                             getattr(mem, "pss", None), None if first else cpu)

    # -- box ------------------------------------------------------------

    def _cpu_pct(self) -> float | None:
        t = psutil.cpu_times()
        # why: on Linux guest time is already counted in user/nice
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        busy = total - t.idle - getattr(t, "iowait", 0.0)
        previous, self._cpu_busy_total = self._cpu_busy_total, (busy, total)
        if previous is None or total <= previous[1]:
            return None
        return round(100.0 * (busy - previous[0]) / (total - previous[1]), 1)

    def _sample_gpus(self) -> tuple[GpuSample, ...]:
        if self._nvml is None:
            self._nvml = Nvml(self._nvml_module)
        nv, gpus = self._nvml, []
        for i in range(nv.device_count()):
            energy, power = nv.energy_mj(i), nv.power_w(i)  # first: closest to t_mono_s
            total, used = nv.memory_bytes(i)
            util, mem_util = nv.utilization_pct(i)
            tx, rx = nv.pcie_throughput_bytes_s(i) if self._read_pcie else (None, None)
            gpus.append(GpuSample(i, util, mem_util, used, total, power, energy,
                                  nv.temperature_c(i), tx, rx))
        return tuple(gpus)

    def sample_once(self) -> Snapshot:
        """Take one snapshot now, add it to the history and wake ``wait_for_next`` callers."""
        with self._sample_lock:
            t_mono, t_wall = time.monotonic(), time.time()
            rapl = read_rapl_zones(self._powercap_root)
            gpus = self._sample_gpus()
            with self._procs_lock:
                procs = list(self._procs.items())
            processes = tuple(self._sample_process(pid, role, p) for pid, (role, p) in procs)
            ram = psutil.virtual_memory()
            self._seq += 1
            snap = Snapshot(self._seq, t_mono, t_wall, self._cpu_pct(),
                            int(ram.total - ram.available), int(ram.available),
                            gpus, processes, rapl)
        with self._changed:
            self._history.append(snap)
            self._changed.notify_all()
        return snap

    # -- thread ---------------------------------------------------------

    def start(self) -> Sampler:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="homepd-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and close NVML; snapshots stay readable."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._sample_lock:
            if self._nvml is not None:
                self._nvml.close()
                self._nvml = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_t += self.period_s
            # why: a slow sample (NVML PCIe reads take ~20 ms each) must not drift the period
            next_t = max(next_t, time.monotonic())
            self._stop.wait(next_t - time.monotonic())

    # -- readers --------------------------------------------------------

    def latest(self) -> Snapshot | None:
        """The newest snapshot, or None before the first."""
        with self._changed:
            return self._history[-1] if self._history else None

    def history(self, since_mono_s: float | None = None) -> tuple[Snapshot, ...]:
        """Snapshots in the ring, oldest first, optionally from ``since_mono_s`` on."""
        with self._changed:
            snaps = tuple(self._history)
        if since_mono_s is None:
            return snaps
        return snaps[bisect_left([s.t_mono_s for s in snaps], since_mono_s):]

    def wait_for_next(self, after_seq: int, timeout_s: float) -> Snapshot | None:
        """Block until a snapshot with ``seq > after_seq`` exists; None on timeout."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._history and self._history[-1].seq > after_seq, timeout_s)
            newest = self._history[-1] if self._history else None
        return newest if newest is not None and newest.seq > after_seq else None


def _unwrap(values: Sequence[float], wrap: float | None) -> list[float]:
    out, offset = [], 0.0
    for prev, value in zip([None, *values], values):
        if prev is not None and value < prev and wrap:
            offset += wrap
        out.append(value + offset)
    return out


def _interp(ts: Sequence[float], ys: Sequence[float], t: float) -> float:
    if t <= ts[0]:
        return ys[0]
    if t >= ts[-1]:
        return ys[-1]
    i = bisect_right(ts, t)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - ts[i - 1]) / (ts[i] - ts[i - 1])


def integrate_energy_j(points: Iterable[tuple[float, float | None, float | None]],
                       t0_s: float, t1_s: float, *, wrap_j: float | None = None) -> float | None:
    """Energy in J between monotonic ``t0_s`` and ``t1_s`` from ``(t_s, counter_j, power_w)`` points.

    Uses the cumulative counter where at least two points have one (linearly
    interpolated at the ends, unwrapped at ``wrap_j``), else the trapezoid over
    power samples.  Time outside the sampled span is not counted; None when
    neither source has two points.
    """
    assert t1_s >= t0_s
    points = sorted(points, key=lambda p: p[0])
    counters = [(t, c) for t, c, _ in points if c is not None]
    if len(counters) >= 2:
        ts = [t for t, _ in counters]
        ys = _unwrap([c for _, c in counters], wrap_j)
        return _interp(ts, ys, t1_s) - _interp(ts, ys, t0_s)
    powers = [(t, p) for t, _, p in points if p is not None]
    if len(powers) < 2:
        return None
    total = 0.0
    for (ta, pa), (tb, pb) in pairwise(powers):
        lo, hi = max(ta, t0_s), min(tb, t1_s)
        if hi > lo:
            p_lo, p_hi = (pa + (pb - pa) * (t - ta) / (tb - ta) for t in (lo, hi))
            total += (p_lo + p_hi) / 2 * (hi - lo)
    return total


def energy_by_source_j(snapshots: Sequence[Snapshot], t0_s: float,
                       t1_s: float) -> dict[str, float | None]:
    """Energy in J per source between two monotonic times, None where NA.

    Keys are ``gpu<index>`` and ``rapl:<zone dir>:<zone name>`` (for example
    ``rapl:intel-rapl:0:package-0``).

    RAPL zones nest (``core`` and ``dram`` sit inside a package, ``psys`` covers
    the platform): sum only ``package-*`` zones for the CPU, never all of them.
    """
    result: dict[str, float | None] = {}
    gpu_indices = sorted({g.index for s in snapshots for g in s.gpus})
    for i in gpu_indices:
        points = [(s.t_mono_s, g.energy_mj / 1000 if g.energy_mj is not None else None, g.power_w)
                  for s in snapshots for g in s.gpus if g.index == i]
        result[f"gpu{i}"] = integrate_energy_j(points, t0_s, t1_s)
    zones: dict[str, list[tuple[float, float | None, None]]] = {}
    wraps: dict[str, float | None] = {}
    for s in snapshots:
        for z in s.rapl:
            key = f"rapl:{Path(z.path).name}:{z.name}"
            zones.setdefault(key, []).append(
                (s.t_mono_s, z.energy_uj / 1e6 if z.energy_uj is not None else None, None))
            wraps[key] = z.max_energy_range_uj / 1e6 if z.max_energy_range_uj else None
    for key, points in zones.items():
        result[key] = integrate_energy_j(points, t0_s, t1_s, wrap_j=wraps[key])
    return result


def other_cpu_cores(snapshots: Sequence[Snapshot], t0_s: float, t1_s: float,
                    n_cpus: int | None = None) -> float | None:
    """The CPU that processes other than the sampled ones used between ``t0_s`` and ``t1_s``, in cores (the
    box's busy share times its cores, less what every registered process used), averaged over the snapshots
    there; None where no snapshot there reads both.  What a measurement on a busy box is told by: the other
    processes' share was taken from the engine's."""
    n_cpus = n_cpus or psutil.cpu_count() or 1
    others = []
    for s in snapshots:
        if not t0_s <= s.t_mono_s <= t1_s or s.cpu_pct is None:
            continue
        ours = [p.cpu_pct for p in s.processes if p.is_alive]
        if not ours or None in ours:
            continue
        others.append(max(0.0, s.cpu_pct / 100.0 * n_cpus - sum(ours) / 100.0))
    return sum(others) / len(others) if others else None
