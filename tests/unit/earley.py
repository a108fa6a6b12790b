"""An Earley recogniser over homepd's parsed GBNF (``homepd.structured.gbnf``): the tests' check that the pure
parser and ``shortest`` read a grammar as written.  Not an oracle for the grammars homepd writes: that is llama.cpp's
own grammar engine (``test_grammar_oracle.py``)."""
from __future__ import annotations

from homepd.structured.gbnf import CharSet, Gbnf, grammar_of


def accepts(text_or_grammar: str | Gbnf, s: str, root: str = "root") -> bool:
    """Whether ``root`` derives exactly ``s``: an Earley recogniser, with Aycock and Horspool's rule for empty rules."""
    g = grammar_of(text_or_grammar)
    start, rules = g.rule_id(root), g.rules
    nullable = [length == 0 for length in g.min_lengths]
    items: list[set[tuple[int, int, int, int]]] = [set() for _ in range(len(s) + 1)]  # (rule, alt, dot, origin)
    waiting: list[dict[int, list]] = [{} for _ in range(len(s) + 1)]  # position -> rule -> items expecting it
    items[0].update((start, alt, 0, 0) for alt in range(len(rules[start])))
    for i in range(len(s) + 1):
        here, waiting_here = items[i], waiting[i]
        code_point = ord(s[i]) if i < len(s) else -1
        agenda = list(here)
        while agenda:
            item = rule, alt, dot, origin = agenda.pop()
            symbols = rules[rule][alt]
            if dot == len(symbols):
                new = [(r, a, d + 1, o) for r, a, d, o in waiting[origin].get(rule, ())]
            elif isinstance(symbols[dot], CharSet):
                if code_point >= 0 and symbols[dot].matches(code_point):
                    items[i + 1].add((rule, alt, dot + 1, origin))
                continue
            else:
                wanted = symbols[dot]
                if wanted in waiting_here:
                    waiting_here[wanted].append(item)
                    new = []
                else:
                    waiting_here[wanted] = [item]
                    new = [(wanted, a, 0, i) for a in range(len(rules[wanted]))]
                if nullable[wanted]:  # why: a rule that completes empty here may have done so already
                    new.append((rule, alt, dot + 1, origin))
            for x in new:
                if x not in here:
                    here.add(x)
                    agenda.append(x)
        if i < len(s) and not items[i + 1]:
            return False
    return any(r == start and o == 0 and d == len(rules[r][a]) for r, a, d, o in items[len(s)])
