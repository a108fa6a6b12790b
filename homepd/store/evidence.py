"""Reading a stored advise run for live advice: which run is the latest for a model, and the shape of the
requests each mix's probes sent (what the capacity curves were measured on).

    latest_advise_run(store, model) -> run id | None
    request_shapes(store, run_id) -> {mix: [(n_prompt_tokens, n_output_tokens, request_class), ...]}
"""
from __future__ import annotations

import json


def latest_advise_run(store, model: str) -> int | None:
    """The newest complete advise run of ``model`` (its base configuration's model) that holds a recommendation
    with capacity curves; None when there is none."""
    with store._lock:
        rows = store.db.execute(
            "SELECT runs.id, runs.config_json, recommendations.data_json FROM runs JOIN recommendations "
            "ON recommendations.run_id = runs.id WHERE runs.kind = 'advise' AND runs.status = 'complete' "
            "ORDER BY runs.id DESC, recommendations.id DESC").fetchall()
    for run_id, config_text, data_text in rows:
        base = (json.loads(config_text or "{}") or {}).get("base") or {}
        if base.get("model") == model and (json.loads(data_text or "{}") or {}).get("capacity"):
            return run_id
    return None


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
