"""What to do when a worker process dies: a pure decision, applied by the engine.

Noticed at once (the pipe closes).  ``plan_recovery`` takes the state at the
death — the requests the dead worker held, which of them still have their KV
intact in an arena extent, the worker's recent deaths — and returns a ``RecoveryPlan``:
honour the cancels that died with it; resume from the extent (no second
prefill); resume by recompute (prompt plus the tokens already streamed
prefilled again on the restarted entry worker, text stream rebuilt); or fail,
with the reason.  A worker that dies in a loop is not restarted and the engine
refuses new work.  No clock, no processes: unit-tested on constructed states.
"""
from __future__ import annotations

from dataclasses import dataclass

RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 0.5
MAX_RESUMES = 2             # a request whose worker died this often is failed, not resumed again
CRASH_LOOP_DEATHS = 5       # this many deaths of one worker within CRASH_LOOP_WINDOW_S: stop restarting it
CRASH_LOOP_WINDOW_S = 60.0


@dataclass(frozen=True)
class HeldRequest:
    """A request the dead worker held, as far as recovery is concerned."""
    request_id: str
    n_prompt: int
    n_output: int            # tokens already streamed to the caller
    max_tokens: int
    n_resumes: int           # how often a death already interrupted it
    is_cancelling: bool = False
    in_intact_extent: bool = False  # its KV waits, intact, in an extent the restarted decode worker can import


@dataclass(frozen=True)
class WorkerDeath:
    role: str
    pid: int | None
    cause: str
    held: tuple[HeldRequest, ...]
    is_crash_loop: bool
    resume: bool             # config.resume
    n_ctx: int
    entry_worker_failed: bool  # the worker a recompute goes to could not be restarted


@dataclass(frozen=True)
class RecoveryPlan:
    cancel: tuple[str, ...]               # cancelled while it died: end as cancelled
    from_extent: tuple[str, ...]          # re-import from the extent on the restarted decode worker
    recompute: tuple[str, ...]            # prefill prompt + output again on the entry worker
    fail: tuple[tuple[str, str], ...]     # (request id, error)
    restart: bool                         # False: crash loop, mark the worker failed
    failed_reason: str | None = None


def is_crash_loop(death_times_s: list[float], now_s: float) -> bool:
    """Whether the deaths (this one included) within the window reach the crash-loop count."""
    return sum(1 for t in death_times_s if now_s - t <= CRASH_LOOP_WINDOW_S) >= CRASH_LOOP_DEATHS


def can_resume(req: HeldRequest, n_ctx: int) -> bool:
    """Not resumed too often already, something left to generate, and prompt + output fit the context."""
    return req.n_resumes < MAX_RESUMES and req.n_output < req.max_tokens and req.n_prompt + req.n_output <= n_ctx


def plan_recovery(death: WorkerDeath) -> RecoveryPlan:
    """Decide the fate of every request the dead worker held."""
    cancel, from_extent, recompute, fail = [], [], [], []
    resume = death.resume and not death.is_crash_loop
    for req in sorted(death.held, key=lambda r: r.request_id):
        if req.is_cancelling:
            cancel.append(req.request_id)
        elif resume and req.in_intact_extent and can_resume(req, death.n_ctx):
            from_extent.append(req.request_id)
        elif resume and not death.entry_worker_failed and can_resume(req, death.n_ctx):
            recompute.append(req.request_id)
        else:
            why = f"; it was already resumed {req.n_resumes} times" if req.n_resumes >= MAX_RESUMES else ""
            fail.append((req.request_id, f"{death.role} worker (pid {death.pid}) died ({death.cause}){why}; "
                                         "request failed — retry it"))
    failed_reason = None
    if death.is_crash_loop:
        failed_reason = f"it died {CRASH_LOOP_DEATHS} times within {CRASH_LOOP_WINDOW_S:.0f} s ({death.cause})"
    return RecoveryPlan(cancel=tuple(cancel), from_extent=tuple(from_extent), recompute=tuple(recompute),
                        fail=tuple(fail), restart=not death.is_crash_loop, failed_reason=failed_reason)
