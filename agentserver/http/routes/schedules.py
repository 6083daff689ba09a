"""``/v1/schedules``: runs on a schedule made, listed, paused, resumed, triggered and
deleted at run time (docs/runs.md, docs/http-api.md). A caller sees and changes only
the schedules of the agents it may address, and of those only its own unless it is an
operator (the authorization rule, docs/security.md): another client's schedule answers
as a missing one."""

from __future__ import annotations

import datetime
import json
from typing import Any

from lxml import etree
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.agents.profile.schedule import ScheduleInvalid, ScheduleSpec
from agentserver.agents.store.base import ScheduleRow
from agentserver.agents.store.sql.schedules import NoSuchSchedule, ScheduleExists
from agentserver.core.handshake import Identity
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.context import HttpContext, Schedules
from agentserver.http.gate import Gate
from agentserver.http.problems import problem

#: How many next fire times a schedule's view lists.
NEXT_TIMES = 3
_FIELDS = ("name", "agent", "cron", "task")


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def schedule_view(row: ScheduleRow) -> dict[str, Any]:
    """A schedule as the API and the CLI show it: settings, next fire times, last outcome."""
    spec = row.spec
    nxt: list[str | None] = []
    if not row.paused and row.next_tick is not None:
        ticks = [row.next_tick]
        for t in spec.ticks_after(row.next_tick):
            if len(ticks) >= NEXT_TIMES:
                break
            ticks.append(t)
        nxt = [_iso(t) for t in ticks]
    return {
        "name": spec.name,
        "agent": spec.agent,
        "cron": spec.cron,
        "timezone": spec.timezone,
        "overlap": spec.overlap,
        "catchup_window": spec.catchup_window_s,
        "jitter": spec.jitter_s,
        "task": spec.payload.decode("utf-8", "replace"),
        "paused": row.paused,
        "source": row.origin,
        "owner": row.owner,
        "next": nxt,
        "last_tick": _iso(row.last_tick),
        "last_outcome": row.last_outcome,
        "last_task_inbox_id": row.last_inbox_id,
        "fired": row.fired,
        "skipped": row.skipped,
    }


class ScheduleRoutes:
    """The schedule routes of one app."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate
        self._parser = SafeParser(ctx.gateway.max_bytes)

    async def _open(self, request: Request) -> tuple[Identity, Schedules] | Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        if self.ctx.schedules is None:
            return problem(404, "not-found", "Not found.")
        return identity, self.ctx.schedules

    async def _visible(
        self, schedules: Schedules, name: str, identity: Identity, request: Request
    ) -> ScheduleRow:
        """Schedule ``name`` if ``identity`` may see it; NoSuchSchedule for a missing one
        and for another's alike (the latter counted and logged as a refusal)."""
        row = await schedules.get(name)
        if not self.gate.may_see(identity, row.spec.agent) or not self.gate.owns(
            identity, row.owner, request
        ):
            raise NoSuchSchedule(name)
        return row

    async def collection(self, request: Request) -> Response:
        opened = await self._open(request)
        if isinstance(opened, Response):
            return opened
        identity, schedules = opened
        if request.method == "POST":
            return await self._add(request, identity, schedules)
        rows = [
            r
            for r in await schedules.list()
            if self.gate.may_see(identity, r.spec.agent)
            and self.gate.rule.decide(identity.name, r.owner)
        ]
        return JSONResponse({"schedules": [schedule_view(r) for r in rows]})

    async def _add(self, request: Request, identity: Identity, schedules: Schedules) -> Response:
        body = await request.body()
        if len(body) > self.ctx.gateway.max_bytes:
            return problem(413, "too-large", "The request is too large.")
        try:
            data = json.loads(body or b"{}")
            if not isinstance(data, dict) or not all(isinstance(data.get(f), str) for f in _FIELDS):
                raise TypeError
            payload = self._parser.parse(data["task"].encode())
            spec = ScheduleSpec(
                name=data["name"],
                agent=data["agent"],
                cron=data["cron"],
                payload=etree.tostring(payload),
                timezone=str(data.get("timezone", "UTC")),
                overlap=str(data.get("overlap", "skip")),
                catchup_window_s=float(data.get("catchup_window", 60)),
                jitter_s=float(data.get("jitter", 0)),
            )
        except ScheduleInvalid as exc:
            return problem(400, "bad-schedule", str(exc))
        except Exception:
            return problem(
                400,
                "bad-schedule",
                'The body must be {"name", "agent", "cron", "task": XML} with optional '
                '"timezone", "overlap", "catchup_window", "jitter".',
            )
        if not self.gate.may_see(identity, spec.agent):
            return problem(404, "not-found", "Not found.")
        try:
            row = await schedules.add(spec, identity.name)
        except ScheduleInvalid as exc:
            return problem(400, "bad-schedule", str(exc))
        except ScheduleExists as exc:
            return problem(409, "schedule-exists", str(exc))
        except NoSuchSchedule as exc:
            return problem(404, "not-found", str(exc))
        return JSONResponse(
            schedule_view(row), 201, headers={"Location": f"/v1/schedules/{spec.name}"}
        )

    async def one(self, request: Request) -> Response:
        """``GET`` or ``DELETE /v1/schedules/{name}``."""
        opened = await self._open(request)
        if isinstance(opened, Response):
            return opened
        identity, schedules = opened
        name = request.path_params["name"]
        try:
            row = await self._visible(schedules, name, identity, request)
            if request.method == "DELETE":
                if row.source == "boot":
                    # As a declared webhook: boot.xml would bring it back at the next start.
                    return problem(
                        409,
                        "conflict",
                        f"Schedule {name!r} is declared in boot.xml: remove it there "
                        "(pause it to stop its runs meanwhile).",
                    )
                await schedules.delete(name)
                return Response(status_code=204)
        except NoSuchSchedule:
            return problem(404, "not-found", "Not found.")
        return JSONResponse(schedule_view(row))

    async def action(self, request: Request) -> Response:
        """``POST /v1/schedules/{name}/pause|resume|trigger``."""
        opened = await self._open(request)
        if isinstance(opened, Response):
            return opened
        identity, schedules = opened
        name, verb = request.path_params["name"], request.path_params["action"]
        if verb not in ("pause", "resume", "trigger"):
            return problem(404, "not-found", "Not found.")
        try:
            row = await self._visible(schedules, name, identity, request)
            if verb == "trigger":
                fired = await schedules.trigger(name)
                outcome = fired.outcome if fired is not None else None
                return JSONResponse(
                    {
                        "name": name,
                        "outcome": outcome,
                        "task_inbox_id": fired.inbox_id if fired is not None else None,
                    },
                    202,
                )
            row = await schedules.pause(name, verb == "pause")
        except NoSuchSchedule:
            return problem(404, "not-found", "Not found.")
        return JSONResponse(schedule_view(row))
