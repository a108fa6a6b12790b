"""Placement plans for CPU-only, 1-GPU and 2-GPU boxes, including what does not fit."""
import dataclasses
import json

import pytest

from fake_nvml import CPU_LLAMA, CUDA_LLAMA, GIB, FakeGpu, FakeNvml
from homepd.hw.placement import VRAM_RESERVE_BYTES, arena_bytes_for, plan_placement, render_plan_text
from homepd.hw.probe import BoxProbe, CpuInfo, MemoryInfo, probe


def make_box(gpus=(), n_cores=8, smt=False, ram_gib=32.0, llama=CUDA_LLAMA) -> BoxProbe:
    """A probe of an imaginary box: the GPUs go through the fake NVML, CPU and RAM are set."""
    real = probe(FakeNvml(list(gpus)), llama)
    cpus = tuple(range(2 * n_cores if smt else n_cores))
    groups = tuple((c, c + n_cores) for c in range(n_cores)) if smt else tuple((c,) for c in cpus)
    ram = int(ram_gib * GIB)
    return dataclasses.replace(
        real,
        cpu=CpuInfo("Imaginary CPU", n_cores, len(cpus), cpus, groups),
        memory=MemoryInfo(ram, ram, 0, 0),
        warnings=(),
    )


def gpu(total_gib, used_gib=0.0, uuid=None):
    return FakeGpu(vram_total_bytes=int(total_gib * GIB), vram_used_bytes=int(used_gib * GIB),
                   uuid=uuid or f"GPU-{total_gib}")


def workers(placement):
    return [placement.prefill, placement.decode]


def assert_disjoint_pinning(plan, box):
    d = plan.disaggregated
    if d.feasible:
        a, b = set(d.prefill.cpu_cores), set(d.decode.cpu_cores)
        assert a and b and not a & b
        assert a | b <= set(box.cpu.usable_cpus)


def test_cpu_only_colocated_uses_every_core_and_disaggregated_splits_them():
    box = make_box(n_cores=8)
    plan = plan_placement(box, 2 * GIB, GIB)
    (w,) = plan.colocated.workers
    assert (w.device, w.cpu_cores, w.n_threads, w.n_gpu_layers) == ("cpu", tuple(range(8)), 8, 0)
    assert w.cuda_visible_devices == ""
    d = plan.disaggregated
    assert d.feasible and not plan.uses_gpus
    assert (d.prefill.role, d.prefill.cpu_cores, d.prefill.n_threads) == ("prefill", (0, 1, 2, 3), 4)
    assert (d.decode.role, d.decode.cpu_cores, d.decode.n_threads) == ("decode", (4, 5, 6, 7), 4)
    assert d.transfer_bytes == arena_bytes_for(GIB)
    assert plan.memory.fits_ram_once and plan.memory.fits_ram_twice


def test_cpu_only_keeps_smt_siblings_together():
    box = make_box(n_cores=4, smt=True)  # siblings (0,4) (1,5) (2,6) (3,7)
    plan = plan_placement(box, GIB, GIB)
    d = plan.disaggregated
    assert d.prefill.cpu_cores == (0, 1, 4, 5) and d.prefill.n_threads == 2
    assert d.decode.cpu_cores == (2, 3, 6, 7) and d.decode.n_threads == 2
    assert plan.colocated.workers[0].n_threads == 4


def test_cpu_only_odd_core_count_gives_prefill_the_larger_half():
    d = plan_placement(make_box(n_cores=3), GIB, GIB).disaggregated
    assert (d.prefill.cpu_cores, d.decode.cpu_cores) == ((0, 1), (2,))


def test_cpu_only_single_core_cannot_disaggregate():
    plan = plan_placement(make_box(n_cores=1), GIB, GIB)
    assert plan.colocated.feasible
    assert not plan.disaggregated.feasible and plan.disaggregated.prefill is None
    assert "at least 2 physical cores" in plan.disaggregated.reason


def test_cpu_only_model_does_not_fit_twice():
    plan = plan_placement(make_box(ram_gib=16), 8 * GIB, GIB)  # 9 GiB fits once, not twice
    assert plan.memory.fits_ram_once and not plan.memory.fits_ram_twice
    assert plan.colocated.feasible
    d = plan.disaggregated
    assert not d.feasible and d.prefill is None and d.decode is None
    assert "does not fit twice" in d.reason and "more memory than the interference" in d.reason


def test_model_does_not_fit_once():
    plan = plan_placement(make_box(ram_gib=8), 8 * GIB, GIB)
    assert not plan.colocated.feasible and "does not fit in RAM" in plan.colocated.reason
    assert not plan.disaggregated.feasible


def test_one_gpu_with_room_for_two_copies_shares_it():
    box = make_box([gpu(24, 1, uuid="GPU-aaaa")])
    plan = plan_placement(box, 4 * GIB, GIB)
    (w,) = plan.colocated.workers
    assert (w.device, w.n_gpu_layers, w.cuda_visible_devices) == ("cuda:0", -1, "GPU-aaaa")
    d = plan.disaggregated
    assert d.feasible and [x.device for x in workers(d)] == ["cuda:0", "cuda:0"]
    assert "share cuda:0" in d.reason
    assert plan.memory.fits_vram_twice == (True,)
    assert_disjoint_pinning(plan, box)


def test_one_gpu_with_room_for_one_copy_puts_decode_on_cpu():
    box = make_box([gpu(12)], n_cores=8)
    plan = plan_placement(box, 7 * GIB, GIB)  # 8 GiB + reserve fits once, not twice
    assert plan.memory.fits_vram_once == (True,) and plan.memory.fits_vram_twice == (False,)
    d = plan.disaggregated
    assert d.feasible
    assert (d.prefill.device, d.prefill.cpu_cores, d.prefill.n_gpu_layers) == ("cuda:0", (0,), -1)
    assert (d.decode.device, d.decode.cpu_cores, d.decode.n_threads) == ("cpu", tuple(range(1, 8)), 7)
    assert d.decode.cuda_visible_devices == "" and d.decode.n_gpu_layers == 0
    assert "decode on the CPU" in d.reason


def test_one_gpu_model_not_fitting_twice_anywhere_is_infeasible():
    box = make_box([gpu(12)], ram_gib=8)
    plan = plan_placement(box, 7 * GIB, GIB)
    assert plan.colocated.feasible and plan.colocated.workers[0].device == "cuda:0"
    d = plan.disaggregated
    assert not d.feasible and "does not fit twice" in d.reason and "largest GPU" in d.reason


def test_one_gpu_too_small_falls_back_to_cpu():
    box = make_box([gpu(4)], ram_gib=64)
    plan = plan_placement(box, 7 * GIB, GIB)
    (w,) = plan.colocated.workers
    assert w.device == "cpu" and "does not fit the free VRAM" in plan.colocated.reason
    d = plan.disaggregated
    assert d.feasible and d.prefill.device == d.decode.device == "cpu"


def test_two_gpus_colocated_replicas_and_decode_on_the_larger():
    box = make_box([gpu(12, uuid="GPU-small"), gpu(24, uuid="GPU-big")])
    plan = plan_placement(box, 4 * GIB, GIB)
    c = plan.colocated
    assert c.feasible and [w.device for w in c.workers] == ["cuda:0", "cuda:1"]
    assert {w.role for w in c.workers} == {"colocated"}
    assert set(c.workers[0].cpu_cores).isdisjoint(c.workers[1].cpu_cores)
    d = plan.disaggregated
    assert (d.prefill.device, d.prefill.cuda_visible_devices) == ("cuda:0", "GPU-small")
    assert (d.decode.device, d.decode.cuda_visible_devices) == ("cuda:1", "GPU-big")
    assert_disjoint_pinning(plan, box)


def test_two_gpus_only_one_with_room():
    box = make_box([gpu(24, 1), gpu(8)])
    plan = plan_placement(box, 10 * GIB, 2 * GIB)
    (w,) = plan.colocated.workers
    assert w.device == "cuda:0" and "cuda:1 has 8.0 GiB free" in plan.colocated.reason
    assert plan.memory.fits_vram_once == (True, False)
    d = plan.disaggregated  # 23 GiB free < 2 x (12 GiB + reserve): decode goes to the CPU
    assert d.feasible and (d.prefill.device, d.decode.device) == ("cuda:0", "cpu")


def test_two_gpus_model_not_fitting_twice_is_infeasible_with_reason():
    box = make_box([gpu(24, 1), gpu(8)], ram_gib=12)
    plan = plan_placement(box, 10 * GIB, 2 * GIB)
    assert plan.colocated.feasible
    d = plan.disaggregated
    assert not d.feasible and "does not fit twice" in d.reason
    assert "KV transfer" in d.reason


def test_vram_reserve_is_counted_per_process():
    need = 10 * GIB
    just_once = gpu((need + VRAM_RESERVE_BYTES) / GIB)
    plan = plan_placement(make_box([just_once]), need, 0)
    assert plan.memory.fits_vram_once == (True,)
    plan = plan_placement(make_box([just_once]), need + 1, 0)
    assert plan.memory.fits_vram_once == (False,)
    just_twice = gpu(2 * (need + VRAM_RESERVE_BYTES) / GIB)  # two CUDA contexts
    assert plan_placement(make_box([just_twice]), need, 0).memory.fits_vram_twice == (True,)
    assert plan_placement(make_box([just_twice]), need + 1, 0).memory.fits_vram_twice == (False,)


def test_cpu_only_llama_build_leaves_gpus_out():
    plan = plan_placement(make_box([gpu(24)], llama=CPU_LLAMA), 4 * GIB, GIB)
    assert not plan.uses_gpus and plan.colocated.workers[0].device == "cpu"
    assert any("CPU-only" in n for n in plan.notes)


def test_gpu_with_unreadable_vram_is_left_out():
    plan = plan_placement(make_box([FakeGpu(vram_total_bytes=None)]), GIB, GIB)
    assert not plan.uses_gpus and plan.memory.gpu_indices == ()
    assert any("cannot read" in n for n in plan.notes)


@pytest.mark.parametrize("gpus", [(), (gpu(24),), (gpu(24), gpu(12))])
def test_plan_is_json_ready_and_rendered(gpus):
    plan = plan_placement(make_box(gpus), 0, 0)
    json.dumps(dataclasses.asdict(plan))
    text = render_plan_text(plan)
    assert "colocated:     feasible" in text and "model size is 0" in text
    assert "disaggregated: feasible" in text
