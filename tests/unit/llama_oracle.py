"""llama.cpp's own grammar engine as the tests' judge of a grammar: whether it compiles, and whether the model may
write a text under it and then end (through a vocab-only model: no weights are needed to sample under a grammar)."""
from __future__ import annotations

import ctypes

import llama_cpp as C

from homepd.core.sampling import Grammar
from homepd.llm import LlamaModel


def sampler(model: LlamaModel, grammar: Grammar):
    gbnf, root = grammar.gbnf.encode(), grammar.root.encode()
    if not grammar.is_lazy:
        return C.llama_sampler_init_grammar(model._vocab, gbnf, root)
    patterns = (ctypes.c_char_p * len(grammar.trigger_patterns))(*[p.encode() for p in grammar.trigger_patterns])
    return C.llama_sampler_init_grammar_lazy_patterns(model._vocab, gbnf, root, patterns, len(patterns), None, 0)


def compiles(model: LlamaModel, grammar: Grammar) -> bool:
    smpl = sampler(model, grammar)
    if smpl:
        C.llama_sampler_free(smpl)
    return bool(smpl)


def accepts(model: LlamaModel, grammar: Grammar, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets the model write ``text`` and then end (each token is checked
    with apply before it is accepted: accepting a refused token aborts the process)."""
    smpl = sampler(model, grammar)
    assert smpl
    cell = (C.llama_token_data * 1)()
    candidates = C.llama_token_data_array(cell, 1, -1, False)

    def allowed(token: int) -> bool:
        cell[0].id, cell[0].logit, cell[0].p = token, 0.0, 0.0
        candidates.size, candidates.selected = 1, -1
        C.llama_sampler_apply(smpl, ctypes.byref(candidates))
        return cell[0].logit != float("-inf")

    try:
        for token in model.tokenize(text, add_special=False, parse_special=False):
            if not allowed(token):
                return False
            C.llama_sampler_accept(smpl, token)
        return allowed(model.eos_id)
    finally:
        C.llama_sampler_free(smpl)
