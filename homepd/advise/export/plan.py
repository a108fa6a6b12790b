"""``homepd advise export``: a stored recommendation as launch recipes for other engines.  Pure: a stored
advise run (``Store.load_run``) in, an ``ExportPlan`` (what the evidence says) out; ``homepd.advise.export.recipes``
turns it into each engine's commands and config files, ``homepd.advise.export.documents`` writes them with their
README.

The mapping, setting by setting (where each value comes from is in ``ExportPlan``'s fields):

* the prefill chunk (prompt tokens a step may carry next to the decodes) -> llama-server ``-b``/``-ub``,
  vLLM ``--max-num-batched-tokens`` and ``--long-prefill-token-threshold``, SGLang ``--chunked-prefill-size``;
* ``n_seq_max`` and ``n_ctx`` (the plan's sequences and context) -> llama-server ``-np``/``-c``, vLLM
  ``--max-num-seqs``/``--max-model-len``, SGLang ``--max-running-requests``/``--context-length``;
* the prefix cache -> llama-server ``--cache-prompt --cache-reuse``, vLLM ``--enable-prefix-caching``;
* disaggregated -> two vLLM servers with the NixlConnector (``kv_both``) and their side-channel ports behind
  vLLM's toy proxy; two SGLang servers (``--disaggregation-mode prefill|decode``) behind ``sglang_router
  --pd-disaggregation``; llm-d's ``pd-profile-handler`` ``threshold`` from homepd's routing threshold
  (uncached tokens), learned from where the routed candidate's requests were prefilled;
* replicas -> N servers behind a router (llm-d: the prefix-cache scorer, as homepd's cache-aware routing).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from homepd.core.modes import Mode
from homepd.errors import ConfigError
from homepd.store.records import Run, RunAdvice


class ExportEngine(str, enum.Enum):
    LLAMA_SERVER = "llama-server"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLM_D = "llm-d"


@dataclass(frozen=True)
class ExportPlan:
    """What a stored advise run recommends, as the recipes need it."""
    run_id: int
    candidate: str                   # the recommended (or chosen) candidate's name
    mode: Mode
    chunk: int | None                # prompt tokens per step (None: unchunked); adaptive: the largest
    adaptive_chunk: bool
    # adaptive: the fixed chunk the run's step-time model predicted for the ITL target (None: not predicted,
    # e.g. a quick run): what an engine with a fixed batch gets instead of the adaptive one
    itl_chunk: int | None
    n_replicas: int | None
    local_prefill: bool              # disaggregated: learned routing of short prompts to the decode worker
    n_ctx: int
    n_seq_max: int
    n_threads: int | None
    model: str                       # the GGUF homepd served (a catalog name or a path)
    prefix_cache: bool
    capacity_rps: float | None       # the candidate's measured capacity on the mix below
    capacity_mix: str | None
    ttft_ms: float
    itl_ms: float | None
    token_target: str                # "gap" | "p99" | "tpot" (homepd.measure.metrics.TokenTarget)
    route_threshold_tokens: int | None   # where routed prompts switched from local to the prefill worker
    route_threshold_why: str
    max_tokens: int                  # the campaign's trace settings (the exported trace's)
    long_tokens: int
    seed: int


def plan_from_run(run: Run, candidate: str | None = None) -> ExportPlan:
    """The ``ExportPlan`` of a stored advise run (``Store.load_run(id)``, with timelines for the routing
    threshold); ``candidate`` another measured candidate than the recommended one.  ``ConfigError`` when the
    run holds no recommendation or no such candidate."""
    advice = run.advice
    if run.kind != "advise" or advice is None:
        raise ConfigError(f"run {run.id} holds no advise recommendation (kind {run.kind!r}); "
                          "run `homepd advise` first, or name an advise run")
    name = candidate or (advice.candidate.name if advice.candidate is not None else None)
    chosen = next((c for c in advice.candidates if c.name == name), None)
    if chosen is None:
        known = ", ".join(c.name for c in advice.candidates) or "none stored"
        raise ConfigError(f"run {run.id} has no candidate {name!r} to export (its candidates: {known})")
    config = run.config
    curve = advice.curve(chosen.name)
    threshold, why = route_threshold(run, chosen.name) if chosen.mode.traits.hands_off_kv else (
        None, "not disaggregated: no prefill/decode routing to carry over")
    return ExportPlan(
        run_id=run.id or 0, candidate=chosen.name, mode=chosen.mode, chunk=chosen.chunk,
        adaptive_chunk=chosen.adaptive_chunk, itl_chunk=_predicted_chunk(advice), n_replicas=chosen.n_replicas,
        local_prefill=chosen.local_prefill, n_ctx=config.n_ctx, n_seq_max=config.n_seq_max,
        n_threads=config.n_threads or run.n_physical_cores, model=config.model, prefix_cache=config.prefix_cache,
        capacity_rps=curve.capacity_rps if curve else None, capacity_mix=curve.mix if curve else None,
        ttft_ms=config.slo.ttft_ms, itl_ms=config.slo.itl_ms, token_target=config.slo.token_target.value,
        route_threshold_tokens=threshold, route_threshold_why=why,
        max_tokens=config.max_tokens, long_tokens=config.long_tokens, seed=config.seed)


def _predicted_chunk(advice: RunAdvice) -> int | None:
    """The chunk the campaign's step-time model predicted for the ITL target (its extra fixed-chunk candidate)."""
    return next((c.chunk for c in advice.candidates if c.reason.startswith("predicted by the step-time model")),
                None)


def route_threshold(run: Run, candidate: str) -> tuple[int | None, str]:
    """homepd's learned routing threshold, in uncached prompt tokens, from where the candidate's requests were
    prefilled: between the longest prompt kept on the decode worker and the shortest sent to the prefill
    worker.  (None, why) when the run does not show it."""
    local, remote = [], []
    for probe in run.measured:
        if probe.candidate != candidate:
            continue
        for req in probe.requests:
            (local if req.routed_to == "decode" else remote if req.routed_to == "prefill"
             else []).append(req.n_uncached_prompt_tokens)
    if not local and not remote:
        return None, "no routed request was stored for this candidate (run it with timelines: a full advise)"
    if not local:
        return 0, f"every prompt went to the prefill worker (shortest {min(remote)} uncached tokens): threshold 0"
    if not remote:
        return max(local), f"every prompt stayed on the decode worker (longest {max(local)} uncached tokens)"
    low, high = max(local), min(remote)
    if low >= high:  # the learned threshold moved during the run (queues count too): the overlap's middle
        return (low + high) // 2, (f"prompts of {high}..{low} uncached tokens went either way (the threshold "
                                   "moves with the queues): the middle of that range")
    return (low + high) // 2, f"longest kept local {low}, shortest sent to prefill {high} uncached tokens"
