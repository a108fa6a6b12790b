"""``homepd advise apply``'s choice: which candidate of a stored advise run to write, and what the config file
then holds (the candidate's configuration, and the ``[advice]`` table saying where it came from, which
``homepd serve`` and the app name at start-up).  Pure: a stored recommendation (``RunAdvice``) in, values out."""
from __future__ import annotations

from homepd.config import ADVICE_TABLE
from homepd.core.modes import Candidate
from homepd.errors import ConfigError
from homepd.store.records import RunAdvice


def choose(run_id: int, advice: RunAdvice, name: str | None) -> tuple[Candidate | None, dict, list[str]]:
    """(candidate, the ``EngineConfig`` values to write, notes for the user) for ``--candidate name`` (None: the
    recommended one).  A name the run does not hold, or an infeasible candidate, is a ConfigError."""
    recommended = advice.candidate.name if advice.candidate is not None else None
    name = name or recommended
    if name is None:  # a recommendation stored before candidates were: its configuration as written then
        values = dict(advice.config)
        if not values:
            raise ConfigError(f"run {run_id}'s recommendation has no configuration to apply")
        return None, values, []
    chosen = next((c for c in advice.candidates if c.name == name), None)
    if chosen is None:
        known = ", ".join(c.name for c in advice.candidates) or "none stored"
        raise ConfigError(f"run {run_id} measured no candidate {name!r} (its candidates: {known})")
    if not chosen.feasible:
        raise ConfigError(f"candidate {name!r} cannot run on this box: {chosen.reason}")
    notes = [] if name == recommended else [f"{name} is not the recommended candidate ({recommended})"]
    notes += [f"its runs on the {f.mix} mix did not exercise its architecture: {f.reason}"
              for f in advice.not_exercised if f.candidate == name]
    return chosen, chosen.config_values(), notes


def advice_values(run_id: int, candidate: Candidate | None, values: dict) -> dict:
    """What the config file gets: the configuration, and the ``[advice]`` table naming its run and candidate."""
    return {**values, ADVICE_TABLE: {"run": run_id, "candidate": candidate.name if candidate else None}}
