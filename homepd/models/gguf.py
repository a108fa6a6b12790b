"""A cheap, bounded reader for the header of a GGUF file.

It parses the fixed header, the metadata key/value section and the tensor
infos, and computes how many bytes the file must hold for its tensor data —
without reading that data.  Every length it reads is checked against the file
size first, so a corrupt or hostile file gives a ``ModelError`` naming it,
never a crash, a huge allocation or a hang.

Layout (GGUF v1..v3): magic ``b"GGUF"``, uint32 version, tensor count and
key/value count (uint32 in v1, uint64 after), the key/values, the tensor infos
(name, n_dims, dims, ggml type, offset), padding to ``general.alignment``
(default 32), then the tensor data.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from homepd.errors import ModelError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (1, 2, 3)
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
# magic + version + tensor count + kv count, in v2/v3
MIN_GGUF_BYTES = 24

# GGUF metadata value types -> struct format of a scalar (8 = string, 9 = array)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml type id -> (elements per block, bytes per block); from gguf-py's GGML_QUANT_SIZES
GGML_BLOCK_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
    8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
    13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74),
    18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
    40: (64, 36), 41: (128, 18), 42: (64, 18),
}

# the few string/uint keys worth keeping; every other value is skipped, not read
_KEPT_KEYS = ("general.architecture", "general.name", "general.alignment", "tokenizer.chat_template",
              "general.file_type")
# architecture hyper-parameters ("<arch>.block_count", ...) kept for the KV size estimate
_KEPT_SUFFIXES = (".block_count", ".embedding_length", ".context_length", ".attention.head_count",
                  ".attention.head_count_kv", ".attention.key_length", ".attention.value_length",
                  ".pooling_type")
KV_BYTES_PER_ELEMENT = 2  # llama.cpp's default K and V cache type is f16


@dataclass(frozen=True)
class GgufHeader:
    """What the header of one GGUF file says about it."""

    path: Path
    size_bytes: int
    version: int
    n_tensors: int
    n_kv: int
    data_offset_bytes: int
    # the least file size that holds every tensor the header describes;
    # exact when all tensor types are known
    expected_size_bytes: int
    n_params: int
    architecture: str | None
    name: str | None
    has_chat_template: bool
    hparams: dict = None  # "<arch>.<suffix>" -> value, for the suffixes in _KEPT_SUFFIXES
    chat_template: str | None = None  # the template's text (Jinja), for clients that show it
    file_type: int | None = None      # general.file_type: llama.cpp's llama_ftype (3 = Q4_1, 15 = Q4_K_M, ...)

    @property
    def kv_bytes_per_token(self) -> int | None:
        """KV cache bytes one token takes (f16 K and V, every layer), None if the header does not say.

        An upper bound for models with sliding-window layers (their cache stops growing).
        """
        arch = self.architecture
        hp = self.hparams or {}
        get = lambda suffix: hp.get(f"{arch}{suffix}")  # noqa: E731
        n_layer, n_embd, n_head = get(".block_count"), get(".embedding_length"), get(".attention.head_count")
        n_head_kv = get(".attention.head_count_kv") or n_head
        if not all(isinstance(v, int) and v > 0 for v in (n_layer, n_embd, n_head, n_head_kv)):
            return None
        head_dim = n_embd // n_head
        k_len, v_len = get(".attention.key_length") or head_dim, get(".attention.value_length") or head_dim
        return n_layer * n_head_kv * (k_len + v_len) * KV_BYTES_PER_ELEMENT


class _Cursor:
    """Reads little-endian values from a buffer, failing with a ModelError past its end."""

    def __init__(self, buf, path: Path, size_bytes: int):
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size_bytes = size_bytes

    def fail(self, what: str) -> ModelError:
        return ModelError(f"{self.path}: corrupt or truncated GGUF header: {what} (file has {self.size_bytes} bytes)")

    def need(self, n_bytes: int, what: str) -> None:
        if n_bytes < 0 or self.pos + n_bytes > self.size_bytes:
            raise ModelError(
                f"{self.path}: truncated: the header needs at least {self.pos + n_bytes} bytes "
                f"to hold {what}, file has {self.size_bytes}"
            )

    def unpack(self, fmt: str, what: str):
        n_bytes = struct.calcsize("<" + fmt)
        self.need(n_bytes, what)
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n_bytes
        return values[0] if len(values) == 1 else values

    def skip(self, n_bytes: int, what: str) -> None:
        self.need(n_bytes, what)
        self.pos += n_bytes

    def skip_strings(self, n_items: int, len_fmt: str, what: str) -> None:
        """Skip an array of ``n_items`` strings (a vocabulary: ~50,000 of them) without decoding them."""
        length = struct.Struct("<" + len_fmt)
        buf, pos, end, step = self.buf, self.pos, self.size_bytes, length.size
        for _ in range(n_items):
            if pos + step > end:
                break
            pos += step + length.unpack_from(buf, pos)[0]
            if pos > end:
                break
        else:
            self.pos = pos
            return
        self.need(pos - self.pos + step, what)  # raises: the array runs past the end of the file
        raise self.fail(f"{what} runs past the end of the file")

    def string(self, len_fmt: str, what: str, keep: bool) -> str | None:
        n_bytes = self.unpack(len_fmt, f"the length of {what}")
        self.need(n_bytes, what)
        text = bytes(self.buf[self.pos:self.pos + n_bytes]).decode("utf-8", "replace") if keep else None
        self.pos += n_bytes
        return text


def _check_regular_file(path: Path) -> os.stat_result:
    """Return the stat of ``path``, or raise if it is not a readable, non-empty regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot stat: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"{path}: is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        # why: never open a FIFO, socket or device (/dev/zero) — it can hang or never end
        raise ModelError(f"{path}: not a regular file, not a GGUF file")
    if st.st_size == 0:
        raise ModelError(f"{path}: empty file, not a GGUF file")
    return st


# why: one engine start reads the header two or three times (the model's check, the placement plan, the
# KV store's size), ~0.1 s each for a 49,000-token vocabulary; a file changed in place changes its key
_HEADERS: dict[tuple, GgufHeader] = {}
_HEADERS_KEPT = 8


def read_gguf_header(path: str | os.PathLike) -> GgufHeader:
    """Parse the header of the GGUF file at ``path`` and check it against the file size.

    Raises ``ModelError`` naming the file when it is missing, not a regular
    file, empty, unreadable, not GGUF, of an unknown version, or shorter than
    its header says (truncated).  Reads only the header, via mmap, once per
    version of the file (its device, inode, size and modification time).
    """
    path = Path(path)
    st = _check_regular_file(path)
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if (header := _HEADERS.get(key)) is not None:
        return header
    header = _read_header(path, st.st_size)
    if len(_HEADERS) >= _HEADERS_KEPT:
        _HEADERS.pop(next(iter(_HEADERS)))
    _HEADERS[key] = header
    return header


def _read_header(path: Path, size_bytes: int) -> GgufHeader:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise ModelError(f"{path}: not a GGUF file (magic {magic!r})")
            if size_bytes < MIN_GGUF_BYTES:
                raise ModelError(f"{path}: truncated: a GGUF header needs at least {MIN_GGUF_BYTES} bytes, file has {size_bytes}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, path, size_bytes))
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _parse(cur: _Cursor) -> GgufHeader:
    cur.pos = 4
    version = cur.unpack("I", "the version")
    if version not in GGUF_VERSIONS:
        raise ModelError(f"{cur.path}: unsupported GGUF version {version} (known: 1..3); the file is corrupt or too new")
    count_fmt = "I" if version == 1 else "Q"
    n_tensors = cur.unpack(count_fmt, "the tensor count")
    n_kv = cur.unpack(count_fmt, "the key/value count")
    # why: each kv takes >= 9 bytes and each tensor info >= 20 (v1 sizes), so bound the
    # counts by the file size before looping over them
    if n_kv * 9 + n_tensors * 20 > cur.size_bytes:
        raise cur.fail(f"header claims {n_tensors} tensors and {n_kv} keys, more than the file can hold")

    kept: dict[str, object] = {}
    for i in range(n_kv):
        key = cur.string(count_fmt, f"key #{i}", keep=True)
        value_type = cur.unpack("I", f"the type of key {key!r}")
        keep = key in _KEPT_KEYS or key.endswith(_KEPT_SUFFIXES)
        kept_value = _read_value(cur, value_type, count_fmt, key, keep=keep)
        if keep:
            kept[key] = kept_value

    alignment = kept.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")

    data_end_bytes = 0  # relative to the data section
    n_params = 0
    for i in range(n_tensors):
        name = cur.string(count_fmt, f"the name of tensor #{i}", keep=True)
        n_dims = cur.unpack("I", f"the dims of tensor {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
        dims = cur.unpack(count_fmt * n_dims, f"the shape of tensor {name!r}")
        dims = (dims,) if n_dims == 1 else dims
        ggml_type = cur.unpack("I", f"the type of tensor {name!r}")
        offset_bytes = cur.unpack("Q", f"the offset of tensor {name!r}")
        n_elements = 1
        for dim in dims:
            n_elements *= dim
        n_params += n_elements
        block = GGML_BLOCK_SIZES.get(ggml_type)
        # why: an unknown (newer) type still gives a lower bound: its offset
        n_tensor_bytes = -(-n_elements // block[0]) * block[1] if block else 0
        data_end_bytes = max(data_end_bytes, offset_bytes + n_tensor_bytes)

    data_offset_bytes = -(-cur.pos // alignment) * alignment
    expected_size_bytes = data_offset_bytes + data_end_bytes if n_tensors else cur.pos
    if cur.size_bytes < expected_size_bytes:
        raise ModelError(
            f"{cur.path}: truncated: header says at least {expected_size_bytes} bytes, file has {cur.size_bytes}"
        )
    return GgufHeader(
        path=cur.path,
        size_bytes=cur.size_bytes,
        version=version,
        n_tensors=n_tensors,
        n_kv=n_kv,
        data_offset_bytes=data_offset_bytes,
        expected_size_bytes=expected_size_bytes,
        n_params=n_params,
        architecture=kept.get("general.architecture"),
        name=kept.get("general.name"),
        has_chat_template="tokenizer.chat_template" in kept,
        hparams={k: v for k, v in kept.items() if k.endswith(_KEPT_SUFFIXES)},
        chat_template=kept.get("tokenizer.chat_template"),
        file_type=kept.get("general.file_type"),
    )


def _read_value(cur: _Cursor, value_type: int, count_fmt: str, key: str, keep: bool):
    """Read (``keep``) or skip one metadata value of ``value_type``."""
    what = f"the value of key {key!r}"
    if value_type == _STRING:
        return cur.string(count_fmt, what, keep)
    if value_type in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[value_type], what)
    if value_type != _ARRAY:
        raise cur.fail(f"key {key!r} has unknown value type {value_type}")
    item_type = cur.unpack("I", f"the item type of {key!r}")
    n_items = cur.unpack(count_fmt, f"the length of {key!r}")
    if item_type in _SCALAR_FORMATS:
        cur.skip(n_items * struct.calcsize("<" + _SCALAR_FORMATS[item_type]), what)
    elif item_type == _STRING:
        cur.need(n_items * struct.calcsize("<" + count_fmt), what)
        cur.skip_strings(n_items, count_fmt, what)
    else:
        # nested arrays exist in the spec but not in any model we know of
        raise cur.fail(f"key {key!r} holds an array of type {item_type}")
    return None
