"""A worker whose homepd code is not its controller's (the package upgraded in place under a running service, then
a worker restarted) says so instead of failing on a message neither side can read: it checks the controller's
wire fingerprint before anything else, answers with a ``WorkerFatal`` naming the mismatch and exits, and the
engine's error and health name it (fake backend: real worker processes, no model)."""
from __future__ import annotations

import dataclasses

import pytest

from engine_helpers import fake_coloc, make_engine, run
from homepd.core.protocol import WorkerFatal, WorkerSpec, wire_fingerprint, worker_mismatch
from homepd.core.modes import Role
from homepd.engine.handles import spawn_worker
from homepd.errors import WorkerError
from homepd.fakellm import FAKE_MODEL_PATH


def test_the_fingerprint_covers_the_modules_that_cross_the_pipe():
    assert len(wire_fingerprint()) == 16 and worker_mismatch(wire_fingerprint()) is None
    assert "restart the service" in worker_mismatch("0123456789abcdef")


def test_a_worker_refuses_a_controller_of_other_code_before_loading_anything():
    spec = WorkerSpec(role=Role.COLOCATED, model_path=str(FAKE_MODEL_PATH), n_ctx=256, n_seq_max=1, chunk=None,
                      n_threads=1, backend="fake", wire="0123456789abcdef")
    process, conn = spawn_worker(spec)
    try:
        msg = conn.recv()
        assert isinstance(msg, WorkerFatal) and "version mismatch" in msg.error and "0123456789abcdef" in msg.error
        assert process.wait(30) == 2
    finally:
        conn.close()
        if process.poll() is None:
            process.kill()


def test_an_engine_whose_worker_is_not_its_code_fails_to_start_naming_the_mismatch(monkeypatch):
    import homepd.engine.controller as controller
    real = controller.worker_specs
    monkeypatch.setattr(controller, "worker_specs", lambda *a, **k: {
        name: dataclasses.replace(spec, wire="0123456789abcdef") for name, spec in real(*a, **k).items()})

    async def scenario():
        async with make_engine(fake_coloc(n_seq_max=1)):
            pass

    with pytest.raises(WorkerError, match="version mismatch"):
        run(scenario())
