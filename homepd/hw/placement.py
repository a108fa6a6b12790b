"""Where prefill and decode run on this box, for both architectures, and whether they fit.

``plan_placement`` is pure: it reads a ``BoxProbe`` and sizes, touches no
hardware, and returns a frozen ``PlacementPlan`` the engine turns into worker
processes (device, pinned cores, ``n_threads``, ``n_gpu_layers``,
``CUDA_VISIBLE_DEVICES``).  One worker needs the model weights plus the KV cache
for the configured context and sequences.  Disaggregation needs it per role —
the decode worker's KV cache for the full context, the prefill worker's only
for the prompts it works on (``prefill_context``) — plus the KV arena, host
shared memory for the handoff (``arena_bytes_for``).  When that does not fit,
disaggregation is infeasible and the reason names the numbers: duplicated
weights and the KV transfer would cost more memory than the interference it
removes.
"""
from __future__ import annotations

import os

from dataclasses import dataclass

from homepd.hw.probe import BoxProbe, GpuInfo, fmt_bytes

# why: each CUDA process holds a context (~300-500 MiB) and compute buffers on
# top of weights and KV; two processes on one GPU pay it twice.
VRAM_RESERVE_BYTES = 512 << 20
# why: the OS, the engine's own process and the HTTP/TUI faces need room.
RAM_RESERVE_BYTES = 1 << 30
ALL_LAYERS = -1  # n_gpu_layers value that offloads every layer
MIN_PREFILL_N_CTX = 512
ARENA_SLACK_BYTES = 1 << 20  # per arena: extent headers, page rounding, llama.cpp's state overhead
MIN_ARENA_FRACTION = 8       # on a short box the arena may shrink to 1/8 of its default, no further
# the KV store tier's default: a quarter of the RAM the workers and the arena leave free, at most 8 GiB
# (llama-server's --cache-ram default), in whole MiB; 0 when RAM cannot be read
STORE_RAM_FRACTION = 4
MAX_DEFAULT_STORE_BYTES = 8 << 30


def store_bytes_for(ram_available_bytes: int | None, used_bytes: int, shm_free_bytes: int | None = None) -> int:
    """The default KV store size when the workers (and arena) take ``used_bytes`` of RAM; at most half of
    what /dev/shm has free (``shm_free_bytes``, default: read now), where the store's segments live."""
    if ram_available_bytes is None:
        return 0
    room = max(0, ram_available_bytes - RAM_RESERVE_BYTES - used_bytes) // STORE_RAM_FRACTION
    shm = shm_free() if shm_free_bytes is None else shm_free_bytes
    # why half of /dev/shm: a container's default is 64 MiB, and the KV arena and other programs use it too
    if shm is not None:
        room = min(room, shm // 2)
    return min(MAX_DEFAULT_STORE_BYTES, room) >> 20 << 20


def shm_free() -> int | None:
    """Bytes free in /dev/shm (None: no /dev/shm)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def prefill_context(n_ctx: int, prefill_n_ctx: int | None = None) -> int:
    """The prefill worker's context: ``prefill_n_ctx`` if given, else a quarter of ``n_ctx`` but at least
    ``MIN_PREFILL_N_CTX`` (never above ``n_ctx``).  Prompts longer than it are prefilled on the decode worker."""
    if prefill_n_ctx is not None:
        return min(prefill_n_ctx, n_ctx)
    return min(n_ctx, max(MIN_PREFILL_N_CTX, n_ctx // 4))


def arena_bytes_for(prefill_kv_bytes: int) -> int:
    """The default KV arena: room for everything the prefill worker's KV cache holds, plus slack for extent
    headers and llama.cpp's state overhead, in whole MiB."""
    return -(-(prefill_kv_bytes + ARENA_SLACK_BYTES) // (1 << 20)) * (1 << 20)


@dataclass(frozen=True)
class WorkerPlacement:
    role: str                      # "colocated", "prefill" or "decode"
    device: str                    # "cpu" or "cuda:N" (N is the NVML index)
    cpu_cores: tuple[int, ...]     # logical CPUs the worker is pinned to
    n_threads: int                 # one per physical core it owns
    n_gpu_layers: int              # 0 on CPU, -1 (all) on a GPU
    cuda_visible_devices: str      # value for the worker's env; "" hides every GPU
    memory_bytes: int              # weights + KV it holds on its device


@dataclass(frozen=True)
class ColocatedPlacement:
    workers: tuple[WorkerPlacement, ...]  # one per replica (two on a 2-GPU box)
    feasible: bool
    reason: str


@dataclass(frozen=True)
class DisaggregatedPlacement:
    prefill: WorkerPlacement | None
    decode: WorkerPlacement | None
    transfer_bytes: int            # host shared memory for the KV handoff: the KV arena
    feasible: bool
    reason: str
    total_bytes: int = 0           # both workers and the arena


@dataclass(frozen=True)
class ReplicasPlacement:
    workers: tuple[WorkerPlacement, ...]  # n colocated workers; requests go to the least loaded
    feasible: bool
    reason: str


@dataclass(frozen=True)
class MemoryFit:
    worker_bytes: int                    # model + KV for one worker (colocated, decode, replica)
    ram_available_bytes: int | None
    fits_ram_once: bool
    fits_ram_twice: bool                 # the prefill and decode workers + the KV arena
    gpu_indices: tuple[int, ...]         # the GPUs homepd may use, by NVML index
    vram_free_bytes: tuple[int | None, ...]
    fits_vram_once: tuple[bool, ...]     # per usable GPU
    fits_vram_twice: tuple[bool, ...]    # prefill and decode workers on that one GPU
    prefill_worker_bytes: int = 0        # model + the prefill worker's KV (its smaller context)


@dataclass(frozen=True)
class PlacementPlan:
    model_bytes: int
    kv_bytes: int
    prefill_kv_bytes: int
    uses_gpus: bool
    memory: MemoryFit
    colocated: ColocatedPlacement
    disaggregated: DisaggregatedPlacement
    replicas: ReplicasPlacement
    notes: tuple[str, ...]
    store_bytes: int = 0  # the KV store tier (host shared memory for prefixes evicted from contexts)
    prefix_cache_bytes: int = 0  # of kv_bytes: what the cells cached prefixes may keep in a context hold


def _fits(need_bytes: int, have_bytes: int | None) -> bool:
    return have_bytes is not None and need_bytes <= have_bytes


def _vram_once(g: GpuInfo, worker_bytes: int) -> bool:
    return _fits(worker_bytes + VRAM_RESERVE_BYTES, g.vram_free_bytes)


def _vram_twice(g: GpuInfo, worker_bytes: int, other_bytes: int | None = None) -> bool:
    other = worker_bytes if other_bytes is None else other_bytes
    return _fits(worker_bytes + other + 2 * VRAM_RESERVE_BYTES, g.vram_free_bytes)


CoreGroups = tuple[tuple[int, ...], ...]  # logical CPUs, grouped by physical core


def _split(groups: CoreGroups, n_first: int) -> tuple[CoreGroups, CoreGroups]:
    return groups[:n_first], groups[n_first:]


def _worker(role: str, gpu: GpuInfo | None, groups: CoreGroups,
            memory_bytes: int) -> WorkerPlacement:
    cores = tuple(sorted(c for g in groups for c in g))
    if gpu is None:
        return WorkerPlacement(role, "cpu", cores, len(groups), 0, "", memory_bytes)
    # why: the UUID names the GPU whatever CUDA_DEVICE_ORDER is; inside the
    # worker the chosen GPU is then device 0
    visible = gpu.uuid or str(gpu.index)
    return WorkerPlacement(role, f"cuda:{gpu.index}", cores, len(groups), ALL_LAYERS,
                           visible, memory_bytes)


def _colocated(gpus: tuple[GpuInfo, ...], groups: CoreGroups, need: int,
               fit: MemoryFit) -> ColocatedPlacement:
    roomy = [g for g in gpus if _vram_once(g, need)]
    if len(roomy) >= 2 and len(groups) >= 2:
        a, b = _split(groups, len(groups) // 2)
        workers = (_worker("colocated", roomy[0], a, need), _worker("colocated", roomy[1], b, need))
        return ColocatedPlacement(workers, True, "two colocated replicas, one per GPU; "
                                  "requests are spread over both")
    if roomy:
        why = f"colocated on cuda:{roomy[0].index}"
        others = [g for g in gpus if g is not roomy[0]]
        if others:
            why += "; " + "; ".join(
                f"cuda:{g.index} has {fmt_bytes(g.vram_free_bytes)} free, too little for a "
                "second replica" if g.vram_free_bytes is not None else
                f"cuda:{g.index} VRAM is NA" for g in others)
        return ColocatedPlacement((_worker("colocated", roomy[0], groups, need),), True, why)
    worker = _worker("colocated", None, groups, need)
    prefix = ""
    if gpus:
        prefix = (f"model + KV ({fmt_bytes(need)}) does not fit the free VRAM of any GPU "
                  f"(largest {fmt_bytes(max((g.vram_free_bytes or 0) for g in gpus))}); ")
    if fit.fits_ram_once:
        return ColocatedPlacement((worker,), True,
                                  prefix + f"colocated on the CPU with {worker.n_threads} threads")
    return ColocatedPlacement((worker,), False, prefix + (
        f"model + KV ({fmt_bytes(need)}) does not fit in RAM "
        f"({fmt_bytes(fit.ram_available_bytes)} available, {fmt_bytes(RAM_RESERVE_BYTES)} kept "
        "for the system); use a smaller quantisation, context or fewer sequences"))


def _disaggregated(gpus: tuple[GpuInfo, ...], groups: CoreGroups, model: int, need: int, prefill_need: int,
                   transfer: int, fit: MemoryFit, ram: int | None) -> DisaggregatedPlacement:
    total = need + prefill_need + transfer

    def plan(prefill, decode, reason):
        return DisaggregatedPlacement(prefill, decode, transfer, True, reason, total)

    def refuse(reason):
        return DisaggregatedPlacement(None, None, transfer, False, reason, total)

    if len(groups) < 2:
        return refuse("needs at least 2 physical cores to pin prefill and decode apart; "
                      f"this box lets homepd use {len(groups)}")
    if not _fits(transfer + RAM_RESERVE_BYTES, ram):
        return refuse(f"the KV arena needs {fmt_bytes(transfer)} of shared memory; "
                      f"RAM has {fmt_bytes(ram)} available")
    half_a, half_b = _split(groups, (len(groups) + 1) // 2)
    roomy = sorted((g for g in gpus if _vram_once(g, need)),
                   key=lambda g: g.vram_free_bytes or 0, reverse=True)
    if len(roomy) >= 2:
        # why: decode keeps the KV of every running sequence, so it gets the larger GPU
        decode_gpu, prefill_gpu = roomy[0], roomy[1]
        return plan(_worker("prefill", prefill_gpu, half_a, prefill_need),
                    _worker("decode", decode_gpu, half_b, need),
                    f"prefill on cuda:{prefill_gpu.index}, decode on cuda:{decode_gpu.index} "
                    "(the one with more free VRAM, it holds every running sequence's KV); "
                    "KV moves GPU -> host shared memory -> GPU over PCIe")
    if roomy and _vram_twice(roomy[0], need, prefill_need):
        g = roomy[0]
        return plan(_worker("prefill", g, half_a, prefill_need), _worker("decode", g, half_b, need),
                    f"two processes share cuda:{g.index} (its VRAM holds both); "
                    "the GPU time-slices between them, so interference is reduced, not removed")
    decode_ram = need + transfer + RAM_RESERVE_BYTES
    if roomy and _fits(decode_ram, ram):
        g = roomy[0]
        one, rest = _split(groups, 1)
        return plan(_worker("prefill", g, one, prefill_need), _worker("decode", None, rest, need),
                    f"cuda:{g.index} holds only one copy, so prefill runs on it and decode on "
                    f"the CPU with {len(rest)} threads; decode is slower per token there")
    if fit.fits_ram_twice:
        prefix = "no GPU has room for model + KV; " if gpus else ""
        return plan(_worker("prefill", None, half_a, prefill_need), _worker("decode", None, half_b, need),
                    prefix + f"CPU cores split: prefill pinned to {len(half_a)} physical "
                    f"core(s), decode to {len(half_b)}")
    where = (f"the largest GPU has {fmt_bytes(max((g.vram_free_bytes or 0) for g in gpus))} free "
             f"VRAM (both workers need {fmt_bytes(need + prefill_need + 2 * VRAM_RESERVE_BYTES)}) and "
             if gpus else "")
    return refuse(
        f"model + KV does not fit twice: {where}RAM has {fmt_bytes(ram)} available, and needs "
        f"{fmt_bytes(total + RAM_RESERVE_BYTES)}: prefill worker {fmt_bytes(prefill_need)} (model "
        f"{fmt_bytes(model)} + KV {fmt_bytes(prefill_need - model)}) + decode worker {fmt_bytes(need)} (model "
        f"{fmt_bytes(model)} + KV {fmt_bytes(need - model)}) + KV arena {fmt_bytes(transfer)} + "
        f"{fmt_bytes(RAM_RESERVE_BYTES)} for the system; duplicated weights + "
        "KV transfer would cost more memory than the interference disaggregation removes")


def _replicas(gpus: tuple[GpuInfo, ...], groups: CoreGroups, need: int, fit: MemoryFit,
              ram: int | None, n_replicas: int) -> ReplicasPlacement:
    """n colocated workers, each with its own copy of the model: one per GPU, or the CPU cores split."""
    def refuse(reason):
        return ReplicasPlacement((), False, reason)

    if n_replicas < 2:
        return refuse("a replica count below 2 is plain colocated serving")
    roomy = [g for g in gpus if _vram_once(g, need)]
    if len(roomy) >= n_replicas and len(groups) >= n_replicas:
        size = len(groups) // n_replicas
        workers = tuple(_worker(f"replica-{i}", roomy[i], groups[i * size:(i + 1) * size], need)
                        for i in range(n_replicas))
        return ReplicasPlacement(workers, True, f"{n_replicas} colocated replicas, one per GPU "
                                                "(" + ", ".join(f"cuda:{g.index}" for g in roomy[:n_replicas]) + ")")
    if len(groups) < n_replicas:
        return refuse(f"needs at least {n_replicas} physical cores for {n_replicas} CPU replicas; "
                      f"this box lets homepd use {len(groups)}")
    total = n_replicas * need + RAM_RESERVE_BYTES
    if not _fits(total, ram):
        return refuse(f"{n_replicas} copies of model + KV need {fmt_bytes(total)} with the system's share; "
                      f"RAM has {fmt_bytes(ram)} available")
    size = len(groups) // n_replicas
    workers = tuple(_worker(f"replica-{i}", None, groups[i * size:(i + 1) * size], need)
                    for i in range(n_replicas))
    prefix = "no GPU pair has room for a replica each; " if gpus else ""
    return ReplicasPlacement(workers, True, prefix + f"{n_replicas} CPU replicas, each pinned to {size} "
                                                     "physical core(s); requests go to the least loaded")


def plan_placement(probe: BoxProbe, model_bytes: int, kv_bytes: int, *,
                   transfer_bytes: int | None = None, n_replicas: int = 2,
                   prefill_kv_bytes: int | None = None, store_bytes: int | None = None,
                   prefix_cache_bytes: int = 0) -> PlacementPlan:
    """Place prefill and decode for colocated and disaggregated serving on ``probe``'s box.

    ``kv_bytes`` is the KV cache for the configured context and sequences, held
    by a colocated, decode or replica worker; ``prefill_kv_bytes`` the prefill
    worker's (its context holds only the prompts it works on; default
    ``kv_bytes``); ``transfer_bytes`` the KV arena, host shared memory for the
    handoff (default: ``arena_bytes_for(prefill_kv_bytes)``, shrunk down to an eighth
    of that when RAM is short — longer prompts then prefill on the decode worker); ``store_bytes`` the KV
    store tier (default: ``store_bytes_for`` the RAM the most demanding mode leaves).
    """
    assert model_bytes >= 0 and kv_bytes >= 0
    prefill_kv = kv_bytes if prefill_kv_bytes is None else prefill_kv_bytes
    need, prefill_need = model_bytes + kv_bytes, model_bytes + prefill_kv
    notes: list[str] = []
    ram = probe.memory.ram_available_bytes
    if transfer_bytes is not None:
        transfer = transfer_bytes
    else:
        transfer = arena_bytes_for(prefill_kv)
        room = None if ram is None else ram - RAM_RESERVE_BYTES - need - prefill_need
        if room is not None and transfer // MIN_ARENA_FRACTION <= room < transfer:
            notes.append(f"KV arena shrunk to {fmt_bytes(room)} (from {fmt_bytes(transfer)}) to fit RAM: prompts "
                         "whose KV does not fit it are prefilled on the decode worker")
            transfer = room
    groups = probe.cpu.core_groups or tuple((c,) for c in probe.cpu.usable_cpus)
    gpus = tuple(g for g in probe.gpus if g.vram_total_bytes is not None)
    if len(gpus) < len(probe.gpus):
        notes.append("GPUs whose VRAM NVML cannot read are left out")
    if gpus and probe.llama_cpp.supports_gpu_offload is False:
        notes.append("llama.cpp is CPU-only, so the GPUs are not used (see the warning above)")
        gpus = ()
    if model_bytes == 0:
        notes.append("model size is 0 (not given): the memory checks are trivially true; "
                     "pass --model-bytes and --kv-bytes")
    fit = MemoryFit(
        worker_bytes=need, ram_available_bytes=ram,
        fits_ram_once=_fits(need + RAM_RESERVE_BYTES, ram),
        fits_ram_twice=_fits(need + prefill_need + transfer + RAM_RESERVE_BYTES, ram),
        gpu_indices=tuple(g.index for g in gpus),
        vram_free_bytes=tuple(g.vram_free_bytes for g in gpus),
        fits_vram_once=tuple(_vram_once(g, need) for g in gpus),
        fits_vram_twice=tuple(_vram_twice(g, need, prefill_need) for g in gpus),
        prefill_worker_bytes=prefill_need,
    )
    if store_bytes is None:
        store_bytes = store_bytes_for(ram, max(need + prefill_need + transfer, n_replicas * need))
    return PlacementPlan(
        model_bytes=model_bytes, kv_bytes=kv_bytes, prefill_kv_bytes=prefill_kv, uses_gpus=bool(gpus), memory=fit,
        store_bytes=store_bytes, prefix_cache_bytes=min(prefix_cache_bytes, kv_bytes),
        colocated=_colocated(gpus, groups, need, fit),
        disaggregated=_disaggregated(gpus, groups, model_bytes, need, prefill_need, transfer, fit, ram),
        replicas=_replicas(gpus, groups, need, fit, ram, n_replicas),
        notes=tuple(notes),
    )


def _worker_line(w: WorkerPlacement) -> str:
    cores = ",".join(map(str, w.cpu_cores))
    gpu = f", n_gpu_layers={w.n_gpu_layers}, CUDA_VISIBLE_DEVICES={w.cuda_visible_devices}" \
        if w.device != "cpu" else ""
    return (f"    {w.role:<9} {w.device:<7} cores [{cores}] n_threads={w.n_threads}{gpu}, "
            f"holds {fmt_bytes(w.memory_bytes)}")


def render_plan_text(plan: PlacementPlan) -> str:
    """The plan as the lines ``homepd probe`` prints under the probe."""
    m = plan.memory
    d = plan.disaggregated
    cached = f" (cached prefixes up to {fmt_bytes(plan.prefix_cache_bytes)} of it)" if plan.prefix_cache_bytes else ""
    lines = [f"placement  model {fmt_bytes(plan.model_bytes)} + KV {fmt_bytes(plan.kv_bytes)}{cached} "
             f"= {fmt_bytes(m.worker_bytes)} per worker; fits in RAM once: {'yes' if m.fits_ram_once else 'no'}",
             f"           disaggregated: prefill {fmt_bytes(m.prefill_worker_bytes)} (KV "
             f"{fmt_bytes(plan.prefill_kv_bytes)}) + decode {fmt_bytes(m.worker_bytes)} + KV arena "
             f"{fmt_bytes(d.transfer_bytes)} = {fmt_bytes(d.total_bytes)}; fits in RAM: "
             f"{'yes' if m.fits_ram_twice else 'no'}"]
    lines.append(f"           KV store (prefixes evicted from the contexts, host shared memory): "
                 f"{fmt_bytes(plan.store_bytes)}")
    for i, once, twice in zip(m.gpu_indices, m.fits_vram_once, m.fits_vram_twice):
        lines.append(f"           cuda:{i} VRAM: once {'yes' if once else 'no'}, "
                     f"twice {'yes' if twice else 'no'}")
    c = plan.colocated
    lines.append(f"  colocated:     {'feasible' if c.feasible else 'INFEASIBLE'} - {c.reason}")
    lines += [_worker_line(w) for w in c.workers] if c.feasible else []
    lines.append(f"  disaggregated: {'feasible' if d.feasible else 'INFEASIBLE'} - {d.reason}")
    lines += [_worker_line(w) for w in (d.prefill, d.decode) if w is not None]
    r = plan.replicas
    lines.append(f"  replicas:      {'feasible' if r.feasible else 'INFEASIBLE'} - {r.reason}")
    lines += [_worker_line(w) for w in r.workers] if r.feasible else []
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
