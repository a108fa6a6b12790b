"""A model's memory footprint, as measured after a load or estimated before one: the records the store keeps
(``homepd.store.footprints``) and the planner (``homepd.models.planner``) plans with.

A footprint depends on what the load allocates, so it is keyed by the model file and each setting that
changes the allocation: ``n_ctx``, ``n_seq_max``, the KV cache's type and the placement (mode, threads do
not count; a GPU and its offloaded layers do).  Sampling options, a request's ``num_ctx`` or keep-alive never
change it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

KV_TYPE = "f16"  # the KV cache type every worker allocates today (llama.cpp's default)


class FootprintSource(enum.StrEnum):
    MEASURED = "measured"     # this box, after a load of the same key (this run, or the store's record)
    ESTIMATED = "estimated"   # from the GGUF header, with the planner's margin: never loaded with this key
    DECLARED = "declared"     # the fake backend's stand-in: what it says it takes (tests of the logic)


@dataclass(frozen=True)
class FootprintKey:
    model_key: str        # the model file's fingerprint (its identity, whatever its path or name)
    n_ctx: int
    n_seq_max: int
    kv_type: str
    placement: str        # e.g. "colocated/cpu", "disaggregated/cpu", "colocated/gpu0:-1"


@dataclass(frozen=True)
class Footprint:
    """The bytes a model takes loaded with ``key``, where that figure comes from, and its load time."""
    key: FootprintKey
    footprint_bytes: int
    source: FootprintSource
    estimate_bytes: int | None = None    # what the header's estimate said (kept beside a measurement)
    load_s: float | None = None          # the last measured load (process start, weights, warm-up)
    n_loads: int = 0
    measured_at: str | None = None
    model_name: str = ""
