"""``homepd advise export``'s recipes: an ``ExportPlan`` (``homepd.advise.export.plan``) as each engine's launch
commands or config file.  Pure text; the mapping of every setting is in ``homepd.advise.export.plan``'s docstring."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from homepd.advise.export.plan import ExportEngine, ExportPlan

# why 256: llama-server's --cache-reuse is the smallest chunk it shifts to reuse; below a few hundred tokens
# recomputing is as cheap on a CPU, and homepd's prefix cache works in blocks of that order too
CACHE_REUSE_TOKENS = 256
VLLM_PORTS = (8100, 8200)                  # prefill, decode (vLLM's NixlConnector guide's)
VLLM_SIDE_CHANNEL_PORTS = (5600, 5601)     # VLLM_NIXL_SIDE_CHANNEL_PORT of each instance
SGLANG_PORTS = (30000, 30001)
SGLANG_BOOTSTRAP_PORT = 8998
ROUTER_PORT = 8000
NIXL_KV_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":"))


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


def fixed_chunk(plan: ExportPlan) -> int | None:
    """The batch an engine without an adaptive step budget gets: the ITL-safe chunk the run predicted when the
    plan is adaptive (its largest chunk would stall decodes behind long prompts), else the plan's chunk."""
    return plan.itl_chunk if plan.adaptive_chunk and plan.itl_chunk else plan.chunk


def llama_server_args(plan: ExportPlan) -> list[str]:
    """The llama-server flags of the plan (one server; replicas get one each)."""
    # why --kv-unified: homepd's cache is one pool all sequences share (a long prompt may use all of n_ctx);
    # without it llama-server splits -c into -np slots of n_ctx/np (a 521-token prompt was refused at 4096/8)
    args = ["-c", plan.n_ctx, "-np", plan.n_seq_max, "--kv-unified"]
    chunk = fixed_chunk(plan)
    if chunk is not None:
        args += ["-b", chunk, "-ub", chunk]
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
    if plan.mode.traits.hands_off_kv:
        notes.append("llama-server has no prefill/decode disaggregation: this is the colocated equivalent with "
                     "the recommended chunk; use vLLM or SGLang for disaggregation across GPUs")
    if plan.adaptive_chunk:
        notes.append(f"homepd adapted each step's prompt budget to the ITL target, up to {plan.chunk}; "
                     "llama-server's batch is fixed: -b/-ub are " + (
                         f"{plan.itl_chunk}, the chunk homepd's step-time model predicted for the ITL target "
                         "on this box" if plan.itl_chunk else "that largest chunk (this run predicted no "
                                                               "ITL-safe chunk: a full advise does)"))
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
    if plan.mode.traits.hands_off_kv:
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
    if plan.mode.traits.hands_off_kv:
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
    if plan.mode.traits.hands_off_kv:
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
