"""The agent loop: prompt → LLM → parse → tools → checkpoint, until something ends it.

:class:`Engine` is pure: the LLM, the tools, the event stream and the session store
are the Protocols of ``protocols.py``. ``run`` takes one turn to its end and emits
exactly one ``loop_end`` (a turn that had already finished emits its ``loop_end`` again,
from the last checkpoint, and nothing else). A turn whose snapshot says it is still running resumes
after its last checkpointed iteration.

Checkpoints: when the turn starts, after every iteration, and once more in the middle
of an iteration that calls tools: the assistant message and its calls are stored
(``SessionSnapshot.pending``) *before* the calls run. A worker that resumes from that
checkpoint re-issues exactly those calls, with the same call ids (the dispatcher
returns the results of those that finished), and does not ask the model again: a
different reply would otherwise be paired with the recorded results of other calls.

Agents: a turn runs as its named agent (``Turn.agent``, else its session's), whose
definition :mod:`.agents` applies over the settings. A session belongs to one agent;
a turn naming another, or an agent nobody defined, is refused before anything is
checkpointed (an ``error`` event and its ``loop_end``), so the session keeps its state.

A cancelled ``run`` *task* (a worker shutting down) is not the end of the turn: it
leaves the snapshot "running" for another worker to resume. Cancelling the turn itself
goes through :class:`~loop_worker.engine.control.TurnControl`.
"""

from __future__ import annotations

from schemas import DEFAULT_AGENT, SessionSnapshot, Turn
from schemas.events import Error, LoopEnd

from .agents import TURN_FALLBACKS
from .control import TurnControl
from .kit import TurnKit
from .ratelimit import TURN_TENANT
from .run import TurnRun, describe, ended_again
from .scope import TurnScope


class Engine(TurnKit):
    """Runs turns on what its :class:`~.kit.TurnKit` holds (its constructor's arguments)."""

    async def run(self, turn: Turn, control: TurnControl | None = None) -> LoopEnd | None:
        scope = TurnScope(turn, control or TurnControl(), self.events, self.clock)
        try:
            stored = await self.store.load(turn.tenant, turn.session)
        except Exception as exc:
            return await refuse(scope, "store", describe(exc))
        if stored is not None and stored.turn_id == turn.id and stored.status == "idle":
            return await ended_again(scope, stored.last_end)
        # the turn's agent: a session belongs to the one its first turn named
        name = turn.agent or (stored.agent if stored is not None else DEFAULT_AGENT)
        if stored is not None and name != stored.agent:
            return await refuse(
                scope, "agent_mismatch",
                f"session {turn.session!r} belongs to agent {stored.agent!r}, and this turn "
                f"names agent {name!r}: send it to a session of its own",
            )  # fmt: skip
        try:
            spec = await self.agents.agent(name)
        except Exception as exc:
            return await refuse(scope, "agents_unavailable", describe(exc))
        if spec is None:
            return await refuse(
                scope, "unknown_agent",
                f"no agent {name!r} is defined (the [[agents]] of the configuration; "
                "`loopmesh agents` lists them)",
            )  # fmt: skip
        agent = self.agent_for(spec)
        snapshot = stored or SessionSnapshot(tenant=turn.tenant, session=turn.session, agent=name)
        fallbacks = TURN_FALLBACKS.set(agent.fallbacks)
        tenant = TURN_TENANT.set(turn.tenant)  # the rate limits' ([llm.limits])
        try:
            return await TurnRun(self, scope, snapshot, agent).run()
        finally:
            TURN_TENANT.reset(tenant)
            TURN_FALLBACKS.reset(fallbacks)


async def refuse(scope: TurnScope, code: str, message: str) -> LoopEnd:
    """End a turn that cannot start: an ``error`` event and its ``loop_end``, nothing
    checkpointed, so the session keeps what it had."""
    await scope.emit(Error, code=code, message=message, fatal=True)
    return await scope.emit(LoopEnd, reason="error", error=f"{code}: {message}")
