"""What a trace is, and its file: one JSON object per line.

A ``Trace`` is an ordered tuple of ``TraceRequest`` plus what replays it
(``concurrency``) and where it came from (``name``, ``seed``, ``generator``).
On disk it is JSONL: an optional header line ``{"homepd_trace": 1, ...}``
with those trace fields, then one request per line with exactly the
``TraceRequest`` field names::

    {"homepd_trace": 1, "name": "mixed", "seed": 0, "concurrency": null, "generator": {...}}
    {"arrival_s": 0.0, "messages": [{"role": "user", "content": "..."}], "max_tokens": 64,
     "kind": "short", "request_class": "interactive", "ignore_eos": true}
    {"arrival_s": 0.41, "prompt": "raw text, no chat template", "max_tokens": 128}

A multi-turn chat (``kind`` "chat") adds ``conversation`` (its id), ``turn``
(0, 1, ...) and ``think_s``: a later turn's messages are the previous turn's
plus that turn's answer and the new question, and the replay sends it
``think_s`` after the previous turn ended (its ``arrival_s`` is the earliest
it could be sent: the previous turn's arrival plus ``think_s``).

Every bad line is refused with an error naming the file, the line and the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

from homepd.core.terms import RequestClass
from homepd.errors import ConfigError

FORMAT_VERSION = 1
KINDS = ("short", "long", "chat", "rag")
REQUEST_CLASSES = tuple(c.value for c in RequestClass)
CLASS_OF_KIND = {"short": RequestClass.INTERACTIVE, "long": RequestClass.BACKGROUND, "chat": RequestClass.INTERACTIVE,
                 "rag": RequestClass.INTERACTIVE}
# why: SmolLM2's tokenizer gives 4.7-4.9 characters per token on the shipped
# corpus (English prose); GPT-style tokenizers give about 4.  Used wherever a
# token count must be guessed without a tokenizer (long prompts, imports).
CHARS_PER_TOKEN = 4.7
LONG_PROMPT_TOKENS = 256  # a prompt of at least this many (estimated) tokens is 'long' when no kind is given


class TraceError(ConfigError):
    """A trace file or record that cannot be read; names the file, line and field."""

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None,
                 field: str | None = None):
        self.reason, self.source, self.line, self.field = message, source, line, field
        where = ":".join(str(x) for x in (source, line) if x is not None)
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where + ': ' if where else ''}{what}{message}")


def estimate_tokens(text: str) -> int:
    """Tokens in ``text``, estimated as characters / ``CHARS_PER_TOKEN`` (no tokenizer)."""
    return max(1, round(len(text) / CHARS_PER_TOKEN))


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives, what it asks, how many tokens it may generate."""
    arrival_s: float                                  # offset from the start of the run
    prompt: str | None = None                         # raw text (no chat template) ...
    messages: tuple[dict[str, str], ...] | None = None  # ... or a chat: ({"role", "content"}, ...)
    max_tokens: int = 32
    kind: str = "short"                               # "short" | "long"
    request_class: RequestClass = RequestClass.INTERACTIVE  # a trace file's "interactive" | "background", parsed
    ignore_eos: bool = False                          # generate exactly max_tokens (benchmarks)
    conversation: int | None = None                   # chat: the conversation this turn belongs to
    turn: int = 0                                     # chat: its index in the conversation
    think_s: float = 0.0                              # chat, turn > 0: sent this long after the previous turn ended

    def __post_init__(self):
        if self.messages is not None and not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))
        _check_request(self)
        object.__setattr__(self, "request_class", RequestClass(self.request_class))

    @property
    def text(self) -> str:
        """The prompt text, or the messages' contents joined (for length estimates and exports)."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages)

    def to_dict(self) -> dict:
        out: dict = {"arrival_s": self.arrival_s}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["messages"] = [dict(m) for m in self.messages]
        out.update(max_tokens=self.max_tokens, kind=self.kind, request_class=self.request_class.value,
                   ignore_eos=self.ignore_eos)
        if self.conversation is not None:
            out.update(conversation=self.conversation, turn=self.turn, think_s=self.think_s)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "TraceRequest":
        """Build from a file record; ``kind`` defaults from the prompt's length, ``request_class`` from
        the kind.  Raises ``TraceError`` naming the field."""
        if not isinstance(d, dict):
            raise TraceError("a request must be a JSON object")
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise TraceError(f"unknown field (known: {', '.join(sorted(_FIELDS))})", field=unknown[0])
        for name in ("arrival_s", "max_tokens"):
            if name not in d:
                raise TraceError("missing", field=name)
        if ("prompt" in d) == ("messages" in d):
            raise TraceError("a request needs exactly one of 'prompt' or 'messages'",
                             field="prompt" if "prompt" in d else "messages")
        messages = d.get("messages")
        if messages is not None:
            _check_messages(messages)
        text = d["prompt"] if "prompt" in d else "\n".join(
            m["content"] for m in messages if isinstance(m.get("content"), str))
        kind = d.get("kind")
        if kind is None and isinstance(text, str):
            kind = "long" if estimate_tokens(text) >= LONG_PROMPT_TOKENS else "short"
        return cls(arrival_s=d["arrival_s"], prompt=d.get("prompt"),
                   messages=None if messages is None else tuple(dict(m) for m in messages),
                   max_tokens=d["max_tokens"], kind=kind,
                   request_class=d.get("request_class", CLASS_OF_KIND.get(kind, RequestClass.INTERACTIVE)),
                   ignore_eos=d.get("ignore_eos", False), conversation=d.get("conversation"),
                   turn=d.get("turn", 0), think_s=d.get("think_s", 0.0))


_FIELDS = {"arrival_s", "prompt", "messages", "max_tokens", "kind", "request_class", "ignore_eos", "conversation",
           "turn", "think_s"}


def _check_request(r: TraceRequest) -> None:
    if not _is_number(r.arrival_s) or not math.isfinite(r.arrival_s) or r.arrival_s < 0:
        raise TraceError(f"must be a finite number >= 0, got {r.arrival_s!r}", field="arrival_s")
    if (r.prompt is None) == (r.messages is None):
        raise TraceError("a request needs exactly one of 'prompt' or 'messages'", field="prompt")
    if r.prompt is not None and (not isinstance(r.prompt, str) or not r.prompt):
        raise TraceError("must be a non-empty string", field="prompt")
    if r.messages is not None:
        _check_messages(r.messages)
    if not isinstance(r.max_tokens, int) or isinstance(r.max_tokens, bool) or r.max_tokens < 1:
        raise TraceError(f"must be an integer >= 1, got {r.max_tokens!r}", field="max_tokens")
    if r.kind not in KINDS:
        raise TraceError(f"must be one of {', '.join(KINDS)}, got {r.kind!r}", field="kind")
    if r.request_class not in REQUEST_CLASSES:
        raise TraceError(f"must be one of {', '.join(REQUEST_CLASSES)}, got {r.request_class!r}",
                         field="request_class")
    if not isinstance(r.ignore_eos, bool):
        raise TraceError(f"must be true or false, got {r.ignore_eos!r}", field="ignore_eos")
    if r.conversation is not None and not _is_count(r.conversation):
        raise TraceError(f"must be an integer >= 0 or absent, got {r.conversation!r}", field="conversation")
    if not _is_count(r.turn) or (r.turn and r.conversation is None):
        raise TraceError(f"must be an integer >= 0, and 0 outside a conversation, got {r.turn!r}", field="turn")
    if not _is_number(r.think_s) or not math.isfinite(r.think_s) or r.think_s < 0:
        raise TraceError(f"must be a finite number >= 0, got {r.think_s!r}", field="think_s")
    if r.conversation is not None and r.messages is None:
        raise TraceError("a conversation's turn must be a chat ('messages')", field="conversation")


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TraceError("must be a non-empty list of {\"role\", \"content\"} objects", field="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["role"], str) \
                or not m["role"] or not isinstance(m["content"], str):
            raise TraceError(f"message {i} must be an object with exactly a string 'role' and 'content'",
                             field="messages")


def check_conversations(requests: tuple[TraceRequest, ...]) -> None:
    """Every conversation's turns come in order 0, 1, ... and each resends the previous turn's messages, then
    that turn's answer (an assistant message) and at least one new message; raises ``TraceError`` naming it."""
    last: dict[int, TraceRequest] = {}
    for r in requests:
        if r.conversation is None:
            continue
        prev = last.get(r.conversation)
        expected = 0 if prev is None else prev.turn + 1
        if r.turn != expected:
            raise TraceError(f"conversation {r.conversation}: turn {r.turn} where turn {expected} was due "
                             "(a conversation's turns are listed in order)", field="turn")
        if prev is not None:
            n = len(prev.messages)
            if r.messages[:n] != prev.messages or len(r.messages) < n + 2 or r.messages[n]["role"] != "assistant":
                raise TraceError(f"conversation {r.conversation}: turn {r.turn} does not resend turn {prev.turn}'s "
                                 "messages followed by its answer (an assistant message) and a new message",
                                 field="messages")
        last[r.conversation] = r


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(frozen=True)
class Trace:
    """Requests in replay order, and how to replay them.

    ``concurrency``: when set, replay keeps that many requests in flight and
    ignores ``arrival_s`` (a closed loop); otherwise each request is sent at
    its arrival offset (an open loop).  ``generator``: the settings that made
    the trace (mix, rate, arrival process, ...), kept for the record.
    """
    requests: tuple[TraceRequest, ...]
    name: str = ""
    seed: int | None = None
    concurrency: int | None = None
    generator: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "requests", tuple(self.requests))
        check_conversations(self.requests)
        if self.concurrency is not None and (not isinstance(self.concurrency, int)
                                             or isinstance(self.concurrency, bool) or self.concurrency < 1):
            raise TraceError(f"must be an integer >= 1 or null, got {self.concurrency!r}", field="concurrency")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i):
        return self.requests[i]

    def header(self) -> dict:
        return {"homepd_trace": FORMAT_VERSION, "name": self.name, "seed": self.seed,
                "concurrency": self.concurrency, "generator": dict(self.generator)}


def tag_user_turns(messages, tag: str) -> list[dict]:
    """``messages`` with ``tag`` before every user turn's text; the other turns copied as they are (the chat
    template's own head and the system prompt stay shared between tagged prompts, as they would be)."""
    return [dict(m, content=tag + m["content"]) if m.get("role") == "user" else dict(m) for m in messages]


def tagged(trace: "Trace", tag: str) -> "Trace":
    """``trace`` with ``tag`` before every raw prompt and every user message.  A benchmark that replays one
    trace at several rates on one engine tags each replay apart, so that no replay is served from the KV an
    earlier one left in the prefix cache or the KV store, while the prefixes its requests share with each
    other (a conversation's history, a document asked twice, the chat template's head) stay shared."""
    def one(r: TraceRequest) -> TraceRequest:
        if r.prompt is not None:
            return replace(r, prompt=tag + r.prompt)
        return replace(r, messages=tuple(tag_user_turns(r.messages, tag)))
    return replace(trace, requests=tuple(one(r) for r in trace.requests))


def dump_lines(trace: Trace) -> Iterator[str]:
    """The trace as JSONL lines (header first), without newlines."""
    yield json.dumps(trace.header())
    for r in trace:
        yield json.dumps(r.to_dict(), ensure_ascii=False)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as homepd JSONL to ``path``."""
    Path(path).write_text("".join(line + "\n" for line in dump_lines(trace)), encoding="utf-8")


def read_trace(path: str | Path) -> Trace:
    """Read a homepd JSONL trace; a missing file or bad line raises ``TraceError`` naming it."""
    return parse_trace(read_lines(path), source=str(path), name=Path(path).stem)


def read_lines(path: str | Path) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace file: {exc}", source=str(path)) from None


def parse_trace(lines: Iterable[str], source: str = "<trace>", name: str = "") -> Trace:
    """Parse homepd JSONL ``lines`` (``source`` names them in errors); blank lines are skipped."""
    header: dict | None = None
    requests = []
    for lineno, record in json_records(lines, source):
        if isinstance(record, dict) and "homepd_trace" in record:
            if header is not None or requests:
                raise TraceError("the header must be the first line", source=source, line=lineno,
                                 field="homepd_trace")
            header = _check_header(record, source, lineno)
            continue
        with at_line(source, lineno):
            requests.append(TraceRequest.from_dict(record))
    if not requests:
        raise TraceError("no requests in the trace", source=source)
    header = header or {}
    with at_line(source, 1):
        return Trace(tuple(requests), name=header.get("name") or name, seed=header.get("seed"),
                     concurrency=header.get("concurrency"), generator=header.get("generator") or {})


def _check_header(h: dict, source: str, lineno: int) -> dict:
    known = {"homepd_trace", "name", "seed", "concurrency", "generator"}
    problems = [(k, "unknown field") for k in sorted(set(h) - known)]
    if h["homepd_trace"] != FORMAT_VERSION:
        problems.append(("homepd_trace", f"format version {h['homepd_trace']!r} is not {FORMAT_VERSION}"))
    if not isinstance(h.get("name", ""), (str, type(None))):
        problems.append(("name", "must be a string"))
    if h.get("seed") is not None and (not isinstance(h["seed"], int) or isinstance(h["seed"], bool)):
        problems.append(("seed", "must be an integer or null"))
    if not isinstance(h.get("generator", {}), (dict, type(None))):
        problems.append(("generator", "must be an object"))
    if problems:
        raise TraceError(problems[0][1], source=source, line=lineno, field=problems[0][0])
    return h


def json_records(lines: Iterable[str], source: str) -> Iterator[tuple[int, object]]:
    """(line number, decoded JSON) for each non-blank line; bad JSON raises ``TraceError``."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not valid JSON ({exc.msg} at column {exc.colno})", source=source,
                             line=lineno) from None


class at_line:
    """Context manager: a ``TraceError`` raised inside gets ``source`` and ``line`` filled in."""

    def __init__(self, source: str, line: int):
        self.source, self.line = source, line

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if isinstance(exc, TraceError) and exc.source is None:
            raise TraceError(exc.reason, source=self.source, line=self.line, field=exc.field) from None
        return False
