"""Per-request state inside a worker: prompt, progress, outputs, KV bookkeeping, and the request's
own sampler and text stream (the stream travels with it in a KV handoff; the sampler is rebuilt there)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from homepd.core.terms import RequestClass
from homepd.core.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    seq_id: int | None = None        # llama.cpp sequence id while admitted
    n_prefilled: int = 0             # prompt tokens already in the KV cache
    output_ids: list[int] = field(default_factory=list)
    is_finished: bool = False
    sampler: object | None = field(default=None, repr=False)  # the backend's (ctx.new_sampler): RNG, penalties, grammar
    stream: object | None = field(default=None, repr=False)  # held-back text, partial UTF-8: homepd.chat.textstream
    request_class: RequestClass = RequestClass.INTERACTIVE
    deadline_s: float | None = None  # when its first token is due (monotonic): arrival + its class's TTFT budget
    arrival_order: int | None = None  # set by the scheduler when it first sees seq: higher = newer
    n_preemptions: int = 0           # times the full KV context took its cells back (homepd.core.kvpolicy)
    n_reused: int = 0                # prompt tokens taken from a cached prefix, not computed (homepd.core.prefixreuse)
    is_restored: bool = False        # that prefix came from the KV store tier, not the context
    # while waiting: the prompt tokens it is expected to take from a cached prefix when admitted (what the
    # deadline order counts as done; homepd.core.prefixreuse.PrefixReuse.expected_reuse, set on arrival)
    n_expected_reuse: int = 0
    last_token_s: float | None = None  # when its newest token was sampled (the worker's clock)
    gap_broken: bool = False         # a gap between two of its tokens went over its ITL budget here
    n_pauses: int = 0                # times its prefill gave its sequence id to a prompt ahead of it (its KV kept)

    def __post_init__(self):
        self.request_class = RequestClass(self.request_class)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.n_prefilled < len(self.prompt_ids)   # why not n_prompt: read per sequence per step (the twin)

    @property
    def n_ctx_needed(self) -> int:
        """KV cells this request can occupy at most: prompt + outputs (the last output never enters the KV)."""
        return self.n_prompt + self.params.max_tokens - 1

    @property
    def next_decode_pos(self) -> int:
        """Position of the last sampled token, which the next decode step feeds."""
        return self.n_prompt + len(self.output_ids) - 1

    @property
    def n_kv_tokens(self) -> int:
        """Tokens currently held in this sequence's KV cache."""
        n_prompt = len(self.prompt_ids)
        if self.n_prefilled < n_prompt:
            return self.n_prefilled
        n_out = len(self.output_ids)
        return n_prompt + n_out - 1 if n_out else n_prompt

    def pause(self) -> None:
        """Its prefill stops and its sequence id goes (its KV stays, as a cached prefix of its own prompt): it
        waits again, expecting to take back the ``n_prefilled`` tokens it computed."""
        self.n_expected_reuse = self.n_prefilled
        self.n_prefilled = 0
        self.n_reused = 0
        self.is_restored = False
        self.seq_id = None
        self.n_pauses += 1

    def restart_for_recompute(self) -> None:
        """Its KV is gone (preempted): the prompt and the output so far become one prompt to prefill again,
        with what is left of ``max_tokens``; the sampler and the text stream carry on (nothing is lost)."""
        if self.output_ids:
            self.prompt_ids = self.prompt_ids + self.output_ids
            self.params = replace(self.params, max_tokens=self.params.max_tokens - len(self.output_ids))
            self.output_ids = []
        self.n_prefilled = 0
        self.n_reused = 0
        self.is_restored = False
        self.seq_id = None
