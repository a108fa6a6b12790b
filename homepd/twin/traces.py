"""The campaign's seeded traces as the twin takes them: (rate, seed) -> requests with their prompts' token ids.

A seed's prompts and output lengths do not depend on the rate (``homepd.measure.trace.generate`` draws them from
their own streams), so each seed's prompts are tokenized once, by the engine's own template and tokenizer (so that
the simulated prefix cache finds what the real one finds), and every rate only moves the arrivals.
"""
from __future__ import annotations

from typing import Callable

from homepd.twin.sim import SimRequest
from homepd.measure.trace import Trace, TraceRequest

TWIN_TAG = "[twin] "   # every simulated run's requests share it, as a probe's requests share their probe's tag


class TraceRequests:
    """``make(rate, n_requests, seed)``: the campaign's trace; ``tokenize(request)``: its prompt's token ids."""

    def __init__(self, make: Callable[[float, int, int], Trace], n_requests: int,
                 tokenize: Callable[[TraceRequest], tuple[int, ...]]):
        self.make, self.n_requests, self.tokenize = make, n_requests, tokenize
        self._ids: dict[int, list[tuple[int, ...]]] = {}
        self._cache: dict[tuple, tuple[int, ...]] = {}

    def prepare(self, seeds) -> None:
        """Tokenize these seeds' prompts now (before the twin's processes fork: they share the result)."""
        for seed in seeds:
            self._prompts(seed)

    def _prompts(self, seed: int) -> list[tuple[int, ...]]:
        if seed not in self._ids:
            trace = self.make(1.0, self.n_requests, seed)
            out = []
            for r in trace:
                key = (r.prompt, tuple(tuple(sorted(m.items())) for m in r.messages or ()))
                if key not in self._cache:
                    self._cache[key] = tuple(self.tokenize(r))
                out.append(self._cache[key])
            self._ids[seed] = out
        return self._ids[seed]

    def __call__(self, rate_rps: float, seed: int) -> list[SimRequest]:
        trace = self.make(rate_rps, self.n_requests, seed)
        return of_trace(trace, self._prompts(seed))


def of_trace(trace: Trace, prompt_ids: list[tuple[int, ...]]) -> list[SimRequest]:
    """``trace``'s requests with these token ids (one per request, in order)."""
    return [SimRequest(r.arrival_s, ids, r.max_tokens, r.request_class) for r, ids in zip(trace, prompt_ids)]
