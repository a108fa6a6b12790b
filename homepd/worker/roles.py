"""What a worker does besides running its steps: its role (colocated, prefill or decode).

The step loop is the same for every role; a ``Role`` only decides what
happens around it: which extra messages it takes (the KV arena, handoffs), what
it does before each schedule (export or import KV), and what happens to a
request whose prompt is done.  ``colocated`` keeps decoding it here; the
disaggregated ``prefill`` and ``decode`` roles are in ``homepd.worker.handoff``.
"""
from __future__ import annotations

from typing import Callable, Protocol

from homepd.core import modes
from homepd.core.protocol import WorkerSpec
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence
from homepd.worker.handoff import DecodeRole, PrefillRole


class Role(Protocol):
    @property
    def has_work(self) -> bool:
        """True while the role holds requests outside the scheduler (waiting for a KV extent or a sequence)."""

    def handle(self, msg) -> bool:
        """Take a role-specific message from the controller; False if it is not one."""

    def pump(self) -> None:
        """Before each schedule: move requests between KV extents and the scheduler as room allows."""

    def prompt_done(self, seq: Sequence, t_s: float) -> None:
        """seq got its first token at ``t_s`` and is not finished."""

    def forget(self, seq: Sequence) -> None:
        """seq (held by the scheduler) is cancelled: drop any reference the role keeps to it."""

    def cancel(self, request_id: str) -> None:
        """Cancel a request the scheduler does not hold; report it if the role held it."""

    def abandon(self) -> None:
        """The controller is gone: release what only the controller would have cleaned up."""


class ColocatedRole:
    """Prefill and decode in this one worker: a finished prompt simply keeps decoding here."""

    has_work = False

    def handle(self, msg) -> bool:
        return False

    def pump(self) -> None:
        pass

    def prompt_done(self, seq: Sequence, t_s: float) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass

    def cancel(self, request_id: str) -> None:
        pass  # not here (finished already): the controller has its end

    def abandon(self) -> None:
        pass


def make_role(spec: WorkerSpec, ctx, scheduler: Scheduler, send: Callable[[object], None],
              finish: Callable[[Sequence], None]) -> Role:
    """The role ``spec.role`` names, given what it may use: the context, the scheduler (the decode role
    admits imported requests), the controller's ``send`` and ``finish`` (a sequence leaves this worker)."""
    role = modes.Role(spec.role)  # unknown: ValueError
    if role is modes.Role.PREFILL:
        return PrefillRole(ctx, send, finish, spec.model_fingerprint)
    if role is modes.Role.DECODE:
        return DecodeRole(ctx, send, finish, spec.model_fingerprint, scheduler)
    return ColocatedRole()
