"""The advise pictures of a run (a live result's ``AdviseResult.run`` or a stored one), and where their image
files go.

The image files sit next to the JSON result file (``advise-N.json`` -> ``advise-N.svg`` and ``.png``);
``homepd history show RUN --plot`` writes them again from the store.  The budgets drawn and judged are the
SLO's interactive ones (``RunConfig.budgets_ms``).  matplotlib is loaded only when a file is written
(``homepd.advise.report.figure``).
"""
from __future__ import annotations

from pathlib import Path

from homepd.advise.report.pictures import run_pictures
from homepd.store.records import Run


def image_stem(json_path: Path) -> Path:
    """``.../advise-12.json`` -> ``.../advise-12`` (the image files add ``.svg`` and ``.png``)."""
    return Path(json_path).with_suffix("")


def write_run_images(run: Run, stem: Path) -> list[Path]:
    """Draw ``run`` to ``stem``.svg and ``stem``.png (read with timelines: the gaps need every token); the
    paths written."""
    # why: matplotlib loads only when a picture is drawn
    from homepd.advise.report.figure import write

    ttft_ms, itl_ms = run.config.budgets_ms
    return write(run_pictures(run), stem, ttft_budget_ms=ttft_ms, itl_budget_ms=itl_ms)
