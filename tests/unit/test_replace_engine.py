"""``homepd.launch.replace_engine``, the one owner of a switch's fallback (the service's ``POST /advice/apply``
and the app's switch both call it), on stand-in engines that record what was started and stopped."""
from __future__ import annotations

import asyncio

import pytest

from homepd.launch import RestartFailed, replace_engine


class Stand:
    """An engine stand-in: ``start`` fails for the configurations in ``broken``."""

    def __init__(self, config, setup, log, broken):
        self.config, self.setup, self.log, self.broken = config, setup, log, broken

    async def start(self):
        self.log.append(("start", self.config))
        if self.config in self.broken:
            raise OSError(f"{self.config} cannot load its model")

    async def stop(self):
        self.log.append(("stop", self.config))


def maker(log, broken=()):
    return lambda config, setup: Stand(config, setup, log, set(broken))


def test_the_new_engine_replaces_the_old_one_after_it_stopped():
    log = []
    old = Stand("colocated", "setup-a", log, set())
    new = asyncio.run(replace_engine(old, "disaggregated", "setup-b", maker(log)))
    assert (new.config, new.setup) == ("disaggregated", "setup-b")
    assert log == [("stop", "colocated"), ("start", "disaggregated")]  # never two engines at once


def test_a_new_engine_that_cannot_start_brings_the_old_configuration_back_with_its_own_setup():
    log = []
    old = Stand("colocated", "setup-a", log, set())
    with pytest.raises(RestartFailed, match="disaggregated cannot load its model.*previous one runs again") as exc:
        asyncio.run(replace_engine(old, "disaggregated", "setup-b", maker(log, {"disaggregated"})))
    back = exc.value.restored
    assert (back.config, back.setup) == ("colocated", "setup-a") and exc.value.again is None
    assert log == [("stop", "colocated"), ("start", "disaggregated"), ("start", "colocated")]


def test_when_neither_configuration_starts_nothing_is_restored_and_both_errors_are_named():
    log = []
    old = Stand("colocated", "setup-a", log, set())
    with pytest.raises(RestartFailed, match="disaggregated cannot.*nor the previous one.*colocated cannot") as exc:
        asyncio.run(replace_engine(old, "disaggregated", "setup-b", maker(log, {"disaggregated", "colocated"})))
    assert exc.value.restored is None


def test_with_no_engine_running_a_failed_start_has_nothing_to_fall_back_to():
    log = []
    with pytest.raises(RestartFailed) as exc:
        asyncio.run(replace_engine(None, "disaggregated", "setup-b", maker(log, {"disaggregated"})))
    assert exc.value.restored is None and log == [("start", "disaggregated")]
    assert "previous" not in str(exc.value)
