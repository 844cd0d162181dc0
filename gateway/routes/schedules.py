"""``/v1/schedules``: a tenant's schedules (docs/GATEWAY.md, "Schedules"). The schedulers
that fire them run in every loop worker and gateway (:mod:`loopmesh.scheduler`); these
handlers only read and write the schedules bucket."""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from loopmesh.schedules import Exists, ScheduleError, TooMany, explain, new_schedule, next_tick
from schemas.schedules import Schedule, ScheduleRun, ScheduleState

from .. import api
from ..api import json_response as _json
from ..checks import check_id
from ..core import Gateway, Handler
from ..errors import Conflict, NotFound, QuotaExceeded, Unprocessable
from ..openapi import Operation, Param

SCHEDULE = Param(
    "schedule", "path", "schedule id", {"type": "string", "pattern": api.PATH_ID_PATTERN}, True
)


class Schedules:
    """The handlers of ``/v1/schedules``, on the gateway's keys, limits and backend."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.backend = gateway.backend

    async def create(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        body = await g.body(request, api.CreateSchedule)
        try:
            schedule = new_schedule(
                who.tenant, id=body.id, cron=body.cron, timezone=body.timezone,
                agent=body.agent or "default", session=body.session, input=body.input,
                policy=body.policy, catch_up_s=body.catch_up_s, priority=body.priority,
                max_input_chars=g.settings.max_input_chars,
                min_interval_s=g.tenant(who.tenant).min_schedule_interval_s,
            )  # fmt: skip
        except ScheduleError as exc:
            raise Unprocessable(str(exc), field=exc.field) from None
        await g.known_agent(schedule.agent)
        if schedule.session is not None:
            await self._session_of(who.tenant, schedule.session, schedule.agent)
        store = await self.backend.schedules()
        try:
            await self.backend.call("create schedule", store.create(schedule))
        except Exists:
            raise Conflict(f"schedule {schedule.id!r} exists already", field="id") from None
        except TooMany as exc:
            raise QuotaExceeded(str(exc)) from None
        return _json(view(schedule, None), 201)

    async def _session_of(self, tenant: str, session: str, agent: str) -> None:
        """Make sure ``session`` is there and belongs to ``agent``: its runs would be
        refused otherwise."""
        if await self.backend.create_session(tenant, session, agent):
            return
        snapshot = await self.backend.session(tenant, session)
        if snapshot is not None and snapshot.agent != agent:
            raise Unprocessable(
                f"session {session!r} belongs to agent {snapshot.agent!r}, not {agent!r}: "
                "its runs would be refused",
                field="session",
            )

    async def listing(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        store = await self.backend.schedules()
        found = await self.backend.call("list schedules", store.all(who.tenant))
        return _json(api.ScheduleList(schedules=[view(s, st, last_only=True) for s, st in found]))

    async def get(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        schedule, state = await self._existing(who.tenant, request)
        ends = await self.backend.run_ends(who.tenant, state.runs) if state else {}
        return _json(view(schedule, state, ends=ends))

    async def delete(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        schedule = check_id(request.path_params["schedule"], "schedule")
        store = await self.backend.schedules()
        if not await self.backend.call("delete schedule", store.delete(who.tenant, schedule)):
            raise NotFound(f"no schedule {schedule!r}")
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        schedule = check_id(request.path_params["schedule"], "schedule")
        paused = request.url.path.endswith("/pause")
        store = await self.backend.schedules()
        changed = await self.backend.call(
            "pause schedule", store.set_paused(who.tenant, schedule, paused)
        )
        if changed is None:
            raise NotFound(f"no schedule {schedule!r}")
        state, _ = await self.backend.call("read schedule", store.state(who.tenant, schedule))
        return _json(view(changed, state if state and state.uid == changed.uid else None))

    async def _existing(
        self, tenant: str, request: Request
    ) -> tuple[Schedule, ScheduleState | None]:
        schedule = check_id(request.path_params["schedule"], "schedule")
        store = await self.backend.schedules()
        found = await self.backend.call("read schedule", store.one(tenant, schedule))
        if found is None:
            raise NotFound(f"no schedule {schedule!r} (GET /v1/schedules lists them)")
        return found

    def operations(self) -> list[tuple[Operation, Handler]]:
        tags = ("schedules",)
        one = "/v1/schedules/{schedule}"
        return [
            (Operation("GET", "/v1/schedules", "list the tenant's schedules", 200,
                       api.ScheduleList, errors=(401, 429, 503), tags=tags), self.listing),
            (Operation("POST", "/v1/schedules", "create a schedule", 201, api.ScheduleView,
                       api.CreateSchedule, errors=(400, 401, 409, 413, 422, 429, 503),
                       tags=tags), self.create),
            (Operation("GET", one, "read a schedule and its last runs", 200, api.ScheduleView,
                       params=(SCHEDULE,), errors=(401, 404, 422, 429, 503), tags=tags),
             self.get),
            (Operation("DELETE", one, "delete a schedule", 204, params=(SCHEDULE,),
                       errors=(401, 404, 422, 429, 503), tags=tags), self.delete),
            *[
                (Operation("POST", f"{one}/{kind}", f"{kind} a schedule", 200, api.ScheduleView,
                           params=(SCHEDULE,), errors=(401, 404, 422, 429, 503), tags=tags),
                 self.pause)
                for kind in ("pause", "resume")
            ],
        ]  # fmt: skip


def view(
    schedule: Schedule,
    state: ScheduleState | None,
    *,
    last_only: bool = False,
    ends: dict[str, str] | None = None,
) -> api.ScheduleView:
    runs = state.runs if state is not None else ()
    last = state.last_tick if state is not None else 0.0
    upcoming = None
    if not schedule.paused:
        upcoming = next_tick(schedule, max(last, schedule.active_since, time.time()))
    return api.ScheduleView(
        id=schedule.id, cron=schedule.cron, timezone=schedule.timezone, agent=schedule.agent,
        session=schedule.session, input=schedule.input, policy=schedule.policy,
        catch_up_s=schedule.catch_up_s, priority=schedule.priority, paused=schedule.paused,
        created_at=schedule.created_at, next_tick=upcoming, explain=explain(schedule),
        runs=[_run_view(r, ends or {}) for r in runs[: 1 if last_only else None]],
    )  # fmt: skip


def _run_view(run: ScheduleRun, ends: dict[str, str]) -> api.ScheduleRunView:
    fields = msgspec.structs.asdict(run)
    fields.pop("events_seq")
    return api.ScheduleRunView(**fields, end=ends.get(run.turn_id or ""))
