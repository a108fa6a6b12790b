"""Build llama-server and llama-bench from the llama.cpp that the installed llama-cpp-python vendors.

The SLO-capacity and chat benchmarks (``homepd bench slo``, ``benchmarks/chat_bench.py``) compare homepd
with llama-server on the same box, and ``homepd bench engine`` reads llama.cpp's own C++ loop
(``llama-bench``) as its reference row, so both must run the same llama.cpp with the same CPU flags as
homepd's own build (pyproject.toml: native, AMX compiled out).  This downloads that version's sdist through
pip's configured indexes, and builds only the ``llama-server`` and ``llama-bench`` targets.

    uv run python benchmarks/build_llama_server.py [--dest .cache/llama-server] [--jobs 2]

Prints llama-server's path, then llama-bench's.  A second run with both binaries present does nothing.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from importlib.metadata import version
from pathlib import Path

CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DCMAKE_C_FLAGS=-U__AMX_INT8__", "-DCMAKE_CXX_FLAGS=-U__AMX_INT8__",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"]


def pip_indexes() -> list[str]:
    """The package indexes pip is configured with, in pip's order: ``index-url`` (pip's own default, PyPI,
    when none is set), then every ``extra-index-url`` (pip's config files and PIP_* environment variables)."""
    from pip._internal.models.index import PyPI  # why: pip's default index, not an address of ours

    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, list[str]] = {"index-url": [], "extra-index-url": []}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in found:
            found[name].extend(value.strip().strip("'\"").split())
    for name, var in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL")):
        if os.environ.get(var):
            found[name] = os.environ[var].split()
    return (found["index-url"][:1] or [PyPI.simple_url]) + found["extra-index-url"]


class _Links(HTMLParser):
    """The file links of a PEP 503 project page."""

    def __init__(self, base: str):
        super().__init__()
        self.base, self.links = base, []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.links.append(urllib.parse.urljoin(self.base, href))


def _project_page(index: str, project: str) -> tuple[str, str] | None:
    """(page URL, HTML) of ``project`` on ``index`` (http(s) or file://), or None when it is not there."""
    url = index.rstrip("/") + f"/{project}/"
    if url.startswith("file://"):
        url += "index.html"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return url, r.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return None


def fetch_sdist(v: str, into: Path) -> Path:
    """The sdist of llama-cpp-python ``v`` from the first of pip's configured indexes that has it (PEP 503
    page), checked against the sha256 the index gives.  (``pip download`` would try to build the package's
    metadata, which needs its build backend.)"""
    name = f"llama_cpp_python-{v}.tar.gz"
    tried = []
    for index in pip_indexes():
        page = _project_page(index, "llama-cpp-python")
        tried.append(index)
        if page is None:
            continue
        parser = _Links(page[0])
        parser.feed(page[1])
        link = next((u for u in parser.links if urllib.parse.urlsplit(u).path.endswith("/" + name)), None)
        if link is None:
            continue
        url, _, fragment = link.partition("#")
        with urllib.request.urlopen(url, timeout=600) as r:
            data = r.read()
        expected = fragment.partition("sha256=")[2]
        if not expected:
            raise SystemExit(f"{name}: the index {index} gives no sha256 to check it against")
        if hashlib.sha256(data).hexdigest() != expected:
            raise SystemExit(f"{name}: sha256 does not match the index {index}")
        into.mkdir(parents=True, exist_ok=True)
        out = into / name
        out.write_bytes(data)
        return out
    raise SystemExit(f"{name} is on none of pip's configured indexes ({', '.join(tried)})")


TARGETS = ("llama-server", "llama-bench")


def build(dest: Path, jobs: int) -> Path:
    """Build the targets into ``dest``/build/bin; return llama-server's path (llama-bench is beside it)."""
    binaries = [dest / "build" / "bin" / t for t in TARGETS]
    if all(b.exists() for b in binaries):
        return binaries[0]
    dest.mkdir(parents=True, exist_ok=True)
    v = version("llama-cpp-python")
    sdist_dir = dest / "sdist"
    if not glob.glob(str(sdist_dir / "llama_cpp_python-*.tar.gz")):
        fetch_sdist(v, sdist_dir)
    (tarball,) = glob.glob(str(sdist_dir / "llama_cpp_python-*.tar.gz"))
    src = dest / "src"
    if not src.exists():
        with tarfile.open(tarball) as tf:
            tf.extractall(dest / "extract")
        (top,) = (dest / "extract").iterdir()
        shutil.move(str(top / "vendor" / "llama.cpp"), src)
        shutil.rmtree(dest / "extract")
    subprocess.run(["cmake", "-S", str(src), "-B", str(dest / "build"), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(dest / "build"), "--target", *TARGETS, "-j", str(jobs)],
                   check=True, env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)})
    return binaries[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=Path(".cache/llama-server"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    server = build(args.dest.resolve(), args.jobs)
    print(server)
    print(server.with_name("llama-bench"))


if __name__ == "__main__":
    main()
