"""The ``WorkerSpec`` each worker of an engine is started with, from the config and the resolved setup."""
from __future__ import annotations

from homepd.config import EngineConfig, max_cached_cells
from homepd.core.protocol import EngineSetup, WorkerSpec
from homepd.engine.topology import topology_for


def worker_specs(config: EngineConfig, setup: EngineSetup) -> dict[str, WorkerSpec]:
    """The spec of every worker the engine starts, by its name (its topology's ``worker_roles``)."""
    specs = {}
    for name, role in topology_for(config.mode).worker_roles(config, setup).items():
        place = setup.placements[name]
        specs[name] = WorkerSpec(
            role=role, model_path=setup.model_path,
            n_ctx=place.n_ctx or config.n_ctx, n_seq_max=config.n_seq_max,
            chunk=config.chunk, n_threads=place.n_threads, cpu_cores=place.cpu_cores,
            n_gpu_layers=999 if place.n_gpu_layers < 0 else place.n_gpu_layers, fault=config.fault,
            cuda_visible_devices=place.cuda_visible_devices or "", model_fingerprint=setup.model_fingerprint,
            backend=config.backend, itl_budget_ms=config.itl_budget_ms if config.adaptive_chunk else None,
            max_cached_cells=max_cached_cells(config, place.n_ctx or config.n_ctx))
    return specs
