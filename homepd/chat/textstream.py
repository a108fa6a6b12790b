"""Turn a stream of token pieces (bytes) into text deltas, honouring stop strings.

Pieces may split a UTF-8 character; text is released only up to the last
complete character, and, while stop strings are set, the tail that could still
become a stop string is held back.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, stop: tuple[str, ...] = ()):
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._pending = b""
        self._text = ""  # decoded, not yet released
        self.released = ""  # everything released so far
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the newly releasable text ('' if none)."""
        if self.stopped:
            return ""
        self._pending += piece
        text, self._pending = _split_utf8(self._pending)
        self._text += text
        # why: the held-back tail is len(longest stop)-1 chars, so a stop
        # string ending in this piece always lies wholly inside _text.
        hits = [i for i in (self._text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(self._text[: min(hits)], rest="")
        if self._holdback:
            return self._release(self._text[: max(0, len(self._text) - self._holdback)],
                                 rest=self._text[max(0, len(self._text) - self._holdback):])
        return self._release(self._text, rest="")

    def flush(self) -> str:
        """At the end of generation: release what was held back."""
        if self.stopped:
            return ""
        tail = self._text + self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return self._release(tail, rest="")

    def _release(self, out: str, rest: str) -> str:
        self._text = rest
        self.released += out
        return out


def _split_utf8(data: bytes) -> tuple[str, bytes]:
    """Decode the longest complete-UTF-8 prefix of data; return (text, leftover bytes)."""
    for cut in range(len(data), max(-1, len(data) - 4), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError as exc:
            if exc.reason == "invalid start byte" or exc.start < cut - 3:
                # garbage in the middle: replace it rather than stall forever
                return data.decode("utf-8", errors="replace"), b""
    return "", data
