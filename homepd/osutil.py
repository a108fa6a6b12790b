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
