"""Build llama-server from the llama.cpp that the installed llama-cpp-python vendors.

The SLO-capacity benchmark (``homepd bench slo``) compares homepd with llama-server on the same box, so
the server must run the same llama.cpp with the same CPU flags as homepd's own build (pyproject.toml:
native, AMX compiled out).  This downloads that version's sdist from PyPI with pip, and builds only the
``llama-server`` target.

    uv run python benchmarks/build_llama_server.py [--dest .cache/llama-server] [--jobs 2]

Prints the binary's path.  A second run with the binary present does nothing.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from importlib.metadata import version
from pathlib import Path

CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DCMAKE_C_FLAGS=-U__AMX_INT8__", "-DCMAKE_CXX_FLAGS=-U__AMX_INT8__",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"]


def fetch_sdist(v: str, into: Path) -> Path:
    """The sdist of llama-cpp-python ``v`` from the package index (PEP 691 JSON), checked against its sha256.
    (``pip download`` would try to build the package's metadata, which needs its build backend.)"""
    name = f"llama_cpp_python-{v}.tar.gz"
    req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    (entry,) = [f for f in files if f["filename"] == name]
    into.mkdir(parents=True, exist_ok=True)
    out = into / name
    with urllib.request.urlopen(entry["url"], timeout=600) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise SystemExit(f"{name}: sha256 does not match the index")
    out.write_bytes(data)
    return out


def build(dest: Path, jobs: int) -> Path:
    binary = dest / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
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
    subprocess.run(["cmake", "--build", str(dest / "build"), "--target", "llama-server", "-j", str(jobs)],
                   check=True, env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)})
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=Path(".cache/llama-server"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    print(build(args.dest.resolve(), args.jobs))


if __name__ == "__main__":
    main()
