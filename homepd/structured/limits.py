"""What one request's JSON schemas may add up to before homepd writes them into a grammar: the limits (each
with its reason) and the ``Budget`` a request's schemas share.  Checked before any conversion, so an oversized
schema is refused in milliseconds (``homepd.structured.schema``)."""
from __future__ import annotations

from homepd.errors import RequestError

INTEGRAL_DIGITS = 16           # the converter's integer rule writes at most 16 digits
MAX_SCHEMA_DEPTH = 32          # JSON nesting (~16 nested objects; OpenAI allows 10): recursion in the checker,
                               # the converter and llama.cpp's grammar stacks grows with it
MAX_SCHEMA_PROPERTIES = 1_000  # in all: each property adds rules, and a grammar of more compiles slowly
MAX_SCHEMA_VALUES = 20_000     # JSON values in all (keys' values, list items)
MAX_SCHEMA_CHARS = 128 * 1024  # characters of keys and strings: about the JSON text's size
MAX_REPEAT = 1_000             # minItems/maxItems/minLength/maxLength and a pattern's {n,m}: the converter writes
                               # a repetition out (nested groups); llama.cpp's own {m,n} silently drops a bound > 2000
MAX_REPEAT_TOTAL = 20_000      # all of a request's repetitions together
MAX_ONE_OF = 64                # oneOf alternatives (each pair is checked to be disjoint)
MAX_PROPERTY_NAME = 256        # characters: the rule keeping extra keys apart from declared ones recurses per one


class Budget:
    """What one request's schemas may add up to (its tools share one)."""

    def __init__(self):
        self.values = self.properties = self.chars = self.repeats = 0

    def repeat(self, n: int, path: str) -> None:
        self.repeats += n
        if self.repeats > MAX_REPEAT_TOTAL:
            raise RequestError(f"{path}: the request's repetitions (minItems, maxItems, minLength, maxLength, "
                               f"pattern counts) add up to more than {MAX_REPEAT_TOTAL}, the most homepd writes "
                               "into a grammar")
