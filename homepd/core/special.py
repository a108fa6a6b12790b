"""A tokenizer's control tokens, as backends describe them to the prompt tokenizer (``homepd.engine.prompt``)."""
from __future__ import annotations

from typing import NamedTuple


class SpecialToken(NamedTuple):
    """A token that only ``parse_special=True`` turns text into (llama.cpp's CONTROL and UNKNOWN tokens).

    ``lstrip``/``rstrip``: the whitespace left/right of it is dropped when it is matched (llama.cpp's
    LLAMA_TOKEN_ATTR_LSTRIP/RSTRIP)."""
    text: str
    id: int
    lstrip: bool = False
    rstrip: bool = False
