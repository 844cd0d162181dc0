"""One agent on the NATS Agent Protocol: its registration, and its prompts run as turns.

An :class:`AgentHost` is the protocol's reference host (``AgentService`` of
``synadia-ai-agent-service``) for one agent of the agents bucket: a NATS micro service
named ``agents`` whose ``prompt`` and ``status`` endpoints are
``agents.<verb>.loopmesh.<tenant>.<agent>`` (queue group ``agents``), with the agent's
description, a heartbeat on ``agents.hb.loopmesh.<tenant>.<agent>``, the leading
``ack``, keep-alive ``ack`` chunks every 30 s, the terminator and the error frames.
What is loopmesh's is here: the host is the request interceptor that makes a turn of
each prompt before it is acked (:mod:`.request`; a bad one gets its ``400`` and no
ack), and the prompt handler that publishes the turn and streams its events
(:mod:`.reply`) until its ``loop_end``, at most ``[nats_agents] turn_timeout_s``.

Stopping (the process stops, or the agent is deleted or its description changed):
prompts in flight get up to ``drain_s`` to end; one still running then ends with an
error naming the session where its turn goes on (a turn never depends on its caller).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextvars import ContextVar

from nats.aio.client import Client
from synadia_ai.agent_service import (
    AgentService,
    CallNext,
    PromptStream,
    RequestInterceptorContext,
    RequestRejectedError,
)
from synadia_ai.agents import Envelope

from loopmesh.aio import unless
from loopmesh.payload import limit_of
from loopmesh.turns import Follower, publish_turn
from schemas import AgentSpec, Subjects, Turn, encode
from schemas.events import LoopEnd

from .reply import Reply
from .request import bad, turn_of
from .settings import NatsAgentsSettings

log = logging.getLogger("loopmesh.nats_agents")

#: The harness token of every loopmesh agent's subjects and ``metadata.agent`` (§2, §3.2).
HARNESS = "loopmesh"
#: The registration metadata key that holds the agent's loopmesh name (the subject's
#: last token is the SDK's base64 of a name with characters it does not take as they
#: are: upper case, say).
AGENT_KEY = "loopmesh_agent"

#: After ``drain_s``, how long the prompts still in flight get to send their error.
CUT_S = 5.0

#: The turn the request interceptor made of the prompt being served (a prompt runs in
#: a task and a context of its own).
_turn: ContextVar[Turn] = ContextVar("nats_agents_turn")


def description_of(spec: AgentSpec) -> str:
    """What the agent's registration says it does (``nats micro list``, discovery)."""
    return spec.description or f"loopmesh agent {spec.name}"


class AgentHost:
    """``spec``'s agent on the protocol, for ``tenant``: ``await start()``, then ``stop()``."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        settings: NatsAgentsSettings,
        spec: AgentSpec,
        *,
        tenant: str,
    ) -> None:
        self.spec = spec
        self.tenant = tenant
        self._nc = nc
        self._js = nc.jetstream()
        self._subjects = subjects
        self._settings = settings
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = asyncio.Event()  # set: prompts in flight end now
        self._service = AgentService(
            agent=HARNESS,
            owner=tenant,
            session_name=spec.name,
            nc=nc,
            description=description_of(spec),
            heartbeat_interval_s=settings.heartbeat_s,
            max_concurrent_prompts=settings.max_concurrent_prompts,
            extra_metadata={AGENT_KEY: spec.name},
            interceptors=[self],
        )
        self._service.on_prompt(self._prompt)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def prompt_subject(self) -> str:
        return self._service.subject.prompt

    @property
    def instance_id(self) -> str:
        return self._service.instance_id

    async def start(self) -> None:
        """Register the agent: discoverable, and serving prompts, once this returns."""
        await self._service.start()
        log.info("agent %s serves prompts on %s", self.name, self.prompt_subject)

    async def stop(self, drain_s: float) -> None:
        """Give prompts in flight up to ``drain_s`` to end, end the rest with an error,
        and withdraw the registration. Idempotent."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_s):
                await self._idle.wait()
        self._cut.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CUT_S):  # their error frames go out
                await self._idle.wait()
        await self._service.stop()
        log.info("agent %s no longer serves %s", self.name, self.prompt_subject)

    # -- a prompt ---------------------------------------------------------------------

    async def around_request(self, ctx: RequestInterceptorContext, call_next: CallNext) -> None:
        """Before the ack: make the prompt a turn, or refuse it (``400``)."""
        if self._cut.is_set():
            raise RequestRejectedError(
                500, f"the host of agent {self.name} is stopping: send the prompt again"
            )
        settings = self._settings
        turn = turn_of(
            ctx.envelope,
            agent=self.name,
            tenant=self.tenant,
            max_input_chars=settings.max_input_chars,
        )
        size, limit = len(encode(turn)), limit_of(self._nc)
        if size > limit:
            raise bad(
                f"the prompt and its attachments make a turn of {size} bytes; the NATS "
                f"server takes at most {limit} in one message"
            )
        token = _turn.set(turn)
        self._in_flight += 1
        self._idle.clear()
        try:
            await call_next()
        finally:
            _turn.reset(token)
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _prompt(self, envelope: Envelope, stream: PromptStream) -> None:
        turn = _turn.get()
        timeout_s = self._settings.turn_timeout_s
        published = asyncio.Event()
        log.info("prompt agent=%s session=%s turn=%s", self.name, turn.session, turn.id)
        try:
            async with asyncio.timeout(timeout_s):
                ended = await unless(self._cut, self._follow(turn, stream, published))
        except TimeoutError:
            why = f"no end of the turn within {timeout_s:g} s"
        else:
            if ended:
                return
            why = f"the host of agent {self.name} stopped"
        if published.is_set():
            raise RequestRejectedError(
                500, f"{why}; turn {turn.id} goes on in session {turn.session}"
            )
        raise RequestRejectedError(500, f"{why} before the turn was sent: send it again")

    async def _follow(self, turn: Turn, stream: PromptStream, published: asyncio.Event) -> None:
        """Publish ``turn`` and stream its events to its ``loop_end``."""
        reply = Reply(turn)
        try:
            async with Follower(self._nc, self._subjects, turn.tenant, turn.session) as events:
                await publish_turn(self._js, self._subjects, turn)
                published.set()
                async for event in events:
                    if event.turn_id != turn.id:
                        continue
                    text = reply.take(event)
                    if isinstance(event, LoopEnd):
                        text += reply.end(event)  # raises when the turn did not answer
                    if text:
                        await stream.send(text)
                    if isinstance(event, LoopEnd):
                        log.info("answered agent=%s turn=%s", self.name, turn.id)
                        return
        except RequestRejectedError as exc:
            log.info("turn failed agent=%s turn=%s: %s", self.name, turn.id, exc.description)
            raise
        except Exception as exc:  # a cancel (the turn's timeout, a stop) is no Exception
            log.exception("prompt failed agent=%s turn=%s", self.name, turn.id)
            raise RequestRejectedError(
                500, f"turn {turn.id} (session {turn.session}): {type(exc).__name__}: {exc}"
            ) from exc
