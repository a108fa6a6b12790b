"""Named POSIX shared-memory segments for the KV arena and the KV store (their extents inside them): naming,
create/attach, unlink, stale cleanup.

Names are ``homepd-kv-<owner pid>-<token>-<index>``: the owner's pid so that a
later controller can tell a dead pool from a live one, a random token per pool
so two pools of one process never collide.

# why: not multiprocessing.shared_memory.SharedMemory.  Before Python 3.13 it
# registers every segment, attached or created, with a resource_tracker that
# unlinks it when *that* process exits, so a worker that attaches and exits
# destroys the controller's segments; unregistering by hand breaks again when
# the tracker is shared (multiprocessing children) and makes the owner's own
# unlink() print tracebacks from the tracker.  Calling shm_open/mmap directly
# (through _posixshmem, the C module SharedMemory itself uses) leaves no tracker
# in the picture: the owner unlinks, cleanup_stale_segments() and
# unlink_pool_of() cover owner crashes.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from pathlib import Path

import _posixshmem

from homepd.osutil import pid_alive
from homepd.errors import ExtentError

NAME_PREFIX = "homepd-kv-"
STORE_PREFIX = "homepd-kvstore-"  # the KV store's segments (homepd.kv.store): apart in the memory breakdown
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^(?:homepd-kv-|homepd-kvstore-)(\d+)-([0-9a-f]+)-(\d+)$")


def new_token() -> str:
    return secrets.token_hex(4)


def segment_name(owner_pid: int, token: str, index: int, prefix: str = NAME_PREFIX) -> str:
    return f"{prefix}{owner_pid}-{token}-{index}"


def parse_segment_name(name: str) -> tuple[int, str, int] | None:
    """``(owner_pid, token, index)`` of a homepd KV segment name (arena or store), else None."""
    match = _NAME_RE.match(name.lstrip("/"))
    return (int(match[1]), match[2], int(match[3])) if match else None


def create_segment(name: str, size_bytes: int, prefault: bool = True) -> mmap.mmap:
    """Create ``name``, allocate every page of it now and map it pre-faulted (``prefault`` False: pages are
    allocated as they are first written, after checking that /dev/shm has room for them all).

    # why: posix_fallocate makes a too-small /dev/shm (Docker's default is
    # 64 MB) fail here with ENOSPC instead of a SIGBUS in the middle of a KV
    # export, and it allocates the pages so the first export does not pay for
    # page faults (measured ~4x slower than a warm buffer).
    """
    free = _shm_free_bytes()
    if not prefault and free is not None and free < size_bytes:
        raise ExtentError(f"no room in {SHM_DIR} for a {size_bytes}-byte KV segment ({free} bytes free) — make "
                          "/dev/shm larger (docker run --shm-size) or ask for less (--kv-store)")
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
    try:
        os.ftruncate(fd, size_bytes)
        if prefault and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size_bytes)
        return _map(fd, size_bytes, populate=prefault)
    except OSError as exc:
        _posixshmem.shm_unlink("/" + name)
        if exc.errno == errno.ENOSPC:
            raise ExtentError(f"no room in {SHM_DIR} for a {size_bytes}-byte KV segment "
                              f"({_shm_free_bytes()} bytes free) — make /dev/shm larger "
                              "(docker run --shm-size) or ask for a smaller arena (--kv-arena)") from None
        raise
    finally:
        _close_quietly(fd)


def allocate_range(name: str, start: int, n_bytes: int) -> None:
    """Allocate the pages of ``[start, start + n_bytes)`` of segment ``name`` now (a segment created without
    ``prefault``), so /dev/shm running out of room is an ExtentError here instead of a SIGBUS at the first write
    into a page it has no room for.  Pages already allocated are left as they are."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise ExtentError(f"KV segment {name} does not exist — its owner closed it or died") from None
    try:
        os.posix_fallocate(fd, start, n_bytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ExtentError(f"no room in {SHM_DIR} for {n_bytes} more bytes of KV segment {name} "
                              f"({_shm_free_bytes()} bytes free)") from None
        raise
    finally:
        os.close(fd)


def attach_segment(name: str, populate: bool = True) -> mmap.mmap:
    """Map an existing segment.  ``populate`` maps every page now (MAP_POPULATE),
    so this process does not take a page fault per 4 KiB on its first pass."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise ExtentError(f"KV segment {name} does not exist — its owner closed the pool "
                          "or died; attach to the names of a live pool") from None
    try:
        return _map(fd, os.fstat(fd).st_size, populate)
    finally:
        os.close(fd)


def _map(fd: int, size_bytes: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def unlink_segment(name: str) -> bool:
    """Remove ``name``; False if it was already gone.  Mappings stay valid until unmapped."""
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def unlink_pool_of(owner_pid: int, token: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every segment of the pool ``(owner_pid, token)``; the names removed.

    For a worker that learns its controller died (its pipe hit EOF) and cleans up
    before exiting.  Does not check that the owner is dead: a dying controller
    can still be an unreaped zombie when its workers notice.
    """
    return _unlink_matching(shm_dir, lambda pid, tok: pid == owner_pid and tok == token)


def cleanup_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every homepd KV segment whose owner pid is no longer alive; the names removed.

    Call at controller start.  Live pools, this process's included, are left alone.
    Linux only (it lists ``/dev/shm``); elsewhere it finds nothing.
    """
    return _unlink_matching(shm_dir, lambda pid, _tok: not pid_alive(pid))


def _unlink_matching(shm_dir: Path, should_unlink) -> list[str]:
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    removed = []
    for name in entries:
        parsed = parse_segment_name(name)
        if parsed and should_unlink(parsed[0], parsed[1]) and unlink_segment(name):
            removed.append(name)
    return removed


def _shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
