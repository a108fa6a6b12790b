"""What box homepd runs on: CPU, memory, NVIDIA GPUs, RAPL and the llama.cpp build.

``probe()`` reads the hardware once and returns a frozen ``BoxProbe``; every
field it cannot read is ``None`` (NA), never an exception.  A box without GPUs
is a normal case.  ``homepd probe [--json]`` prints it with the placement plan
(see ``homepd.hw.placement``); docs/probe.md documents the JSON fields.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from homepd.hw.nvml import GpuInfo, Nvml, probe_gpus

if TYPE_CHECKING:
    from homepd.llm import BuildInfo

SCHEMA_VERSION = 1
POWERCAP_ROOT = Path("/sys/class/powercap")
CPU_SYSFS_ROOT = Path("/sys/devices/system/cpu")
NVIDIA_PROC_DIR = Path("/proc/driver/nvidia/gpus")
# quoted by the README ("With a GPU")
CUDA_REBUILD_COMMAND = (
    "uv sync --reinstall-package llama-cpp-python "
    "--config-settings-package llama-cpp-python:cmake.define.GGML_CUDA=ON"
)


@dataclass(frozen=True)
class CpuInfo:
    model: str | None
    physical_cores: int | None
    logical_cores: int | None
    usable_cpus: tuple[int, ...]               # os.sched_getaffinity(0), sorted
    core_groups: tuple[tuple[int, ...], ...]   # usable CPUs grouped by physical core


@dataclass(frozen=True)
class MemoryInfo:
    ram_total_bytes: int | None
    ram_available_bytes: int | None
    swap_total_bytes: int | None
    swap_used_bytes: int | None


@dataclass(frozen=True)
class NvmlInfo:
    is_available: bool
    error: str | None
    driver_version: str | None
    cuda_version: str | None


@dataclass(frozen=True)
class RaplZone:
    name: str                       # "package-0", "core", "dram", ...
    path: str
    energy_uj: int | None           # None when unreadable (root-only since Linux 5.10)
    max_energy_range_uj: int | None


@dataclass(frozen=True)
class LlamaCppInfo:
    is_installed: bool
    version: str | None
    supports_gpu_offload: bool | None
    backends: tuple[str, ...] | None   # registered ggml backends, e.g. ("CUDA", "CPU")
    error: str | None


@dataclass(frozen=True)
class BoxProbe:
    hostname: str
    cpu: CpuInfo
    memory: MemoryInfo
    nvml: NvmlInfo
    gpus: tuple[GpuInfo, ...]
    rapl: tuple[RaplZone, ...]
    llama_cpp: LlamaCppInfo
    warnings: tuple[str, ...]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _cpu_model() -> str | None:
    text = _read_text(Path("/proc/cpuinfo")) or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or None


def probe_cpu(sysfs_root: Path = CPU_SYSFS_ROOT) -> CpuInfo:
    """CPU model, core counts, the CPUs this process may run on, grouped by physical core."""
    try:
        usable = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        usable = tuple(range(os.cpu_count() or 1))
    groups: dict[tuple[int | None, int | None], list[int]] = {}
    for cpu in usable:
        topology = sysfs_root / f"cpu{cpu}" / "topology"
        key = (_read_int(topology / "physical_package_id"), _read_int(topology / "core_id"))
        groups.setdefault(key if None not in key else (None, cpu), []).append(cpu)
    return CpuInfo(
        model=_cpu_model(),
        physical_cores=psutil.cpu_count(logical=False),
        logical_cores=psutil.cpu_count(logical=True),
        usable_cpus=usable,
        core_groups=tuple(sorted(tuple(g) for g in groups.values())),
    )


def probe_memory() -> MemoryInfo:
    """RAM and swap totals from psutil."""
    ram, swap = psutil.virtual_memory(), psutil.swap_memory()
    return MemoryInfo(int(ram.total), int(ram.available), int(swap.total), int(swap.used))


def read_rapl_zones(root: Path = POWERCAP_ROOT) -> tuple[RaplZone, ...]:
    """RAPL zones under ``root`` (intel-rapl, also used on AMD); unreadable counters are None."""
    try:
        dirs = sorted(p for p in root.iterdir() if p.name.startswith(("intel-rapl:", "amd-rapl:")))
    except OSError:
        return ()
    return tuple(
        RaplZone(
            name=_read_text(d / "name") or d.name, path=str(d),
            energy_uj=_read_int(d / "energy_uj"),
            max_energy_range_uj=_read_int(d / "max_energy_range_uj"),
        )
        for d in dirs if (d / "energy_uj").exists()
    )


def _backends_from_system_info(text: str) -> tuple[str, ...]:
    # llama_print_system_info(): "CUDA : ARCHS = 890 | ... | CPU : SSE3 = 1 | ..."
    names = [part.split(" : ", 1)[0].strip() for part in text.split(" | ") if " : " in part]
    return tuple(dict.fromkeys(n for n in names if n))


def probe_llama_cpp(build: BuildInfo | None = None) -> LlamaCppInfo:
    """What the installed llama-cpp-python can do; an import failure is NA, not an error.

    ``build``: report this instead of asking ``homepd.llm.build_info()`` (tests pass one).
    """
    if build is None:
        try:
            from homepd.llm import build_info  # why: llama_cpp loads (or fails to) only when asked about
            build = build_info()
        except Exception as exc:  # ImportError, or OSError from a broken shared library
            return LlamaCppInfo(False, None, None, None, f"llama_cpp not importable: {exc}")
    backends = None if build.system_info is None else _backends_from_system_info(build.system_info)
    return LlamaCppInfo(True, build.version, build.supports_gpu_offload, backends, None)


def _warnings(nvml: NvmlInfo, gpus: tuple[GpuInfo, ...], llama: LlamaCppInfo,
              nvidia_proc_dir: Path) -> tuple[str, ...]:
    found = []
    if gpus and llama.supports_gpu_offload is False:
        found.append(
            f"{len(gpus)} NVIDIA GPU(s) found but the installed llama.cpp is CPU-only, so "
            f"homepd cannot use them. Rebuild it with CUDA:\n  {CUDA_REBUILD_COMMAND}")
    if not llama.is_installed:
        found.append(f"{llama.error}; homepd cannot serve until llama-cpp-python is installed")
    if not nvml.is_available and nvidia_proc_dir.is_dir():
        found.append(f"an NVIDIA driver is loaded ({nvidia_proc_dir}) but {nvml.error}")
    return tuple(found)


def probe(nvml_module: Any = None, llama_build: BuildInfo | None = None, *,
          powercap_root: Path = POWERCAP_ROOT,
          nvidia_proc_dir: Path = NVIDIA_PROC_DIR) -> BoxProbe:
    """Read the box once. ``nvml_module`` replaces pynvml, ``llama_build`` the llama.cpp build info, in tests."""
    with Nvml(nvml_module) as nvml:
        nvml_info = NvmlInfo(nvml.is_available, nvml.error,
                             nvml.driver_version(), nvml.cuda_version())
        gpus = probe_gpus(nvml)
    llama = probe_llama_cpp(llama_build)
    return BoxProbe(
        hostname=socket.gethostname(), cpu=probe_cpu(), memory=probe_memory(),
        nvml=nvml_info, gpus=gpus, rapl=read_rapl_zones(powercap_root), llama_cpp=llama,
        warnings=_warnings(nvml_info, gpus, llama, nvidia_proc_dir),
    )


@dataclass(frozen=True)
class BoxIdentity:
    """What a measured capacity depends on of the box it was measured on: the CPU model, the CPUs this process
    may use, and the GPUs.  Free memory, the hostname and the llama.cpp build are not part of it."""
    cpu_model: str | None
    n_cpus: int
    gpus: tuple[str, ...]

    @classmethod
    def of(cls, hardware: dict | None) -> BoxIdentity | None:
        """From a probe's JSON form (``to_dict``, as each run stores it); None when it holds none."""
        cpu = (hardware or {}).get("cpu")
        if not cpu:
            return None
        return cls(cpu.get("model"), len(cpu.get("usable_cpus") or ()),
                   tuple(sorted(g.get("name") or "unknown GPU" for g in hardware.get("gpus") or ())))

    def describe(self) -> str:
        gpus = ", ".join(self.gpus) if self.gpus else "no GPU"
        return f"{self.cpu_model or 'unknown CPU'} ({self.n_cpus} CPUs), {gpus}"


def identity(box: BoxProbe) -> BoxIdentity:
    return BoxIdentity.of(to_dict(box))


def to_dict(box: BoxProbe, plan: Any = None) -> dict[str, Any]:
    """The probe (and a ``PlacementPlan`` if given) as plain JSON-ready data."""
    data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(box)}
    data["placement"] = dataclasses.asdict(plan) if plan is not None else None
    return data


def to_json(box: BoxProbe, plan: Any = None) -> str:
    """One JSON object; NA is ``null``."""
    return json.dumps(to_dict(box, plan), indent=2)


def fmt_bytes(n: int | float | None) -> str:
    """Human size in binary units, ``NA`` for None."""
    if n is None:
        return "NA"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
