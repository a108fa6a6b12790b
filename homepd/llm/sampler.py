"""A request's sampler on llama.cpp's sampler chain (``llama_sampler_chain_*``), in C.

The chain is top-k, top-p, min-p, temperature and the seeded distribution
(greedy: argmax), each added only when it does something; logit bias and
penalties go before it, written in place into the logits row on just the
tokens they concern (llama.cpp's penalties sampler scans the whole vocabulary
through a hash map: 3.6 ms a token at 49k).  ``homepd.fakellm.
ReferenceSampler`` is the same semantics in numpy.  A grammar runs as llama.cpp's common sampler runs it:
the chain samples first, the grammar checks that one token, and only when it
refuses is the grammar applied to the whole vocabulary and the chain run again
(llama.cpp ``common_sampler_sample``), so a grammar costs one token check on
most steps.  Plain greedy (nothing that moves the argmax) is one numpy argmax.

A sampler lives in one process: it holds C state, so a request that moves (a
KV handoff, a resume) gets a new one built from its parameters and the tokens
it generated so far (``history``: replayed into the penalties and the grammar;
the seed is derived from the count, ``homepd.core.sampling.derived_seed``).
"""
from __future__ import annotations

import ctypes

import numpy as np

import llama_cpp as C

from homepd.core.sampling import Grammar, SamplingParams, bias_and_penalize, derived_seed
from homepd.errors import RequestError, WorkerError
from homepd.structured.gbnf import GbnfError, check as gbnf_check

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
assert _TOKEN_DATA.itemsize == ctypes.sizeof(C.llama_token_data)


def grammar_sampler(vocab, grammar: Grammar):
    """llama.cpp's grammar sampler for ``grammar`` on ``vocab`` (a ``llama_vocab`` pointer); RequestError
    when llama.cpp cannot parse it, or could not survive it (checked first, in pure code: a client's grammar
    left-recursive through a rule that may be empty grows llama.cpp's stacks until the OOM killer ends the
    process).  The caller owns the result (``llama_sampler_free``)."""
    try:
        gbnf_check(grammar.gbnf)
    except GbnfError as exc:
        raise RequestError(f"the {grammar.origin} grammar cannot be used: {exc}") from None
    gbnf, root = grammar.gbnf.encode("utf-8"), grammar.root.encode("utf-8")
    if grammar.is_lazy:
        patterns = (ctypes.c_char_p * len(grammar.trigger_patterns))(
            *[p.encode("utf-8") for p in grammar.trigger_patterns])
        smpl = C.llama_sampler_init_grammar_lazy_patterns(vocab, gbnf, root, patterns, len(patterns), None, 0)
    else:
        smpl = C.llama_sampler_init_grammar(vocab, gbnf, root)
    if not smpl:
        raise RequestError(f"the {grammar.origin} grammar does not parse in llama.cpp (GBNF syntax error or "
                           "an undefined rule)")
    return smpl


class CandidateBuffer:
    """One vocabulary-sized ``llama_token_data`` array per context, refilled from a logits row (the grammar
    path needs the whole vocabulary in an array it can cut)."""

    def __init__(self, n_vocab: int):
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.array = C.llama_token_data_array(
            data=self.data.ctypes.data_as(C.llama_token_data_p), size=n_vocab, selected=-1, sorted=False)

    def fill(self, logits: np.ndarray):
        self.data["id"] = self.ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        a = self.array
        a.data, a.size, a.selected, a.sorted = self.data.ctypes.data_as(C.llama_token_data_p), self.data.size, -1, False
        return ctypes.byref(a)

    def selected(self) -> int:
        a = self.array
        if a.selected < 0 or a.selected >= a.size:
            raise WorkerError("the sampler chain selected no token (every candidate was cut)")
        return int(a.data[a.selected].id)


class LlamaSampler:
    """One request's sampler over one ``LlamaContext``'s logits."""

    def __init__(self, ctx, params: SamplingParams, history: tuple[int, ...] = ()):
        self.ctx, self.params = ctx, params
        self.chain = None
        self.grammar = None
        params.check_vocab(ctx.model.n_vocab)
        self.adjusts = bool(params.logit_bias) or params.has_penalties
        # why banned, not skipped: llama-server's ignore_eos biases every end-of-generation token to -inf, so the
        # answer goes on as text; sampled and stepped over, they streamed as nothing, and a benchmark's client saw
        # two or three steps as one gap (chat_bench's rag trace: 240-370 ms where every step took under 140)
        self.banned = ctx.model.eog_ids if params.ignore_eos else None
        self.history: list[int] = []   # generated tokens (the penalties' window)
        if not params.is_plain_greedy:
            self.chain = _chain(params, len(history))
        if params.grammar is not None:
            self.grammar = grammar_sampler(ctx.model._vocab, params.grammar)
        for token in history:
            self.accept(token)

    def close(self) -> None:
        if self.chain is not None:
            C.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar is not None:
            C.llama_sampler_free(self.grammar)
            self.grammar = None

    __del__ = close

    def accept(self, token: int) -> None:
        """``token`` was generated: it enters the penalties' window and advances the grammar."""
        if self.params.has_penalties:
            self.history.append(token)
            if len(self.history) > 2 * self.params.repeat_last_n:
                del self.history[:-self.params.repeat_last_n]
        if self.grammar is not None:
            C.llama_sampler_accept(self.grammar, token)

    def sample(self, row: int) -> int:
        """The next token from batch row ``row`` of the context's last decode, accepted (penalties, grammar).
        Bias, penalties and ``ignore_eos``'s ban are written into the context's logits row (nothing reads it after
        sampling)."""
        logits = self.ctx.logits(row)
        if self.banned is not None:
            logits[self.banned] = -np.inf
        if self.chain is None:
            return int(np.argmax(logits))
        if self.adjusts:
            bias_and_penalize(logits, self.params, self.history)
        if self.grammar is None:
            token = int(C.llama_sampler_sample(self.chain, self.ctx._ctx, row))
        else:
            buf = self.ctx.candidates()
            C.llama_sampler_apply(self.chain, buf.fill(logits))
            token = buf.selected()
            if not self._grammar_allows(token):
                # why: common_sampler_sample's resampling: the grammar first, over the whole vocabulary
                arr = buf.fill(logits)
                C.llama_sampler_apply(self.grammar, arr)
                C.llama_sampler_apply(self.chain, arr)
                token = buf.selected()
        self.accept(token)
        return token

    def _grammar_allows(self, token: int) -> bool:
        one = C.llama_token_data(token, 1.0, 0.0)
        arr = C.llama_token_data_array(data=ctypes.pointer(one), size=1, selected=-1, sorted=False)
        C.llama_sampler_apply(self.grammar, ctypes.byref(arr))
        return arr.data[0].logit != float("-inf")


def _chain(params: SamplingParams, n_generated: int):
    """top-k, top-p, min-p, temperature, the seeded draw (greedy: argmax); bias and penalties come before,
    in place (``bias_and_penalize``)."""
    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    add = lambda smpl: C.llama_sampler_chain_add(chain, smpl)  # noqa: E731
    if params.is_greedy:
        add(C.llama_sampler_init_greedy())
        return chain
    if params.top_k:
        add(C.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(C.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(C.llama_sampler_init_min_p(params.min_p, 1))
    add(C.llama_sampler_init_temp(params.temperature))
    seed = derived_seed(params.seed, n_generated)
    add(C.llama_sampler_init_dist(C.LLAMA_DEFAULT_SEED if seed is None else seed))
    return chain
