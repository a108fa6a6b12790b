"""A JSON Schema ``pattern`` (ECMA-262) rewritten into the regex subset llama.cpp's JSON-schema converter turns
into GBNF, so that every string the grammar writes matches the pattern and is valid JSON
(``PatternRegex``); what the rewrite cannot keep exact is refused, naming the construct."""
from __future__ import annotations

import re

from homepd.structured.gbnf import class_char
from homepd.structured.limits import MAX_REPEAT, Budget
from homepd.errors import RequestError

_SAFE_LITERAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !#%&',-/:;<=>@_`~")
_JSON_ESCAPED = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))   # what a JSON string must escape
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_LINE_END = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")
MAX_PATTERN_NESTING = 32


class PatternRegex:
    """A JSON Schema pattern (ECMA-262) rewritten into the regex subset the converter turns into GBNF, so that
    the grammar writes each matching string as JSON: a quote, a backslash or a control character the pattern
    names comes out escaped; ``.``, negated classes and ``\\D\\W\\S`` never write those (narrower, never
    wrong); an unanchored pattern gets any text around it, as JSON Schema's search semantics says.  Refused:
    lookaround, back-references, word boundaries, anchors inside, unicode property escapes."""

    def __init__(self, src: str, path: str, budget: Budget):
        self.src, self.path, self.budget = src, path, budget
        self.i = self.depth = 0

    def error(self, why: str) -> RequestError:
        return RequestError(f"{self.path}: {why} (in pattern {self.src!r}); homepd refuses a pattern it cannot "
                            "enforce")

    def convert(self) -> str:
        src = self.src
        starts = src.startswith("^")
        n_backslashes = len(src) - 1 - len(src[:-1].rstrip("\\"))
        ends = src.endswith("$") and len(src) > starts and n_backslashes % 2 == 0
        self.body = src[int(starts):len(src) - int(ends)]
        out = self.alternation()
        if self.i < len(self.body):
            raise self.error("an unbalanced ')'")
        anything = _negated(()) + "*"
        return f"^{'' if starts else anything}({out}){'' if ends else anything}$"

    def peek(self, n: int = 1) -> str:
        return self.body[self.i:self.i + n]

    def alternation(self) -> str:
        parts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.sequence())
        return "|".join(parts)

    def sequence(self) -> str:
        items = []
        while self.i < len(self.body) and self.peek() not in ("|", ")"):
            atom = self.atom()
            count = self.quantifier()
            items.append(atom + count if count else atom)
        return "".join(items)

    def quantifier(self) -> str:
        c = self.peek()
        match = _COUNT.match(self.body, self.i) if c == "{" else None
        if c in ("*", "+", "?"):
            self.i += 1
            out = c
        elif match:
            lo = int(match[1])
            hi = lo if match[2] is None else int(match[3]) if match[3] else None
            if max(lo, hi or 0) > MAX_REPEAT:
                raise self.error(f"a count over {MAX_REPEAT}, the most homepd writes into a grammar")
            if hi is not None and hi < lo:
                raise self.error("a count {m,n} with n < m")
            self.budget.repeat(max(lo, hi or 0), self.path)
            self.i = match.end()
            out = "{%d}" % lo if hi == lo else "{%d,}" % lo if hi is None else "{%d,%d}" % (lo, hi)
        else:
            return ""
        if self.peek() == "?":   # lazy: the same strings, for a pattern matched as a whole
            self.i += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and _COUNT.match(self.body, self.i)):
            raise self.error("a quantifier on a quantifier")
        return out

    def atom(self) -> str:
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.peek(2) == "?:":
                self.i += 2
            elif self.peek(2) == "?<" and self.peek(3) not in ("?<=", "?<!") and ">" in self.body[self.i:]:
                self.i = self.body.index(">", self.i) + 1   # a named group is a group
            elif self.peek() == "?":
                raise self.error("lookaround and other (?...) groups are not supported")
            self.depth += 1
            if self.depth > MAX_PATTERN_NESTING:
                raise self.error(f"groups nested more than {MAX_PATTERN_NESTING} deep")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("an unbalanced '('")
            self.i += 1
            self.depth -= 1
            return f"({inner})"
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return _negated(_LINE_END)
        if c == "\\":
            return self.escape()
        if c in ("^", "$"):
            raise self.error("an anchor inside the pattern is not supported; anchor the pattern as a whole, ^...$")
        if c in ("*", "+", "?") or (c == "{" and _COUNT.match(self.body, self.i)):
            raise self.error("a quantifier with nothing to repeat")
        self.i += 1
        return _literal(c)

    def escape(self) -> str:
        got = self.class_escape(outside=True)
        if isinstance(got, tuple):
            return got[1] if got[0] == "negated" else _positive(got[1])
        return _literal(chr(got))

    def class_escape(self, outside: bool = False):
        """The escape at ``self.i``: a code point, or ("ranges"/"negated", ranges) for \\d\\w\\s / \\D\\W\\S."""
        if self.i + 1 >= len(self.body):
            raise self.error("a trailing backslash")
        c = self.body[self.i + 1]
        self.i += 2
        shorthand = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if c in shorthand:
            return ("ranges", shorthand[c])
        if c in "DWS":
            if not outside:
                raise self.error(f"\\{c} inside a character class is not supported")
            return ("negated", _negated(shorthand[c.lower()]))
        if c == "b" and not outside:
            return 0x08
        if c in "bB":
            raise self.error("word boundaries (\\b, \\B) are not supported")
        if c.isdigit() and c != "0":
            raise self.error("back-references are not supported")
        if c in "kpPc":
            raise self.error(f"\\{c} escapes are not supported")
        if c == "0":
            if self.peek().isdigit():
                raise self.error("octal escapes are not supported")
            return 0
        if c in _CHAR_ESCAPES:
            return ord(_CHAR_ESCAPES[c])
        if c in "xu":
            n = 2 if c == "x" else 4
            digits = self.peek(n)
            if not re.fullmatch("[0-9a-fA-F]{%d}" % n, digits):
                raise self.error(f"\\{c} needs {n} hex digits (\\u{{...}} needs the u flag, which JSON Schema has not)")
            self.i += n
            code = int(digits, 16)
            low = re.match(r"\\u([dD][c-fC-F][0-9a-fA-F]{2})", self.body[self.i:])
            if 0xD800 <= code < 0xDC00 and low:
                self.i += 6
                code = 0x10000 + ((code - 0xD800) << 10) + (int(low[1], 16) - 0xDC00)
            return code
        if c.isalnum():
            raise self.error(f"an unknown escape \\{c}")
        return ord(c)

    def char_class(self) -> str:
        self.i += 1
        negated = self.peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        while True:
            if self.i >= len(self.body):
                raise self.error("an unbalanced '['")
            if self.peek() == "]":
                self.i += 1
                break
            lo = self.class_atom()
            if isinstance(lo, tuple):
                ranges += lo[1]
                continue
            if self.peek() == "-" and self.peek(2) not in ("-]", "-") and self.i + 1 < len(self.body):
                self.i += 1
                hi = self.class_atom()
                if isinstance(hi, tuple) or hi < lo:
                    raise self.error("a character range out of order or ending in a class escape")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        if not ranges:
            raise self.error("an empty character class, which matches nothing")
        return _negated(tuple(ranges)) if negated else _positive(tuple(ranges))

    def class_atom(self):
        if self.peek() == "\\":
            return self.class_escape()
        c = self.body[self.i]
        self.i += 1
        return ord(c)


def _merge(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _class_text(ranges) -> str:
    return "".join(class_char(chr(lo)) if lo == hi else f"{class_char(chr(lo))}-{class_char(chr(hi))}"
                   for lo, hi in ranges)


def _negated(ranges) -> str:
    """A class of everything outside ``ranges`` that a JSON string may hold unescaped."""
    return f"[^{_class_text(_merge(tuple(ranges) + _JSON_ESCAPED))}]"


def _escaped(code: int) -> str:
    """The JSON escape for ``code`` (a character a JSON string must escape), as pattern text."""
    short = _SHORT_ESCAPES.get(code)
    second = f"[{class_char(short)}]" if short in ('"', "\\") else short or f"u{code:04x}"
    return f"([\\x5C]{second})"


def _positive(ranges) -> str:
    """A class of ``ranges``, as JSON text: characters a JSON string must escape come out as their escapes."""
    merged = _merge(ranges)
    special = [c for lo, hi in merged for c in range(lo, min(hi, 0x5C) + 1) if c <= 0x1F or c in (0x22, 0x5C)]
    plain = merged
    for a, b in _JSON_ESCAPED:
        plain = [p for x, y in plain for p in ((x, min(y, a - 1)), (max(x, b + 1), y)) if p[0] <= p[1]]
    alternatives = ([f"[{_class_text(plain)}]"] if plain else []) + [_escaped(c) for c in special]
    return alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"


def _literal(c: str) -> str:
    """One pattern character as converter input that writes it as JSON text."""
    code = ord(c)
    if c in _SAFE_LITERAL or (code >= 0x80 and code not in (0x2028, 0x2029)):
        return c
    if code <= 0x1F or code in (0x22, 0x5C):
        return _escaped(code)
    return f"[{class_char(c)}]"
