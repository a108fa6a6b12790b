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

        path, identity = FAKE_MODEL_PATH if config.model == EngineConfig.model else config.model, "f" * 64
    else:
        from homepd.hw.isa import check_build

        check_build()  # before any process loads llama.cpp: a build for another CPU is refused, not a SIGILL
        path = str(resolve_model(config.model, config.models_dir, pull=pull, progress=progress))
        identity = fingerprint(path)
    if box is None and config.mode != "colocated":
        from homepd.hw.probe import probe

        box = probe()  # once: the placements and the arena are planned on the same reading
    return EngineSetup(path, identity, placements(config, path, box), kv_arena_bytes(config, path, box))


def kv_arena_bytes(config: EngineConfig, model_path: str, box=None) -> int | None:
    """Disaggregated: the KV arena's size — ``--kv-arena``, else the placement plan's (the prefill worker's
    KV plus slack, shrunk if RAM is short).  Refuses a configuration whose workers and arena do not fit RAM,
    naming the numbers.  None for the other modes."""
    if config.mode != "disaggregated":
        return None
    plan = placement_plan(config, model_path, box)
    if not plan.memory.fits_ram_twice and not plan.uses_gpus:
        raise EngineError(f"disaggregated serving does not fit this box's RAM: {plan.disaggregated.reason}")
    return plan.disaggregated.transfer_bytes


def placements(config: EngineConfig, model_path: str, box=None) -> dict[str, RolePlacement]:
    """Per role: pinned cores, threads, GPU and offload.

    Colocated: the config's cores/threads/GPU.  Disaggregated: per-role flags
    where given, else the placement plan (``homepd probe`` shows the same plan);
    the prefill worker gets its own, smaller context (``prefill_context``).
    Replicas: the plan's ``replica-N`` workers (one per GPU, or the cores split).
    """
    from homepd.hw.placement import prefill_context

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
    n_ctx = {"prefill": prefill_context(c.n_ctx, c.prefill_n_ctx), "decode": None}
    for role, (cores, threads) in overrides.items():
        if cores:  # placed by hand: on the CPU, on these cores
            out[role] = RolePlacement(cpu_cores=tuple(cores), n_threads=threads or len(cores), n_ctx=n_ctx[role])
        else:
            planned = getattr(plan, role)
            out[role] = RolePlacement(cpu_cores=planned.cpu_cores or None, n_threads=threads or planned.n_threads,
                                      cuda_visible_devices=planned.cuda_visible_devices or None,
                                      n_gpu_layers=planned.n_gpu_layers, n_ctx=n_ctx[role])
    return out


def placement_plan(config: EngineConfig, model_path: str, box=None):
    """The placement plan for ``config`` on ``box`` (probed when None), sized from the model's GGUF header:
    the decode (and colocated) worker's KV for ``n_ctx``, the prefill worker's for its own context, and
    the KV arena (``--kv-arena``, else the plan's default)."""
    from homepd.hw.placement import plan_placement, prefill_context
    from homepd.hw.probe import probe

    if config.backend == "fake":
        model_bytes, per_token = 1 << 20, 1024
    else:
        from homepd.models.gguf import read_gguf_header

        header = read_gguf_header(model_path)
        model_bytes, per_token = header.size_bytes, header.kv_bytes_per_token or KV_BYTES_PER_TOKEN_GUESS
    return plan_placement(box if box is not None else probe(), model_bytes=model_bytes,
                          kv_bytes=config.n_ctx * per_token,
                          prefill_kv_bytes=prefill_context(config.n_ctx, config.prefill_n_ctx) * per_token,
                          transfer_bytes=config.kv_arena_bytes, n_replicas=config.n_replicas)
