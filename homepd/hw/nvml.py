"""A thin wrapper over NVML (``pynvml``) that answers NA instead of raising.

Every getter returns ``None`` where NVML cannot answer: no library, a driver
that fails to load, a GPU that does not support the field, a GPU that fell off
the bus.  The module object is injectable so tests pass a fake (see
``tests/unit/fake_nvml.py``); by default ``pynvml`` is imported when a session opens.
``probe_gpus`` reads every GPU once into frozen ``GpuInfo`` records.

Units follow NVML's raw values converted to the names' suffixes: power in W
(NVML reports mW), energy in mJ (as NVML), PCIe throughput in bytes/s (NVML
reports KiB/s), temperatures in degrees Celsius.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# theoretical one-direction bandwidth of one PCIe lane, per generation, in GB/s
# (after line encoding: 8b/10b for gen 1-2, 128b/130b for gen 3-5, FLIT for 6)
PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def pcie_gb_s(generation: int | None, width: int | None) -> float | None:
    """Theoretical one-direction PCIe bandwidth in GB/s of a link, or None if unknown."""
    if generation is None or width is None or generation not in PCIE_LANE_GB_S:
        return None
    return round(PCIE_LANE_GB_S[generation] * width, 3)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Nvml:
    """One NVML session over ``module`` (``pynvml`` unless given).

    Opening never raises: when NVML is missing or fails to initialise,
    ``is_available`` is False, ``error`` says why, and every getter answers NA.
    NVML is thread-safe and reference counts ``nvmlInit``, so several sessions
    (the probe, the sampler thread) may be open at once.
    """

    def __init__(self, module: Any = None):
        self.error: str | None = None
        self._nv: Any = module
        self._handles: dict[int, Any] = {}
        self.is_available = False
        if self._nv is None:
            try:
                self._nv = importlib.import_module("pynvml")
            except Exception as exc:  # ImportError, or a broken install
                self.error = f"pynvml not importable: {exc}"
                return
        try:
            self._nv.nvmlInit()
        except Exception as exc:
            self.error = f"NVML failed to initialise: {_text(exc) or type(exc).__name__}"
            return
        self.is_available = True

    def close(self) -> None:
        """End the session; safe to call twice."""
        if self.is_available:
            self.is_available = False
            self._handles.clear()
            try:
                self._nv.nvmlShutdown()
            except Exception:
                pass

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, *args: Any) -> Any:
        if not self.is_available:
            return None
        fn = getattr(self._nv, name, None)
        if fn is None:  # an older pynvml without this entry point
            return None
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported, _GpuIsLost, _NoPermission, ...
            return None

    def _device_call(self, index: int, name: str, *args: Any) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            handle = self._call("nvmlDeviceGetHandleByIndex", index)
            if handle is None:
                return None
            self._handles[index] = handle
        return self._call(name, handle, *args)

    # -- system ---------------------------------------------------------

    def device_count(self) -> int:
        """Number of GPUs NVML sees; 0 when NVML is unavailable."""
        count = self._call("nvmlDeviceGetCount")
        return int(count) if count is not None else 0

    def driver_version(self) -> str | None:
        """The NVIDIA driver version, e.g. ``"550.54.14"``."""
        value = self._call("nvmlSystemGetDriverVersion")
        return _text(value) if value is not None else None

    def cuda_version(self) -> str | None:
        """The CUDA version the driver supports, e.g. ``"12.4"``."""
        value = self._call("nvmlSystemGetCudaDriverVersion")
        if value is None:
            return None
        return f"{int(value) // 1000}.{int(value) % 1000 // 10}"

    # -- per device -----------------------------------------------------

    def name(self, index: int) -> str | None:
        """Marketing name of GPU ``index``."""
        value = self._device_call(index, "nvmlDeviceGetName")
        return _text(value) if value is not None else None

    def uuid(self, index: int) -> str | None:
        """UUID of GPU ``index`` (``"GPU-..."``), usable in CUDA_VISIBLE_DEVICES."""
        value = self._device_call(index, "nvmlDeviceGetUUID")
        return _text(value) if value is not None else None

    def memory_bytes(self, index: int) -> tuple[int | None, int | None]:
        """(total, used) VRAM of GPU ``index`` in bytes."""
        info = self._device_call(index, "nvmlDeviceGetMemoryInfo")
        if info is None:
            return None, None
        return int(info.total), int(info.used)

    def pcie_link(self, index: int) -> tuple[int | None, int | None, int | None, int | None]:
        """(current generation, current width, max generation, max width) of the PCIe link."""
        return (
            self._device_call(index, "nvmlDeviceGetCurrPcieLinkGeneration"),
            self._device_call(index, "nvmlDeviceGetCurrPcieLinkWidth"),
            self._device_call(index, "nvmlDeviceGetMaxPcieLinkGeneration"),
            self._device_call(index, "nvmlDeviceGetMaxPcieLinkWidth"),
        )

    def power_w(self, index: int) -> float | None:
        """Current board power draw in W."""
        value = self._device_call(index, "nvmlDeviceGetPowerUsage")
        return value / 1000.0 if value is not None else None

    def power_limit_w(self, index: int) -> float | None:
        """Enforced power limit in W."""
        value = self._device_call(index, "nvmlDeviceGetEnforcedPowerLimit")
        return value / 1000.0 if value is not None else None

    def temperature_c(self, index: int) -> int | None:
        """GPU die temperature in degrees Celsius."""
        sensor = getattr(self._nv, "NVML_TEMPERATURE_GPU", 0)
        return self._device_call(index, "nvmlDeviceGetTemperature", sensor)

    def utilization_pct(self, index: int) -> tuple[int | None, int | None]:
        """(GPU busy %, memory controller busy %) over NVML's last sample period."""
        rates = self._device_call(index, "nvmlDeviceGetUtilizationRates")
        if rates is None:
            return None, None
        return int(rates.gpu), int(rates.memory)

    def energy_mj(self, index: int) -> int | None:
        """Total energy the GPU used since the driver loaded, in mJ (Volta and later)."""
        value = self._device_call(index, "nvmlDeviceGetTotalEnergyConsumption")
        return int(value) if value is not None else None

    def pcie_throughput_bytes_s(self, index: int) -> tuple[int | None, int | None]:
        """(TX, RX) PCIe throughput in bytes/s; NVML samples it over ~20 ms per call."""
        tx = self._device_call(index, "nvmlDeviceGetPcieThroughput",
                               getattr(self._nv, "NVML_PCIE_UTIL_TX_BYTES", 0))
        rx = self._device_call(index, "nvmlDeviceGetPcieThroughput",
                               getattr(self._nv, "NVML_PCIE_UTIL_RX_BYTES", 1))
        return (tx * 1024 if tx is not None else None,
                rx * 1024 if rx is not None else None)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the probe saw it; ``index`` is NVML's (PCI bus) order."""

    index: int
    name: str | None
    uuid: str | None
    vram_total_bytes: int | None
    vram_used_bytes: int | None
    pcie_gen: int | None
    pcie_width: int | None
    pcie_max_gen: int | None
    pcie_max_width: int | None
    pcie_gb_s: float | None
    pcie_max_gb_s: float | None
    power_w: float | None
    power_limit_w: float | None
    temperature_c: int | None
    utilization_pct: int | None
    memory_utilization_pct: int | None
    energy_mj: int | None

    @property
    def vram_free_bytes(self) -> int | None:
        """VRAM not used by any process at probe time (total when ``used`` is NA)."""
        if self.vram_total_bytes is None:
            return None
        return self.vram_total_bytes - (self.vram_used_bytes or 0)


def probe_gpus(nvml: Nvml) -> tuple[GpuInfo, ...]:
    """One ``GpuInfo`` per GPU NVML sees (none when NVML is unavailable)."""
    gpus = []
    for index in range(nvml.device_count()):
        total, used = nvml.memory_bytes(index)
        gen, width, max_gen, max_width = nvml.pcie_link(index)
        util, mem_util = nvml.utilization_pct(index)
        gpus.append(GpuInfo(
            index=index, name=nvml.name(index), uuid=nvml.uuid(index),
            vram_total_bytes=total, vram_used_bytes=used,
            pcie_gen=gen, pcie_width=width, pcie_max_gen=max_gen, pcie_max_width=max_width,
            pcie_gb_s=pcie_gb_s(gen, width), pcie_max_gb_s=pcie_gb_s(max_gen, max_width),
            power_w=nvml.power_w(index), power_limit_w=nvml.power_limit_w(index),
            temperature_c=nvml.temperature_c(index),
            utilization_pct=util, memory_utilization_pct=mem_util,
            energy_mj=nvml.energy_mj(index),
        ))
    return tuple(gpus)
