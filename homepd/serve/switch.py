"""Switching the running service to another measured configuration (``POST /advice/apply``, ``--auto-apply``).

The service stops admitting (new requests wait at admission: ``Service.until_admitting``), lets every admitted
request finish on the engine it runs on (the drain, up to ``--drain-timeout``; if they have not finished by
then nothing is switched and serving carries on), stops that engine, starts one in the candidate's
configuration (its ``EngineConfig`` values, as ``homepd advise apply`` writes them) and admits again.  No
request is lost: running ones finish where they are, waiting ones are served by the new engine.  If the new
engine cannot start, the old configuration is started again.  The switch lasts until the service restarts;
``homepd advise apply RUN --candidate NAME`` makes it permanent.  Each switch is an ``advice`` event with its
evidence.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from homepd.config.origin import ConfigOrigin, ConfigSource
from homepd.core.records import to_plain
from homepd.engine.topology import topology_for
from homepd.errors import HomepdError
from homepd.launch import RestartFailed, prepare, replace_engine

log = logging.getLogger("homepd.serve")


class SwitchError(Exception):
    """A switch that cannot be done (the message says why); nothing was changed."""


async def switch_to(service, candidate: str, why: str) -> dict:
    """Drain and restart ``service`` in ``candidate``'s configuration (from the live evidence); the record of
    the switch (also published as an ``advice`` event).  ``SwitchError`` when it cannot be done."""
    advisor = service.advisor
    evidence = advisor.evidence
    if evidence is None or candidate not in evidence.configs:
        known = ", ".join(sorted(evidence.configs)) if evidence else "no evidence loaded"
        raise SwitchError(f"no measured candidate {candidate!r} to switch to (candidates: {known})")
    if candidate == advisor.running():
        raise SwitchError(f"{candidate} is already running")
    if service.models.is_multi:
        raise SwitchError("this service serves several models: live advice switches a one-model service only")
    if service.state != "ready":
        raise SwitchError(f"the service is {service.state}: it switches only while ready")
    old_config, old_origin = service.config, service.origin
    verdict = advisor.verdict.to_dict() if advisor.verdict else None
    t0 = time.monotonic()
    n_drained = len(service.in_flight)
    service.state = "switching"
    service.admitting.clear()
    try:
        try:  # why: placement first: a configuration that cannot run here is refused before anything drains
            config = dataclasses.replace(old_config, **evidence.configs[candidate]).validated()
            setup = await asyncio.to_thread(prepare, config, pull=False, progress=False)
        except HomepdError as exc:
            raise SwitchError(f"{candidate} cannot run here: {exc}") from None
        try:
            await asyncio.wait_for(service.idle.wait(), service.settings.drain_timeout_s)
        except asyncio.TimeoutError:
            raise SwitchError(f"{len(service.in_flight)} request(s) still running after "
                              f"{service.settings.drain_timeout_s:g} s (--drain-timeout); nothing switched") from None
        old, service.engine = service.engine, None
        try:
            service.engine = await replace_engine(old, config, setup, service.new_engine)
        except RestartFailed as failed:
            log.error("homepd: switch to %s failed (%s)", candidate, failed)
            service.engine = failed.restored
            if failed.restored is None:
                service._fail(f"after a failed switch to {candidate} the previous configuration could not start "
                              f"again: {failed.again}")
            raise SwitchError(f"switching to {candidate}: {failed}") from None
        service.config = service.models.default.config = config
        service.origin = ConfigOrigin(ConfigSource.ADVICE, topology_for(config.mode).describe(config),
                                      f"switched by live advice ({why}) to run {evidence.run_id}'s candidate "
                                      f"{candidate}", evidence.run_id, candidate)
    finally:
        if service.state == "switching":
            service.state = "ready"
        service.admitting.set()
    record = {"kind": "switch-applied", "candidate": candidate, "from": old_origin.to_dict(),
              "configuration": service.origin.to_dict(), "values": to_plain(evidence.configs[candidate]),
              "run_id": evidence.run_id, "why": why, "drained_requests": n_drained,
              "took_s": round(time.monotonic() - t0, 3), "raised_unix_s": advisor.clock(), "evidence": verdict}
    advisor.switched(record)
    log.info("homepd: switched to %s (%s) after draining %d request(s): %s", candidate, why, n_drained,
             service.origin.line)
    service.publish("advice", record)
    return record
