"""The advise pictures of a live result or a stored run, and where their image files go.

The image files sit next to the JSON result file (``advise-N.json`` -> ``advise-N.svg`` and ``.png``);
``homepd history show RUN --plot`` writes them again from the store.  The budgets drawn and judged are the
SLO's interactive ones, which advise reads from ``EngineConfig.class_budgets``.  matplotlib is loaded only
when a file is written (``homepd.advise.figure``).
"""
from __future__ import annotations

from pathlib import Path

from homepd.advise.pictures import Pictures, pictures, projections, runs_from_result, runs_from_stored
from homepd.advise.twobox import TwoBoxProjection
from homepd.config import EngineConfig
from homepd.core.admission import RequestClass
from homepd.core.records import to_plain

_DEFAULT = EngineConfig().class_budgets[RequestClass.INTERACTIVE]


def result_budgets_ms(result) -> tuple[float, float | None]:
    """(TTFT, ITL) budget of the interactive class as the live ``result``'s SLO holds them."""
    slo = result.settings.slo
    return float(slo.ttft_ms), _itl(slo)


def run_budgets_ms(run: dict) -> tuple[float, float | None]:
    """(TTFT, ITL) budget of the interactive class of a stored advise run (its SLO, else its engine config,
    else today's defaults)."""
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    slo = ((config.get("settings") or {}).get("slo") or {}) if isinstance(config.get("settings"), dict) else {}
    base = config.get("base") if isinstance(config.get("base"), dict) else {}
    ttft = slo.get("ttft_ms") or base.get("ttft_budget_ms") or _DEFAULT.ttft_ms
    itl = slo.get("itl_ms") or slo.get("tpot_ms") or base.get("itl_budget_ms") or _DEFAULT.itl_ms
    return float(ttft), None if itl is None else float(itl)


def result_pictures(result) -> Pictures:
    """The pictures of a finished ``homepd.advise.campaign.AdviseResult``."""
    from homepd.advise.command import result_dict

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
    from homepd.advise.figure import write

    ttft_ms, itl_ms = result_budgets_ms(result)
    return write(result_pictures(result), image_stem(json_path), ttft_budget_ms=ttft_ms, itl_budget_ms=itl_ms)


def write_run_images(run: dict, stem: Path) -> list[Path]:
    """Draw a stored run to ``stem``.svg and ``stem``.png; the paths written."""
    from homepd.advise.figure import write

    ttft_ms, itl_ms = run_budgets_ms(run)
    return write(run_pictures(run), stem, ttft_budget_ms=ttft_ms, itl_budget_ms=itl_ms)


def result_projections(result) -> tuple[TwoBoxProjection, ...]:
    """The two-box rows of ``result``'s disaggregated runs (projected, not measured)."""
    ttft_ms, _ = result_budgets_ms(result)
    return projections(runs_from_result(result), ttft_budget_ms=ttft_ms)


def projections_plain(result) -> list[dict]:
    """``result_projections`` as JSON-ready data (each row says ``"note": "projected, not measured"``)."""
    return to_plain(list(result_projections(result)))


def _itl(slo) -> float | None:
    # why getattr: the SLO's per-token field is ``itl_ms`` (every gap) or, in older settings, ``tpot_ms``
    value = getattr(slo, "itl_ms", None) or getattr(slo, "tpot_ms", None)
    return None if value is None else float(value)
