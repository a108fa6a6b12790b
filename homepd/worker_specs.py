"""Where each worker of an engine runs, and the ``WorkerSpec`` it is started with.

Colocated: the config's cores/threads/GPU.  Disaggregated: per-role flags
where given, else the placement plan (``homepd probe`` shows the same plan).
"""
from __future__ import annotations

from homepd.config import EngineConfig
from homepd.errors import EngineError
from homepd.worker import WorkerSpec

KV_BYTES_PER_TOKEN_GUESS = 64 << 10  # placement plan's memory check when the GGUF header does not say


def roles_for(mode: str) -> list[str]:
    return ["colocated"] if mode == "colocated" else ["prefill", "decode"]


def placements(config: EngineConfig, model_path: str) -> dict[str, dict]:
    """Per role: cpu_cores, n_threads, gpu (CUDA_VISIBLE_DEVICES value or None), n_gpu_layers."""
    c = config
    if c.mode == "colocated":
        return {"colocated": {"cpu_cores": c.cpu_cores, "n_threads": c.effective_n_threads,
                              "gpu": None if c.gpu_index is None else str(c.gpu_index),
                              "n_gpu_layers": c.n_gpu_layers}}
    from homepd.gguf import read_gguf_header
    from homepd.placement import plan_placement
    from homepd.probe import probe

    header = read_gguf_header(model_path)
    per_token = header.kv_bytes_per_token or KV_BYTES_PER_TOKEN_GUESS
    kv_bytes = c.n_ctx * per_token
    # the slot pool: n_slots slots, each sized for a full-context sequence
    plan = plan_placement(probe(), model_bytes=header.size_bytes, kv_bytes=kv_bytes,
                          transfer_bytes=c.n_slots * kv_bytes).disaggregated
    overrides = {"prefill": (c.prefill_cores, c.prefill_threads), "decode": (c.decode_cores, c.decode_threads)}
    if not plan.feasible and not all(cores for cores, _ in overrides.values()):
        raise EngineError(f"disaggregated serving is not feasible on this box: {plan.reason}")
    out = {}
    for role in roles_for(c.mode):
        cores, threads = overrides[role]
        if cores:  # placed by hand: on the CPU, on these cores
            out[role] = {"cpu_cores": tuple(cores), "n_threads": threads or len(cores), "gpu": None,
                         "n_gpu_layers": 0}
        else:
            planned = getattr(plan, role)
            out[role] = {"cpu_cores": planned.cpu_cores or None, "n_threads": threads or planned.n_threads,
                         "gpu": planned.cuda_visible_devices or None, "n_gpu_layers": planned.n_gpu_layers}
    return out


def worker_specs(config: EngineConfig, model_path: str, model_fingerprint: str) -> dict[str, WorkerSpec]:
    """The spec of every worker the engine starts, by role."""
    specs = {}
    for role, place in placements(config, model_path).items():
        n_gpu_layers = place["n_gpu_layers"]
        specs[role] = WorkerSpec(
            role=role, model_path=model_path, n_ctx=config.n_ctx, n_seq_max=config.n_seq_max, chunk=config.chunk,
            n_threads=place["n_threads"], cpu_cores=place["cpu_cores"],
            n_gpu_layers=999 if n_gpu_layers < 0 else n_gpu_layers, fault=config.fault,
            cuda_visible_devices=place["gpu"] or "", model_fingerprint=model_fingerprint)
    return specs
