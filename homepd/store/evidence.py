"""Reading a stored advise run for live advice: which run is the latest for a model, and the shape of the
requests each mix's probes sent (what the capacity curves were measured on).

    advise_runs(store, model) -> [(run id, stored hardware probe | None), ...], newest first
    request_shapes(store, run_id) -> {mix: [(n_prompt_tokens, n_output_tokens, request_class), ...]}
"""
from __future__ import annotations

import json


def advise_runs(store, model: str) -> list[tuple[int, dict | None]]:
    """The complete advise runs of ``model`` (their base configuration's) that hold a recommendation with
    capacity curves, newest first, each with the hardware probe it stored (None if it stored none)."""
    with store._lock:
        rows = store.db.execute(
            "SELECT DISTINCT runs.id, runs.hardware_json FROM runs JOIN recommendations "
            "ON recommendations.run_id = runs.id WHERE runs.kind = 'advise' AND runs.status = 'complete' "
            "AND json_extract(runs.config_json, '$.base.model') = ? "
            "AND json_array_length(recommendations.data_json, '$.capacity') > 0 ORDER BY runs.id DESC",
            [model]).fetchall()
    return [(run_id, json.loads(hardware) if hardware else None) for run_id, hardware in rows]


def request_shapes(store, run_id: int) -> dict[str, list[tuple[int, int, str]]]:
    """Per mix (a result's mix without its ``@rate``), every request its probes sent: prompt tokens, output
    tokens and class.  Recovery scenarios (``+kill``) are left out."""
    with store._lock:
        rows = store.db.execute(
            "SELECT results.mix, requests.n_prompt_tokens, requests.n_output_tokens, "
            "json_extract(requests.lifecycle_json, '$.request_class') FROM results JOIN requests "
            "ON requests.result_id = results.id WHERE results.run_id = ? AND results.status = 'measured' "
            "AND results.mix IS NOT NULL AND results.mix NOT LIKE '%+kill%'", [run_id]).fetchall()
    out: dict[str, list[tuple[int, int, str]]] = {}
    for mix, n_prompt, n_output, klass in rows:
        out.setdefault(mix.split("@", 1)[0], []).append((n_prompt or 0, n_output or 0, klass or "interactive"))
    return out
