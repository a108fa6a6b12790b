"""A fake ``pynvml`` module for tests: the same entry points, GPUs described as data.

A ``FakeGpu`` field set to ``None`` makes the matching NVML call raise
``NVMLError_NotSupported``, as a real GPU does for a field it lacks.  Also the
llama.cpp build info of a CUDA and a CPU-only build.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from homepd.llm import BuildInfo

GIB = 1 << 30


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


@dataclass
class FakeGpu:
    name: str = "NVIDIA GeForce RTX 3090"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    vram_total_bytes: int | None = 24 * GIB
    vram_used_bytes: int = 1 * GIB
    pcie: tuple[int, int, int, int] | None = (4, 16, 4, 16)  # gen, width, max gen, max width
    power_mw: int | None = 35_000
    power_limit_mw: int | None = 350_000
    temperature_c: int | None = 41
    utilization: tuple[int, int] | None = (3, 1)  # gpu %, memory %
    energy_mj: int | None = 1_000_000
    pcie_kib_s: tuple[int, int] | None = (100, 200)  # tx, rx


class FakeNvml:
    """Quacks like ``pynvml`` for the calls ``homepd.hw.nvml`` makes."""

    NVML_TEMPERATURE_GPU = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: Exception | None = None,
                 driver: str = "550.54.14", cuda: int = 12040):
        self.gpus = list(gpus or [])
        self.init_error = init_error
        self.driver, self.cuda = driver, cuda
        self.init_count = 0
        self.calls: list[str] = []

    def _gpu(self, handle: int) -> FakeGpu:
        return self.gpus[handle]

    @staticmethod
    def _need(value):
        if value is None:
            raise NVMLError_NotSupported("Not Supported")
        return value

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error
        self.init_count += 1

    def nvmlShutdown(self):
        self.init_count -= 1

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetName(self, h):
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h):
        return self._gpu(h).uuid.encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self._gpu(h)
        total = self._need(g.vram_total_bytes)
        return SimpleNamespace(total=total, used=g.vram_used_bytes, free=total - g.vram_used_bytes)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._need(self._gpu(h).pcie)[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._need(self._gpu(h).pcie)[1]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._need(self._gpu(h).pcie)[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._need(self._gpu(h).pcie)[3]

    def nvmlDeviceGetPowerUsage(self, h):
        self.calls.append("power")
        return self._need(self._gpu(h).power_mw)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._need(self._gpu(h).power_limit_mw)

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._need(self._gpu(h).temperature_c)

    def nvmlDeviceGetUtilizationRates(self, h):
        gpu, memory = self._need(self._gpu(h).utilization)
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self._need(self._gpu(h).energy_mj)

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        return self._need(self._gpu(h).pcie_kib_s)[counter]


# What homepd.llm.build_info() reports for a CUDA build and for a CPU-only build.
CUDA_LLAMA = BuildInfo("0.3.36", True, "CUDA : ARCHS = 860 | USE_GRAPHS = 1 | CPU : SSE3 = 1 | ")
CPU_LLAMA = BuildInfo("0.3.36", False, "CPU : SSE3 = 1 | AVX2 = 1 | ")
