"""An advise result as JSON-ready data: the result file's content, and what the pictures find curves in."""
from __future__ import annotations

from homepd.advise.report.pictures import projections_plain
from homepd.advise.report.render import evidence_rows
from homepd.core.records import to_plain


def result_dict(result) -> dict:
    """The whole advise result as JSON-ready data (the result file's content)."""
    return {
        "run_id": result.run_id, "wall_s": result.wall_s, "settings": to_plain(result.settings),
        "hardware": result.box, "candidates": to_plain(result.candidates),
        "predicted_chunk": result.predicted_chunk, "evidence": evidence_rows(result),
        "calibration": {"prefill_tok_s": result.speeds[0], "decode_step_ms": result.speeds[1]},
        "recommendation": to_plain(result.recommendation),
        "runs": [{"candidate": c, "mix": m, "repeat": r, "at_capacity": True, "record": rec.to_dict()}
                 for (c, m, r), rec in result.records.items()],
        "recovery": {mode: rec.to_dict() for mode, rec in result.recovery.items()},
        "twins": [to_plain(t) for t in result.twins.values()],
        "projected_two_box": projections_plain(result.run),
    }
