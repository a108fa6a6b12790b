"""The ``model_footprints`` table: each model's measured memory and load time, per allocation (its
``FootprintKey``), so that a service plans its next load of it from a measurement, not an estimate.

    record_footprint(store, footprint, breakdown=None, is_load=True)   # upsert; n_loads counts a load
    load_footprint(store, key) -> Footprint | None
"""
from __future__ import annotations

import dataclasses
import json

from homepd.models.footprint import Footprint, FootprintKey, FootprintSource

_KEY = tuple(f.name for f in dataclasses.fields(FootprintKey))


def record_footprint(store, footprint: Footprint, breakdown: dict | None = None, is_load: bool = True) -> None:
    """Write ``footprint`` (measured) over any earlier record of its key, counting the loads (``is_load``
    False: a measurement of a model already loaded, which raises its figure and counts no load)."""
    key = dataclasses.asdict(footprint.key)
    with store._lock, store.db.atomic():
        before = load_footprint(store, footprint.key)
        store.db["model_footprints"].upsert({
            **key, "footprint_bytes": footprint.footprint_bytes, "estimate_bytes": footprint.estimate_bytes,
            "load_s": footprint.load_s, "n_loads": (before.n_loads if before else 0) + is_load,
            "measured_at": footprint.measured_at, "model_name": footprint.model_name,
            "breakdown_json": json.dumps(breakdown) if breakdown is not None else None}, pk=_KEY)


def load_footprint(store, key: FootprintKey) -> Footprint | None:
    """The measured footprint of ``key``, or None when it was never measured here."""
    with store._lock:
        row = next(store.db.query("SELECT * FROM model_footprints WHERE model_key = ? AND n_ctx = ? AND n_seq_max = ? "
                                  "AND kv_type = ? AND placement = ?", [getattr(key, k) for k in _KEY]), None)
    if row is None:
        return None
    return Footprint(key, row["footprint_bytes"], FootprintSource.MEASURED, row["estimate_bytes"], row["load_s"],
                     row["n_loads"] or 0, row["measured_at"], row["model_name"] or "")
