"""``homepd probe``: the probe and the placement plan as text or JSON (the CLI face of ``probe``)."""
from __future__ import annotations

import argparse
from typing import Any

from homepd.config import cached_cells_for
from homepd.errors import HomepdError
from homepd.hw.probe import BoxProbe, fmt_bytes, probe, to_json
from homepd.models.catalog import DEFAULT_MODEL
from homepd.models.gguf import read_gguf_header
from homepd.models.resolve import resolve_model


def _na(value: Any, unit: str = "") -> str:
    return "NA" if value is None else f"{value}{unit}"


def _cpu_ranges(cpus: tuple[int, ...]) -> str:
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def render_text(box: BoxProbe) -> str:
    """The probe as the lines ``homepd probe`` prints."""
    cpu, mem, nv = box.cpu, box.memory, box.nvml
    lines = [
        f"host       {box.hostname}",
        f"CPU        {_na(cpu.model)}: {_na(cpu.physical_cores)} physical / "
        f"{_na(cpu.logical_cores)} logical cores, usable CPUs {_cpu_ranges(cpu.usable_cpus)}",
        f"RAM        {fmt_bytes(mem.ram_total_bytes)} total, {fmt_bytes(mem.ram_available_bytes)}"
        f" available; swap {fmt_bytes(mem.swap_used_bytes)} used of {fmt_bytes(mem.swap_total_bytes)}",
    ]
    if nv.is_available:
        lines.append(f"NVIDIA     driver {_na(nv.driver_version)}, CUDA {_na(nv.cuda_version)}, "
                     f"{len(box.gpus)} GPU(s)")
    else:
        lines.append(f"NVIDIA     no GPUs ({nv.error})")
    for g in box.gpus:
        energy = "NA" if g.energy_mj is None else f"{g.energy_mj / 1000:.0f} J"
        lines += [
            f"GPU {g.index}      {_na(g.name)}  {_na(g.uuid)}",
            f"           VRAM {fmt_bytes(g.vram_used_bytes)} used of {fmt_bytes(g.vram_total_bytes)}; "
            f"PCIe gen{_na(g.pcie_gen)} x{_na(g.pcie_width)} = {_na(g.pcie_gb_s, ' GB/s')} "
            f"(max gen{_na(g.pcie_max_gen)} x{_na(g.pcie_max_width)} = {_na(g.pcie_max_gb_s, ' GB/s')})",
            f"           power {_na(g.power_w, ' W')} of {_na(g.power_limit_w, ' W')}; "
            f"{_na(g.temperature_c, ' C')}; util {_na(g.utilization_pct, '%')} "
            f"(memory {_na(g.memory_utilization_pct, '%')}); energy counter {energy}",
        ]
    readable = [z for z in box.rapl if z.energy_uj is not None]
    lines.append(f"RAPL       {', '.join(z.name for z in readable)}" if readable else
                 f"RAPL       {'no zones' if not box.rapl else 'zones present but unreadable (root only)'}")
    lc = box.llama_cpp
    if lc.is_installed:
        backends = "NA" if lc.backends is None else (", ".join(lc.backends) or "none reported")
        offload = {True: "yes", False: "no", None: "NA"}[lc.supports_gpu_offload]
        lines.append(f"llama.cpp  llama-cpp-python {_na(lc.version)}; GPU offload {offload}; "
                     f"backends {backends}")
    else:
        lines.append(f"llama.cpp  NA ({lc.error})")
    lines += [f"warning: {w}" for w in box.warnings]
    return "\n".join(lines)


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    clean = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if clean and clean[-1] in units:
            return int(float(clean[:-1]) * units[clean[-1]])
        return int(clean)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes, or 800M, 1.5G)")


def register(subparsers: Any) -> None:
    """Add ``homepd probe`` to the CLI."""
    parser = subparsers.add_parser(
        "probe", help="show this box's CPU, RAM, GPUs, llama.cpp build and placement plan")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default=None,
                        help="catalog name or GGUF path whose size (and KV size per token, from its header) "
                             "the placement plan uses; default: the default model if it is present")
    parser.add_argument("--n-ctx", type=int, default=4096, help="context (KV cells) for the KV size; default 4096")
    parser.add_argument("--model-bytes", type=_size, default=None,
                        help="model weight size for the placement plan (e.g. 1.1G); overrides --model")
    parser.add_argument("--kv-bytes", type=_size, default=None,
                        help="KV cache size for the configured context and sequences; overrides --model")
    parser.add_argument("--prefill-n-ctx", type=int, default=None,
                        help="disaggregated: the prefill worker's context (default n_ctx/4, at least 512)")
    parser.add_argument("--kv-arena", type=_size, default=None,
                        help="disaggregated: the KV arena's size (default: the plan's, from the prefill context)")
    parser.add_argument("--kv-store", type=_size, default=None,
                        help="the KV store tier's size (default: the plan's, from free RAM)")
    parser.add_argument("--prefix-cache-cells", type=int, default=None,
                        help="KV cells cached prefixes may keep in a context (default: a quarter of --n-ctx)")
    parser.set_defaults(func=run)


def model_sizes(model: str | None, n_ctx: int) -> tuple[int, int, str | None]:
    """(model bytes, KV bytes for n_ctx, the path used) of a model present on disk; never pulls."""
    try:
        path = resolve_model(model or DEFAULT_MODEL, pull=False)
    except HomepdError:
        if model is not None:
            raise
        return 0, 0, None  # the default model is not pulled yet: sizes unknown
    header = read_gguf_header(path)
    return header.size_bytes, (header.kv_bytes_per_token or 0) * n_ctx, str(path)


def run(args: argparse.Namespace) -> int:
    """Probe the box, plan placement, print; exit code 0."""
    # why: `homepd --help` does not load the planner (4 ms)
    from homepd.hw.placement import plan_placement, prefill_context, render_plan_text

    box = probe()
    model_bytes, kv_bytes, _ = model_sizes(args.model, args.n_ctx)
    kv_bytes = kv_bytes if args.kv_bytes is None else args.kv_bytes
    prefill_n_ctx = prefill_context(args.n_ctx, args.prefill_n_ctx)
    plan = plan_placement(box, model_bytes if args.model_bytes is None else args.model_bytes, kv_bytes,
                          prefill_kv_bytes=kv_bytes * prefill_n_ctx // max(args.n_ctx, 1),
                          transfer_bytes=args.kv_arena, store_bytes=args.kv_store,
                          prefix_cache_bytes=kv_bytes * cached_cells_for(args.n_ctx, args.prefix_cache_cells)
                          // max(args.n_ctx, 1))
    if args.json:
        print(to_json(box, plan))
    else:
        print(render_text(box))
        print()
        print(render_plan_text(plan))
    return 0
