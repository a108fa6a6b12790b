"""A campaign's wall-clock budgets (``AdviseSettings.wall_budget_s``), apart so that a face can state them
without loading the campaign (and the engine under it)."""
from __future__ import annotations

QUICK_WALL_BUDGET_S = 105.0   # + the command's start and its report: within 2 minutes
FULL_WALL_BUDGET_S = 1800.0   # ``--budget`` changes it


def describe_budget(seconds: float) -> str:
    """``105`` -> ``"2 min"``, ``1800`` -> ``"30 min"``: what a person reads before starting a campaign (the
    command's start and its report take about a quarter of a minute more)."""
    return f"{max(1, round((seconds + 15) / 60))} min"
