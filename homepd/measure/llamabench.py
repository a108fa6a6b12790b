"""llama.cpp's own C++ loop, ``llama-bench``, as ``homepd bench engine``'s reference row.

``llama-bench`` is built beside llama-server from the llama.cpp that llama-cpp-python vendors, with homepd's
CPU flags (``benchmarks/build_llama_server.py``), so it runs the same kernels as the engine's worker.  It is
run as the engine's measured request runs: the prompt (``-p n_prompt``) at depth 0, in batches of the
engine's chunk, and the decode (``-n n_gen``) after a prompt of the same length (``-d n_prompt``), on the
worker's cores with its thread count; each invocation does llama-bench's own warm-up run first.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from homepd.errors import HomepdError

REPO_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "llama-server" / "build" / "bin" / "llama-bench"
BUILD_HINT = "build it with: uv run python benchmarks/build_llama_server.py"
TIMEOUT_S = 600.0


class LlamaBenchError(HomepdError):
    """llama-bench is missing, failed, or printed what this module cannot read."""


@dataclass(frozen=True)
class LlamaBenchRun:
    """One round of llama-bench: prompt tok/s at depth 0, decode tok/s at depth ``n_prompt``."""
    prompt_tok_s: float
    decode_tok_s: float
    n_threads: int            # what llama-bench reports it ran with
    cpu_affinity: tuple[int, ...]


def find_llama_bench(explicit: str | os.PathLike | None = None) -> Path | None:
    """``explicit`` (an error when it is not an executable file), else the build cache's, else None."""
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlamaBenchError(f"--llama-bench {path}: no executable file there ({BUILD_HINT})")
        return path
    return REPO_CACHE if REPO_CACHE.is_file() else None


def reference_n_ctx(n_prompt: int, n_gen: int) -> int:
    """The context the engine is measured in: as small as llama-bench's own for the round's decode (it sizes it
    to the test's prompt and generated tokens; llama.cpp pads a context to 256 cells)."""
    return -(-(n_prompt + n_gen + 1) // 256) * 256


def llama_bench_argv(binary: Path, model: str, n_threads: int, n_prompt: int, n_gen: int, chunk: int | None,
                     n_gpu_layers: int, flash_attn: bool = False) -> list[list[str]]:
    """The two llama-bench invocations of one round: the prompt at depth 0 in batches of ``chunk`` (the
    engine's; none: the whole prompt, as the engine's single step), and the decode after ``n_prompt`` tokens;
    offloaded and with flash attention as the engine's worker (``WorkerSpec``)."""
    n_batch = chunk or n_prompt
    common = [str(binary), "-m", model, "-t", str(n_threads), "-ngl", str(n_gpu_layers),
              "-fa", "1" if flash_attn else "0", "-r", "1", "-o", "json"]
    return [common + ["-p", str(n_prompt), "-n", "0", "-b", str(n_batch), "-ub", str(min(n_batch, 512))],
            common + ["-p", "0", "-n", str(n_gen), "-d", str(n_prompt)]]


def parse_tests(stdout: str) -> list[dict]:
    """llama-bench's ``-o json`` output: one object per test, each with n_prompt, n_gen, n_depth, n_threads
    and avg_ts; a LlamaBenchError naming what is missing otherwise."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise LlamaBenchError(f"llama-bench printed no JSON ({exc}): {stdout[-300:]!r}") from exc
    if not isinstance(tests, list) or not tests:
        raise LlamaBenchError(f"llama-bench printed no test: {stdout[-300:]!r}")
    for t in tests:
        missing = [k for k in ("n_prompt", "n_gen", "n_depth", "n_threads", "avg_ts") if k not in t]
        if missing:
            raise LlamaBenchError(f"llama-bench's test lacks {', '.join(missing)}: {t!r}")
    return tests


def run_round(binary: Path, model: str, n_threads: int, n_prompt: int, n_gen: int, chunk: int | None,
              n_gpu_layers: int = 0, cpu_cores: tuple[int, ...] | None = None,
              flash_attn: bool = False, cuda_visible_devices: str | None = None) -> LlamaBenchRun:
    """One round (prompt, then decode), each invocation pinned to ``cpu_cores`` and seeing the GPUs of
    ``cuda_visible_devices`` (the engine worker's; None: this process's)."""
    # why the worker's GPUs too: a CUDA build runs a large batch's matrix products on a visible GPU even with
    # -ngl 0, so on an H200 a CPU worker's reference read 14,002 prompt tok/s against the worker's 2,308
    env = None if cuda_visible_devices is None else {**os.environ, "CUDA_VISIBLE_DEVICES": cuda_visible_devices}

    def pin():
        if cpu_cores:
            os.sched_setaffinity(0, cpu_cores)

    speeds, threads = [], set()
    for argv in llama_bench_argv(binary, model, n_threads, n_prompt, n_gen, chunk, n_gpu_layers, flash_attn):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=pin, env=env)
        if done.returncode != 0:
            raise LlamaBenchError(f"llama-bench exited {done.returncode}: {done.stderr[-500:]}")
        (test,) = parse_tests(done.stdout)
        speeds.append(float(test["avg_ts"]))
        threads.add(int(test["n_threads"]))
    affinity = tuple(sorted(cpu_cores)) if cpu_cores else tuple(sorted(os.sched_getaffinity(0)))
    return LlamaBenchRun(speeds[0], speeds[1], threads.pop() if len(threads) == 1 else -1, affinity)
