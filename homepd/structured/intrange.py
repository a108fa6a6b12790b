"""JSON integers in a range as GBNF: what a schema's ``minimum``/``maximum`` on an integer becomes in the grammar
(``homepd.llm.grammar``'s converter).  Pure string building, tested against a regex over every integer in range
(``tests/unit/test_grammar.py``)."""
from __future__ import annotations

from homepd.structured.limits import INTEGRAL_DIGITS


def int_range_gbnf(lo: int | None, hi: int | None) -> str:
    """GBNF for the JSON integers in [lo, hi] (None: unbounded), at most 16 digits, as llama.cpp's C++
    ``build_min_max_int``, except that its recursion on a lower bound keeps the digits' width (llama.cpp's
    ``stoll(min_s.substr(1))`` drops the zeros, so its ``minimum: 100`` admits 10)."""
    cap = 10 ** INTEGRAL_DIGITS - 1
    if hi is not None and hi >= cap:
        hi = None
    if lo is not None and lo <= -cap:
        lo = None
    if lo is None and hi is None:
        return '"-"? ([0] | [1-9] [0-9]{0,15})'
    # why: a one-sided bound of 15+ digits has no room for the longer numbers its single-bound rule writes
    if hi is None and lo >= 10 ** (INTEGRAL_DIGITS - 2):
        hi = cap
    if lo is None and hi <= -10 ** (INTEGRAL_DIGITS - 2):
        lo = -cap
    out: list[str] = []
    _min_max_int(lo, hi, out)
    return "".join(out)


def _digits(lo: int, hi: int | None, out: list[str]) -> None:
    out.append("[" + (str(lo) if lo == hi else f"{lo}-{hi}") + "]")


def _more_digits(lo: int, hi: int, out: list[str]) -> None:
    out.append("[0-9]" + ("" if lo == hi == 1 else "{%d}" % lo if lo == hi else "{%d,%d}" % (lo, hi)))


def _min_max_int(lo: int | None, hi: int | None, out: list[str]) -> None:
    less = INTEGRAL_DIGITS - 1
    if lo is not None and hi is not None:
        if lo < 0 and hi < 0:
            out.append('"-" (')
            _min_max_int(-hi, -lo, out)
            out.append(")")
            return
        if lo < 0:
            out.append('"-" (')
            _min_max_int(0, -lo, out)
            out.append(") | ")
            lo = 0
        low, high = str(lo), str(hi)
        for n_digits in range(len(low), len(high)):
            _uniform_range(low, "9" * n_digits, out)
            low = "1" + "0" * n_digits
            out.append(" | ")
        _uniform_range(low, high, out)
    elif lo is not None:
        if lo < 0:
            out.append('"-" (')
            _min_max_int(0, -lo, out)
            out.append(") | [0] | [1-9] ")
            _more_digits(0, less, out)
        else:
            _at_least(str(lo), INTEGRAL_DIGITS, True, out)
    elif hi >= 0:
        out.append('"-" [1-9] ')
        _more_digits(0, less, out)
        out.append(" | ")
        _min_max_int(0, hi, out)
    else:
        out.append('"-" (')
        _at_least(str(-hi), INTEGRAL_DIGITS, True, out)
        out.append(")")


def _at_least(low: str, n_left: int, top: bool, out: list[str]) -> None:
    """Digit strings >= ``low`` taken as numbers of ``low``'s width or longer (top: with no leading zero, i.e.
    the integers >= low), at most ``n_left`` digits."""
    less = max(n_left - 1, 1)
    first = "1" if top else "0"
    if top and low == "0":
        out.append("[0] | [1-9] ")
        _more_digits(0, less, out)
        return
    if not top and not low.strip("0"):
        _more_digits(len(low), n_left, out)
        return
    c = int(low[0])
    if c > int(first):
        _digits(int(first), c - 1, out)
        out.append(" ")
        _more_digits(len(low), less, out)
        out.append(" | ")
    if len(low) == 1:
        _digits(c, 9, out)
        out.append(" ")
        _more_digits(0, less, out)
        return
    _digits(c, c, out)
    out.append(" (")
    _at_least(low[1:], less, False, out)
    out.append(")")
    if c < 9:
        out.append(" | ")
        _digits(c + 1, 9, out)
        out.append(" ")
        _more_digits(len(low) - 1, less, out)


def _uniform_range(low: str, high: str, out: list[str]) -> None:
    """The digit strings from ``low`` to ``high``, of the same length (llama.cpp's ``uniform_range``)."""
    i = 0
    while i < len(low) and low[i] == high[i]:
        i += 1
    if i > 0:
        out.append(f'"{low[:i]}"')
    if i == len(low):
        return
    if i > 0:
        out.append(" ")
    n_rest = len(low) - i - 1
    if n_rest == 0:
        out.append(f"[{low[i]}-{high[i]}]")
        return
    low_rest, high_rest = low[i + 1:], high[i + 1:]
    zeros, nines = "0" * n_rest, "9" * n_rest
    a, b = int(low[i]), int(high[i])
    reached = False
    out.append("(")
    if low_rest == zeros:
        _digits(a, b - 1, out)
        out.append(" ")
        _more_digits(n_rest, n_rest, out)
    else:
        out.append(f"[{a}] (")
        _uniform_range(low_rest, nines, out)
        out.append(")")
        if a < b - 1:
            out.append(" | ")
            if high_rest == nines:
                _digits(a + 1, b, out)
                reached = True
            else:
                _digits(a + 1, b - 1, out)
            out.append(" ")
            _more_digits(n_rest, n_rest, out)
    if not reached:
        out.append(" | ")
        _digits(b, b, out)
        out.append(" ")
        _uniform_range(zeros, high_rest, out)
    out.append(")")

