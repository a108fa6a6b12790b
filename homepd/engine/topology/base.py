"""The ``Topology`` protocol every mode implements, its defaults, and the factory from the ``Mode`` enum."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Mapping

from homepd.config import EngineConfig
from homepd.core.terms import RequestClass
from homepd.core.modes import Candidate, Mode, Role
from homepd.core.protocol import EngineSetup, RolePlacement
from homepd.core.routing import RouteReason
from homepd.engine.topology.handoff import NoHandoff

PlanOf = Callable[[], object]  # returns the box's ``PlacementPlan``, computed only if a topology asks for it


def no_cache(handle) -> int:
    return 0


@dataclass(frozen=True)
class Routed:
    """Where a new request enters, why, and the prompt tokens that worker probably holds."""
    worker: object              # the WorkerHandle
    reason: RouteReason
    n_cached_tokens: int = 0


@dataclass(frozen=True)
class Health:
    """What the faces need to know of the engine's workers (``Engine.health``)."""
    failed: tuple[str, ...]    # workers whose failure makes the engine unusable (empty: usable)
    restarting: bool           # a worker is (re)starting: no request can be admitted now
    reasons: tuple[str, ...] = ()  # why each of ``failed`` failed (its last error)


class Topology:
    """One architecture.  Stateless: every method gets the config or the workers it reads.

    ``workers`` below is the controller's ``{name: WorkerHandle}``; a handle has ``role`` (its name),
    ``spec.role`` (a ``Role``), ``failed``, ``ready`` and ``in_flight``.
    """
    mode: Mode
    needs_plan = True          # its placements come from the box's placement plan (the box is probed)
    uses_kv_arena = False      # its workers hand KV over through the shared-memory arena

    # workers ------------------------------------------------------------------------------------
    def worker_roles(self, config: EngineConfig, setup: EngineSetup) -> dict[str, Role]:
        """Name -> role of every worker the engine starts."""
        raise NotImplementedError

    def placements(self, config: EngineConfig, plan: PlanOf) -> dict[str, RolePlacement]:
        """Where each worker runs (``homepd.launch.prepare`` calls it; ``plan`` gives the placement plan)."""
        raise NotImplementedError

    def kv_arena_bytes(self, config: EngineConfig, plan: PlanOf) -> int | None:
        """The KV arena's size, for a topology that uses one."""
        return None

    def plan_part(self, plan):
        """This mode's part of a ``PlacementPlan`` (its ``feasible`` and ``reason``)."""
        raise NotImplementedError

    def make_handoff(self, config: EngineConfig, setup: EngineSetup, workers: Mapping):
        """The mode's KV handoff once the workers are ready (``homepd.engine.topology.handoff``)."""
        return NoHandoff()

    # requests -----------------------------------------------------------------------------------
    def entry_worker(self, workers: Mapping, kv, n_tokens: int = 0, avoid=None):
        """Where a new (or recomputed) request of ``n_tokens`` enters; ``avoid``: a worker that just died."""
        raise NotImplementedError

    def route_new(self, config: EngineConfig, workers: Mapping, kv, gate, load: Callable, n_tokens: int,
                  cached: Callable = no_cache, request_class: RequestClass = RequestClass.INTERACTIVE) -> Routed:
        """The entry worker of a new request, the gate consulted where the topology has a choice
        (``load(handle)``: the ``WorkerLoad`` that worker holds; ``cached(handle)``: the tokens of this
        prompt that worker probably holds, from the controller's route index over the prompt's ids)."""
        return Routed(self.entry_worker(workers, kv, n_tokens), RouteReason.SOLE)

    def n_entry_workers(self, config: EngineConfig) -> int:
        """Workers a new request may enter."""
        return 1

    def capacity(self, config: EngineConfig, max_queue: int) -> int:
        """Requests a service admits at once: every entry worker's sequences plus its wait queue."""
        return config.n_seq_max * self.n_entry_workers(config) + max_queue

    # failures -----------------------------------------------------------------------------------
    def fatal_failures(self, workers: Mapping) -> list:
        """The failed workers, when their failure makes the engine unusable; else []."""
        return [h for h in workers.values() if h.failed]

    def health(self, workers: Mapping) -> Health:
        handles = list(workers.values())
        fatal = self.fatal_failures(workers)
        return Health(tuple(h.role for h in fatal), not any(h.ready is not None for h in handles if not h.failed)
                      or any(h.ready is None for h in handles), tuple(str(h.failed) for h in fatal))

    def recovery_victim(self, config: EngineConfig) -> str:
        """The worker advise's recovery scenario kills."""
        raise NotImplementedError

    # advise and the app ---------------------------------------------------------------------------
    def advise_candidates(self, base: EngineConfig, plan, chunks: tuple[int | None, ...]) -> list[Candidate]:
        """The configurations of this mode advise measures on a box with ``plan``; the last is the mode's best
        scheduler (the quick campaign measures only it)."""
        raise NotImplementedError

    def describe(self, config: EngineConfig) -> str:
        """The mode in a few words, for the app's title ("disaggregated", "colocated, chunk 256")."""
        return self.mode.value


@functools.cache
def topology_for(mode: Mode | str) -> Topology:
    """The topology of ``mode`` (a ``Mode`` or its value)."""
    mode = Mode(mode)
    # why by name: a new mode is its own module, with no registry to edit beside it
    module = importlib.import_module(f"{__package__}.{mode.value}")
    topology = module.TOPOLOGY
    assert topology.mode is mode, f"{module.__name__} serves {topology.mode}, not {mode}"
    return topology
