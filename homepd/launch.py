"""What an engine needs before it starts: the model file, its fingerprint, where each worker runs.

Faces (``homepd run``, ``serve``, ``advise``, the app) call ``prepare`` — which
may pull a catalog model (``pull=True``, an interactive command) or refuse to
(``pull=False``, a service) — and hand the result to ``Engine``.  The engine
itself never downloads, probes or plans.
"""
from __future__ import annotations

from homepd.config import EngineConfig
from homepd.core.protocol import EngineSetup, RolePlacement
from homepd.errors import EngineError

KV_BYTES_PER_TOKEN_GUESS = 64 << 10  # placement plan's memory check when the GGUF header does not say


def prepare(config: EngineConfig, *, pull: bool = True, progress: bool = True, box=None) -> EngineSetup:
    """Resolve ``config.model`` (pulling a missing catalog model when ``pull``), fingerprint it and place
    the workers (``box``: a ``BoxProbe`` to plan on, else this box is probed when the plan is needed)."""
    from homepd.models.resolve import fingerprint, resolve_model

    config = config.validated()
    if config.backend == "fake":
        from homepd.fakellm import FAKE_MODEL_PATH

        path = FAKE_MODEL_PATH if config.model == EngineConfig.model else config.model
        return EngineSetup(path, "f" * 64, placements(config, path, box))
    from homepd.hw.isa import check_build

    check_build()  # before any process loads llama.cpp: a build for another CPU is refused, not a SIGILL
    path = str(resolve_model(config.model, config.models_dir, pull=pull, progress=progress))
    return EngineSetup(path, fingerprint(path), placements(config, path, box))


def placements(config: EngineConfig, model_path: str, box=None) -> dict[str, RolePlacement]:
    """Per role: pinned cores, threads, GPU and offload.

    Colocated: the config's cores/threads/GPU.  Disaggregated: per-role flags
    where given, else the placement plan (``homepd probe`` shows the same plan).
    Replicas: the plan's ``replica-N`` workers (one per GPU, or the cores split).
    """
    c = config
    if c.mode == "colocated":
        return {"colocated": RolePlacement(cpu_cores=c.cpu_cores, n_threads=c.effective_n_threads,
                                           cuda_visible_devices=None if c.gpu_index is None else str(c.gpu_index),
                                           n_gpu_layers=c.n_gpu_layers)}
    if c.mode == "replicas":
        plan = placement_plan(c, model_path, box).replicas
        if not plan.feasible:
            raise EngineError(f"{c.n_replicas} replicas are not feasible on this box: {plan.reason}")
        return {w.role: RolePlacement(cpu_cores=w.cpu_cores or None, n_threads=w.n_threads,
                                      cuda_visible_devices=w.cuda_visible_devices or None,
                                      n_gpu_layers=w.n_gpu_layers) for w in plan.workers}
    overrides = {"prefill": (c.prefill_cores, c.prefill_threads), "decode": (c.decode_cores, c.decode_threads)}
    plan = None
    if not all(cores for cores, _ in overrides.values()):
        plan = placement_plan(c, model_path, box).disaggregated
        if not plan.feasible:
            raise EngineError(f"disaggregated serving is not feasible on this box: {plan.reason}")
    out = {}
    for role, (cores, threads) in overrides.items():
        if cores:  # placed by hand: on the CPU, on these cores
            out[role] = RolePlacement(cpu_cores=tuple(cores), n_threads=threads or len(cores))
        else:
            planned = getattr(plan, role)
            out[role] = RolePlacement(cpu_cores=planned.cpu_cores or None, n_threads=threads or planned.n_threads,
                                      cuda_visible_devices=planned.cuda_visible_devices or None,
                                      n_gpu_layers=planned.n_gpu_layers)
    return out


def placement_plan(config: EngineConfig, model_path: str, box=None):
    """The placement plan for ``config`` on ``box`` (probed when None), sized from the model's GGUF header."""
    from homepd.hw.placement import plan_placement
    from homepd.hw.probe import probe

    if config.backend == "fake":
        model_bytes, per_token = 1 << 20, 1024
    else:
        from homepd.models.gguf import read_gguf_header

        header = read_gguf_header(model_path)
        model_bytes, per_token = header.size_bytes, header.kv_bytes_per_token or KV_BYTES_PER_TOKEN_GUESS
    kv_bytes = config.n_ctx * per_token
    # the slot pool: n_slots slots, each sized for a full-context sequence
    return plan_placement(box if box is not None else probe(), model_bytes=model_bytes, kv_bytes=kv_bytes,
                          transfer_bytes=config.n_slots * kv_bytes, n_replicas=config.n_replicas)
