"""The ``WorkerSpec`` each worker of an engine is started with, from the config and the resolved setup."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from homepd.config import EngineConfig, cached_ids, flash_attn_of, kv_streams, max_cached_cells, prefill_ids
from homepd.core.modes import Role
from homepd.core.protocol import EngineSetup, WorkerSpec, wire_fingerprint
from homepd.core.steppolicy import IDLE_STEP_SHARE_OF_TTFT
from homepd.engine.topology import topology_for


def worker_specs(config: EngineConfig, setup: EngineSetup) -> dict[str, WorkerSpec]:
    """The spec of every worker the engine starts, by its name (its topology's ``worker_roles``); a prefill worker
    has no ids for prompts beyond its ``n_seq_max`` (every one of its sequences is a prompt already)."""
    specs = {}
    for name, role in topology_for(config.mode).worker_roles(config, setup).items():
        place = setup.placements[name]
        cached_cells = max_cached_cells(config, place.n_ctx or config.n_ctx)
        specs[name] = WorkerSpec(
            role=role, model_path=setup.model_path,
            n_ctx=place.n_ctx or config.n_ctx, n_seq_max=config.n_seq_max,
            chunk=config.chunk, n_threads=place.n_threads, cpu_cores=place.cpu_cores,
            n_gpu_layers=999 if place.n_gpu_layers < 0 else place.n_gpu_layers, fault=config.fault,
            cuda_visible_devices=place.cuda_visible_devices or "", model_fingerprint=setup.model_fingerprint,
            backend=config.backend, itl_budget_ms=itl_budget_ms(config, role),
            idle_step_ms=idle_step_ms(config, role), gap_ceiling_ms=gap_ceiling_ms(config, role),
            max_cached_cells=cached_cells, n_cached_ids=cached_ids(config),
            n_prefill_ids=prefill_ids(config) if role != Role.PREFILL else 0,
            kv_unified=not kv_streams(config), wire=wire_fingerprint())
    fa = flash_attn(config, specs.values())
    return {name: dataclasses.replace(spec, flash_attn=fa) for name, spec in specs.items()}


def flash_attn(config: EngineConfig, specs: Iterable[WorkerSpec]) -> bool:
    """Flash attention for every worker of the engine: ``--flash-attn on/off``, or auto: on where any worker
    offloads to a GPU, off when all run on the CPU (homepd.llm.flash_attn_type says why).  One setting for all,
    not one per worker: a disaggregated handoff between a GPU prefill and a CPU decode needs one V layout."""
    asked = flash_attn_of(config.flash_attn)
    return asked if asked is not None else any(spec.offload_layers for spec in specs)


def itl_budget_ms(config: EngineConfig, role: Role) -> float | None:
    """The ITL budget a worker's step policy keeps (None: the fixed chunk).  A decode worker keeps it even
    with a fixed chunk: the prompts it prefills itself (the gate's local prefill, prompts too long for the
    prefill worker) must not stall the streams it exists to keep smooth (at a fixed chunk 256 they stalled
    them by 1.9 s in an advise campaign); the chunk is then its largest prompt budget."""
    return config.itl_budget_ms if config.adaptive_chunk or role is Role.DECODE else None


def gap_ceiling_ms(config: EngineConfig, role: Role) -> float | None:
    """The longest gap a step granted to a TTFT deadline may make (``--gap-ceiling`` ITL budgets; None: no
    ITL budget, or 0: never granted)."""
    itl = itl_budget_ms(config, role)
    return None if itl is None or not config.gap_ceiling else itl * config.gap_ceiling


def idle_step_ms(config: EngineConfig, role: Role) -> float | None:
    """The longest step of a worker whose chunk adapts when no interactive stream decodes: an eighth of the
    interactive TTFT budget, so that an interactive prompt arriving meanwhile is not held for long (None:
    no cap, the fixed chunk; a prefill worker, which runs no decodes, keeps the whole chunk)."""
    if itl_budget_ms(config, role) is None or role is Role.PREFILL:
        return None
    return config.ttft_budget_ms * IDLE_STEP_SHARE_OF_TTFT
