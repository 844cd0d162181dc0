"""``loopmesh schedules``: list, add, show, delete, pause and resume a tenant's schedules,
straight in the schedules bucket (the gateway's ``/v1/schedules`` does the same over HTTP)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime

import msgspec
from nats.aio.client import Client

from loopmesh.agents import read_agents
from loopmesh.cli import config_from_args
from loopmesh.errors import LoopmeshError
from loopmesh.jetstream import Publisher, open_kv
from loopmesh.nats import connect
from loopmesh.schedules import (
    POLICIES,
    Exists,
    ScheduleError,
    ScheduleStore,
    TooMany,
    explain,
    new_schedule,
    next_tick,
    run_ends,
)
from loopmesh.settings import SchedulerSettings
from schemas import encode
from schemas.schedules import Schedule, ScheduleState

from .options import client_config, token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """List, add, show, delete, pause or resume the tenant's schedules.

A schedule turns INPUT into a turn of an agent at every tick of a cron expression (five
fields: minute hour day-of-month month day-of-week, or six with seconds first) in a
time zone. Every loop worker and gateway runs a scheduler; each tick fires once.

  loopmesh schedules                                  list them
  loopmesh schedules add "Summarise the day" --cron "0 18 * * 1-5" --timezone Europe/Paris
  loopmesh schedules show ID                          one, with its last runs
  loopmesh schedules pause ID | resume ID | delete ID

--session S sends every run to session S (default: a new session per run); --policy
says what a tick does while the previous run has not ended: skip (default), buffer_one
(one run waits) or allow. A tenant has at most [scheduler] max_per_tenant schedules
(100; 0: no limit), read from this command's configuration."""

ACTIONS = ("list", "add", "show", "delete", "pause", "resume")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``[scheduler]``, for its ``max_per_tenant``: ``add`` refuses past it, as the gateway does."""

    scheduler: SchedulerSettings = SchedulerSettings()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=ACTIONS, default="list")
    parser.add_argument("target", nargs="?", help="the schedule's id (add: its input)")
    parser.add_argument("--cron", help="add: the cron expression")
    parser.add_argument("--timezone", default="UTC", help="add: an IANA time zone (UTC)")
    parser.add_argument("--agent", type=token("agent"), help="add: the agent (default)")
    parser.add_argument("--session", type=token("session"), help="add: one session for all runs")
    parser.add_argument("--policy", choices=POLICIES, default="skip", help="add: overlap policy")
    parser.add_argument("--id", type=token("schedule"), help="add: the schedule's id")
    parser.add_argument(
        "--catch-up-s", type=float, default=3600.0, metavar="S",
        help="add: fire a tick missed while no scheduler ran if at most S seconds old",
    )  # fmt: skip
    parser.add_argument(
        "--tenant", type=token("tenant"), help="tenant id (default: [client] tenant, local)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines")


async def main(args: argparse.Namespace) -> int:
    config = client_config(args)
    tenant, subjects = config.client.tenant, config.nats.subjects
    limit = config_from_args(SchedulerConfig, args).scheduler.max_per_tenant
    nc = await connect(config.nats, name="loopmesh-schedules")
    publisher = Publisher(nc)
    try:
        kv = await open_kv(nc.jetstream(), publisher, subjects.schedules_bucket, timeout=5.0)
        store = ScheduleStore(kv, nc.jetstream(), subjects, max_per_tenant=limit)
        match args.action:
            case "list":
                found = await store.all(tenant)
                _print(args, [(s, st) for s, st in found], table=True)
            case "add":
                schedule = await _add(args, tenant, store, nc)
                _print(args, [(schedule, None)], table=False)
            case "show":
                one = await store.one(tenant, _target(args))
                if one is None:
                    raise LoopmeshError(f"no schedule {args.target!r} of tenant {tenant}")
                runs = one[1].runs if one[1] else ()
                ends = await run_ends(publisher, subjects, tenant, runs)
                _print(args, [one], table=False, ends=ends)
            case "delete":
                if not await store.delete(tenant, _target(args)):
                    raise LoopmeshError(f"no schedule {args.target!r} of tenant {tenant}")
                print(f"deleted schedule {args.target}", file=sys.stderr)
            case _:
                changed = await store.set_paused(tenant, _target(args), args.action == "pause")
                if changed is None:
                    raise LoopmeshError(f"no schedule {args.target!r} of tenant {tenant}")
                print(f"{args.action}d schedule {args.target}", file=sys.stderr)
    finally:
        await publisher.close()
        await nc.close()
    return 0


def _target(args: argparse.Namespace) -> str:
    if not args.target:
        raise LoopmeshError(f"`loopmesh schedules {args.action}` needs the schedule's id")
    return str(token("schedule")(args.target))


async def _add(args: argparse.Namespace, tenant: str, store: ScheduleStore, nc: Client) -> Schedule:
    if not args.cron or not args.target:
        raise LoopmeshError('add needs the input and --cron, e.g. add "hello" --cron "0 9 * * *"')
    try:
        schedule = new_schedule(
            tenant, id=args.id, cron=args.cron, timezone=args.timezone,
            agent=args.agent or "default", session=args.session, input=args.target,
            policy=args.policy, catch_up_s=args.catch_up_s,
        )  # fmt: skip
    except ScheduleError as exc:
        raise LoopmeshError(str(exc)) from None
    agents = await read_agents(nc.jetstream(), store.subjects)
    if schedule.agent not in agents:
        raise LoopmeshError(f"`agent`: no agent {schedule.agent!r} (defined: {', '.join(agents)})")
    try:
        await store.create(schedule)
    except Exists:
        raise LoopmeshError(f"`id`: schedule {schedule.id!r} exists already") from None
    except TooMany as exc:
        raise LoopmeshError(str(exc)) from None
    return schedule


def _print(
    args: argparse.Namespace,
    found: list[tuple[Schedule, ScheduleState | None]],
    *,
    table: bool,
    ends: dict[str, str] | None = None,
) -> None:
    if args.json:
        for schedule, state in found:
            line = json.loads(encode(schedule))
            line["runs"] = json.loads(encode(state.runs)) if state else []
            sys.stdout.write(json.dumps(line) + "\n")
        return
    if table:
        sys.stdout.write(render(found))
        return
    for schedule, state in found:
        sys.stdout.write(describe(schedule, state, ends or {}))


def _when(at: float | None) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S") if at else "-"


def _next(schedule: Schedule, state: ScheduleState | None) -> float | None:
    if schedule.paused:
        return None
    last = state.last_tick if state else 0.0
    return next_tick(schedule, max(last, schedule.active_since, time.time()))


def render(found: list[tuple[Schedule, ScheduleState | None]]) -> str:
    """The schedules as a table (times in UTC)."""
    rows = [("ID", "CRON", "TIMEZONE", "POLICY", "SESSION", "AGENT", "NEXT (UTC)", "LAST RUN")]
    for s, state in found:
        last = state.runs[0] if state and state.runs else None
        rows.append((
            s.id, s.cron, s.timezone, s.policy, s.session or "(new per run)", s.agent,
            "paused" if s.paused else _when(_next(s, state)),
            f"{_when(last.tick)} {last.outcome}" if last else "-",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def describe(schedule: Schedule, state: ScheduleState | None, ends: dict[str, str]) -> str:
    """One schedule, a field a line, then its runs, newest first."""
    fields = [
        ("id", schedule.id), ("cron", f"{schedule.cron}  ({explain(schedule)})"),
        ("timezone", schedule.timezone), ("agent", schedule.agent),
        ("session", schedule.session or "(a new session per run)"),
        ("policy", schedule.policy), ("paused", str(schedule.paused).lower()),
        ("next tick (UTC)", _when(_next(schedule, state))), ("input", schedule.input),
    ]  # fmt: skip
    lines = [f"{name:<16}  {value}" for name, value in fields]
    for run in state.runs if state else ():
        what: str = run.outcome
        if run.turn_id:
            what += f" turn {run.turn_id}: {ends.get(run.turn_id, 'not ended')}"
        if run.reason:
            what += f" ({run.reason})"
        lines.append(f"{'run ' + _when(run.tick):<16}  {what}")
    return "\n".join(lines) + "\n"
