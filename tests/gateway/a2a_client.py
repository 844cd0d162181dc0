"""The official ``a2a-sdk`` client against a test gateway: a client per agent and key,
messages, and the stream of a task collected until it ends."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.types import (
    AgentCard,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskState,
)

from tests.gateway.conftest import auth

ENDED = frozenset(
    {
        TaskState.TASK_STATE_COMPLETED,
        TaskState.TASK_STATE_CANCELED,
        TaskState.TASK_STATE_FAILED,
        TaskState.TASK_STATE_REJECTED,
        TaskState.TASK_STATE_INPUT_REQUIRED,
    }
)


@contextlib.asynccontextmanager
async def a2a_client(
    base_url: str, key: str | None, *, streaming: bool = True
) -> AsyncIterator[Client]:
    """A client of the agent whose card is at ``base_url/.well-known/agent-card.json``
    (the gateway's root: the default agent; ``.../a2a/<agent>``: that one)."""
    headers = auth(key) if key is not None else {}
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        factory = ClientFactory(ClientConfig(httpx_client=http, streaming=streaming))
        client = await factory.create_from_url(base_url)  # resolves the card first
        try:
            yield client
        finally:
            await client.close()


async def resolve_card(base_url: str) -> AgentCard:
    """The card at ``base_url/.well-known/agent-card.json``, as the client resolves it."""
    async with httpx.AsyncClient(timeout=30) as http:
        return await A2ACardResolver(http, base_url).get_agent_card()


def message(text: str, *, context_id: str = "", task_id: str = "") -> SendMessageRequest:
    return SendMessageRequest(
        message=Message(
            message_id=uuid.uuid4().hex,
            role=Role.ROLE_USER,
            parts=[Part(text=text)],
            context_id=context_id,
            task_id=task_id,
        )
    )


@dataclass
class Followed:
    """What a stream of a task delivered, in order."""

    events: list[StreamResponse] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [e.WhichOneof("payload") or "" for e in self.events]

    @property
    def task_id(self) -> str:
        for e in self.events:
            match e.WhichOneof("payload"):
                case "task":
                    return e.task.id
                case "status_update":
                    return e.status_update.task_id
                case "artifact_update":
                    return e.artifact_update.task_id
        raise AssertionError("no event named the task")

    @property
    def state(self) -> int:
        for e in reversed(self.events):
            match e.WhichOneof("payload"):
                case "task":
                    return e.task.status.state
                case "status_update":
                    return e.status_update.status.state
        return TaskState.TASK_STATE_UNSPECIFIED

    def streamed_text(self) -> str:
        """The answer artifact as a client that applies the chunks sees it."""
        text = ""
        for e in self.events:
            if e.WhichOneof("payload") == "artifact_update":
                chunk = "".join(p.text for p in e.artifact_update.artifact.parts)
                text = text + chunk if e.artifact_update.append else chunk
        return text


async def follow(
    stream: AsyncIterator[StreamResponse],
    into: Followed | None = None,
    *,
    until: frozenset[int] = ENDED,
    timeout: float = 60,
) -> Followed:
    """Collect ``stream`` until it ends or the task reaches a state in ``until``."""
    got = into if into is not None else Followed()
    async with asyncio.timeout(timeout):
        async for event in stream:
            got.events.append(event)
            if got.state in until:
                break
    return got


def answer(task: Task) -> str:
    """The text of the task's ``answer`` artifact."""
    for artifact in task.artifacts:
        if artifact.artifact_id == "answer":
            return "".join(p.text for p in artifact.parts)
    return ""


class Webhook:
    """An HTTP server on loopback that records what is POSTed to it (push
    notifications): ``async with Webhook() as hook``, then ``hook.url``. While ``open``
    is clear it records each POST as it arrives and answers none (a stalled receiver)."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.open = asyncio.Event()
        self.open.set()
        self._changed = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Webhook:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/hook"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[1:]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                async with self._changed:
                    self.received.append((headers, body))
                    self._changed.notify_all()
                await self.open.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def wait(self, done: Callable[[list[tuple[dict[str, str], bytes]]], bool]) -> None:
        async with asyncio.timeout(30), self._changed:
            await self._changed.wait_for(lambda: done(self.received))
