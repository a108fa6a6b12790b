"""What one KV extent of the arena holds: the header layout, its checks, and the payload checksum.

An extent (once a fixed "slot": the magic's "SL" is from then) is a page-aligned run of the KV arena
(``homepd.kv.pool``): a ``HEADER_BYTES`` header, then the payload (one
sequence's ``llama_state_seq_get_data`` bytes), rounded up to whole pages.
Little-endian, byte offsets from the start of the extent::

    0   magic        8s   b"HPDKVSL\\0"
    8   version      u16  LAYOUT_VERSION
    10  state        u8   ExtentState; the only byte that changes outside begin() and publish()
    12  holder_pid   u32  last process that took the extent (begin() / payload() / open_ready())
    16  header_crc   u32  zlib.crc32 of bytes [BODY_OFFSET, HEADER_BYTES)
    32  body         BODY below; the rest of the header is reserved (zeros),
                          covered by header_crc, room for new fields

The header is one page, so the payload starts page-aligned.  Version 2: the
body names the extent's length, and ``n_ctx`` is the producer's context (the
consumer checks that the tokens fit its own).
"""
from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from homepd.errors import ExtentError

MAGIC = b"HPDKVSL\0"
LAYOUT_VERSION = 2
HEADER_BYTES = 4096
STATE_OFFSET = 10
HOLDER_PID_OFFSET = 12
HEADER_CRC_OFFSET = 16
BODY_OFFSET = 32
REQUEST_ID_MAX_BYTES = 64
FINGERPRINT_BYTES = 32

PREFIX = struct.Struct("<8sHBxII")  # magic, version, state, holder_pid, header_crc
# payload_bytes, payload_checksum, extent_bytes, n_ctx, n_tokens, export_start_s, export_end_s,
# published_s, verify kind, request_id length, request_id, model fingerprint
BODY = struct.Struct(f"<QQQIIdddBB{REQUEST_ID_MAX_BYTES}s{FINGERPRINT_BYTES}s")
assert BODY_OFFSET + BODY.size <= HEADER_BYTES

VERIFY_KINDS = {"full": 1, "sampled": 2}
_VERIFY_NAMES = {code: name for name, code in VERIFY_KINDS.items()}


class ExtentState(enum.IntEnum):
    """Who may touch an extent.  Each transition has one writer: the producer that
    allocated it (FREE→WRITING→READY), the consumer it was handed to
    (READY→READING→FREE), the controller after a death (→FREE, READING→READY)."""
    FREE = 0
    WRITING = 1
    READY = 2
    READING = 3


@dataclass(frozen=True)
class ExtentHeader:
    """One request's KV hand-off.  The producer fills the first fields; ``KVArena.publish``
    fills ``extent_bytes``, ``published_s``, ``payload_checksum`` and ``verify``."""
    request_id: str
    model_fingerprint: str  # homepd.models.resolve.fingerprint(): 64 hex chars
    n_ctx: int              # the producer's context
    n_tokens: int
    payload_bytes: int
    export_start_s: float = 0.0  # time.monotonic() around state_get
    export_end_s: float = 0.0
    published_s: float = 0.0
    payload_checksum: int = 0
    verify: str = "full"
    extent_bytes: int = 0   # header + payload rounded up to pages: what the extent takes in the arena


@dataclass(frozen=True)
class ExtentExpectation:
    """What a consumer knows the extent must hold; every field is checked.  ``n_ctx`` is the
    consumer's own context: the extent's tokens must fit it (the producer's may be smaller)."""
    request_id: str
    model_fingerprint: str
    n_ctx: int


def pack_body(header: ExtentHeader) -> bytes:
    request_id = header.request_id.encode("utf-8")
    if len(request_id) > REQUEST_ID_MAX_BYTES:
        raise ExtentError(f"request id {header.request_id[:20]!r}… is {len(request_id)} bytes of utf-8, "
                          f"a KV extent's header holds at most {REQUEST_ID_MAX_BYTES} — use shorter request ids")
    return BODY.pack(header.payload_bytes, header.payload_checksum, header.extent_bytes, header.n_ctx,
                     header.n_tokens,
                     header.export_start_s, header.export_end_s, header.published_s,
                     VERIFY_KINDS[header.verify], len(request_id), request_id,
                     fingerprint_bytes(header.model_fingerprint))


def unpack_body(body) -> ExtentHeader:
    (payload_bytes, payload_checksum, extent_bytes, n_ctx, n_tokens, export_start_s, export_end_s, published_s,
     verify_code, request_id_len, request_id, fingerprint) = BODY.unpack_from(body)
    return ExtentHeader(request_id=request_id[:request_id_len].decode("utf-8", errors="replace"),
                        model_fingerprint=fingerprint.hex(), n_ctx=n_ctx, n_tokens=n_tokens,
                        payload_bytes=payload_bytes, export_start_s=export_start_s,
                        export_end_s=export_end_s, published_s=published_s,
                        payload_checksum=payload_checksum,
                        verify=_VERIFY_NAMES.get(verify_code, f"unknown({verify_code})"), extent_bytes=extent_bytes)


def fingerprint_bytes(fingerprint: str) -> bytes:
    try:
        raw = bytes.fromhex(fingerprint)
    except ValueError:
        raw = b""
    if len(raw) != FINGERPRINT_BYTES:
        raise ExtentError(f"model fingerprint {fingerprint[:16]!r} is not a hex sha256 "
                          "— pass homepd.models.resolve.fingerprint(model_path)")
    return raw


def header_checksum(header_buf) -> int:
    return zlib.crc32(header_buf[BODY_OFFSET:HEADER_BYTES])


def check_header(where: str, header_buf, expect: ExtentExpectation, extent_bytes: int) -> ExtentHeader:
    """Verify everything but the payload checksum; raise ExtentError naming the first mismatch.

    ``where`` names the extent in messages (e.g. "KV extent at 8192"); ``extent_bytes``
    is its length as the arena knows it (the header must agree).
    """
    magic, version, _state, _holder, stored_crc = PREFIX.unpack_from(header_buf)
    if magic != MAGIC:
        raise ExtentError(f"{where} is not a homepd KV extent (magic {magic!r}, expected {MAGIC!r})")
    if version != LAYOUT_VERSION:
        raise ExtentError(f"{where} has layout version {version}, this homepd reads version "
                          f"{LAYOUT_VERSION} — run the controller and workers from the same homepd install")
    found_crc = header_checksum(header_buf)
    if found_crc != stored_crc:
        raise ExtentError(f"{where} header checksum mismatch: stored {stored_crc:08x}, header gives "
                          f"{found_crc:08x} — the header was overwritten after publish")
    header = unpack_body(header_buf[BODY_OFFSET:])
    if header.request_id != expect.request_id:
        raise ExtentError(f"{where} holds KV for request id {header.request_id!r}, expected "
                          f"{expect.request_id!r} — the extent was handed to the wrong request")
    if header.model_fingerprint != expect.model_fingerprint.lower():
        raise ExtentError(f"{where} holds KV for model fingerprint {header.model_fingerprint[:12]}…, "
                          f"this decode worker runs {expect.model_fingerprint[:12]}… "
                          "— both workers must load the same GGUF")
    if header.n_tokens > expect.n_ctx:
        raise ExtentError(f"{where} holds KV of {header.n_tokens} tokens (made with n_ctx {header.n_ctx}), "
                          f"this decode worker runs n_ctx {expect.n_ctx} — give the decode worker at least "
                          "the context of the prefill worker")
    if header.extent_bytes != extent_bytes or header.payload_bytes > extent_bytes - HEADER_BYTES:
        raise ExtentError(f"{where} claims payload bytes {header.payload_bytes} in an extent of "
                          f"{header.extent_bytes} bytes, the arena gave it {extent_bytes} — the header is corrupt")
    if header.verify not in VERIFY_KINDS:
        raise ExtentError(f"{where} payload checksum kind is {header.verify}, this homepd knows "
                          f"{sorted(VERIFY_KINDS)} — run the controller and workers from the same homepd install")
    return header


# payload checksum ---------------------------------------------------------------
CHUNK_WORDS = 8192  # 64 KiB of uint64 words summed per term
EDGE_BYTES = 64 * 1024  # "sampled" checks the first and last bytes in full
SAMPLE_PAGE_BYTES = 4096
SAMPLE_LINE_BYTES = 64
SAMPLE_BLOCK_PAGES = SAMPLE_PAGE_BYTES // SAMPLE_LINE_BYTES  # 64 pages, one line each
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def payload_checksum(buf, n_bytes: int, verify: str = "full") -> int:
    """A 64-bit checksum of ``buf[:n_bytes]``; the one place that defines it.

    ``"full"``: the payload as uint64 words, summed per 64 KiB chunk, chunk sums
    combined with distinct odd weights, folded with ``n_bytes``.  A change in any
    one byte changes exactly one chunk sum by a nonzero amount mod 2^64, an odd
    weight keeps it nonzero, so single-byte corruption is always caught; so is a
    different length.  Swapping whole 64 KiB chunks is caught; two compensating
    changes inside one chunk are not (not a failure mode of a memcpy).

    ``"sampled"``: the first and last ~64 KiB in full (llama.cpp's state
    header and the end of the data), then one 64-byte line of every 4 KiB page,
    the line moving down the page from page to page so that every 64 pages cover
    every offset.  Reads ~2 % of a large payload: catches truncation, a stale or
    misrouted extent and gross overwrites, not an isolated flipped byte.

    # why: numpy sums run at memory bandwidth (~2-4× a memcpy here); zlib.crc32
    # runs at half a memcpy and would alone cost more than the transfer budget.
    """
    if verify not in VERIFY_KINDS:
        raise ValueError(f"verify must be one of {sorted(VERIFY_KINDS)}, not {verify!r}")
    data = np.frombuffer(buf, dtype=np.uint8, count=n_bytes)
    if verify == "full":
        terms = _full_terms(data)
    else:
        head = min(n_bytes, EDGE_BYTES)
        block_bytes = SAMPLE_BLOCK_PAGES * SAMPLE_PAGE_BYTES
        n_blocks = max(0, n_bytes - 2 * EDGE_BYTES) // block_bytes
        middle_end = head + n_blocks * block_bytes
        blocks = data[head:middle_end].view(np.uint64).reshape(
            n_blocks, SAMPLE_BLOCK_PAGES, SAMPLE_BLOCK_PAGES, SAMPLE_LINE_BYTES // 8)
        # line j of page j in each block: a strided view, no gather
        sampled = np.diagonal(blocks, axis1=1, axis2=2).sum(axis=(1, 2), dtype=np.uint64)
        terms = np.concatenate([_full_terms(data[:head]), sampled, _full_terms(data[middle_end:])])
    weights = (np.arange(len(terms), dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(_GOLDEN)
    acc = int((terms * weights).sum(dtype=np.uint64))  # uint64 arrays wrap mod 2^64
    return _mix64(acc ^ ((n_bytes * _GOLDEN) & _MASK64) ^ VERIFY_KINDS[verify])


def _full_terms(data: np.ndarray) -> np.ndarray:
    """Per-chunk uint64 sums of ``data``, then the sum of the leftover words, then the leftover bytes."""
    n_words = len(data) // 8
    n_chunks = n_words // CHUNK_WORDS
    words = data[:n_words * 8].view(np.uint64)
    chunk_sums = words[:n_chunks * CHUNK_WORDS].reshape(n_chunks, CHUNK_WORDS).sum(axis=1, dtype=np.uint64)
    rest_sum = words[n_chunks * CHUNK_WORDS:].sum(dtype=np.uint64)
    tail = bytes(data[n_words * 8:]).ljust(8, b"\0")
    return np.concatenate([chunk_sums, np.array([rest_sum, int.from_bytes(tail, "little")], dtype=np.uint64)])


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that spreads every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
