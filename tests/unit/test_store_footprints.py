"""The ``model_footprints`` table (``homepd.store.footprints``): a measured footprint is kept per allocation key,
read back typed, counted per load, and another key (a larger context) is a separate record."""
from __future__ import annotations

from homepd.models.footprint import Footprint, FootprintKey, FootprintSource
from homepd.store import Store
from homepd.store.footprints import load_footprint, record_footprint

KEY = FootprintKey("ab" * 32, 4096, 8, "f16", "colocated/cpu")


def measured(n_bytes: int, load_s: float, key: FootprintKey = KEY) -> Footprint:
    return Footprint(key, n_bytes, FootprintSource.MEASURED, 300_000_000, load_s, 0, "2026-12-06T12:00:00+00:00",
                     "smollm2")


def test_a_measured_footprint_is_read_back_typed_and_counts_its_loads():
    with Store.open(":memory:") as store:
        assert load_footprint(store, KEY) is None
        record_footprint(store, measured(250_000_000, 1.5), {"total_bytes": 250_000_000})
        record_footprint(store, measured(260_000_000, 1.2))
        got = load_footprint(store, KEY)
    assert got == Footprint(KEY, 260_000_000, FootprintSource.MEASURED, 300_000_000, 1.2, 2,
                            "2026-12-06T12:00:00+00:00", "smollm2")


def test_another_context_size_is_another_record():
    bigger = FootprintKey(KEY.model_key, 8192, 8, "f16", "colocated/cpu")
    with Store.open(":memory:") as store:
        record_footprint(store, measured(250_000_000, 1.5))
        assert load_footprint(store, bigger) is None
        record_footprint(store, measured(330_000_000, 1.7, bigger))
        assert load_footprint(store, bigger).footprint_bytes == 330_000_000
        assert load_footprint(store, KEY).footprint_bytes == 250_000_000


def test_a_measurement_of_a_loaded_model_raises_its_figure_and_counts_no_load():
    with Store.open(":memory:") as store:
        record_footprint(store, measured(250_000_000, 1.5))
        record_footprint(store, measured(270_000_000, 1.5), is_load=False)
        got = load_footprint(store, KEY)
    assert (got.footprint_bytes, got.n_loads) == (270_000_000, 1)
