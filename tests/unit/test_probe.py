"""The hardware probe: real CPU/RAM of this box, fake NVML for 0, 1 and 2 GPUs."""
import argparse
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from fake_nvml import CPU_LLAMA, CUDA_LLAMA, GIB, FakeGpu, FakeNvml, NVMLError_LibraryNotFound
from homepd.hw import probe as probe_mod
from homepd.hw.nvml import Nvml, pcie_gb_s
from homepd.hw.placement import plan_placement
from homepd.cli import probe as probe_cli
from homepd.llm import BuildInfo, build_info
from homepd.hw.probe import CUDA_REBUILD_COMMAND, probe, probe_llama_cpp, read_rapl_zones

DOCS = Path(__file__).resolve().parents[2] / "docs" / "probe.md"
NO_DRIVER = Path("/nonexistent/proc/driver/nvidia")


def fake_probe(nvml, llama=CUDA_LLAMA, **kw):
    return probe(nvml, llama, nvidia_proc_dir=NO_DRIVER, **kw)


def test_real_box_cpu_and_ram():
    box = probe()  # the real pynvml and llama_cpp, whatever this box has
    assert box.cpu.logical_cores == psutil.cpu_count(logical=True)
    assert box.cpu.usable_cpus == tuple(sorted(os.sched_getaffinity(0)))
    grouped = sorted(c for group in box.cpu.core_groups for c in group)
    assert grouped == list(box.cpu.usable_cpus)
    assert box.memory.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < box.memory.ram_available_bytes <= box.memory.ram_total_bytes
    assert box.nvml.is_available == (box.nvml.error is None)
    assert len(box.gpus) == 0 or box.nvml.is_available


def test_no_gpus():
    fake = FakeNvml([])
    box = fake_probe(fake)
    assert box.nvml.is_available and box.gpus == ()
    assert box.nvml.driver_version == "550.54.14" and box.nvml.cuda_version == "12.4"
    assert fake.init_count == 0  # the session was shut down


def test_one_gpu_every_field():
    box = fake_probe(FakeNvml([FakeGpu()]))
    (g,) = box.gpus
    assert (g.index, g.name) == (0, "NVIDIA GeForce RTX 3090")
    assert g.uuid == "GPU-00000000-0000-0000-0000-000000000000"  # bytes decoded
    assert (g.vram_total_bytes, g.vram_used_bytes, g.vram_free_bytes) == (24 * GIB, GIB, 23 * GIB)
    assert (g.pcie_gen, g.pcie_width, g.pcie_max_gen, g.pcie_max_width) == (4, 16, 4, 16)
    assert g.pcie_gb_s == pytest.approx(31.504) and g.pcie_max_gb_s == pytest.approx(31.504)
    assert (g.power_w, g.power_limit_w) == (35.0, 350.0)
    assert (g.temperature_c, g.utilization_pct, g.memory_utilization_pct) == (41, 3, 1)
    assert g.energy_mj == 1_000_000
    assert box.warnings == ()


def test_two_gpus_with_downtrained_link():
    gpus = [FakeGpu(), FakeGpu(name="NVIDIA GeForce RTX 3060", uuid="GPU-1",
                               vram_total_bytes=12 * GIB, pcie=(3, 4, 4, 16))]
    box = fake_probe(FakeNvml(gpus))
    assert [g.index for g in box.gpus] == [0, 1]
    assert box.gpus[1].name == "NVIDIA GeForce RTX 3060"
    assert box.gpus[1].pcie_gb_s == pytest.approx(3.94)       # gen3 x4 now
    assert box.gpus[1].pcie_max_gb_s == pytest.approx(31.504)  # gen4 x16 possible


def test_gpu_without_power_and_energy_is_na():
    gpu = FakeGpu(power_mw=None, power_limit_mw=None, energy_mj=None, temperature_c=None,
                  pcie=None, utilization=None)
    box = fake_probe(FakeNvml([gpu]))
    (g,) = box.gpus
    assert (g.power_w, g.power_limit_w, g.energy_mj, g.temperature_c) == (None,) * 4
    assert (g.pcie_gen, g.pcie_gb_s, g.utilization_pct) == (None, None, None)
    assert g.vram_total_bytes == 24 * GIB  # what the GPU does support is still read
    data = json.loads(probe_mod.to_json(box))
    assert data["gpus"][0]["power_w"] is None and data["gpus"][0]["energy_mj"] is None
    text = probe_cli.render_text(box)
    assert "power NA of NA" in text and "energy counter NA" in text


@pytest.mark.parametrize("error", [NVMLError_LibraryNotFound("NVML Shared Library Not Found"),
                                   OSError("libnvidia-ml.so.1: cannot open shared object")])
def test_nvml_failing_to_initialise(error):
    box = fake_probe(FakeNvml([FakeGpu()], init_error=error))
    assert not box.nvml.is_available and box.gpus == ()
    assert str(error) in box.nvml.error
    assert box.nvml.driver_version is None and box.nvml.cuda_version is None
    assert "no GPUs (NVML failed to initialise" in probe_cli.render_text(box)


def test_nvml_error_with_driver_present_warns(tmp_path):
    box = probe(FakeNvml(init_error=NVMLError_LibraryNotFound("gone")), CUDA_LLAMA,
                nvidia_proc_dir=tmp_path)
    assert any("NVIDIA driver is loaded" in w for w in box.warnings)


def test_nvml_missing_entry_point_is_na():
    fake = FakeNvml([FakeGpu()])
    fake.nvmlDeviceGetTotalEnergyConsumption = None  # an older pynvml
    with Nvml(fake) as nv:
        assert nv.energy_mj(0) is None and nv.power_w(0) == 35.0
        assert nv.name(5) is None  # no such GPU: NA, not an exception


def test_cpu_only_llama_with_gpu_warns_with_rebuild_command():
    box = fake_probe(FakeNvml([FakeGpu()]), CPU_LLAMA)
    assert box.llama_cpp.supports_gpu_offload is False
    assert box.llama_cpp.backends == ("CPU",)
    (warning,) = box.warnings
    assert CUDA_REBUILD_COMMAND in warning
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert CUDA_REBUILD_COMMAND in readme  # the README quotes the same command
    assert f"warning: {warning}" in probe_cli.render_text(box)


def test_cuda_llama_reports_backends_and_cpu_only_box_does_not_warn():
    assert probe_llama_cpp(CUDA_LLAMA).backends == ("CUDA", "CPU")
    assert fake_probe(FakeNvml([]), CPU_LLAMA).warnings == ()


def test_llama_cpp_import_failure_is_na(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    monkeypatch.delitem(sys.modules, "homepd.llm")       # so homepd.llm is imported again, and fails
    info = probe_llama_cpp()
    assert not info.is_installed and info.supports_gpu_offload is None
    assert "llama_cpp not importable" in info.error


def test_build_info_of_the_installed_llama_cpp():
    import llama_cpp

    build = build_info()
    assert build.version == llama_cpp.__version__
    assert build.supports_gpu_offload is bool(llama_cpp.llama_supports_gpu_offload())
    assert build.system_info == llama_cpp.llama_print_system_info().decode()
    info = probe_llama_cpp()  # through homepd.llm, as `homepd probe` does
    assert info.is_installed and info.error is None and info.version == build.version
    assert "CPU" in info.backends  # every build registers the CPU backend


def test_build_info_entry_point_missing_or_failing_is_na():
    def failing():
        raise OSError("symbol not found")

    old_build = SimpleNamespace(__version__="0.2.0", llama_supports_gpu_offload=failing)  # no system info
    build = build_info(old_build)
    assert build == BuildInfo("0.2.0", None, None)
    info = probe_llama_cpp(build)
    assert info.is_installed and (info.supports_gpu_offload, info.backends) == (None, None)


def test_pcie_bandwidth_per_generation():
    assert pcie_gb_s(5, 16) == pytest.approx(63.008)
    assert pcie_gb_s(1, 1) == 0.25
    assert pcie_gb_s(None, 16) is None and pcie_gb_s(9, 16) is None


def write_zone(root, name, zone, energy_uj, max_uj=262143328850):
    d = root / name
    d.mkdir()
    (d / "name").write_text(zone + "\n")
    if energy_uj is None:
        (d / "energy_uj").mkdir()  # exists but cannot be read, like a root-only counter
    else:
        (d / "energy_uj").write_text(f"{energy_uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")


def test_rapl_zones(tmp_path):
    write_zone(tmp_path, "intel-rapl:0", "package-0", 123456)
    write_zone(tmp_path, "intel-rapl:0:0", "core", None)
    (tmp_path / "intel-rapl").mkdir()  # the control type directory: not a zone
    zones = read_rapl_zones(tmp_path)
    assert [(z.name, z.energy_uj) for z in zones] == [("package-0", 123456), ("core", None)]
    assert zones[0].max_energy_range_uj == 262143328850
    assert read_rapl_zones(tmp_path / "missing") == ()


def test_core_groups_follow_smt_siblings(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    for cpu in usable:
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{cpu // 2}\n")  # pairs of siblings
    groups = probe_mod.probe_cpu(tmp_path).core_groups
    assert groups == tuple(tuple(c for c in usable if c // 2 == core)
                           for core in sorted({c // 2 for c in usable}))


def json_paths(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            yield from json_paths(item, path)
    elif isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        yield from json_paths(value[0], prefix + "[]")


def test_every_json_field_is_documented(tmp_path):
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1)
    box = fake_probe(FakeNvml([FakeGpu()]), powercap_root=tmp_path)
    plan = plan_placement(box, 4 * GIB, GIB)
    data = json.loads(probe_mod.to_json(box, plan))
    documented = set(re.findall(r"`([a-z_\[\].]+)`", DOCS.read_text()))
    missing = [p for p in json_paths(data) if p not in documented]
    assert missing == []
    assert data["schema_version"] == probe_mod.SCHEMA_VERSION


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser()
    probe_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_cli_json_is_one_object_with_real_cpu_and_plan(capsys):
    data = json.loads(run_cli(["probe", "--json", "--model-bytes", "1G", "--kv-bytes", "256M"],
                              capsys))
    assert data["cpu"]["logical_cores"] == psutil.cpu_count(logical=True)
    assert data["placement"]["model_bytes"] == GIB
    assert data["placement"]["kv_bytes"] == 256 << 20
    assert data["placement"]["memory"]["worker_bytes"] == GIB + (256 << 20)


@pytest.mark.parametrize("text,expected", [("123", 123), ("800M", 800 << 20),
                                           ("1.5GiB", int(1.5 * GIB)), ("2g", 2 * GIB)])
def test_size_option(text, expected):
    assert probe_cli._size(text) == expected


def test_size_option_rejects_garbage():
    with pytest.raises(argparse.ArgumentTypeError):
        probe_cli._size("lots")
