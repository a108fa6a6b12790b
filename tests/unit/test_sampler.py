"""The live sampler: real child processes, fake NVML, energy attribution."""
import subprocess
import sys
import time

import psutil
import pytest

from fake_nvml import FakeGpu, FakeNvml
from homepd.hw.monitor import (GpuSample, ProcessSample, Sampler, Snapshot, energy_by_source_j,
                               integrate_energy_j, other_cpu_cores)
from homepd.hw.probe import RaplZone

MIB = 1 << 20

# The child allocates 50 MiB when told to and says so; the pipe is the only clock.
CHILD = """
import sys
print("ready", flush=True)
assert sys.stdin.readline() == "alloc\\n"
block = b"x" * (50 << 20)  # touches every page
print("allocated", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_real_child_uss_grows_by_what_it_allocates(child):
    sampler = Sampler(nvml_module=FakeNvml([]))
    sampler.register_process(child.pid, "decode")
    (before,) = sampler.sample_once().processes
    assert before.is_alive and before.role == "decode" and before.cpu_pct is None
    assert 0 < before.uss_bytes <= before.pss_bytes <= before.rss_bytes

    child.stdin.write("alloc\n")
    child.stdin.flush()
    assert child.stdout.readline() == "allocated\n"
    (after,) = sampler.sample_once().processes
    assert after.uss_bytes - before.uss_bytes >= 48 * MIB
    assert after.pss_bytes - before.pss_bytes >= 48 * MIB
    assert after.rss_bytes - before.rss_bytes >= 48 * MIB
    assert after.cpu_pct is not None and after.cpu_pct >= 0

    child.stdin.write("exit\n")
    child.stdin.flush()
    child.wait()
    (gone,) = sampler.sample_once().processes
    assert not gone.is_alive and gone.uss_bytes is None

    sampler.unregister_process(child.pid)
    assert sampler.sample_once().processes == ()
    sampler.stop()


def test_unknown_pid_is_reported_dead():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sampler = Sampler(nvml_module=FakeNvml([]))
    sampler.register_process(dead.pid, "prefill")
    (p,) = sampler.sample_once().processes
    assert (p.pid, p.is_alive, p.rss_bytes) == (dead.pid, False, None)


def test_gpu_samples_with_and_without_power():
    fake = FakeNvml([FakeGpu(), FakeGpu(power_mw=None, energy_mj=None, pcie_kib_s=None)])
    sampler = Sampler(nvml_module=fake)
    snap = sampler.sample_once()
    a, b = snap.gpus
    assert (a.index, a.power_w, a.energy_mj, a.utilization_pct) == (0, 35.0, 1_000_000, 3)
    assert (a.pcie_tx_bytes_s, a.pcie_rx_bytes_s) == (100 * 1024, 200 * 1024)
    assert (b.index, b.power_w, b.energy_mj, b.pcie_tx_bytes_s) == (1, None, None, None)
    assert b.vram_total_bytes == a.vram_total_bytes
    assert fake.init_count == 1
    sampler.stop()
    assert fake.init_count == 0  # NVML session closed


def test_nvml_unavailable_gives_no_gpus_and_box_figures():
    sampler = Sampler(nvml_module=FakeNvml([FakeGpu()], init_error=OSError("no driver")))
    first = sampler.sample_once()
    ticks = sum(psutil.cpu_times())
    while sum(psutil.cpu_times()) == ticks:  # until the kernel's CPU clock ticks
        pass
    second = sampler.sample_once()
    assert first.gpus == () and first.cpu_pct is None
    assert second.cpu_pct is not None and 0 <= second.cpu_pct <= 100
    assert second.ram_available_bytes > 0 and second.ram_used_bytes > 0
    assert second.seq == first.seq + 1 and second.t_mono_s >= first.t_mono_s


def test_history_is_a_bounded_ring():
    sampler = Sampler(history_len=3, nvml_module=FakeNvml([]))
    snaps = [sampler.sample_once() for _ in range(5)]
    assert [s.seq for s in sampler.history()] == [3, 4, 5]
    assert sampler.latest() is snaps[-1]
    assert [s.seq for s in sampler.history(since_mono_s=snaps[3].t_mono_s)] == [4, 5]


def test_background_thread_produces_snapshots():
    fake = FakeNvml([FakeGpu()])
    sampler = Sampler(period_s=0.02, nvml_module=fake, read_pcie=False)
    assert sampler.latest() is None
    with sampler:
        first = sampler.wait_for_next(0, timeout_s=10)
        assert first is not None
        later = sampler.wait_for_next(first.seq + 1, timeout_s=10)
        assert later is not None and later.seq >= first.seq + 2
        assert later.t_mono_s > first.t_mono_s
    assert fake.init_count == 0
    count = len(sampler.history())
    assert sampler.wait_for_next(10**9, timeout_s=0) is None  # stopped: nothing new
    assert len(sampler.history()) == count


def test_rapl_counters_are_sampled(tmp_path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text("1000000\n")
    (zone / "energy_uj").write_text("900000\n")
    sampler = Sampler(nvml_module=FakeNvml([]), powercap_root=tmp_path)
    s0 = sampler.sample_once()
    (zone / "energy_uj").write_text("100000\n")  # wrapped: 0.2 J later
    s1 = sampler.sample_once()
    assert s1.rapl[0].energy_uj == 100000
    joules = energy_by_source_j([s0, s1], s0.t_mono_s, s1.t_mono_s)
    assert joules == {"rapl:intel-rapl:0:package-0": pytest.approx(0.2)}


def test_gpu_energy_from_counter_and_from_power():
    fake = FakeNvml([FakeGpu(), FakeGpu(energy_mj=None, power_mw=100_000)])
    sampler = Sampler(nvml_module=fake, read_pcie=False)
    s0 = sampler.sample_once()
    fake.gpus[0].energy_mj += 5_000
    s1 = sampler.sample_once()
    joules = energy_by_source_j([s0, s1], s0.t_mono_s, s1.t_mono_s)
    assert joules["gpu0"] == pytest.approx(5.0)
    assert joules["gpu1"] == pytest.approx(100.0 * (s1.t_mono_s - s0.t_mono_s))
    sampler.stop()


def test_integrate_counter_interpolates_inside_the_window():
    points = [(0.0, 0.0, None), (1.0, 10.0, None), (2.0, 30.0, None)]
    assert integrate_energy_j(points, 0.5, 1.5) == pytest.approx(5.0 + 10.0)
    assert integrate_energy_j(points, -5.0, 9.0) == pytest.approx(30.0)  # only sampled time
    assert integrate_energy_j(points, 1.0, 1.0) == 0.0


def test_integrate_prefers_counters_and_falls_back_to_power():
    both = [(0.0, 0.0, 999.0), (2.0, 4.0, 999.0)]
    assert integrate_energy_j(both, 0.0, 2.0) == pytest.approx(4.0)
    ramp = [(0.0, None, 0.0), (2.0, None, 20.0)]
    assert integrate_energy_j(ramp, 0.0, 2.0) == pytest.approx(20.0)
    assert integrate_energy_j(ramp, 1.0, 2.0) == pytest.approx(15.0)  # 10 W -> 20 W over 1 s


def test_integrate_unwraps_and_says_na():
    wrapped = [(0.0, 8.0, None), (1.0, 2.0, None), (2.0, 6.0, None)]
    assert integrate_energy_j(wrapped, 0.0, 2.0, wrap_j=10.0) == pytest.approx(8.0)
    assert integrate_energy_j([(0.0, 1.0, 5.0)], 0.0, 1.0) is None
    assert integrate_energy_j([(0.0, None, None), (1.0, None, None)], 0.0, 1.0) is None


def test_energy_by_source_reports_na_for_a_gpu_with_nothing():
    def snap(seq, t):
        gpu = GpuSample(0, None, None, None, None, None, None, None, None, None)
        zone = RaplZone("package-0", "/x/intel-rapl:0", None, None)
        return Snapshot(seq, t, t, None, 1, 1, (gpu,), (), (zone,))

    joules = energy_by_source_j([snap(1, 0.0), snap(2, 1.0)], 0.0, 1.0)
    assert joules == {"gpu0": None, "rapl:intel-rapl:0:package-0": None}


SPIN = """
import sys, time
print("spinning", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    pass
"""


def test_other_processes_cpu_is_seen_apart_from_the_sampled_ones():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert spinner.stdout.readline() == "spinning\n"
        sampler = Sampler(nvml_module=FakeNvml([]))
        sampler.register_process(psutil.Process().pid, "controller")
        first = sampler.sample_once()
        psutil.Process(spinner.pid).cpu_percent(None)
        time.sleep(0.6)  # the measurement window: the spinner's CPU accumulates
        last = sampler.sample_once()
        # the spinner holds one core the sampler was not told about
        assert other_cpu_cores([first, last], first.t_mono_s, last.t_mono_s) >= 0.6
    finally:
        spinner.kill()
        spinner.wait()


def test_other_cpu_takes_the_sampled_processes_out_of_the_box_share():
    def snap(t, box_pct, ours_pct):
        return Snapshot(0, t, t, box_pct, 0, 0, (), tuple(ProcessSample(1, "decode", True, 1, 1, 1, p)
                                                          for p in ours_pct), ())
    snaps = [snap(0.0, None, [None]), snap(1.0, 75.0, [100.0, 40.0]), snap(2.0, 50.0, [100.0, 0.0])]
    # 4 cores: 3 busy less 1.4 ours, then 2 busy less 1 ours
    assert other_cpu_cores(snaps, 0.0, 2.0, n_cpus=4) == pytest.approx((1.6 + 1.0) / 2)
    assert other_cpu_cores(snaps, 0.0, 1.5, n_cpus=4) == pytest.approx(1.6)
    assert other_cpu_cores(snaps[:1], 0.0, 2.0, n_cpus=4) is None
