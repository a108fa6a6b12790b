"""``homepd advise export``: a stored recommendation as launch recipes for other engines.  Pure: a stored
advise run (``Store.get_run``) in, an ``ExportPlan`` (what the evidence says) out; ``homepd.advise.export.recipes``
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

from homepd.advise.export.apply import stored_candidates
from homepd.core.modes import Mode
from homepd.errors import ConfigError

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


def plan_from_run(run: dict, candidate: str | None = None) -> ExportPlan:
    """The ``ExportPlan`` of a stored advise run (``Store.get_run(id)``, with timelines for the routing
    threshold); ``candidate`` another measured candidate than the recommended one.  ``ConfigError`` when the
    run holds no recommendation or no such candidate."""
    recs = run.get("recommendations") or []
    if run.get("kind") != "advise" or not recs:
        raise ConfigError(f"run {run.get('id')} holds no advise recommendation (kind {run.get('kind')!r}); "
                          "run `homepd advise` first, or name an advise run")
    rec = recs[-1].get("data") or {}
    name = candidate or (rec.get("candidate") or {}).get("name")
    chosen = next((c for c in stored_candidates(rec) if c.name == name), None)
    if chosen is None:
        known = ", ".join(c.name for c in stored_candidates(rec)) or "none stored"
        raise ConfigError(f"run {run.get('id')} has no candidate {name!r} to export (its candidates: {known})")
    config = run.get("config") or {}
    base, settings = config.get("base") or {}, config.get("settings") or {}
    slo = settings.get("slo") or {}
    curve = _curve(rec, chosen.name)
    threshold, why = route_threshold(run, chosen.name) if chosen.mode is Mode.DISAGGREGATED else (
        None, "not disaggregated: no prefill/decode routing to carry over")
    return ExportPlan(
        run_id=int(run.get("id") or 0), candidate=chosen.name, mode=chosen.mode, chunk=chosen.chunk,
        adaptive_chunk=chosen.adaptive_chunk, itl_chunk=_predicted_chunk(rec), n_replicas=chosen.n_replicas, local_prefill=chosen.local_prefill,
        n_ctx=int(base.get("n_ctx") or 4096), n_seq_max=int(base.get("n_seq_max") or 8),
        n_threads=base.get("n_threads") or ((run.get("hardware") or {}).get("cpu") or {}).get("physical_cores"),
        model=str(base.get("model") or ""), prefix_cache=bool(base.get("prefix_cache", True)),
        capacity_rps=(curve or {}).get("capacity_rps"), capacity_mix=(curve or {}).get("mix"),
        ttft_ms=float(slo.get("ttft_ms") or base.get("ttft_budget_ms") or 4000.0),
        itl_ms=slo.get("itl_ms", base.get("itl_budget_ms", 100.0)), token_target=str(slo.get("token_target") or "gap"),
        route_threshold_tokens=threshold, route_threshold_why=why,
        max_tokens=int(settings.get("max_tokens") or 32), long_tokens=int(settings.get("long_tokens") or 400),
        seed=int(settings.get("seed") or 0))


def _predicted_chunk(rec: dict) -> int | None:
    """The chunk the campaign's step-time model predicted for the ITL target (its extra fixed-chunk candidate)."""
    return next((c.chunk for c in stored_candidates(rec) if c.reason.startswith("predicted by the step-time model")),
                None)


def _curve(rec: dict, candidate: str) -> dict | None:
    curves = [c for c in rec.get("capacity") or () if isinstance(c, dict) and c.get("candidate") == candidate]
    return next((c for c in curves if c.get("mix") == "mixed"), curves[0] if curves else None)


def route_threshold(run: dict, candidate: str) -> tuple[int | None, str]:
    """homepd's learned routing threshold, in uncached prompt tokens, from where the candidate's requests were
    prefilled: between the longest prompt kept on the decode worker and the shortest sent to the prefill
    worker.  (None, why) when the run does not show it."""
    local, remote = [], []
    for result in run.get("results") or ():
        if result.get("candidate") != candidate or not isinstance(result.get("record"), dict):
            continue
        for req in result["record"].get("requests") or ():
            uncached = int(req.get("n_prompt_tokens") or 0) - int(req.get("n_cached_tokens") or 0)
            (local if req.get("routed_to") == "decode" else remote if req.get("routed_to") == "prefill"
             else []).append(uncached)
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
