"""``homepd advise apply``'s choice: which candidate of a stored advise run to write, and what the config file
then holds (the candidate's configuration, and the ``[advice]`` table saying where it came from, which
``homepd serve`` and the app name at start-up).  Pure: a stored recommendation in, values out."""
from __future__ import annotations

import dataclasses

from homepd.config import ADVICE_TABLE
from homepd.core.modes import Candidate
from homepd.errors import ConfigError

_FIELDS = {f.name for f in dataclasses.fields(Candidate)}


def candidate_from_plain(data: dict) -> Candidate:
    """A ``Candidate`` as stored (``to_plain``); fields it predates keep their defaults."""
    return Candidate(**{k: v for k, v in data.items() if k in _FIELDS})


def stored_candidates(rec: dict) -> list[Candidate]:
    """The candidates of a stored recommendation: every one the campaign listed (stored since candidates
    became selectable), else only the recommended one."""
    if rec.get("candidates"):
        return [candidate_from_plain(c) for c in rec["candidates"]]
    return [candidate_from_plain(rec["candidate"])] if rec.get("candidate") else []


def choose(run_id: int, rec: dict, name: str | None) -> tuple[Candidate | None, dict, list[str]]:
    """(candidate, the ``EngineConfig`` values to write, notes for the user) for ``--candidate name`` (None: the
    recommended one).  A name the run does not hold, or an infeasible candidate, is a ConfigError."""
    candidates = stored_candidates(rec)
    recommended = rec.get("candidate") or {}
    name = name or recommended.get("name")
    if name is None:  # a recommendation stored before candidates were: its configuration as written then
        values = dict(rec.get("config") or {})
        if not values:
            raise ConfigError(f"run {run_id}'s recommendation has no configuration to apply")
        return None, values, []
    chosen = next((c for c in candidates if c.name == name), None)
    if chosen is None:
        known = ", ".join(c.name for c in candidates) or "none stored"
        raise ConfigError(f"run {run_id} measured no candidate {name!r} (its candidates: {known})")
    if not chosen.feasible:
        raise ConfigError(f"candidate {name!r} cannot run on this box: {chosen.reason}")
    notes = [] if name == recommended.get("name") else [f"{name} is not the recommended candidate "
                                                         f"({recommended.get('name')})"]
    notes += [f"its runs on the {f['mix']} mix did not exercise its architecture: {f['reason']}"
              for f in rec.get("not_exercised") or () if f.get("candidate") == name]
    return chosen, chosen.config_values(), notes


def advice_values(run_id: int, candidate: Candidate | None, values: dict) -> dict:
    """What the config file gets: the configuration, and the ``[advice]`` table naming its run and candidate."""
    return {**values, ADVICE_TABLE: {"run": run_id, "candidate": candidate.name if candidate else None}}
