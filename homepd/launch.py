"""What an engine needs before it starts: the model file, its fingerprint, where each worker runs.

Faces (``homepd run``, ``serve``, ``advise``, the app) call ``prepare`` — which
may pull a catalog model (``pull=True``, an interactive command) or refuse to
(``pull=False``, a service) — and hand the result to ``Engine``.  The engine
itself never downloads, probes or plans.
"""
from __future__ import annotations

import functools

from homepd.config import ADVICE_TABLE, EngineConfig, config_file_values, read_config_file
from homepd.config.origin import SERVING_FIELDS, ConfigOrigin
from homepd.config.origin import config_origin as origin_of
from homepd.core.protocol import EngineSetup, RolePlacement
from homepd.engine.topology import topology_for
from homepd.errors import EngineError
from homepd.models.gguf import read_gguf_header
from homepd.models.resolve import fingerprint, resolve_model

KV_BYTES_PER_TOKEN_GUESS = 64 << 10  # placement plan's memory check when the GGUF header does not say


def model_file(config: EngineConfig, *, pull: bool = False, progress: bool = False) -> str:
    """The path ``config``'s backend loads ``config.model`` from: the fake's own for the fake backend (nothing to
    pull), else the GGUF's (a missing catalog model is pulled when ``pull``, else named in a ``ModelError``)."""
    if config.backend == "fake":
        from homepd.fakellm import FAKE_MODEL_PATH  # why: `homepd --help` does not load the fake (1.5 ms)

        return FAKE_MODEL_PATH if config.model == EngineConfig.model else config.model
    return str(resolve_model(config.model, config.models_dir, pull=pull, progress=progress))


def prepare(config: EngineConfig, *, pull: bool = True, progress: bool = True, box=None) -> EngineSetup:
    """Resolve ``config.model`` (pulling a missing catalog model when ``pull``), fingerprint it and place
    the workers (``box``: a ``BoxProbe`` to plan on, else this box is probed when the plan is needed)."""
    config = config.validated()
    if config.backend != "fake":
        from homepd.hw.isa import check_build  # why: `homepd --help` does not load the build guard

        check_build()  # before any process loads llama.cpp: a build for another CPU is refused, not a SIGILL
    path = model_file(config, pull=pull, progress=progress)
    identity = "f" * 64 if config.backend == "fake" else fingerprint(path)
    topology = topology_for(config.mode)
    if box is None and topology.needs_plan:
        # why: psutil (the probe) loads only when a plan is needed
        from homepd.hw.probe import probe

        box = probe()  # once: the placements and the arena are planned on the same reading
    plan = functools.cache(lambda: placement_plan(config, path, box))
    return EngineSetup(path, identity, topology.placements(config, plan), topology.kv_arena_bytes(config, plan),
                       kv_store_bytes(config, path, plan if topology.needs_plan else None))


def kv_store_bytes(config: EngineConfig, model_path: str, plan=None) -> int:
    """The KV store tier's size: ``--kv-store``, else the placement plan's (``plan``: its thunk; None: from
    the free RAM less one worker, without probing the whole box); 0 on the fake backend unless given (its
    tests measure the logic they name)."""
    if config.kv_store_bytes is not None:
        return config.kv_store_bytes
    if config.backend == "fake" or not config.prefix_cache:
        return 0
    if plan is not None:
        return plan().store_bytes
    # why: psutil (the probe) loads only when the store is sized here
    from homepd.hw.placement import store_bytes_for
    from homepd.hw.probe import probe_memory

    header = read_gguf_header(model_path)
    per_token = header.kv_bytes_per_token or KV_BYTES_PER_TOKEN_GUESS
    return store_bytes_for(probe_memory().ram_available_bytes, header.size_bytes + config.n_ctx * per_token)


def kv_arena_bytes(config: EngineConfig, model_path: str, box=None) -> int | None:
    """The KV arena's size for ``config``'s topology (disaggregated: ``--kv-arena``, else the placement
    plan's); None for a topology without one.  Refuses an arena that does not fit, naming the numbers."""
    return topology_for(config.mode).kv_arena_bytes(config, lambda: placement_plan(config, model_path, box))


def placements(config: EngineConfig, model_path: str, box=None) -> dict[str, RolePlacement]:
    """Per worker: pinned cores, threads, GPU and offload, by the topology's placement rule (colocated: the
    config's; disaggregated: per-role flags where given, else the placement plan, as ``homepd probe``
    shows it; replicas: the plan's ``replica-N`` workers)."""
    return topology_for(config.mode).placements(config, lambda: placement_plan(config, model_path, box))


def placement_plan(config: EngineConfig, model_path: str, box=None):
    """The placement plan for ``config`` on ``box`` (probed when None), sized from the model's GGUF header:
    the decode (and colocated) worker's KV for ``n_ctx``, the prefill worker's for its own context, and
    the KV arena (``--kv-arena``, else the plan's default)."""
    # why: psutil (the probe) loads only when a plan is needed
    from homepd.hw.placement import plan_placement, prefill_context
    from homepd.hw.probe import probe

    if config.backend == "fake":
        model_bytes, per_token = 1 << 20, 1024
    else:
        header = read_gguf_header(model_path)
        model_bytes, per_token = header.size_bytes, header.kv_bytes_per_token or KV_BYTES_PER_TOKEN_GUESS
    return plan_placement(box if box is not None else probe(), model_bytes=model_bytes,
                          kv_bytes=config.n_ctx * per_token,
                          prefill_kv_bytes=prefill_context(config.n_ctx, config.prefill_n_ctx) * per_token,
                          transfer_bytes=config.kv_arena_bytes, n_replicas=config.n_replicas,
                          store_bytes=config.kv_store_bytes)


def config_origin(config: EngineConfig, document: dict | None = None) -> ConfigOrigin:
    """Which configuration ``config`` serves with and why (applied advice, the built-in default, or set by
    hand), from the config file in force (``document``: its parsed TOML, default: read it)."""
    document = read_config_file() if document is None else document
    defaults = EngineConfig()
    return origin_of({n: getattr(config, n) for n in SERVING_FIELDS}, {n: getattr(defaults, n) for n in SERVING_FIELDS},
                     config_file_values(EngineConfig, None, document), document.get(ADVICE_TABLE) or {},
                     topology_for(config.mode).describe(config))


class RestartFailed(EngineError):
    """The engine in the new configuration did not start (``error``).  ``restored`` is an engine of the
    previous configuration started again in its place, or None if that could not start either (``again``)."""

    def __init__(self, error: BaseException, restored=None, again: BaseException | None = None):
        self.error, self.restored, self.again = error, restored, again
        super().__init__(f"the new configuration could not start ({error})" +
                         ("; the previous one runs again" if restored is not None else
                          f", nor the previous one ({again})" if again is not None else ""))


async def replace_engine(old, config: EngineConfig, setup: EngineSetup, make):
    """Stop ``old`` (None: nothing runs) and start ``make(config, setup)``, an unstarted engine, in its place:
    the one owner of a switch's fallback, for the service and the app.

    ``setup`` comes from ``prepare``, called before anything stopped, so a configuration that cannot be placed
    is refused while ``old`` still serves.  If the new engine cannot start, ``old``'s configuration is started
    again and RestartFailed carries it (``restored``); if that fails too, or there was no ``old``, RestartFailed
    has ``restored`` None.
    """
    if old is not None:
        await old.stop()
    try:
        engine = make(config, setup)
        await engine.start()
        return engine
    except Exception as exc:
        if old is None:
            raise RestartFailed(exc, None, None) from None
        error = exc
    try:
        back = make(old.config, old.setup)
        await back.start()
    except Exception as again:
        raise RestartFailed(error, None, again) from None
    raise RestartFailed(error, back) from None
