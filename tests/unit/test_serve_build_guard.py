"""The start-up guard: a llama.cpp build whose instruction sets exceed the CPU's is refused (homepd.hw.isa)."""
from __future__ import annotations

import pytest

from homepd.hw.isa import REBUILD_COMMAND, BuildMismatchError, build_isa, check_build, cpu_flags, missing_isa

AVX512_BUILD = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
                "AVX512_VNNI = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
AVX2_BUILD = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | OPENMP = 1 | "
CUDA_AND_CPU = "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX = 1 | "
N100_CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) N100\n"
                "flags\t\t: fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 avx_vnni\n\n"
                "processor\t: 1\nflags\t\t: fpu\n")
N3450_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse sse2 pni ssse3 sse4_1 sse4_2 movbe popcnt aes\n"
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 asimdhp asimddp\n"


def test_build_isa_reads_only_instruction_sets_set_to_1():
    assert build_isa(AVX2_BUILD) == {"SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2"}
    assert build_isa("CPU : AVX = 0 | AVX2 = 1 | ") == {"AVX2"}
    assert build_isa(CUDA_AND_CPU) == {"SSE3", "AVX"}  # CUDA's fields are not instruction sets


def test_cpu_flags_from_the_first_processor_on_x86_and_arm():
    assert "avx2" in cpu_flags(N100_CPUINFO) and "fpu" in cpu_flags(N100_CPUINFO)
    assert cpu_flags(ARM_CPUINFO) == {"fp", "asimd", "evtstrm", "aes", "crc32", "asimdhp", "asimddp"}
    assert cpu_flags("nothing here") == set()


def test_avx512_build_on_an_n100_misses_exactly_avx512():
    assert missing_isa(AVX512_BUILD, cpu_flags(N100_CPUINFO)) == ["AVX512", "AVX512_VNNI"]


def test_avx2_build_on_a_celeron_n3450_misses_avx():
    assert missing_isa(AVX2_BUILD, cpu_flags(N3450_CPUINFO)) == ["AVX", "AVX2", "BMI2", "F16C", "FMA"]


def test_matching_build_passes():
    assert missing_isa(AVX2_BUILD, cpu_flags(N100_CPUINFO)) == []
    check_build(AVX2_BUILD, N100_CPUINFO)  # no exception
    check_build("CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1 | ", ARM_CPUINFO)


def test_mismatched_build_is_refused_with_the_rebuild_command():
    with pytest.raises(BuildMismatchError) as info:
        check_build(AVX512_BUILD, N100_CPUINFO)
    message = str(info.value)
    assert "AVX512" in message and "SIGILL" in message and REBUILD_COMMAND in message


def test_unreadable_cpu_flags_do_not_block():
    check_build(AVX512_BUILD, "")


def test_prepare_refuses_a_mismatched_build_before_loading_anything(monkeypatch, tmp_path):
    import homepd.hw.isa as isa
    from homepd.config import EngineConfig
    from homepd.launch import prepare

    monkeypatch.setattr(isa, "_installed_system_info", lambda: AVX512_BUILD)
    monkeypatch.setattr(isa, "CPUINFO_PATH", tmp_path / "cpuinfo")
    (tmp_path / "cpuinfo").write_text(N100_CPUINFO)
    with pytest.raises(BuildMismatchError, match="AVX512"):
        prepare(EngineConfig(model=str(tmp_path / "absent.gguf")), pull=False)


def test_the_installed_build_runs_here():
    """The real check on this box: the build in the venv (read in a child interpreter) fits this CPU."""
    from homepd.hw.isa import read_build_system_info

    info = read_build_system_info()
    assert "CPU :" in info
    check_build(info)
