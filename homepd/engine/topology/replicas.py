"""Replicas: ``n_replicas`` colocated workers (``replica-N``), each with its own model copy; a request
enters the one probably holding its longest prefix unless that one's queue would break its TTFT budget,
else the least loaded one that has not failed (``homepd.core.routing``); the engine serves while one
replica is left."""
from __future__ import annotations

from homepd.core.terms import RequestClass
from homepd.core.modes import Candidate, Mode, Role
from homepd.core.protocol import RolePlacement
from homepd.core.routing import ReplicaView, choose_replica
from homepd.engine.topology.base import Health, Routed, Topology, no_cache
from homepd.errors import EngineError


class Replicas(Topology):
    mode = Mode.REPLICAS

    def worker_roles(self, config, setup):
        return {name: Role.COLOCATED for name in sorted(setup.placements)}  # the plan's replica-N

    def placements(self, config, plan):
        part = self.plan_part(plan())
        if not part.feasible:
            raise EngineError(f"{config.n_replicas} replicas are not feasible on this box: {part.reason}")
        return {w.role: RolePlacement(cpu_cores=w.cpu_cores or None, n_threads=w.n_threads,
                                      cuda_visible_devices=w.cuda_visible_devices or None,
                                      n_gpu_layers=w.n_gpu_layers) for w in part.workers}

    def plan_part(self, plan):
        return plan.replicas

    def entry_worker(self, workers, kv, n_tokens=0, avoid=None):
        usable = [h for h in workers.values() if not h.failed and h is not avoid] or \
                 [h for h in workers.values() if not h.failed] or list(workers.values())
        return min(usable, key=load_rank)

    def route_new(self, config, workers, kv, gate, load, n_tokens, cached=no_cache, request_class=None):
        request_class = request_class or RequestClass.INTERACTIVE
        usable = [h for h in workers.values() if not h.failed] or list(workers.values())
        views = []
        for h in usable:
            n_cached = min(cached(h), n_tokens)
            views.append(ReplicaView(h.role, n_cached, load_rank(h),
                                     gate.predicted_ttft_ms(request_class, n_tokens - n_cached, h.role, h.spec,
                                                            load(h))))
        choice = choose_replica(views, gate.budgets[request_class].ttft_ms)
        return Routed(workers[choice.name], choice.reason, choice.n_cached_tokens)

    def n_entry_workers(self, config):
        return config.n_replicas

    def fatal_failures(self, workers):
        failed = [h for h in workers.values() if h.failed]
        return failed if len(failed) == len(workers) else []

    def health(self, workers):
        base = super().health(workers)
        return Health(base.failed, not any(h.ready is not None for h in workers.values() if not h.failed),
                      base.reasons)

    def recovery_victim(self, config):
        return "replica-0"  # the first, as homepd.hw.placement names them

    def advise_candidates(self, base, plan, chunks):
        part = self.plan_part(plan)
        # each replica runs the best colocated scheduler (the adaptive chunk)
        return [Candidate(f"replicas-{base.n_replicas}", Mode.REPLICAS, chunk=base.chunk, adaptive_chunk=True,
                          n_replicas=base.n_replicas, feasible=part.feasible, reason=part.reason)]


def load_rank(handle) -> tuple:
    """Less loaded first: requests in flight (a replica not ready counts one more), then the name."""
    return len(handle.in_flight) + (0 if handle.ready else 1), handle.role


TOPOLOGY = Replicas()
