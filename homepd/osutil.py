"""Small operating-system helpers shared by every layer (standard library only)."""
from __future__ import annotations

import ctypes
import os
import signal


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (another user's counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# numpy's OpenBLAS starts a thread per core when numpy is imported: 0.09-0.13 CPU-s of every process's start on
# the 2-vCPU VM (2026-12-07: ten fake engines' workers 4.4 -> 3.4 CPU-s), and threads that would wait beside
# llama.cpp's on the cores a worker is pinned to.  homepd's numpy work is one token's logits and small fits: one
# BLAS thread loses nothing.  A value the user set is kept.
SINGLE_THREAD_BLAS = {"OPENBLAS_NUM_THREADS": "1"}


def single_thread_blas(env: dict) -> dict:
    """``env`` (a process's environment, changed in place and returned) with ``SINGLE_THREAD_BLAS`` where unset:
    set it before numpy is imported, in homepd's own process and in every process it starts."""
    for key, value in SINGLE_THREAD_BLAS.items():
        env.setdefault(key, value)
    return env


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux's ``PR_SET_PDEATHSIG``; nothing
    elsewhere).  A ``preexec_fn`` for children that must not outlive whoever started them: a test's
    ``homepd serve`` when pytest is interrupted.  Note the kernel ties it to the thread that forked the child."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # why: the parent died between the fork and the prctl; no signal will come
        os.kill(os.getpid(), sig)
