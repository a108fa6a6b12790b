"""Plain-text rendering of a run record, and the SLO flags every measuring command shares."""
from __future__ import annotations

import argparse

from homepd.config import env_default
from homepd.core.terms import ClassBudget, RequestClass
from homepd.errors import ConfigError
from homepd.measure.memory import render_breakdown
from homepd.measure.metrics import SLO, Dist, TokenTarget
from homepd.measure.replay import RunRecord

MIB = 2 ** 20


def fmt(x, spec: str = ".0f") -> str:
    return "NA" if x is None else format(x, spec)


def add_slo_flags(parser: argparse.ArgumentParser) -> None:
    """``--slo-ttft-ms``, ``--slo-itl-ms``, ``--slo-token``, ``--slo-tpot-ms``, ``--slo-background-ttft-ms``
    (each also ``HOMEPD_SLO_*``).  A target not given is the class budget's (``--ttft-budget``,
    ``--itl-budget``, ``--background-ttft-budget``): the engine's budgets are the SLO."""
    tokens = ", ".join(t.value for t in TokenTarget)
    parser.add_argument("--slo-ttft-ms", type=float, default=env_default("slo-ttft-ms", None, float),
                        help="interactive TTFT target for goodput (default: --ttft-budget)")
    parser.add_argument("--slo-itl-ms", type=float, default=env_default("slo-itl-ms", None, float),
                        help="interactive per-token target (default: --itl-budget), checked as --slo-token says")
    parser.add_argument("--slo-token", choices=[t.value for t in TokenTarget],
                        default=env_default("slo-token", TokenTarget.EVERY_GAP.value),
                        help=f"which statistic of a request's gaps must meet --slo-itl-ms ({tokens}; default "
                             f"gap: every gap, so a stall fails the request)")
    parser.add_argument("--slo-tpot-ms", type=float, default=env_default("slo-tpot-ms", None, float),
                        help="shorthand for --slo-token tpot --slo-itl-ms N (the mean time per output token)")
    parser.add_argument("--slo-background-ttft-ms", type=float,
                        default=env_default("slo-background-ttft-ms", None, float),
                        help="background TTFT target (default: --background-ttft-budget)")


def slo_from_args(args: argparse.Namespace, budgets: dict[RequestClass, ClassBudget]) -> SLO:
    """The SLO the flags state, over the class budgets ``budgets`` (``EngineConfig.class_budgets``)."""
    token, itl_ms = TokenTarget(args.slo_token), args.slo_itl_ms
    if args.slo_tpot_ms is not None:
        if itl_ms is not None or token not in (TokenTarget.EVERY_GAP, TokenTarget.MEAN_TPOT):
            raise ConfigError("--slo-tpot-ms is --slo-token tpot --slo-itl-ms N: give one or the other")
        token, itl_ms = TokenTarget.MEAN_TPOT, args.slo_tpot_ms
    for name, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-itl-ms", itl_ms),
                        ("--slo-background-ttft-ms", args.slo_background_ttft_ms)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be a positive number of milliseconds, got {value:g}")
    return SLO.from_budgets(budgets, ttft_ms=args.slo_ttft_ms, itl_ms=itl_ms, token_target=token,
                            background_ttft_ms=args.slo_background_ttft_ms)


def dist_line(name: str, d: Dist, spec: str = ".0f") -> str:
    return (f"{name:<6} mean {fmt(d.mean, spec):>7}  p50 {fmt(d.p50, spec):>7}  p90 {fmt(d.p90, spec):>7}  "
            f"p99 {fmt(d.p99, spec):>7}  max {fmt(d.max, spec):>7} ms")


def prompt_reuse_line(s) -> str:
    """'prompt tokens: 900 computed, 2100 reused from cached prefixes (70%)' (finished requests)."""
    share = s.cached_prompt_share
    return (f"prompt tokens: {s.n_computed_prompt_tokens} computed, {s.n_cached_prompt_tokens} reused from cached "
            f"prefixes ({fmt(share and share * 100)}%)")


def render_run(record: RunRecord, kinds: list[str] | None = None, n_stalls: int = 5) -> str:
    """The ``homepd run`` report: per request, then run figures, stalls, worker events, memory, energy."""
    out = [f"{'request':<16}{'kind':<7}{'prompt':>7}{'reused':>7}{'out':>5}{'queue ms':>10}{'TTFT ms':>9}"
           f"{'TPOT ms':>9}  finish"]
    for i, r in enumerate(record.requests):
        kind = kinds[i] if kinds and i < len(kinds) else ""
        out.append(f"{r.request_id[-16:]:<16}{kind:<7}{r.n_prompt_tokens:>7}{r.n_cached_tokens:>7}"
                   f"{len(r.token_times_s):>5}"
                   f"{fmt(r.queue_wait_s and r.queue_wait_s * 1e3):>10}{fmt(r.ttft_s and r.ttft_s * 1e3):>9}"
                   f"{fmt(r.tpot_s and r.tpot_s * 1e3, '.1f'):>9}  {r.finish_reason or r.state.value}"
                   f"{' ' + r.error if r.error else ''}")
    s = record.summary
    out += ["", f"{s.n_finished}/{s.n_requests} finished in {s.span_s:.1f} s ({s.n_failed} failed, "
                f"{s.n_resumed} resumed); prompt {fmt(s.prompt_tok_s)} tok/s, output {fmt(s.output_tok_s, '.1f')} "
                f"tok/s, {fmt(s.request_per_s, '.2f')} req/s",
            dist_line("TTFT", s.ttft_ms), dist_line("TPOT", s.tpot_ms, ".1f"), dist_line("ITL", s.itl_ms, ".1f"),
            dist_line("E2E", s.e2e_ms), dist_line("queue", s.queue_ms),
            f"goodput {fmt(s.goodput_per_s, '.2f')} req/s: {s.n_slo_met}/{s.n_requests} met {s.slo.describe()}",
            prompt_reuse_line(s)]
    inter = s.interference
    out.append(f"steps {s.n_steps}, at most {s.max_prompt_tokens_per_step} prompt tokens in one step; "
               f"interference: decode step alone {fmt(inter.decode_only_ms, '.1f')} ms "
               f"(n={inter.decode_only_steps}), "
               f"{'beside a prefill step' if s.interference_kind == 'concurrent' else 'with prompt tokens'} "
               f"{fmt(inter.mixed_ms, '.1f')} ms (n={inter.mixed_steps}); x{fmt(inter.slowdown, '.2f')} at equal "
               f"batch size")
    if s.kv is not None:
        kv = s.kv
        out.append(f"KV handoff: {kv.n_moved} requests, {kv.bytes_mean / 1e6:.1f} MB each on average; transfer "
                   f"(prompt done -> imported) p50/p99 {fmt(kv.transfer_ms.p50, '.1f')}/{fmt(kv.transfer_ms.p99, '.1f')}"
                   f" ms; export {fmt(kv.export_ms_p50, '.2f')} ms, import {fmt(kv.import_ms_p50, '.2f')} ms, "
                   f"extent wait p95 {fmt(kv.extent_wait_ms_p95, '.1f')} ms")
    if record.stalls:
        out.append(f"stalls over {fmt(s.slo.itl_ms)} ms: {len(record.stalls)} "
                   f"(worst {min(n_stalls, len(record.stalls))}):")
        for st in record.stalls[:n_stalls]:
            who = ", ".join(f"{c.request_id} ({c.n_prompt_tokens} prompt tokens, {c.held_ms:.0f} ms"
                            f"{'' if c.same_step else ', concurrent'}{c.grant_note})"
                            for c in st.culprits[:3]) or "no prompt"
            store = f", KV store saves and restores {st.store_ms:.0f} ms" if st.store_ms >= 1 else ""
            out.append(f"  {st.request_id} token {st.token_index}: {st.gap_ms:.0f} ms gap, held by {who}{store}")
    for ev in record.worker_events:
        extra = f", back after {ev.recovery_s:.2f} s" if ev.recovery_s is not None else ""
        held = (f"; resumed {len(ev.resumed_from_extent)} from their extent, {len(ev.recomputed_requests)} by "
                f"recompute, {len(ev.failed_requests)} lost") if ev.kind.value == "died" else ""
        out.append(f"worker {ev.role} (pid {ev.pid}) {ev.kind.value}{extra}{held}{': ' + ev.cause if ev.cause else ''}")
    mb = lambda b: "NA" if b is None else f"{b / MIB:.0f}"  # noqa: E731
    for m in record.memory:
        out.append(f"{m.role} memory (peak MiB): RSS {mb(m.rss_bytes)}, PSS {mb(m.pss_bytes)}, USS {mb(m.uss_bytes)}")
    if record.memory:
        out.append(f"total PSS of every homepd process: {mb(record.total_pss_bytes)} MiB")
    if record.kv_arena_bytes:
        out.append(f"KV arena: {mb(record.kv_arena_bytes)} MiB of pre-faulted shared memory (in the PSS above); "
                   f"peak use {mb(record.arena_peak_bytes)} MiB with {mb(record.arena_peak_kv_bytes)} MiB of KV in "
                   "transit then")
    if record.memory_breakdown is not None:
        out += render_breakdown(record.memory_breakdown)
    energy = {k: v for k, v in record.energy_j.items() if v is not None}
    out.append("energy: " + (", ".join(f"{k} {v:.1f} J" for k, v in energy.items()) if energy
                             else "NA (no RAPL counters or GPU energy readable on this box)"))
    return "\n".join(out)
