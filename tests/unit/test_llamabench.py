"""llama-bench as bench engine's reference row (homepd.measure.llamabench): the invocations that match the
engine's measured request, reading llama-bench's JSON, and clear errors.  A stand-in executable plays
llama-bench here (it answers from its own argv); the real binary runs in ``homepd bench engine``."""
import os
import stat
import sys

import pytest

from homepd.measure.llamabench import (LlamaBenchError, find_llama_bench, llama_bench_argv, parse_tests,
                                       reference_n_ctx, run_round)

STAND_IN = """#!{python}
import json, os, sys
a = sys.argv[1:]
if os.environ.get("LB_ENV_OUT"):
    open(os.environ["LB_ENV_OUT"], "a").write(repr(os.environ.get("CUDA_VISIBLE_DEVICES")) + "\\n")
if os.environ.get("LB_FAIL"):
    sys.stderr.write("error: failed to load model\\n"); sys.exit(1)
v = lambda flag: int(a[a.index(flag) + 1])
n_prompt, n_gen, depth = v("-p"), v("-n"), (v("-d") if "-d" in a else 0)
cores = sorted(os.sched_getaffinity(0))
# prompt speed 100 + batch, decode speed 10 + depth / 100 + the first core: what each run was asked for
ts = 100.0 + v("-b") if n_gen == 0 else 10.0 + depth / 100 + cores[0]
print(json.dumps([{{"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth, "n_threads": v("-t"), "avg_ts": ts}}]))
"""


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "llama-bench"
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_prompt_runs_at_depth_zero_in_the_engine_s_chunk_and_the_decode_after_the_prompt(tmp_path):
    prompt, decode = llama_bench_argv(tmp_path / "lb", "m.gguf", 1, 256, 128, 64, 0)
    assert prompt[prompt.index("-p") + 1] == "256" and prompt[prompt.index("-n") + 1] == "0"
    assert prompt[prompt.index("-b") + 1] == "64" and prompt[prompt.index("-ub") + 1] == "64"
    assert "-d" not in prompt
    assert decode[decode.index("-p") + 1] == "0" and decode[decode.index("-n") + 1] == "128"
    assert decode[decode.index("-d") + 1] == "256"
    assert all(argv[argv.index("-t") + 1] == "1" and argv[argv.index("-o") + 1] == "json"
               and argv[argv.index("-fa") + 1] == "0" for argv in (prompt, decode))
    on, _ = llama_bench_argv(tmp_path / "lb", "m.gguf", 1, 256, 8, 64, 99, flash_attn=True)  # as the worker
    assert on[on.index("-fa") + 1] == "1" and on[on.index("-ngl") + 1] == "99"
    whole, _ = llama_bench_argv(tmp_path / "lb", "m.gguf", 1, 900, 8, None, 0)  # no chunk: one batch, ub <= 512
    assert whole[whole.index("-b") + 1] == "900" and whole[whole.index("-ub") + 1] == "512"


def test_a_round_reads_each_invocation_s_speed_on_the_given_cores(stand_in):
    core = sorted(os.sched_getaffinity(0))[-1]
    run = run_round(stand_in, "m.gguf", 2, 256, 128, 32, cpu_cores=(core,))
    assert run.prompt_tok_s == 132.0                      # 100 + the batch it was given
    assert run.decode_tok_s == 10.0 + 2.56 + core         # at depth 256, pinned to ``core``
    assert run.n_threads == 2 and run.cpu_affinity == (core,)


def test_a_round_sees_the_gpus_the_worker_sees(stand_in, monkeypatch, tmp_path):
    # a CPU worker hides every GPU (""); a CUDA build would still run a large batch on a visible one
    seen = tmp_path / "env"
    monkeypatch.setenv("LB_ENV_OUT", str(seen))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    run_round(stand_in, "m.gguf", 1, 16, 4, None, cuda_visible_devices="")
    run_round(stand_in, "m.gguf", 1, 16, 4, None, cuda_visible_devices="GPU-1b78")
    run_round(stand_in, "m.gguf", 1, 16, 4, None)  # this process's
    assert seen.read_text().split() == ["''"] * 2 + ["'GPU-1b78'"] * 2 + ["'0'"] * 2


def test_a_failing_llama_bench_is_an_error_with_its_message(stand_in, monkeypatch):
    monkeypatch.setenv("LB_FAIL", "1")
    with pytest.raises(LlamaBenchError, match="failed to load model"):
        run_round(stand_in, "m.gguf", 1, 16, 4, None)


@pytest.mark.parametrize("stdout, names", [("main: build = 1\n", "no JSON"), ("[]", "no test"),
                                           ('[{"n_prompt": 1, "n_gen": 0}]', "n_depth, n_threads, avg_ts")])
def test_output_it_cannot_read_is_named(stdout, names):
    with pytest.raises(LlamaBenchError, match=names):
        parse_tests(stdout)


def test_an_explicit_path_without_a_binary_is_an_error_naming_how_to_build_it(tmp_path):
    with pytest.raises(LlamaBenchError, match="build_llama_server.py"):
        find_llama_bench(tmp_path / "nothing-here")


def test_the_engine_is_measured_in_a_context_as_small_as_llama_bench_s():
    # llama-bench's decode test at depth 256 with 128 tokens has 384 cells, padded to 512 by llama.cpp
    assert reference_n_ctx(256, 128) == 512
    assert reference_n_ctx(255, 0) == 256 and reference_n_ctx(256, 0) == 512  # room for the sampled token
    assert reference_n_ctx(1900, 100) == 2048 and reference_n_ctx(2000, 48) == 2048 + 256
