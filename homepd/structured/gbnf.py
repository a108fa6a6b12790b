"""GBNF grammars (llama.cpp's format) in pure Python: parsing and a shortest string a grammar accepts.

The fake backend (``homepd.fakellm``) answers a request that carries a grammar with ``shortest(grammar)``; the
tests check, through llama.cpp's own grammar engine, that every grammar homepd writes accepts that string
(``tests/unit/test_grammar_oracle.py``). ``parse`` reads what ``llama_grammar_parser::parse`` reads, except token
references (``<think>``, ``<[1000]>``, ``!<...>``), which need a model's vocabulary and are refused.

A parsed grammar is plain BNF: a group becomes a rule of its own and a repetition a few rules (as llama.cpp
rewrites them, though left-recursive), so one derivation-length computation covers all of the syntax.
"""
from __future__ import annotations

import functools
import heapq
import re
from dataclasses import dataclass
from functools import cached_property
from typing import NoReturn

MAX_REPETITION_THRESHOLD = 2000  # llama.cpp's cap on a repetition count and on the rules one repetition creates
_NAME = re.compile(r"[A-Za-z0-9-]+")
_INT = re.compile(r"[0-9]+")
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_SIMPLE_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
# why: letters first, so a class like [^"\\] gives "a", never a quote, a control character or a space
_PREFERRED = [*range(ord("a"), ord("z") + 1), *range(ord("A"), ord("Z") + 1), *range(ord("0"), ord("9") + 1)]
_PREFERRED += [cp for cp in range(0x21, 0x7F) if cp not in _PREFERRED] + [0x20]


class GbnfError(ValueError):
    """A grammar llama.cpp would refuse, a rule it lacks, or a root that derives no finite string."""


@dataclass(frozen=True)
class CharSet:
    """A terminal: one code point inside ``ranges`` (inclusive pairs), or outside them all when ``is_negated``."""
    ranges: tuple[tuple[int, int], ...]
    is_negated: bool = False

    def matches(self, code_point: int) -> bool:
        for lo, hi in self.ranges:
            if lo <= code_point <= hi:
                return not self.is_negated
        return self.is_negated


ANY_CHAR = CharSet((), is_negated=True)  # `.`
NO_CHAR = CharSet(())  # a token reference (``parse(tokens=True)``): no text derives it


@dataclass(frozen=True)
class Gbnf:
    """A grammar as BNF: ``rules[i]`` holds rule i's alternatives, each a tuple of symbols (a rule index or a CharSet).

    ``names[i]`` is rule i's name. Rules made from groups and repetitions are named ``<owner>_<i>`` (an underscore
    cannot occur in a GBNF name), and ``owners[i]`` is the named rule they were written in."""
    names: tuple[str, ...]
    owners: tuple[str, ...]
    rules: tuple[tuple[tuple[int | CharSet, ...], ...], ...]

    def rule_id(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise GbnfError(f"the grammar has no rule {name!r}") from None

    @cached_property
    def min_lengths(self) -> tuple[int | None, ...]:
        """Each rule's shortest derivation in characters; None where it derives no finite string."""
        return self._settled[0]

    @cached_property
    def _settled(self) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
        return _min_lengths(self)

    @cached_property
    def _choices(self) -> tuple[int | None, ...]:
        return _shortest_alternatives(self, *self._settled)


def parse(text: str, tokens: bool = False) -> Gbnf:
    """Parse GBNF text; a GbnfError names the line, column and what was expected, the undefined rule, or the
    left-recursive one.  ``tokens``: read token references (``<think>``, ``<[1000]>``, ``!<...>``) as terminals
    that match no character (which token a name is needs a vocabulary): to check a grammar's structure before
    llama.cpp sees it; without it they are refused, since no text derives them."""
    return _Parser(text, tokens).grammar()


@functools.lru_cache(maxsize=64)
def check(text: str) -> None:
    """GbnfError unless llama.cpp can be given ``text``: it parses (token references allowed), every rule is defined,
    and no rule is left-recursive in a way llama.cpp refuses or cannot survive (``_left_recursion``)."""
    parse(text, tokens=True)


def shortest(text_or_grammar: str | Gbnf, root: str = "root") -> str:
    """A shortest string ``root`` derives: at each rule the least-length alternative (the first of equals), each
    repetition its minimum count, and for a class of characters a printable one (a-z, A-Z, 0-9, other ASCII)."""
    g = grammar_of(text_or_grammar)
    start = g.rule_id(root)
    if g.min_lengths[start] is None:
        culprits = ", ".join(repr(name) for name in _never_terminating(g, start))
        raise GbnfError(f"rule {root!r} derives no finite string: no alternative of rule {culprits} ever ends "
                        "(each recurses, or needs a character its class excludes)")
    out: list[str] = []
    stack: list[int | CharSet] = [start]
    while stack:  # why: a stack, not recursion, since derivations nest as deep as the grammar recurses
        symbol = stack.pop()
        if isinstance(symbol, CharSet):
            out.append(_pick(symbol))
        else:
            stack.extend(reversed(g.rules[symbol][g._choices[symbol]]))
    return "".join(out)


@functools.lru_cache(maxsize=64)
def _parse_cached(text: str) -> Gbnf:
    return parse(text)


def grammar_of(text_or_grammar: str | Gbnf) -> Gbnf:
    """``text_or_grammar`` parsed (the last 64 texts are kept parsed)."""
    return text_or_grammar if isinstance(text_or_grammar, Gbnf) else _parse_cached(text_or_grammar)


def _min_lengths(g: Gbnf) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """Each rule's least derivation length and an alternative achieving it whose rules were all settled earlier.

    Knuth's generalisation of Dijkstra's algorithm: a rule is settled when the smallest pending alternative is
    popped, and an alternative is pushed once every rule it refers to is settled."""
    uses: list[list[tuple[int, int]]] = [[] for _ in g.rules]
    pending: dict[tuple[int, int], list[int]] = {}  # (rule, alt) -> [unsettled references, length so far]
    heap: list[tuple[int, int, int]] = []
    for rule, alts in enumerate(g.rules):
        for alt, symbols in enumerate(alts):
            if any(isinstance(s, CharSet) and _matches_nothing(s) for s in symbols):
                continue  # a class no character matches: the alternative derives nothing
            refs = [s for s in symbols if not isinstance(s, CharSet)]
            pending[rule, alt] = [len(refs), len(symbols) - len(refs)]
            for ref in refs:
                uses[ref].append((rule, alt))
            if not refs:
                heapq.heappush(heap, (len(symbols), rule, alt))
    lengths: list[int | None] = [None] * len(g.rules)
    via: list[int | None] = [None] * len(g.rules)
    while heap:
        length, rule, alt = heapq.heappop(heap)
        if lengths[rule] is not None:
            continue
        lengths[rule], via[rule] = length, alt
        for user in uses[rule]:
            state = pending[user]
            state[0] -= 1
            state[1] += length
            if state[0] == 0 and lengths[user[0]] is None:
                heapq.heappush(heap, (state[1], *user))
    return tuple(lengths), tuple(via)


def _shortest_alternatives(g: Gbnf, lengths: tuple[int | None, ...],
                           via: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """The alternative ``shortest`` expands for each rule: the first of least length, unless following those
    choices can loop (only through empty alternatives of equal length), where Knuth's settled one is taken."""
    def length_of(symbols):
        parts = [(None if _matches_nothing(s) else 1) if isinstance(s, CharSet) else lengths[s] for s in symbols]
        return None if None in parts else sum(parts)

    first = [None if lengths[r] is None else next(a for a, alt in enumerate(alts) if length_of(alt) == lengths[r])
             for r, alts in enumerate(g.rules)]
    children = [() if a is None else [s for s in g.rules[r][a] if not isinstance(s, CharSet)]
                for r, a in enumerate(first)]
    # why: a rule that can reach a loop switches to its settled alternative, whose rules were settled before it;
    # rules that cannot reach one only lead to rules that cannot either, so no loop is left
    loops = [False] * len(g.rules)
    state = [0] * len(g.rules)  # 0 unvisited, 1 on the depth-first path, 2 done
    for top in range(len(g.rules)):
        if state[top]:
            continue
        state[top], path = 1, [(top, iter(children[top]))]
        while path:
            rule, rest = path[-1]
            for child in rest:
                if state[child] == 0:
                    state[child] = 1
                    path.append((child, iter(children[child])))
                    break
                loops[rule] |= state[child] == 1 or loops[child]
            else:
                state[rule] = 2
                path.pop()
                if path:
                    loops[path[-1][0]] |= loops[rule]
    return tuple(via[r] if loops[r] else first[r] for r in range(len(g.rules)))


def _never_terminating(g: Gbnf, start: int) -> list[str]:
    """The written rules to blame for ``start`` deriving nothing finite: those that recurse in every alternative."""
    lengths = g.min_lengths
    infinite_refs = [{s for alt in alts for s in alt if not isinstance(s, CharSet) and lengths[s] is None}
                     for alts in g.rules]
    reachable, frontier = {start}, [start]
    while frontier:
        for ref in infinite_refs[frontier.pop()] - reachable:
            reachable.add(ref)
            frontier.append(ref)

    def on_a_loop(rule: int) -> bool:
        seen, frontier = set(), list(infinite_refs[rule])
        while frontier:
            r = frontier.pop()
            if r == rule:
                return True
            if r not in seen:
                seen.add(r)
                frontier.extend(infinite_refs[r])
        return False

    blamed = [r for r in sorted(reachable) if not infinite_refs[r] or on_a_loop(r)]
    return list(dict.fromkeys(g.owners[r] for r in blamed))


@functools.lru_cache(maxsize=4096)
def _pick(chars: CharSet) -> str:
    """The character ``shortest`` writes for a class: preferred printable ASCII, else the first printable one."""
    for cp in _PREFERRED:
        if chars.matches(cp):
            return chr(cp)
    cp = _next_allowed(chars, 0x80)
    for _ in range(1 << 16):
        if cp is None or chr(cp).isprintable():
            break
        cp = _next_allowed(chars, cp + 1)
    if cp is None or not chr(cp).isprintable():
        cp = _next_allowed(chars, 0)  # only control characters (or nothing printable nearby): the grammar wants one
    assert cp is not None, "an empty class has no finite derivation, so shortest never picks from it"
    return chr(cp)


def _next_allowed(chars: CharSet, cp: int) -> int | None:
    """The least code point from ``cp`` on that ``chars`` matches, None if none up to U+10FFFF does."""
    while cp <= 0x10FFFF:
        if chars.matches(cp):
            return cp
        if chars.is_negated:
            cp = max(hi for lo, hi in chars.ranges if lo <= cp <= hi) + 1
        else:
            cp = min((lo for lo, _ in chars.ranges if lo > cp), default=0x110000)
    return None


@functools.lru_cache(maxsize=4096)
def _matches_nothing(chars: CharSet) -> bool:
    return _next_allowed(chars, 0) is None


@functools.lru_cache(maxsize=4096)
def _literal(cp: int) -> CharSet:
    return CharSet(((cp, cp),))


def _left_recursion(rules: list[list[list]]) -> int | None:
    """A left-recursive rule that llama.cpp cannot take, or None.

    llama.cpp refuses a rule that can begin with itself (``llama_grammar_detect_left_recursion``), counting a rule
    as possibly empty only when one of its alternatives is empty.  A rule empty only by way of others
    (``e ::= "a"?``) passes that check, and then: at the end of an alternative (a tail call) its stacks repeat
    and llama.cpp's set of seen stacks ends the loop (``("a"?)*`` works), but with anything after it each turn
    pushes one more element, and the stacks grow without end (measured: ``root ::= e root "x"`` took 24 GB in a
    few seconds, then the OOM killer).  Both are refused here, and nothing else is."""
    direct = [any(not alt for alt in alts) for alts in rules]
    nullable = direct[:]
    changed = True
    while changed:
        changed = False
        for rule, alts in enumerate(rules):
            if not nullable[rule] and any(all(not isinstance(x, CharSet) and nullable[x] for x in alt) for alt in alts):
                nullable[rule] = changed = True

    def edges(empty: list[bool]) -> list[list[tuple[int, bool]]]:
        """Each rule's leftmost references (after symbols that ``empty`` says may be empty), and whether a symbol
        follows the reference in its alternative (the stack grows when llama.cpp enters it)."""
        out = []
        for alts in rules:
            heads = []
            for alt in alts:
                for i, symbol in enumerate(alt):
                    if isinstance(symbol, CharSet):
                        break
                    heads.append((symbol, i + 1 < len(alt)))
                    if not empty[symbol]:
                        break
            out.append(heads)
        return out

    # an edge rule → head lies on a cycle when both ends are in one strongly connected component (a self-loop too)
    as_llama = edges(direct)
    component = _components(as_llama)
    for rule, heads in enumerate(as_llama):
        if any(component[head] == component[rule] for head, _ in heads):
            return rule
    as_stacks = edges(nullable)
    component = _components(as_stacks)
    for rule, heads in enumerate(as_stacks):
        if any(grows and component[head] == component[rule] for head, grows in heads):
            return rule
    return None


def _components(graph: list[list[tuple[int, bool]]]) -> list[int]:
    """Tarjan's strongly connected components (each rule's component number), with a stack instead of recursion:
    leftmost chains may be deeper than Python's recursion limit."""
    n = len(graph)
    index, low, component = [-1] * n, [0] * n, [-1] * n
    on_stack, stack, counter, n_components = [False] * n, [], 0, 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            else:
                w = graph[v][i - 1][0]
                low[v] = min(low[v], low[w])
            for j in range(i, len(graph[v])):
                w = graph[v][j][0]
                if index[w] < 0:
                    work.append((v, j + 1))
                    work.append((w, 0))
                    break
                if on_stack[w]:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    while True:
                        w = stack.pop()
                        on_stack[w] = False
                        component[w] = n_components
                        if w == v:
                            break
                    n_components += 1
    return component


class _Parser:
    """Recursive descent over the text, following llama.cpp's parse_rule / parse_alternates / parse_sequence."""

    def __init__(self, text: str, tokens: bool = False):
        self.text, self.pos, self.tokens = text, 0, tokens
        self.names: list[str] = []
        self.owners: list[str] = []
        self.rules: list[list[list] | None] = []
        self.ids: dict[str, int] = {}  # named rules only
        self.first_use: dict[int, int] = {}  # rule -> where it was first referred to

    def grammar(self) -> Gbnf:
        self._space(newline_ok=True)
        while self.pos < len(self.text):
            self._rule()
        for rule, alts in enumerate(self.rules):
            if alts is None:
                line, column = self._where(self.first_use[rule])
                raise GbnfError(f"undefined rule {self.names[rule]!r} (referred to at line {line}, column {column})")
        recursing = _left_recursion(self.rules)
        if recursing is not None:
            raise GbnfError(f"rule {self.owners[recursing]!r} is left-recursive (it can begin with itself), which "
                            "llama.cpp's grammar engine does not support: put the recursion after a first character")
        return Gbnf(tuple(self.names), tuple(self.owners), tuple(tuple(map(tuple, alts)) for alts in self.rules))

    def _rule(self) -> None:
        name = self._name()
        self._space(newline_ok=False)
        if not self.text.startswith("::=", self.pos):
            self._fail("'::='")
        self.pos += 3
        self._space(newline_ok=True)
        rule = self._named(name)
        self.rules[rule] = self._alternates(name)  # a second definition replaces the first, as in llama.cpp
        if self.text.startswith("\r\n", self.pos):
            self.pos += 2
        elif self._peek() in ("\r", "\n"):
            self.pos += 1
        elif self._peek():
            self._fail("a newline or the end of the grammar")
        self._space(newline_ok=True)

    def _alternates(self, owner: str) -> list[list]:
        """A rule's alternatives, each a list of symbols, up to the end of its body.

        A group pushes the sequence it interrupts onto a stack instead of recursing: the JSON-schema converter
        writes a string's maxLength n as n nested groups, deeper than Python's recursion limit allows."""
        open_groups: list[tuple[list, list, int, int]] = []  # enclosing (alts, seq, group rule, rules before it)
        alts: list[list] = []
        seq: list[int | CharSet] = []
        last = 0  # where the item a repetition suffix applies to begins; len(seq) when there is none
        n_prev_rules = 1  # llama.cpp's count of the rules that repeating that item copies
        while True:
            c, at = self._peek(), self.pos
            if c == '"':
                self.pos += 1
                last, n_prev_rules = len(seq), 1
                while self._peek() != '"':
                    if not self._peek():
                        self._fail("'\"' to end the string")
                    seq.append(_literal(self._char()))
            elif c == "[":
                last, n_prev_rules = len(seq), 1
                chars = self._class()
                if chars is not None:
                    seq.append(chars)
            elif c in ("<", "!"):
                if not self.tokens:
                    self._fail("a string, class, rule name or group (token references such as <think> or "
                               "<[1000]> need a model's vocabulary and are not supported here)")
                last, n_prev_rules = len(seq), 1
                seq.append(self._token())
            elif _NAME.match(self.text, at):
                last, n_prev_rules = len(seq), 1
                seq.append(self._named(self._name(), refer=True))
                self._space(newline_ok=bool(open_groups))
                continue
            elif c == "(":
                self.pos += 1
                self._space(newline_ok=True)
                rules_before = len(self.rules)
                open_groups.append((alts, seq, self._new_rule(owner), rules_before))
                alts, seq, last = [], [], 0
                continue
            elif c == ".":
                last, n_prev_rules = len(seq), 1
                seq.append(ANY_CHAR)
            elif c in ("*", "+", "?", "{"):
                low, high = self._counts(nested=bool(open_groups))
                if last == len(seq):
                    self._fail(f"an item before {c!r}", at)
                seq[last:], n_prev_rules = self._repeat(owner, seq[last:], low, high, n_prev_rules, at)
                continue
            elif c == "|":
                alts.append(seq)
                seq, last = [], 0
                self.pos += 1
                self._space(newline_ok=True)
                continue
            else:
                alts.append(seq)
                if not open_groups:
                    return alts
                if c != ")":
                    self._fail("')'")
                outer_alts, outer_seq, group, rules_before = open_groups.pop()
                self.rules[group] = alts
                alts, seq = outer_alts, outer_seq
                last, n_prev_rules = len(seq), max(1, len(self.rules) - rules_before)
                seq.append(group)
            self.pos += 1
            self._space(newline_ok=bool(open_groups))

    def _counts(self, nested: bool) -> tuple[int, int | None]:
        """The bounds of the repetition suffix at pos (``*`` ``+`` ``?`` ``{m}`` ``{m,}`` ``{m,n}``); None: no bound."""
        c, at = self._peek(), self.pos
        self.pos += 1
        self._space(nested)
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        low = self._int()
        self._space(nested)
        if self._peek() == "}":
            high = low
        elif self._peek() == ",":
            self.pos += 1
            self._space(nested)
            high = self._int() if _INT.match(self.text, self.pos) else None
            self._space(nested)
            if self._peek() != "}":
                self._fail("'}'")
        else:
            self._fail("',' or '}'")
        self.pos += 1
        self._space(nested)
        if low > MAX_REPETITION_THRESHOLD:
            self._fail(f"a repetition count of at most {MAX_REPETITION_THRESHOLD}", at)
        if high is not None and high > MAX_REPETITION_THRESHOLD:
            high = None  # why: llama.cpp reads a larger maximum as no maximum
        if high is not None and high < low:
            self._fail(f"a maximum of at least the minimum {low}", at)
        return low, high

    def _repeat(self, owner: str, item: list, low: int, high: int | None, n_prev_rules: int, at: int):
        """``item`` repeated low..high times (high None: no bound), as symbols and the rules they refer to, written
        as llama.cpp's ``handle_repetitions`` writes them: ``item`` low times, then for no bound R ::= item R | "",
        else a chain of high - low optional copies, Rk ::= item Rk-1 | "" (R1 ::= item | "")."""
        total = high if high else (low or 1)
        if n_prev_rules * total > MAX_REPETITION_THRESHOLD:
            self._fail(f"a repetition that creates at most {MAX_REPETITION_THRESHOLD} rules", at)
        symbols = item * low
        n_optional = 1 if high is None else high - low
        last = None
        for _ in range(n_optional):
            rest = self._new_rule(owner)
            tail = [rest] if high is None else [] if last is None else [last]
            self.rules[rest] = [[*item, *tail], []]
            last = rest
        return symbols + ([last] if last is not None else []), n_prev_rules * total

    def _token(self) -> CharSet:
        """A token reference, as llama.cpp's ``parse_token`` reads one: a terminal no character matches."""
        self.pos += self._peek() == "!"
        if self._peek() != "<":
            self._fail("'<' to start a token")
        self.pos += 1
        if self._peek() == "[":
            self.pos += 1
            self._int()
            if self._peek() != "]":
                self._fail("']'")
            self.pos += 1
        else:
            while self._peek() not in ("", ">"):
                self.pos += 1
        if self._peek() != ">":
            self._fail("'>' to end the token")
        return NO_CHAR  # the '>' is consumed with the item, as a class's ']'


    def _class(self) -> CharSet | None:
        """A character class; None for ``[]`` or ``[^]``, which llama.cpp reads as nothing at all (no element: it
        derives the empty string, and a repetition after it has no item to repeat)."""
        self.pos += 1
        is_negated = self._peek() == "^"
        self.pos += is_negated
        ranges = []
        while self._peek() != "]":
            if not self._peek():
                self._fail("']' to end the character class")
            lo = hi = self._char()
            if self._peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("", "]"):
                self.pos += 1
                hi = self._char()
            ranges.append((lo, hi))
        return CharSet(tuple(ranges), is_negated) if ranges else None

    def _char(self) -> int:
        c = self._peek()
        if c != "\\":
            self.pos += 1
            return ord(c)
        escape = self.text[self.pos + 1:self.pos + 2]
        if escape in _HEX_DIGITS:
            n_digits = _HEX_DIGITS[escape]
            digits = self.text[self.pos + 2:self.pos + 2 + n_digits]
            if len(digits) != n_digits or not all(d in "0123456789abcdefABCDEF" for d in digits):
                self._fail(f"{n_digits} hex digits after '\\{escape}'", self.pos + 2)
            if int(digits, 16) > 0x10FFFF:
                self._fail("a code point up to U+10FFFF", self.pos)
            self.pos += 2 + n_digits
            return int(digits, 16)
        if escape in _SIMPLE_ESCAPES:
            self.pos += 2
            return ord(_SIMPLE_ESCAPES[escape])
        self._fail("an escape: \\n \\r \\t \\\\ \\\" \\[ \\] \\- \\xHH \\uHHHH or \\UHHHHHHHH", self.pos)

    def _name(self) -> str:
        match = _NAME.match(self.text, self.pos)
        if not match:
            self._fail("a rule name (letters, digits, '-')")
        self.pos = match.end()
        return match.group()

    def _int(self) -> int:
        match = _INT.match(self.text, self.pos)
        if not match:
            self._fail("an integer")
        self.pos = match.end()
        return int(match.group())

    def _named(self, name: str, refer: bool = False) -> int:
        rule = self.ids.get(name)
        if rule is None:
            rule = self.ids[name] = self._new_rule(name, name=name)
        if refer:
            self.first_use.setdefault(rule, self.pos - len(name))
        return rule

    def _new_rule(self, owner: str, name: str | None = None) -> int:
        self.names.append(name or f"{owner}_{len(self.names)}")
        self.owners.append(owner)
        self.rules.append(None)
        return len(self.rules) - 1

    def _space(self, newline_ok: bool) -> None:
        text, pos = self.text, self.pos
        while pos < len(text):
            if text[pos] == "#":
                while pos < len(text) and text[pos] not in "\r\n":
                    pos += 1
            elif text[pos] in " \t" or (newline_ok and text[pos] in "\r\n"):
                pos += 1
            else:
                break
        self.pos = pos

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _where(self, pos: int) -> tuple[int, int]:
        line_start = self.text.rfind("\n", 0, pos) + 1
        return self.text.count("\n", 0, pos) + 1, pos - line_start + 1

    def _fail(self, expected: str, pos: int | None = None) -> NoReturn:
        pos = self.pos if pos is None else pos
        line, column = self._where(pos)
        found = repr(self.text[pos]) if pos < len(self.text) else "the end of the grammar"
        raise GbnfError(f"GBNF syntax error at line {line}, column {column}: expected {expected}, found {found}")


def class_char(c: str) -> str:
    """``c`` inside a GBNF character class (hex-escaped, so no character is special)."""
    n = ord(c)
    return f"\\x{n:02X}" if n < 0x100 else f"\\u{n:04X}" if n < 0x10000 else f"\\U{n:08X}"
