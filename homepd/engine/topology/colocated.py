"""Colocated: one worker prefills (in chunks) and decodes beside its running streams."""
from __future__ import annotations

from homepd.core.modes import Candidate, Mode, Role
from homepd.core.protocol import RolePlacement
from homepd.engine.topology.base import Topology


def chunk_candidate(chunk: int | None, feasible: bool = True, reason: str = "") -> Candidate:
    """The colocated configuration with prefill chunk ``chunk`` (None: unchunked), as advise names it."""
    name = "colocated-unchunked" if chunk is None else f"colocated-chunk-{chunk}"
    return Candidate(name, Mode.COLOCATED, chunk=chunk, feasible=feasible, reason=reason)


def adaptive_candidate(max_chunk: int | None, feasible: bool = True, reason: str = "") -> Candidate:
    """The colocated configuration whose step policy sizes each step's prompt budget (at most ``max_chunk``) to
    the interactive streams' ITL budget, interactive prompts first (the project's benchmark's best)."""
    return Candidate("colocated-adaptive", Mode.COLOCATED, chunk=max_chunk, adaptive_chunk=True, feasible=feasible,
                     reason=reason or "each step's prompt budget kept to the ITL budget, interactive prompts first")


class Colocated(Topology):
    mode = Mode.COLOCATED
    needs_plan = False  # the config's cores, threads and GPU

    def worker_roles(self, config, setup):
        return {Role.COLOCATED.value: Role.COLOCATED}

    def placements(self, config, plan):
        c = config
        return {Role.COLOCATED.value: RolePlacement(
            cpu_cores=c.cpu_cores, n_threads=c.effective_n_threads,
            cuda_visible_devices=None if c.gpu_index is None else str(c.gpu_index), n_gpu_layers=c.n_gpu_layers)}

    def plan_part(self, plan):
        return plan.colocated

    def entry_worker(self, workers, kv, n_tokens=0, avoid=None):
        return workers[Role.COLOCATED]

    def recovery_victim(self, config):
        return Role.COLOCATED.value

    def describe(self, config):
        if config.adaptive_chunk:
            return f"{self.mode}, adaptive chunk" + (f" (at most {config.chunk})" if config.chunk else "")
        return f"{self.mode}, chunk {config.chunk or 'none'}"

    def advise_candidates(self, base, plan, chunks):
        part = self.plan_part(plan)
        why = "" if part.feasible else part.reason
        return [chunk_candidate(chunk, part.feasible, why) for chunk in chunks] + \
            [adaptive_candidate(base.chunk, part.feasible, why)]


TOPOLOGY = Colocated()
