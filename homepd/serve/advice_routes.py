"""Live advice's routes: ``GET /advice`` (the verdict, the standing advice, its evidence and history, the
traffic profile), ``POST /advice/evaluate`` (judge now) and ``POST /advice/apply`` (switch to the advised, or a
named, measured candidate: drain, restart, resume).  Like every route but ``/health``, they need the API key
when the service has one."""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from homepd.advise.live.advice import AdviceKind
from homepd.serve.errors import APIError
from homepd.serve.switch import SwitchError, switch_to

router = APIRouter(tags=["advice"])


class ApplyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    candidate: str | None = None    # None (a body of {}): the candidate the standing advice names


def _advisor(request: Request):
    advisor = request.app.state.service.advisor
    if advisor is None:
        raise APIError(404, "live advice is off (homepd serve --no-advice)", "not_found_error", "advice_off")
    return advisor


@router.get("/advice")
async def advice(request: Request):
    """The current verdict, the standing advice, its evidence rows and history, and the live profile."""
    return _advisor(request).to_dict()


@router.post("/advice/evaluate")
async def evaluate(request: Request):
    """Judge the traffic now (as the periodic evaluation does); returns ``GET /advice``."""
    advisor = _advisor(request)
    if request.app.state.service.state == "ready":
        advisor.evaluate()
    return advisor.to_dict()


@router.post("/advice/apply", responses={409: {"description": "nothing to apply, or the switch cannot be done"}})
async def apply(request: Request, body: ApplyRequest):
    """Drain, restart the workers in the advised (or the named) candidate's configuration and resume; returns
    the switch's record.  Requests that arrive meanwhile wait and are served by the new configuration."""
    advisor = _advisor(request)
    name = body.candidate
    if name is None:
        standing = advisor.tracker.current
        if standing is None or standing.verdict.kind is not AdviceKind.SWITCH:
            raise APIError(409, "no advice to switch stands now (GET /advice); name a candidate to switch anyway",
                           code="no_advice")
        name = standing.verdict.candidate
    try:
        return await switch_to(request.app.state.service, name, "POST /advice/apply")
    except SwitchError as exc:
        raise APIError(409, str(exc), code="switch_refused") from None
