"""Disaggregated: a prefill worker exports each request's KV into the shared-memory arena and a decode
worker imports it.  A prompt whose KV fits neither the prefill worker's context nor the arena is
prefilled on the decode worker itself; with ``local_prefill`` the gate may send a short one there too."""
from __future__ import annotations

from homepd.core.modes import Candidate, Mode, Role
from homepd.core.protocol import RolePlacement
from homepd.core.routing import MIN_PREFIX_GAIN_TOKENS, RouteReason
from homepd.engine.topology.base import Routed, Topology, no_cache
from homepd.engine.topology.handoff import ArenaHandoff
from homepd.errors import EngineError
from homepd.hw.placement import prefill_context
from homepd.kv.router import KVRouter


class Disaggregated(Topology):
    mode = Mode.DISAGGREGATED
    uses_kv_arena = True

    def worker_roles(self, config, setup):
        return {Role.PREFILL.value: Role.PREFILL, Role.DECODE.value: Role.DECODE}

    def placements(self, config, plan):
        c = config
        overrides = {Role.PREFILL: (c.prefill_cores, c.prefill_threads),
                     Role.DECODE: (c.decode_cores, c.decode_threads)}
        part = None
        if not all(cores for cores, _ in overrides.values()):
            part = self.plan_part(plan())
            if not part.feasible:
                raise EngineError(f"disaggregated serving is not feasible on this box: {part.reason}")
        out = {}
        n_ctx = {Role.PREFILL: prefill_context(c.n_ctx, c.prefill_n_ctx), Role.DECODE: None}
        for role, (cores, threads) in overrides.items():
            if cores:  # placed by hand: on the CPU, on these cores
                out[role.value] = RolePlacement(cpu_cores=tuple(cores), n_threads=threads or len(cores),
                                                n_ctx=n_ctx[role])
            else:
                planned = getattr(part, role.value)
                out[role.value] = RolePlacement(
                    cpu_cores=planned.cpu_cores or None, n_threads=threads or planned.n_threads,
                    cuda_visible_devices=planned.cuda_visible_devices or None,
                    n_gpu_layers=planned.n_gpu_layers, n_ctx=n_ctx[role])
        return out

    def kv_arena_bytes(self, config, plan):
        """``--kv-arena``, else the placement plan's (the prefill worker's KV plus slack, shrunk if RAM is
        short).  Refuses a configuration whose workers and arena do not fit RAM, naming the numbers."""
        p = plan()
        if not p.memory.fits_ram_twice and not p.uses_gpus:
            raise EngineError(f"disaggregated serving does not fit this box's RAM: {p.disaggregated.reason}")
        return p.disaggregated.transfer_bytes

    def plan_part(self, plan):
        return plan.disaggregated

    def make_handoff(self, config, setup, workers):
        # the placement plan's arena (else sized from the prefill worker's measured KV state bytes)
        return ArenaHandoff(KVRouter(setup.kv_arena_bytes, workers[Role.PREFILL].ready, max_extents=config.n_extents),
                            workers)

    def entry_worker(self, workers, kv, n_tokens=0, avoid=None):
        """The prefill worker, unless the prompt's KV fits its context or the arena not: then the decode
        worker prefills it itself (colocated-style, so it never waits for room that cannot come)."""
        if kv is None:
            return workers[Role.PREFILL]
        return workers[Role.PREFILL if kv.fits_prefill_worker(n_tokens) else Role.DECODE]

    def route_new(self, config, workers, kv, gate, load, n_tokens, cached=no_cache, request_class=None):
        """A prompt that fits the prefill worker is still prefilled on the decode worker when the gate
        predicts that is sooner, each side computing only its uncached tokens: a short prompt, or a
        conversation's next turn whose history the decode worker holds (it recorded prompt + output)."""
        worker = self.entry_worker(workers, kv, n_tokens)
        prefill, decode = workers[Role.PREFILL], workers[Role.DECODE]
        if worker is not prefill or not config.local_prefill or decode.failed:
            return Routed(worker, RouteReason.SOLE, min(cached(worker), n_tokens))
        n_local, n_remote = min(cached(decode), n_tokens), min(cached(prefill), n_tokens)
        if gate.route(n_tokens, prefill.spec, load(prefill), decode.spec, load(decode), n_local, n_remote):
            worker, n_cached, n_other = decode, n_local, n_remote
        else:
            worker, n_cached, n_other = prefill, n_remote, n_local
        reason = RouteReason.PREFIX_HIT if n_cached - n_other >= MIN_PREFIX_GAIN_TOKENS else RouteReason.SOONER
        return Routed(worker, reason, n_cached)

    def recovery_victim(self, config):
        return Role.DECODE.value

    def describe(self, config):
        return f"{self.mode}, " + ("learned routing" if config.local_prefill else "every prompt handed off")

    def advise_candidates(self, base, plan, chunks):
        """Every prompt handed off (the architecture itself), and the learned routing, which may keep a short
        prompt on the decode worker within its streams' ITL budget."""
        part = self.plan_part(plan)
        return [Candidate(Mode.DISAGGREGATED.value, Mode.DISAGGREGATED, chunk=base.chunk, feasible=part.feasible,
                          reason=part.reason or "every prompt that fits the prefill worker is handed off"),
                Candidate(f"{Mode.DISAGGREGATED.value}-routed", Mode.DISAGGREGATED, chunk=base.chunk,
                          local_prefill=True, feasible=part.feasible,
                          reason=part.reason or "learned routing: a short prompt may be prefilled on the decode "
                                                "worker, within its streams' ITL budget")]


TOPOLOGY = Disaggregated()
