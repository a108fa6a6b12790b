"""The replicas architecture in the placement plan: one per GPU, or the CPU cores split; refusals name the numbers."""
from test_placement import gpu, make_box

from fake_nvml import GIB
from homepd.hw.placement import plan_placement, render_plan_text


def test_two_gpus_give_one_replica_each_on_split_cores():
    box = make_box([gpu(12, uuid="GPU-a"), gpu(8, uuid="GPU-b")], n_cores=8)
    r = plan_placement(box, 2 * GIB, GIB).replicas
    assert r.feasible and [w.device for w in r.workers] == ["cuda:0", "cuda:1"]
    assert [w.cuda_visible_devices for w in r.workers] == ["GPU-a", "GPU-b"]
    a, b = (set(w.cpu_cores) for w in r.workers)
    assert a and b and not a & b


def test_cpu_only_box_splits_the_cores_and_pins_each_replica():
    box = make_box(n_cores=4, ram_gib=16)
    r = plan_placement(box, GIB, GIB // 2).replicas
    assert r.feasible and [w.role for w in r.workers] == ["replica-0", "replica-1"]
    assert [w.cpu_cores for w in r.workers] == [(0, 1), (2, 3)] and all(w.n_threads == 2 for w in r.workers)
    assert all(w.device == "cpu" and w.n_gpu_layers == 0 for w in r.workers)
    assert "replicas:      feasible" in render_plan_text(plan_placement(box, GIB, GIB // 2))


def test_one_core_or_too_little_ram_is_refused_with_the_numbers():
    one_core = plan_placement(make_box(n_cores=1), GIB, GIB).replicas
    assert not one_core.feasible and "at least 2 physical cores" in one_core.reason and "use 1" in one_core.reason
    small = plan_placement(make_box(n_cores=4, ram_gib=4), 2 * GIB, GIB).replicas
    assert not small.feasible and "2 copies" in small.reason and "GiB" in small.reason


def test_three_replicas_need_three_core_groups():
    r = plan_placement(make_box(n_cores=6), GIB, GIB, n_replicas=3).replicas
    assert r.feasible and len(r.workers) == 3 and all(len(w.cpu_cores) == 2 for w in r.workers)
