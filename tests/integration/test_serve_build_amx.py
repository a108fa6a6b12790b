"""The llama.cpp build in the venv carries no AMX instruction (pyproject: native build, AMX compiled out).

AMX is advertised but not usable on some VMs; the build must not contain the
kernels at all.  ``objdump`` comes with binutils (``.ci/run`` installs it when
missing).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

# every AMX mnemonic: tile configuration, loads/stores and the dot products (INT8, BF16, FP16, complex)
AMX = re.compile(r"\s(ldtilecfg|sttilecfg|tilerelease|tilezero|tileloaddt?1?|tilestored|"
                 r"tdpb[su][su]d|tdpbf16ps|tdpfp16ps|tcmmimfp16ps|tcmmrlfp16ps)\b")


def _built_libraries() -> list[Path]:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(p for p in lib.glob("*.so") if p.name.startswith(("libggml", "libllama")))
    assert any(p.name.startswith("libggml-cpu") for p in found), f"no libggml-cpu*.so in {lib}"
    assert any(p.name == "libllama.so" for p in found), f"no libllama.so in {lib}"
    return found


def test_the_scan_finds_amx_in_an_assembled_object(tmp_path):
    """The check can fail: an object assembled with AMX instructions is caught, AVX512-VNNI is not."""
    assert shutil.which("as") and shutil.which("objdump"), "binutils missing: apt-get install binutils"
    source = tmp_path / "amx.s"
    source.write_text("ldtilecfg (%rdi)\ntileloadd (%rsi,%rdx,1), %tmm0\ntdpbssd %tmm2, %tmm1, %tmm0\n"
                      "tilerelease\nvpdpbusd %zmm1, %zmm2, %zmm3\n")
    subprocess.run(["as", "-o", str(tmp_path / "amx.o"), str(source)], check=True)
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(tmp_path / "amx.o")], capture_output=True,
                             text=True, check=True).stdout
    assert [m.group(1) for m in AMX.finditer(listing)] == ["ldtilecfg", "tileloadd", "tdpbssd", "tilerelease"]


@pytest.mark.parametrize("name", ["libggml-cpu.so", "libggml-base.so", "libllama.so"])
def test_built_library_has_no_amx_instruction(name):
    assert shutil.which("objdump"), "objdump missing: apt-get install binutils (.ci/run does)"
    library = next((p for p in _built_libraries() if p.name == name), None)
    assert library is not None, f"{name} not built"
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True,
                             text=True, check=True).stdout
    assert len(listing) > 10_000, f"objdump gave no disassembly of {library}"
    found = sorted({m.group(1) for m in AMX.finditer(listing)})
    assert not found, f"{library} contains AMX instructions: {found}"
