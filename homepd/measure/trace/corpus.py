"""The text traces are built from: chat questions and long documents shipped in ``homepd/measure/corpus/``.

``chat.txt`` holds one question per line; each ``documents/*.txt`` holds a
title line, then paragraphs separated by blank lines.  All of it was written
for this project (no third-party text).  Passages are whole sentences taken in
order from a paragraph start, so a "long" prompt reads as real prose.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Document:
    name: str
    title: str
    paragraphs: tuple[tuple[str, ...], ...]  # each paragraph as its sentences

    @property
    def text(self) -> str:
        return "\n\n".join(" ".join(p) for p in self.paragraphs)


@lru_cache(maxsize=1)
def chat_questions() -> tuple[str, ...]:
    text = (resources.files("homepd.measure") / "corpus" / "chat.txt").read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


@lru_cache(maxsize=1)
def documents() -> tuple[Document, ...]:
    folder = resources.files("homepd.measure") / "corpus" / "documents"
    out = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".txt"):
            continue
        title, _, body = entry.read_text(encoding="utf-8").strip().partition("\n")
        paragraphs = tuple(tuple(_SENTENCE_END.split(" ".join(p.split())))
                           for p in body.strip().split("\n\n") if p.strip())
        out.append(Document(entry.name[:-4], title.strip(), paragraphs))
    assert out, "the trace corpus has no documents"
    return tuple(out)


def passage(rng: random.Random, n_chars: int, head: str = "") -> str:
    """``head`` (``{title}`` filled in) then whole sentences from a random document, from a random paragraph
    start, as many as keep the whole within ``n_chars`` (at least one); runs on into the next document if
    one is too short."""
    docs = documents()
    d = rng.randrange(len(docs))
    return passage_of(d, rng.randrange(len(docs[d].paragraphs)), n_chars, head)


def passage_of(d: int, start: int, n_chars: int, head: str = "") -> str:
    """``passage`` from document ``d`` (an index into ``documents()``) at its paragraph ``start``."""
    docs = documents()
    head = head.format(title=docs[d].title)
    paragraphs, used = [], len(head)
    for para in _paragraphs_from(docs, d, start):
        taken = []
        for sentence in para:
            cost = len(sentence) + (1 if taken else 2 if paragraphs else 0)  # the space or blank line before it
            if used + cost > n_chars and (taken or paragraphs):
                break
            taken.append(sentence)
            used += cost
        if taken:
            paragraphs.append(" ".join(taken))
        if len(taken) < len(para):
            break
    return head + "\n\n".join(paragraphs)


def _paragraphs_from(docs, d: int, start: int):
    while True:
        yield from docs[d].paragraphs[start:]
        d, start = (d + 1) % len(docs), 0


def filler(offset: int, n_chars: int) -> str:
    """Exactly ``n_chars`` characters of corpus prose starting at ``offset`` (wrapping around): for prompts
    that must have a given length (imported traces) rather than read well."""
    text = _all_text()
    start = offset % len(text)
    out = []
    while n_chars > 0:
        piece = text[start:start + n_chars]
        out.append(piece)
        n_chars -= len(piece)
        start = 0
    return "".join(out)


def corpus_chars() -> int:
    """Characters of document prose that ``filler`` draws from."""
    return len(_all_text())


@lru_cache(maxsize=1)
def _all_text() -> str:
    return " ".join(" ".join(" ".join(p) for p in d.paragraphs) for d in documents()) + " "
