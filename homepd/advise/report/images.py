"""The advise pictures of a live result or a stored run, and where their image files go.

The image files sit next to the JSON result file (``advise-N.json`` -> ``advise-N.svg`` and ``.png``);
``homepd history show RUN --plot`` writes them again from the store.  The budgets drawn and judged are the
SLO's interactive ones, which advise reads from ``EngineConfig.class_budgets``.  matplotlib is loaded only
when a file is written (``homepd.advise.report.figure``).
"""
from __future__ import annotations

from pathlib import Path

from homepd.advise.report.pictures import (Pictures, pictures, result_budgets_ms, run_budgets_ms, runs_from_result,
                                          runs_from_stored)
from homepd.advise.report.result import result_dict


def result_pictures(result) -> Pictures:
    """The pictures of a finished ``homepd.advise.campaign.run.AdviseResult``."""
    ttft_ms, _ = result_budgets_ms(result)
    title = f"advise run {result.run_id}" if result.run_id is not None else "advise run (not stored)"
    return pictures(title, runs_from_result(result), result_dict(result), ttft_budget_ms=ttft_ms)


def run_pictures(run: dict) -> Pictures:
    """The pictures of a stored run (``Store.get_run(id)``, with timelines: the gaps need every token)."""
    ttft_ms, _ = run_budgets_ms(run)
    return pictures(f"advise run {run.get('id')}", runs_from_stored(run), run, ttft_budget_ms=ttft_ms)


def image_stem(json_path: Path) -> Path:
    """``.../advise-12.json`` -> ``.../advise-12`` (the image files add ``.svg`` and ``.png``)."""
    return Path(json_path).with_suffix("")


def write_result_images(result, json_path: Path) -> list[Path]:
    """Draw ``result`` next to its JSON result file; the paths written."""
    from homepd.advise.report.figure import write

    ttft_ms, itl_ms = result_budgets_ms(result)
    return write(result_pictures(result), image_stem(json_path), ttft_budget_ms=ttft_ms, itl_budget_ms=itl_ms)


def write_run_images(run: dict, stem: Path) -> list[Path]:
    """Draw a stored run to ``stem``.svg and ``stem``.png; the paths written."""
    from homepd.advise.report.figure import write

    ttft_ms, itl_ms = run_budgets_ms(run)
    return write(run_pictures(run), stem, ttft_budget_ms=ttft_ms, itl_budget_ms=itl_ms)
