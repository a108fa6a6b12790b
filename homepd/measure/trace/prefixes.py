"""Which part of a prompt was seen before: a bounded table of hashes of token-block prefixes.

``PrefixTracker.observe`` takes prompts' token ids in arrival order and answers,
for each, how many leading tokens an earlier prompt began with too (in whole
blocks of ``BLOCK_TOKENS``) and which earlier prompt that was (the most recent
one holding that prefix), so that a replay can give the two the same prefix.

It is computed from the token ids alone, independent of whether an engine's
prefix cache hit: a prefix seen before counts here even when the cache had
evicted it (or has none).  Each block's digest is chained over every block
before it, so equal digests mean equal prefixes, and keyed with a random key
made per tracker and never stored: the digests say nothing about the text.
Bounded: at most ``max_prefixes`` block prefixes (about 100 bytes each) are
kept, the least recently seen dropped first.
"""
from __future__ import annotations

import hashlib
import secrets
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

BLOCK_TOKENS = 16        # the engine's KV block: a prefix is matched in whole blocks
MAX_PREFIXES = 65_536    # block prefixes kept: ~1M prompt tokens of history, ~13 MB (measured: ~200 B each)
_DIGEST_BYTES = 16


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a prompt an earlier prompt began with: ``n_tokens`` (a multiple of the block size)
    and the id of that earlier prompt (None when no whole block was seen before)."""
    n_tokens: int = 0
    parent_id: str | None = None


class PrefixTracker:
    """Feed prompts in arrival order with ``observe``; not thread-safe (one caller)."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS, max_prefixes: int = MAX_PREFIXES):
        assert block_tokens >= 1 and max_prefixes >= 1
        self.block_tokens, self.max_prefixes = block_tokens, max_prefixes
        self._key = secrets.token_bytes(32)
        self._last_holder: OrderedDict[bytes, str] = OrderedDict()  # block-prefix digest -> latest prompt id

    def __len__(self) -> int:
        return len(self._last_holder)

    def observe(self, prompt_id: str, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest prefix of ``token_ids`` (whole blocks) that an earlier prompt had; then remember this
        prompt's block prefixes, with ``prompt_id`` as their latest holder."""
        digests = self._block_digests(token_ids)
        match = PrefixMatch()
        for i, digest in enumerate(digests):
            holder = self._last_holder.get(digest)
            if holder is None:
                break
            match = PrefixMatch((i + 1) * self.block_tokens, holder)
        for digest in digests:
            self._last_holder[digest] = prompt_id
            self._last_holder.move_to_end(digest)
        while len(self._last_holder) > self.max_prefixes:
            self._last_holder.popitem(last=False)
        return match

    def _block_digests(self, token_ids: Sequence[int]) -> list[bytes]:
        n_blocks = len(token_ids) // self.block_tokens
        step = self.block_tokens * 8
        packed = struct.pack(f"<{n_blocks * self.block_tokens}q", *token_ids[:n_blocks * self.block_tokens])
        out, previous = [], b""
        for start in range(0, n_blocks * step, step):
            previous = hashlib.blake2b(previous + packed[start:start + step], key=self._key,
                                       digest_size=_DIGEST_BYTES).digest()
            out.append(previous)
        return out
