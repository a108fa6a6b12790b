"""``homepd advise export``: a stored recommendation as launch recipes for other engines.  Pure: a stored
advise run (``Store.get_run``) in, an ``ExportPlan`` (what the evidence says) and per engine the commands
and config files that reproduce it out.  ``homepd.advise.exportdoc`` writes them with their README.

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
import json
import shlex
from dataclasses import dataclass

from homepd.advise.apply import stored_candidates
from homepd.core.modes import Mode
from homepd.errors import ConfigError

# why 256: llama-server's --cache-reuse is the smallest chunk it shifts to reuse; below a few hundred tokens
# recomputing is as cheap on a CPU, and homepd's prefix cache works in blocks of that order too
CACHE_REUSE_TOKENS = 256
VLLM_PORTS = (8100, 8200)                  # prefill, decode (vLLM's NixlConnector guide's)
VLLM_SIDE_CHANNEL_PORTS = (5600, 5601)     # VLLM_NIXL_SIDE_CHANNEL_PORT of each instance
SGLANG_PORTS = (30000, 30001)
SGLANG_BOOTSTRAP_PORT = 8998
ROUTER_PORT = 8000
NIXL_KV_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":"))


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
        adaptive_chunk=chosen.adaptive_chunk, n_replicas=chosen.n_replicas, local_prefill=chosen.local_prefill,
        n_ctx=int(base.get("n_ctx") or 4096), n_seq_max=int(base.get("n_seq_max") or 8),
        n_threads=base.get("n_threads") or ((run.get("hardware") or {}).get("cpu") or {}).get("physical_cores"),
        model=str(base.get("model") or ""), prefix_cache=bool(base.get("prefix_cache", True)),
        capacity_rps=(curve or {}).get("capacity_rps"), capacity_mix=(curve or {}).get("mix"),
        ttft_ms=float(slo.get("ttft_ms") or base.get("ttft_budget_ms") or 4000.0),
        itl_ms=slo.get("itl_ms", base.get("itl_budget_ms", 100.0)), token_target=str(slo.get("token_target") or "gap"),
        route_threshold_tokens=threshold, route_threshold_why=why,
        max_tokens=int(settings.get("max_tokens") or 32), long_tokens=int(settings.get("long_tokens") or 400),
        seed=int(settings.get("seed") or 0))


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


# ---- the recipes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """One engine's files (name -> text) and the notes the README gives about them."""
    engine: ExportEngine
    files: dict[str, str]
    notes: tuple[str, ...]
    endpoint: str                    # the URL the benchmark drives


def _sh(*lines: str) -> str:
    return "#!/bin/sh\n# written by `homepd advise export`; see README.md for where each value came from\nset -e\n" \
        + "\n".join(lines) + "\n"


def _cmd(*words) -> str:
    return " ".join(shlex.quote(str(w)) if not str(w).startswith("$") else f'"{w}"' for w in words if w != "")


def llama_server_args(plan: ExportPlan) -> list[str]:
    """The llama-server flags of the plan (one server; replicas get one each)."""
    args = ["-c", plan.n_ctx, "-np", plan.n_seq_max]
    if plan.chunk is not None:
        args += ["-b", plan.chunk, "-ub", plan.chunk]
    if plan.n_threads:
        threads = max(1, plan.n_threads // (plan.n_replicas or 1))
        args += ["-t", threads, "-tb", threads]
    args += ["--cache-prompt", "--cache-reuse", CACHE_REUSE_TOKENS] if plan.prefix_cache else ["--no-cache-prompt"]
    return [str(a) for a in [*args, "--jinja"]]


def llama_server(plan: ExportPlan) -> Recipe:
    n = plan.n_replicas or 1
    lines = [f'MODEL="${{MODEL:-{plan.model}}}"  # the GGUF homepd served (a path: `homepd models` shows it)']
    for i in range(n):
        bg = " &" if n > 1 else ""
        lines.append(_cmd("llama-server", "-m", "$MODEL", "--host", "0.0.0.0", "--port", 8080 + i,
                          *llama_server_args(plan)) + bg)
    if n > 1:
        lines.append("wait")
    notes = [f"{n} llama-server processes on ports 8080..{8080 + n - 1}, each with its share of the threads: "
             "put any OpenAI-compatible load balancer in front (llama-server has no router; homepd routed by "
             "cached prefix)"] if n > 1 else []
    if plan.mode is Mode.DISAGGREGATED:
        notes.append("llama-server has no prefill/decode disaggregation: this is the colocated equivalent with "
                     "the recommended chunk; use vLLM or SGLang for disaggregation across GPUs")
    if plan.adaptive_chunk:
        notes.append(f"homepd adapted each step's prompt budget to the ITL target, up to {plan.chunk}; "
                     "llama-server's batch is fixed: -b/-ub are that largest chunk")
    return Recipe(ExportEngine.LLAMA_SERVER, {"launch.sh": _sh(*lines)}, tuple(notes), "http://127.0.0.1:8080")


def _vllm_common(plan: ExportPlan) -> list:
    args = ["--max-num-seqs", plan.n_seq_max, "--max-model-len", plan.n_ctx]
    if plan.chunk is not None:
        args += ["--enable-chunked-prefill", "--max-num-batched-tokens", max(plan.chunk, plan.n_seq_max),
                 "--long-prefill-token-threshold", plan.chunk]
    else:
        args += ["--max-num-batched-tokens", plan.n_ctx]
    args += ["--enable-prefix-caching"] if plan.prefix_cache else ["--no-enable-prefix-caching"]
    return args


def vllm(plan: ExportPlan) -> Recipe:
    model = 'MODEL_ID="${MODEL_ID:?set MODEL_ID to the model id vLLM loads (see README.md)}"'
    if plan.mode is Mode.DISAGGREGATED:
        lines = [model]
        for gpu, (port, side) in enumerate(zip(VLLM_PORTS, VLLM_SIDE_CHANNEL_PORTS)):
            lines.append(f"CUDA_VISIBLE_DEVICES={gpu} VLLM_NIXL_SIDE_CHANNEL_PORT={side} "
                         + _cmd("vllm", "serve", "$MODEL_ID", "--port", port, *_vllm_common(plan),
                                "--kv-transfer-config", NIXL_KV_CONFIG) + " &")
        lines.append("# vLLM's proxy for the NixlConnector: tests/v1/kv_connector/nixl_integration/toy_proxy_server.py")
        lines.append(_cmd("python", "toy_proxy_server.py", "--port", ROUTER_PORT, "--prefiller-host", "127.0.0.1",
                          "--prefiller-port", VLLM_PORTS[0], "--decoder-host", "127.0.0.1", "--decoder-port",
                          VLLM_PORTS[1]))
        notes = ("two instances, one GPU each, both kv_both (either may prefill or decode; the proxy sends the "
                 "prompt to the first, then the decode to the second)",
                 "homepd's learned routing (short prompts kept on the decode worker) has no vLLM flag: the toy "
                 "proxy sends every prompt to the prefiller; llm-d's threshold carries it (see the llm-d export)")
        return Recipe(ExportEngine.VLLM, {"launch.sh": _sh(*lines)}, notes, f"http://127.0.0.1:{ROUTER_PORT}")
    n = plan.n_replicas or 1
    lines = [model] + [(f"CUDA_VISIBLE_DEVICES={i} " if n > 1 else "")
                       + _cmd("vllm", "serve", "$MODEL_ID", "--port", 8000 + i + (1 if n > 1 else 0),
                              *_vllm_common(plan)) + (" &" if n > 1 else "") for i in range(n)]
    if n > 1:
        lines.append("wait")
    notes = (f"{n} replicas on ports 8001..{8000 + n}: put a router in front (llm-d's prefix-cache scorer is "
             "homepd's cache-aware routing)",) if n > 1 else ()
    return Recipe(ExportEngine.VLLM, {"launch.sh": _sh(*lines)}, notes,
                  f"http://127.0.0.1:{8001 if n > 1 else 8000}")


def _sglang_common(plan: ExportPlan) -> list:
    return ["--max-running-requests", plan.n_seq_max, "--context-length", plan.n_ctx,
            "--chunked-prefill-size", plan.chunk if plan.chunk is not None else -1,
            *([] if plan.prefix_cache else ["--disable-radix-cache"])]


def sglang(plan: ExportPlan) -> Recipe:
    model = 'MODEL_ID="${MODEL_ID:?set MODEL_ID to the model id SGLang loads (see README.md)}"'
    base = ["python", "-m", "sglang.launch_server", "--model-path", "$MODEL_ID"]
    if plan.mode is Mode.DISAGGREGATED:
        lines = [model,
                 _cmd(*base, "--port", SGLANG_PORTS[0], *_sglang_common(plan), "--disaggregation-mode", "prefill",
                      "--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-port",
                      SGLANG_BOOTSTRAP_PORT, "--base-gpu-id", 0) + " &",
                 _cmd(*base, "--port", SGLANG_PORTS[1], *_sglang_common(plan), "--disaggregation-mode", "decode",
                      "--disaggregation-transfer-backend", "nixl", "--base-gpu-id", 1) + " &",
                 _cmd("python", "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
                      f"http://127.0.0.1:{SGLANG_PORTS[0]}", SGLANG_BOOTSTRAP_PORT, "--decode",
                      f"http://127.0.0.1:{SGLANG_PORTS[1]}", "--host", "0.0.0.0", "--port", ROUTER_PORT)]
        notes = ("transfer backend nixl (mooncake is the other; both need RDMA or NVLink to be fast)",)
        return Recipe(ExportEngine.SGLANG, {"launch.sh": _sh(*lines)}, notes, f"http://127.0.0.1:{ROUTER_PORT}")
    n = plan.n_replicas or 1
    lines = [model, _cmd(*base, "--port", SGLANG_PORTS[0], *_sglang_common(plan), *(["--dp-size", n] if n > 1 else []))]
    notes = (f"--dp-size {n}: SGLang's own data-parallel replicas behind its built-in router",) if n > 1 else ()
    return Recipe(ExportEngine.SGLANG, {"launch.sh": _sh(*lines)}, notes, f"http://127.0.0.1:{SGLANG_PORTS[0]}")


def llm_d(plan: ExportPlan) -> Recipe:
    """The EndpointPickerConfig: P/D with the threshold, or one profile with prefix-cache-aware routing."""
    if plan.mode is Mode.DISAGGREGATED:
        threshold = plan.route_threshold_tokens if plan.route_threshold_tokens is not None else 0
        text = f"""apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefill-header-handler
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
- type: pd-profile-handler
  parameters:
    # homepd's routing threshold in uncached prompt tokens: {plan.route_threshold_why}
    threshold: {threshold}
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
        notes = ("prompts with fewer uncached tokens than the threshold are prefilled on the decode pod, as homepd "
                 "kept them on its decode worker",)
    else:
        text = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: single-profile-handler
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
        notes = ("not disaggregated: one scheduling profile, pods chosen by cached prefix and queue (homepd's "
                 "replicas routing); each pod runs the vLLM recipe's flags",)
    return Recipe(ExportEngine.LLM_D, {"epp-config.yaml": text}, notes, "http://GATEWAY")


RECIPES = {ExportEngine.LLAMA_SERVER: llama_server, ExportEngine.VLLM: vllm, ExportEngine.SGLANG: sglang,
           ExportEngine.LLM_D: llm_d}


def recipe(plan: ExportPlan, engine: ExportEngine | str) -> Recipe:
    return RECIPES[ExportEngine(engine)](plan)
