"""KV arena figures on this machine: memcpy, fresh vs pre-faulted segments, checksums, a hand-off.

    uv run python benchmarks/kvarena_bench.py [--mb 47 95] [--repeat 5]

Every figure is the best of ``--repeat`` runs over warm buffers unless it says
"first".  The hand-off line is the target ratio: one memcpy of the payload ÷
(export + import), where export = a copy into the extent + ``publish`` and import
= ``open_ready`` + a copy out (stand-ins for llama_state_seq_get/set_data, which
run near memcpy speed); 0.5 is the two-copy ideal.
"""
from __future__ import annotations

import argparse
import hashlib
import time
import zlib
from multiprocessing import shared_memory

import numpy as np

from homepd.kv.header import payload_checksum
from homepd.kv.pool import ExtentExpectation, ExtentHeader, KVArena, extent_bytes_for

FINGERPRINT = "0" * 64


def best_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def once_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def line(label: str, n_bytes: int, seconds: float, memcpy_s: float | None = None) -> None:
    extra = f"  {memcpy_s / seconds:5.2f}× memcpy" if memcpy_s else ""
    print(f"  {label:44s} {n_bytes / seconds / 1e9:7.2f} GB/s {seconds * 1e3:8.2f} ms{extra}")


def bench(n_bytes: int, repeat: int) -> None:
    print(f"\n{n_bytes / 1e6:.0f} MB")
    src = np.random.default_rng(0).integers(0, 256, n_bytes, dtype=np.uint8)
    dst = np.ones_like(src)
    memcpy_s = best_s(lambda: np.copyto(dst, src), repeat)
    line("memcpy (np.copyto, warm)", n_bytes, memcpy_s)

    # writes into segments ---------------------------------------------------------
    shm = shared_memory.SharedMemory(create=True, size=n_bytes)
    try:
        seg = np.frombuffer(shm.buf, dtype=np.uint8, count=n_bytes)
        line("write into fresh SharedMemory (first)", n_bytes, once_s(lambda: np.copyto(seg, src)), memcpy_s)
        line("write into same SharedMemory (warm)", n_bytes, best_s(lambda: np.copyto(seg, src), repeat), memcpy_s)
        del seg
    finally:
        shm.close()
        shm.unlink()
    extent = extent_bytes_for(n_bytes)
    create_s = time.perf_counter()
    with KVArena.create(extent, verify="full") as arena:
        create_s = time.perf_counter() - create_s
        print(f"  {'KVArena.create (allocate + pre-fault)':44s} {create_s * 1e3:25.2f} ms")
        arena.begin(0, extent)
        seg = np.frombuffer(arena.payload(0, n_bytes), dtype=np.uint8)
        line("write into a fresh arena extent (first)", n_bytes, once_s(lambda: np.copyto(seg, src)), memcpy_s)
        line("write into the same extent (warm)", n_bytes, best_s(lambda: np.copyto(seg, src), repeat), memcpy_s)
        del seg
        for populate in (False, True):
            attach_s = time.perf_counter()
            attached = KVArena.attach(list(arena.names), populate=populate)
            attach_s = time.perf_counter() - attach_s
            # the attacher's own page tables start empty: what a worker's first export sees
            attached.begin(0, extent)
            seg = np.frombuffer(attached.payload(0, n_bytes), dtype=np.uint8)
            label = f"attach populate={populate} ({attach_s * 1e3:.1f} ms), first write"
            line(label, n_bytes, once_s(lambda: np.copyto(seg, src)), memcpy_s)
            del seg
            attached.close()
        arena.release(0)

    # checksums --------------------------------------------------------------------
    view = memoryview(src)
    words = src[:n_bytes // 8 * 8].view(np.uint64)
    candidates = {
        "zlib.crc32": lambda: zlib.crc32(view),
        "zlib.adler32": lambda: zlib.adler32(view),
        "hashlib.blake2b (8-byte digest)": lambda: hashlib.blake2b(view, digest_size=8).digest(),
        "hashlib.sha1 (SHA-NI via OpenSSL)": lambda: hashlib.sha1(view).digest(),
        "numpy uint64 sum (no position mix)": lambda: int(words.sum(dtype=np.uint64)),
        "payload_checksum full (chunk-weighted)": lambda: payload_checksum(view, n_bytes, "full"),
        "payload_checksum sampled": lambda: payload_checksum(view, n_bytes, "sampled"),
    }
    for name, fn in candidates.items():
        line(name, n_bytes, best_s(fn, min(repeat, 3) if "hashlib" in name else repeat), memcpy_s)

    # hand-off through one extent ------------------------------------------------------
    for verify in ("full", "sampled"):
        with KVArena.create(extent, verify=verify) as producer:
            consumer = KVArena.attach(list(producer.names))
            expect = ExtentExpectation("bench", FINGERPRINT, 4096)

            def export() -> None:
                producer.begin(0, extent)
                np.copyto(np.frombuffer(producer.payload(0, n_bytes), dtype=np.uint8), src)
                producer.publish(0, ExtentHeader("bench", FINGERPRINT, 4096, 4096, n_bytes))

            def import_() -> None:
                _header, payload = consumer.open_ready(0, expect, extent)
                np.copyto(dst, np.frombuffer(payload, dtype=np.uint8))
                consumer.release(0)

            export_s, import_s = [], []
            for _ in range(repeat):
                export_s.append(once_s(export))
                import_s.append(once_s(import_))
            consumer.close()
        total_s = min(export_s) + min(import_s)
        print(f"  hand-off verify={verify:8s} export {min(export_s) * 1e3:6.2f} ms + import "
              f"{min(import_s) * 1e3:6.2f} ms: memcpy ÷ (export + import) = {memcpy_s / total_s:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[47, 95])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for mb in args.mb:
        bench(int(mb * 1e6) // 8 * 8, args.repeat)


if __name__ == "__main__":
    main()
