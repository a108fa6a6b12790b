"""Does the installed llama.cpp build run on this CPU?  Checked before anything loads it.

llama.cpp is built native (``-march=native``, AMX compiled out): a venv or a uv
cache copied from a bigger CPU (AVX-512 on an N100, AVX on a Celeron N3450)
would die with SIGILL inside llama.cpp.  ``check_build`` compares the
instruction sets the build reports (``llama_print_system_info``, read through
``homepd.llm.build_info`` in a child process, so a build that cannot even load
here kills the child and not us) with the CPU's flags (``/proc/cpuinfo``), and
refuses with the rebuild command.  ``missing_isa`` is the pure comparison.
"""
from __future__ import annotations

import functools
import re
import signal
import subprocess
import sys
from pathlib import Path

from homepd.errors import HomepdError

CPUINFO_PATH = Path("/proc/cpuinfo")
REBUILD_COMMAND = "uv cache clean llama-cpp-python && uv sync --reinstall-package llama-cpp-python"
BUILD_INFO_TIMEOUT_S = 60.0

# llama_print_system_info name -> the /proc/cpuinfo flag that must be there (x86 "flags", Arm "Features").
# Names that are not instruction sets (LLAMAFILE, OPENMP, REPACK, ...) are not listed and not checked.
ISA_CPU_FLAGS: dict[str, str] = {
    "SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
    "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8",
    "NEON": "asimd", "ARM_FMA": "asimd", "FP16_VA": "asimdhp", "DOTPROD": "asimddp",
    "MATMUL_INT8": "i8mm", "SVE": "sve", "SME": "sme",
}
_ENABLED = re.compile(r"\b([A-Z][A-Z0-9_]*)\s*=\s*1\b")


class BuildMismatchError(HomepdError):
    """The llama.cpp build uses instructions this CPU does not have."""


def build_isa(system_info: str) -> set[str]:
    """Instruction sets a build reports as used, e.g. ``{"AVX", "AVX2", ...}`` from ``"CPU : AVX = 1 | ..."``."""
    return {name for name in _ENABLED.findall(system_info) if name in ISA_CPU_FLAGS}


def cpu_flags(cpuinfo_text: str) -> set[str]:
    """The first processor's feature flags from ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def missing_isa(system_info: str, flags: set[str]) -> list[str]:
    """The build's instruction sets whose CPU flag is absent, sorted (empty: the build runs here)."""
    return sorted(name for name in build_isa(system_info) if ISA_CPU_FLAGS[name] not in flags)


def read_build_system_info() -> str:
    """``llama_print_system_info()`` of the installed build, read in a child interpreter.

    Raises BuildMismatchError when the child dies of SIGILL (the build cannot
    even load on this CPU) or cannot report.
    """
    code = "from homepd.llm import build_info; print(build_info().system_info or '')"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=BUILD_INFO_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BuildMismatchError(f"reading the llama.cpp build's capabilities took over {BUILD_INFO_TIMEOUT_S:.0f} s"
                                 ) from None
    if done.returncode == -signal.SIGILL:
        raise BuildMismatchError("the installed llama.cpp build dies with an illegal instruction (SIGILL) on this "
                                 f"CPU: it was built for another machine.  Rebuild it here: {REBUILD_COMMAND}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise BuildMismatchError(f"could not load llama.cpp to check its build (exit code {done.returncode}): {last}")
    return done.stdout.strip()


def check_build(system_info: str | None = None, cpuinfo_text: str | None = None) -> None:
    """Refuse a llama.cpp build that uses instructions this CPU lacks (arguments: injected by tests).

    Does nothing where the CPU's flags cannot be read (not Linux).
    """
    if cpuinfo_text is None:
        try:
            cpuinfo_text = CPUINFO_PATH.read_text()
        except OSError:
            return
    flags = cpu_flags(cpuinfo_text)
    if not flags:
        return
    info = system_info if system_info is not None else _installed_system_info()
    missing = missing_isa(info, flags)
    if missing:
        raise BuildMismatchError(
            f"the installed llama.cpp build uses {', '.join(missing)}, which this CPU does not have (a venv or uv "
            f"cache copied from another machine?); it would crash with SIGILL.  Rebuild it for this CPU: "
            f"{REBUILD_COMMAND}")


@functools.lru_cache(maxsize=1)
def _installed_system_info() -> str:
    return read_build_system_info()  # once per process: the build does not change under a running process
